"""The final round's part of the submission's ENVIRONMENT.md (rules Art. 12): the environment a team
sets per tier for the finals' start script and client, from the tier-environment file
`forge sweep --round final` writes (run.final_pick; given with --tier-env), or the round's baseline
values where no file is given or a tier has no winner. Written for `forge report --round final` and
`forge submission --round final`."""

from __future__ import annotations

import shlex
from pathlib import Path

from .. import paths
from ..contest import rounds
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..model import capacity as capacity_mod
from ..model import headroom as headroom_mod
from ..model.shape import load_shape
from ..run import final_pick


def _cell(s: object) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def tier_rows(rnd: rounds.Round, tier_env: Path | None) -> list[dict]:
    """Per tier of the round: {"tier", "environment", "engine_options", "from"}: the file's winner, else
    the round's baseline values."""
    recorded = final_pick.read_tier_env(tier_env)["tiers"] if tier_env else {}
    out = []
    for t in rnd.tier_order:
        e = recorded.get(t)
        if e and e.get("harness"):
            # random weights, end-of-text ignored: the ranking of a GPU machine's stand-in, not the card's
            raise ForgeError(f"{paths.rel(tier_env)}: key 'tiers.{t}': the winner (sweep {e.get('sweep')}, run "
                             f"{e.get('run')}) was measured by a harness sweep (random weights on a GPU machine), not "
                             "on the card the submission is for",
                             hint="give the tier-environment file of a sweep run on the DCU (forge sweep --round final "
                                  "without --harness), or leave --tier-env out for the baseline's values")
        if e:
            out.append({"tier": t, "environment": e["environment"], "engine_options": e.get("engine_options") or {},
                        "from": f"sweep {e.get('sweep')}, run {e.get('run')}"
                                + (f" ({e['tok_s']:.2f} output tok/s, {100 * e['lift']:+.1f} % against the baseline)"
                                   if isinstance(e.get("tok_s"), (int, float)) and isinstance(e.get("lift"), (int, float))
                                   else "")})
        else:
            out.append({"tier": t, "environment": rounds.tier_env(rnd, t, rnd.baseline), "engine_options": {},
                        "from": "the finals' baseline configuration (no sweep winner given)"})
    return out


def above_baseline(rows: list[dict]) -> list[str]:
    """Per tier set above the baseline's utilization, why the memory it leaves outside vLLM's budget holds what
    vLLM puts there on a DCU card (model/headroom.py), or that the model does not say so."""
    out, shape = [], None
    for r in rows:
        env = r["environment"]
        try:
            u, seqs = float(env["GPU_MEMORY_UTILIZATION"]), int(env["MAX_NUM_SEQS"])
            tp, mnbt = int(env["TENSOR_PARALLEL_SIZE"]), int(env["MAX_NUM_BATCHED_TOKENS"])
        except (KeyError, ValueError):
            continue
        if u <= headroom_mod.BASELINE_UTILIZATION:
            continue
        shape = shape or load_shape()
        kv = "int8" if r["engine_options"].get("--kv-cache-dtype") == "int8" else "bf16"
        h = capacity_mod.room(shape, capacity_mod.capacity(shape, tp=tp, kv_dtype=kv, utilization=u,
                                                           max_num_batched_tokens=mnbt), seqs)
        out.append(f"- {r['tier']}: `GPU_MEMORY_UTILIZATION={env['GPU_MEMORY_UTILIZATION']}`, above the finals' "
                   f"baseline {headroom_mod.BASELINE_UTILIZATION:g}. On a DCU card, {h.why()} "
                   f"(scripts/forge/model/headroom.py: the runtime's context is an allowance, not a measurement)"
                   + ("; measured on the card in " + r["from"] if r["from"].startswith("sweep") else
                      "; not measured on the card") + ".")
    if out:
        out = ["The memory a utilization above the baseline's leaves outside vLLM's budget holds the runtime's "
               "context and the CUDA-graph pool (captured after the KV cache is allocated):", "", *out, ""]
    return out


def final_section(contest: dict, tier_env: Path | None = None) -> str:
    """The markdown section (see the module's docstring)."""
    rnd = rounds.load_round(contest, "final")
    rows = tier_rows(rnd, tier_env)
    names = [u.env for u in rnd.unlocked]
    ours = [u.env for u in rnd.unlocked if u.names_ours]
    src = f"`{paths.rel(tier_env)}`" if tier_env else "none given (`--tier-env FILE`)"
    L = ["", "## The final round: the environment per tier", "",
         "决赛中每个档位单独启动服务：拓扑（TP=2/DP=1 或 TP=1/DP=2）、max-num-seqs、max-num-batched-tokens、"
         "gpu-memory-utilization 与客户端并发数由启动脚本的环境变量按档位设置，下表给出每个档位的取值。", "",
         "In the final round each tier is served by its own server start. The topology, `--max-num-seqs`, "
         "`--max-num-batched-tokens`, `--gpu-memory-utilization` and the client's concurrency are set per tier "
         "through the start script's environment; everything else stays as the finals' start script sets it "
         f"(\"{contest_mod.rule_text(contest, rnd.organizers_rule)}\"). The values below come from the search "
         f"`forge sweep --round final` recorded (tier-environment file: {src}).", "",
         "The finals' start script, as public team documents describe it (the variables fill the unlocked values):", "",
         "```", rnd.command, "```", "",
         "| tier | " + " | ".join(f"`{n}`" for n in names) + " | client concurrency | engine options | from |",
         "|---|" + "---|" * (len(names) + 3)]
    for r in rows:
        env = r["environment"]
        conc = next(((k, v) for k, v in env.items() if k not in names), None)
        opts = " ".join(f"`{k} {v}`" for k, v in r["engine_options"].items()) or "none"
        L.append(f"| {r['tier']} | " + " | ".join(f"`{_cell(env.get(n, ''))}`" for n in names)
                 + f" | {f'`{conc[0]}={conc[1]}`' if conc else ''} | {opts} | {_cell(r['from'])} |")
    L += ["", "Per tier, as set before the start script (and the client) run:", "", "```"]
    for r in rows:
        L.append(f"# {r['tier']}")
        L.append(" ".join(f"{k}={shlex.quote(v)}" for k, v in r["environment"].items()))
    L += ["```", ""]
    L += above_baseline(rows)
    if ours:
        L.append(f"The names {', '.join(f'`{n}`' for n in ours)} are ours: the finals' own names for these values "
                 "were not published (the client's `CONCURRENCY_4_8K`, `CONCURRENCY_8_16K`, `CONCURRENCY_16_32K` were). "
                 "An engine option in the table (the KV cache's dtype) is a reviewed option the submission adds to the "
                 "start script for that tier.")
    return "\n".join(L) + "\n"
