"""`forge plan --against RUN`: the capacity planner checked against what a served run's vLLM reported.

A server started by `forge serve` records in its run folder's serve.json the command it ran and the KV
cache each of its engines reported (vLLM's "GPU KV cache size: N tokens", one per data-parallel rank); an
end-to-end run's profile folder (`forge e2e-gpu`) has the command, and its server log beside it
(`server.log`) or in the run's `logs/server-<profile>.log`. From the command: the tensor- and
data-parallel sizes, the KV cache dtype (`--kv-cache-dtype int8`, else the model's bf16), the
utilization (vLLM's 0.9 where none is given) and batched tokens (the last occurrence of each, as vLLM's
parser keeps it; a command without --max-num-batched-tokens is refused) and a fixed
`--kv-cache-memory-bytes` where one was given (vLLM then takes those bytes and skips its memory profile:
the check is of the page math alone). The planner prices that configuration on `--card` (the card the
run was served on: `dcu`, the default, for a run on the contest's card) and each rank's reported tokens
are compared with it; a rank more than 2 % off fails the check (exit 1), naming the card's figures
to look at. A topology no contest round runs (TP4, DP3, TP2 x DP2 on a larger GPU machine) is checked all
the same, the planner per rank as the server ran, under a note citing the final round's rule: the page math
is the planner's at any topology, so such a run still checks it. A "GPU KV cache size" line not as vLLM
writes it is refused, quoted with its file (it read as no report at all)."""

from __future__ import annotations

from pathlib import Path

from .. import options, paths, records
from ..contest import rounds
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..model import capacity as cap_mod
from ..model.shape import load_shape, served_kv_dtype
from . import runs, serverlog

TOLERANCE = 0.02          # the planner's stated bound against vLLM's report (±2 %)
MOST_TOKENS = 10 ** 9      # a KV cache of a billion tokens or more is no card's (the model's 64 KiB per token)
MOST_RANKS = 1024          # tensor- or data-parallel ranks past any machine's (a billion were looped over, one by one)


def served_config(argv: list[str], where: str) -> dict:
    """The configuration a server command ran at, as vLLM's parser reads it."""
    def whole(*opts: str, default: int, most: int | None = None) -> int:
        v = options.last_value(argv, *opts)
        if v is None:
            return default
        n = options.parse_whole(v)
        if n is None or n < 1 or most is not None and n > most:
            raise ForgeError(f"{where}: {opts[0]} {v!r} in the recorded command is not a whole number >= 1"
                             + (f" and <= {most}" if most else ""),
                             hint="the record is not a server command forge wrote; serve the run again")
        return n
    kv = served_kv_dtype(argv)
    if kv is None:
        raise ForgeError(f"{where}: --kv-cache-dtype {options.last_value(argv, '--kv-cache-dtype')} in the recorded "
                         "command: the planner knows the model's bf16 and int8", hint="check a run served with bf16 or "
                         "int8 KV")
    util_text = options.last_value(argv, "--gpu-memory-utilization")
    util = 0.9 if util_text is None else options.parse_number(util_text)
    if util is None or not 0 < util <= 1:
        raise ForgeError(f"{where}: --gpu-memory-utilization {util_text!r} in the recorded command is not in (0, 1]",
                         hint="the record is not a server command forge wrote; serve the run again")
    if whole("--pipeline-parallel-size", "-pp", default=1) > 1:
        raise ForgeError(f"{where}: the recorded command runs pipeline parallelism (--pipeline-parallel-size > 1): "
                         "the planner prices TP and DP only", hint="check a TP or DP run")
    if options.last_value(argv, "--max-num-batched-tokens") is None:
        raise ForgeError(f"{where}: the recorded command sets no --max-num-batched-tokens (the non-KV peak grows with "
                         "it, and vLLM's default depends on the machine)", hint="check a run served with the start "
                         "script's --max-num-batched-tokens (every forge profile sets it)")
    return {"tp": whole("--tensor-parallel-size", "-tp", default=1, most=MOST_RANKS),
            "dp": whole("--data-parallel-size", "-dp", default=1, most=MOST_RANKS), "kv_dtype": kv,
            "gpu_memory_utilization": util, "max_num_batched_tokens": whole("--max-num-batched-tokens", default=0),
            "kv_cache_memory_bytes": whole("--kv-cache-memory-bytes", default=0) or None}


