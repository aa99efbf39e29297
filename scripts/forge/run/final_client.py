"""The benchmark client of a round, per tier: the preliminary's (configs/contest.yaml client: one
request at a time at rate 1) or the final's (configs/contest.yaml rounds.final.client: the tier's
concurrency, `--request-rate inf`, 1024 outputs, 80 / 70 / 60 requests, 2 warm-ups). The tier's
concurrency comes from the sweep, else the published variable (CONCURRENCY_4_8K, CONCURRENCY_8_16K,
CONCURRENCY_16_32K), else the round's value. A run records its round and each tier's client settings
in its manifest; a resume of a run of another round, or one that would change a finished tier's
settings, is refused before anything is written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from ..contest import rounds
from ..errors import ForgeError

PRELIMINARY = rounds.DEFAULT_ROUND


def check_round(contest: dict, name: str | None) -> rounds.Round:
    """The round `name` (None: the default, the preliminary) of configs/contest.yaml."""
    return rounds.load_round(contest, name or rounds.DEFAULT_ROUND)


def run_round(manifest: dict | None, where: str = "manifest.json") -> str:
    """The round a run was measured in: its manifest's `round` (a run recorded before rounds existed
    is of the preliminary); a value that names no round is refused naming `where` (the manifest's path),
    never taken as a round's name."""
    name = (manifest or {}).get("round")
    if name is None:
        return PRELIMINARY
    if not isinstance(name, str) or name not in rounds.ROUNDS:
        raise ForgeError(f"{where}: key 'round' is {repr(name)[:60]}, not a round of the contest "
                         f"({', '.join(rounds.ROUNDS)})",
                         hint="manifest.json is damaged; restore it from a copy of the run or rerun the step that "
                              "wrote it")
    return name


def fewer_requests(contest: dict, run: dict) -> str | None:
    """What a loaded run (score.load_run) says where a tier sent fewer requests than its round's client
    sends (the run's --num-prompts was smaller): its score is not the contest's. None where every tier
    sent them all, or the round sends every prompt of the tier file (the preliminary)."""
    rnd = check_round(contest, run.get("round"))
    sent = {name: m.get("completed", 0) + m.get("failed", 0) for name, m in run["tiers"].items()}
    short = [f"tier {name}: {n} requests, the round's {rnd.client(name).num_prompts}" for name, n in sent.items()
             if rnd.client(name).num_prompts and n < rnd.client(name).num_prompts]
    return (f"fewer requests than the {rnd.name} round's client sends ({'; '.join(short)}: the run's "
            "--num-prompts was smaller): its score is not comparable to the contest's") if short else None


def _rate(v: float) -> str:
    return "inf" if v == float("inf") else (str(int(v)) if float(v).is_integer() else str(v))


def tier_plan(contest: dict, rnd: rounds.Round, tiers: list[dict], *, num_prompts: int | None = None,
              concurrency: Mapping[str, int] | None = None, concurrency_from: str = "the sweep's configuration",
              environ: Mapping[str, str] | None = None) -> tuple[list[dict], dict]:
    """The tiers to run with their client settings, and the manifest's record of them.

    Returns (tiers, record): in a round other than the preliminary each tier dict gains `client` (the
    client options the round sets: {option: value}) and the round's `num_prompts`; record is
    {"round", "tiers": {name: settings}, "differences": [what differs from the round's client]}.
    `concurrency` (the sweep's; `concurrency_from` says whence) wins over the environment's
    CONCURRENCY_<tier>, which wins over the round's value; each is checked against the round's bounds.
    Only the tiers given read their variable: pass the tiers the run measures, never more."""
    environ = os.environ if environ is None else environ
    if rnd.name != PRELIMINARY and not concurrency:
        # CONCURRENCY_4_8k was read by nothing: the client ran at the round's value, where serve refuses it
        rounds.refuse_mistyped(rnd, environ, f"the {rnd.name} round's client")
    out, rec, diffs = [], {}, []
    for t in tiers:
        name = t["name"]
        tc = rnd.client(name)
        if rnd.name == PRELIMINARY:
            out.append(t)
            rec[name] = {"max_concurrency": tc.concurrency, "request_rate": _rate(tc.request_rate),
                         "custom_output_len": tc.output_len, "num_warmups": tc.warmups,
                         "num_prompts": num_prompts or tc.num_prompts or "every prompt of the tier"}
            continue
        if concurrency and name in concurrency:
            c, src = concurrency[name], concurrency_from
        elif tc.concurrency_env and environ.get(tc.concurrency_env, "").strip():
            # read as `forge serve` reads it: "08" and "+8" are not what the finals' client gets
            c = rounds.env_value(rnd, None, tc.concurrency_env, environ[tc.concurrency_env], f"tier {name}")
            src = tc.concurrency_env
        else:
            c, src = tc.concurrency, f"configs/contest.yaml rounds.{rnd.name}.client"
        c = rounds.check_settings(rnd, {"concurrency": c}, where=f"tier {name}: {src}").concurrency
        n = num_prompts or tc.num_prompts
        if num_prompts and num_prompts != tc.num_prompts:
            diffs.append(f"tier {name}: --num-prompts {num_prompts} (the {rnd.name} round sends {tc.num_prompts})")
        opts = {"--max-concurrency": str(c), "--request-rate": _rate(tc.request_rate),
                "--custom-output-len": str(tc.output_len), "--num-warmups": str(tc.warmups)}
        out.append({**t, "num_prompts": n, "client": opts})
        rec[name] = {"max_concurrency": c, "concurrency_from": src, "request_rate": _rate(tc.request_rate),
                     "custom_output_len": tc.output_len, "num_warmups": tc.warmups, "num_prompts": n}
    return out, {"round": rnd.name, "tiers": rec, "differences": diffs}


def for_server(rnd: rounds.Round, server: dict | None, tiers: list[str] | None,
               environ: Mapping[str, str] | None = None) -> tuple[list[str] | None, dict[str, int] | None, str]:
    """What the round's client may run against the server `forge serve` started (`server`: its record,
    serve.json; None: nothing to check). A server measures in its own round only. In a later round a
    server is started for one tier with that tier's settings: the client runs that tier (`tiers` None)
    and refuses another, at the concurrency that start resolved from the profile or the environment,
    unless the tier's CONCURRENCY_<tier> is set now. Returns (tiers, concurrency, whence) for tier_plan."""
    if not isinstance(server, dict):
        return tiers, None, ""
    was = server.get("round") or PRELIMINARY
    if was != rnd.name:
        hint = (f"add --round {was} (make bench-all-tiers ROUND={was})" if was != PRELIMINARY else
                f"forge stop, then start the tier's server: make serve ROUND={rnd.name} TIER=<tier> PROFILE=...")
        raise ForgeError(f"the server answering now was started for the {was} round; the {rnd.name} round's client "
                         "measures a server of its own round only", hint=hint)
    tier = server.get("tier")
    if was == PRELIMINARY or not isinstance(tier, str):
        return tiers, None, ""
    if tiers is not None and set(tiers) != {tier}:
        raise ForgeError(f"tier(s) {', '.join(t for t in tiers if t != tier)}: the server answering now was started "
                         f"for tier {tier}; in the {rnd.name} round each tier runs against a server started with "
                         "that tier's settings", hint=f"--tiers {tier}, or forge stop and start the other tier's "
                                                      f"server (make serve ROUND={rnd.name} TIER=<tier>)")
    environ = os.environ if environ is None else environ
    var = rnd.client(tier).concurrency_env
    conc, src = (server.get("settings") or {}).get("concurrency"), (server.get("sources") or {}).get("concurrency")
    if type(conc) is not int or src in (None, "baseline") or (var and environ.get(var, "").strip()):
        return [tier], None, ""
    return [tier], {tier: conc}, f"the server's start ({src})"


def check_resume(manifest: dict, plan: dict, run_id: str, done: list[str], rdir: Path) -> None:
    """Refuse to add to run `run_id` a measurement of another round, or one that changes the client
    settings a finished tier (`done`) was measured with."""
    if not manifest:
        return
    was = run_round(manifest)
    if was != plan["round"]:
        raise ForgeError(f"run {run_id} was measured in the {was} round; this is the {plan['round']} round's client",
                         hint=f"resume it with --round {was} (make ... ROUND={was}), or start a new run (omit --run-id)")
    recorded = (manifest.get("client_settings") or {}).get("tiers") or {}
    for name in done:
        old, new = recorded.get(name), plan["tiers"].get(name)
        if old is not None and new is not None and _comparable(old) != _comparable(new):
            diff = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in _comparable(new)
                             if old.get(k) != new.get(k))
            raise ForgeError(f"run {run_id}: tier {name} was measured with other client settings ({diff}; "
                             f"{rdir.name}/manifest.json client_settings)",
                             hint="resume with the same concurrency (CONCURRENCY_<tier>), or start a new run (omit --run-id)")


def _comparable(s: dict) -> dict:
    """What a resume may not change (the prompts are the dataset's check: bench_data.dataset_differs)."""
    return {k: v for k, v in s.items() if k not in ("concurrency_from", "num_prompts")}


def record(manifest: dict, plan: dict, ran: list[str]) -> None:
    """Write the round and the settings of the tiers that run now into the manifest (kept tiers keep
    theirs)."""
    manifest["round"] = plan["round"]
    cs = manifest.setdefault("client_settings", {"tiers": {}, "differences": []})
    cs.setdefault("tiers", {}).update({n: plan["tiers"][n] for n in ran if n in plan["tiers"]})
    cs["differences"] = sorted(set(cs.get("differences") or []) | set(plan["differences"]))