def _report(rdir: Path, serve: dict, dp: int) -> tuple[dict, str]:
    """{rank: tokens} the run's engines reported, and where it was read."""
    if isinstance(serve.get("kv_cache"), dict) and serve["kv_cache"].get("tokens"):
        tokens = serve["kv_cache"]["tokens"]
        if not isinstance(tokens, dict) or not all(isinstance(k, str) and k.isascii() and k.isdigit() and k == str(int(k)) and type(v) is int and
                                                   0 < v < MOST_TOKENS for k, v in tokens.items()):
            raise ForgeError(f"{paths.rel(rdir / 'serve.json')}: kv_cache.tokens is not a map of data-parallel rank to a "
                             f"token count ({str(tokens)[:80]})", hint="serve the run again (forge serve records it)")
        return serve["kv_cache"], "serve.json"
    profile = serve.get("profile") if isinstance(serve.get("profile"), str) else ""
    logs = [rdir / "server.log"] + ([rdir.resolve().parent.parent / "logs" / f"server-{profile}.log"]
                                    if paths.name_problem(profile) is None else [])
    for log in logs:
        if log.is_file():
            text = log.read_text(errors="replace")
            unread = serverlog.kv_cache_unread(text)
            if unread:                     # read as no report at all before: "missing"
                raise ForgeError(f"{paths.rel(log)}: a KV cache report that cannot be read: {unread[0][-200:]!r} (vLLM "
                                 f"writes \"{serverlog.KV_LINE}: 28,224 tokens\")", hint="the log is damaged or edited: "
                                 "serve the run again, or give the run's log as vLLM wrote it")
            rep = serverlog.kv_cache_report(text, dp)
            if any(n <= 0 for n in rep["tokens"].values()):
                raise ForgeError(f"{paths.rel(log)}: a rank reported a KV cache of 0 tokens (the server could not "
                                 "hold a request)", hint="nothing to check the planner against: serve it again")
            if rep["tokens"]:
                return rep, paths.rel(log)
    raise ForgeError(f"{paths.rel(rdir)}: no KV cache report (serve.json has none, and no server log beside it says "
                     "\"GPU KV cache size\")", hint="give a run `forge serve` started and saw ready, or an e2e-gpu "
                     "profile folder (unpacked: forge unpack-run)")


def topology_note(tp: int, dp: int) -> str | None:
    """Where the run's topology is none a contest round runs, what the check then is: the planner against
    the server as it ran (its figure per rank at TP`tp`: a GPU machine's server may run other topologies, and
    its page math is still the planner's), not against a server of the contest's; None for a round's."""
    contest = contest_mod.load_contest()
    final, first = (rounds.load_round(contest, n) for n in ("final", "preliminary"))
    if (tp, dp) in final.topologies or (tp, dp) in first.topologies:
        return None
    rule = next((u.rule for u in final.unlocked if u.key == "tensor_parallel_size"), final.organizers_rule)
    return (f"TP{tp}/DP{dp} is not a topology of the contest: the final round runs "
            + " or ".join(f"TP{t}/DP{d}" for t, d in final.topologies)
            + f" (\"{contest_mod.rule_text(contest, rule)}\" (rule '{rule}')), the preliminary "
            + " or ".join(f"TP{t}/DP{d}" for t, d in first.topologies)
            + f"; this checks the planner per rank at TP{tp} as this server ran, not a server of the contest's")


def check(run: str, card: str = "dcu") -> dict:
    rdir = runs.resolve_run(run)
    spath = rdir / "serve.json"
    if spath.is_dir() or (spath.exists() and not spath.is_file()):
        raise ForgeError(f"{paths.rel(spath)}: not a file (a {'folder' if spath.is_dir() else 'special file'}), where "
                         "the record of the server a run was served with is read", hint="give a run folder `forge "
                         "serve` or `forge e2e-gpu` wrote (reports/runs/<id>, or <e2e folder>/runs/<profile>)")
    if not spath.is_file():
        raise ForgeError(f"{paths.rel(rdir)}: no serve.json (the record of the server a run was served with)",
                         hint="give a run folder `forge serve` or `forge e2e-gpu` wrote (reports/runs/<id>, "
                              "or <e2e folder>/runs/<profile>)")
    serve = records.read_json(spath)
    argv = serve.get("launch") or serve.get("command") if isinstance(serve, dict) else None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ForgeError(f"{paths.rel(spath)}: no server command recorded (launch)", hint="serve the run again")
    cfg = served_config(argv, paths.rel(spath))
    report, source = _report(rdir, serve, cfg["dp"])
    try:
        cap = cap_mod.capacity(load_shape(), tp=cfg["tp"], kv_dtype=cfg["kv_dtype"], card_name=card,
                               utilization=cfg["gpu_memory_utilization"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
                               kv_cache_memory_bytes=cfg["kv_cache_memory_bytes"])
    except ForgeError as e:         # a degree the model cannot run: said without the record it came from
        raise ForgeError(f"{paths.rel(spath)}: the recorded command: {e.message}",
                         hint=f"the record is not a server command vLLM ran for this model; check a run served at "
                              f"{e.hint}" if e.hint else "serve the run again") from None
    extra = sorted(r for r in report["tokens"] if int(r) >= cfg["dp"])
    if extra:
        raise ForgeError(f"{source}: data-parallel rank(s) {', '.join(extra)} reported a KV cache, but the recorded "
                         f"command runs {cfg['dp']} rank(s)", hint="the report and the command are of other servers: "
                         "serve the run again")
    ranks = []
    for rank in (str(r) for r in range(cfg["dp"])):
        tokens = report["tokens"].get(rank)
        if tokens is None:                 # a rank that never reported: nothing checked, so not within
            ranks.append({"rank": rank, "reported_tokens": None, "planned_tokens": cap.reported_tokens,
                          "error": None, "within": False})
            continue
        err = cap.reported_tokens / tokens - 1
        ranks.append({"rank": rank, "reported_tokens": tokens, "planned_tokens": cap.reported_tokens,
                      "error": err, "within": abs(err) <= TOLERANCE})
    return {"run": paths.rel(rdir), "report_from": source, "card": card, "config": cfg, "ranks": ranks,
            "topology_note": topology_note(cfg["tp"], cfg["dp"]),
            "flag": report.get("flag"), "tolerance": TOLERANCE, "ok": all(r["within"] for r in ranks),
            "planner": {"num_blocks": cap.num_blocks, "block_size": cap.block_size, "kv_bytes": cap.kv_bytes}}


def render(res: dict) -> list[str]:
    c = res["config"]
    how = (f"--kv-cache-memory-bytes {c['kv_cache_memory_bytes']} (fixed: the page math alone)"
           if c["kv_cache_memory_bytes"] else f"card {res['card']}, --gpu-memory-utilization {c['gpu_memory_utilization']}")
    L = [f"run {res['run']}: TP{c['tp']}/DP{c['dp']} {c['kv_dtype']} KV, {how}, --max-num-batched-tokens "
         f"{c['max_num_batched_tokens']}; vLLM's report from {res['report_from']}",
         f"{'rank':>5} {'vLLM reported':>14} {'planner':>10} {'error':>8}  within ±{res['tolerance']:.0%}"]
    if res.get("topology_note"):
        L.insert(1, f"note: {res['topology_note']}")
    for r in res["ranks"]:
        if r["reported_tokens"] is None:
            L.append(f"{'DP' + r['rank']:>5} {'(no report)':>14} {r['planned_tokens']:>10,} {'—':>8}  NO")
            continue
        L.append(f"{'DP' + r['rank']:>5} {r['reported_tokens']:>14,} {r['planned_tokens']:>10,} {r['error']:>+8.2%}  "
                 f"{'yes' if r['within'] else 'NO'}")
    if res["flag"]:
        L.append(f"flag: {res['flag']}")
    missing = [r["rank"] for r in res["ranks"] if r["reported_tokens"] is None]
    if missing:
        L.append(f"rank(s) {', '.join(missing)} of the command's {len(res['ranks'])} reported no KV cache: not checked")
    if any(r["reported_tokens"] is not None and not r["within"] for r in res["ranks"]):
        note = cap_mod.CARDS[res["card"]].note
        L.append(f"the planner misses this run's report: check that --card {res['card']} is the card it was served on "
                 f"({note}); its plan's preemption verdicts for this card are off by as much")
    return L
