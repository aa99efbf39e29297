"""`forge plan`: the capacity planner (scripts/forge/model/capacity.py) per tier and topology: the KV
cache vLLM 0.18.1 will report ("GPU KV cache size: N tokens"), the blocks a request of the tier holds
(its prompt + the round's 1024 output tokens), how many of the tier's requests stay resident (its
largest and its median), and whether the tier's concurrency will preempt (no: the concurrency's
largest requests fit together; yes: even its smallest do not; possible: in between). DP2 is two TP1
servers, each with half the concurrency. The prompts are the official run's (configs/workload.yaml).

"planned seqs" is the --max-num-seqs that keeps a tier's requests resident where its concurrency would
preempt: the resident count of its largest request (one replica; DP2 sets it per replica), shown where
that is below the concurrency per replica, "-" where nothing preempts (no cap needed). vLLM admits up to
--max-num-seqs requests and, when their blocks run out, preempts by recompute (a DCU card's cache holds 4
of the 16-32K tier's largest at TP1 bf16); `forge predict --round final` and `forge sweep --round final`
try this value beside their own.

The reported tokens divide the block pool by its 4 groups as if each held attention tokens; the 3 GDN
groups hold one block per request, so residency is counted in blocks. Also printed: the
`--kv-cache-memory-bytes` that makes a server on another card (the GPU machine) allocate exactly the
DCU card's blocks at TP1 (vLLM then skips its memory profile and takes that many bytes for the cache),
and the memory the utilization leaves outside vLLM's budget: above 0.95, the largest --max-num-seqs
whose CUDA-graph pool it holds beside the runtime (scripts/forge/model/headroom.py).

`--against RUN` checks the planner against a served run instead: the KV cache each of its engines
reported (serve.json, or the server log of an e2e-gpu profile folder), against the planner's figure for
the run's own command (topology, KV dtype, utilization, batched tokens; a fixed --kv-cache-memory-bytes
checks the page math alone) on --card; exit 1 where a rank is more than 2 % off. A topology no contest round
runs is checked all the same, with a note citing the final round's rule; a "GPU KV cache size" line not as
vLLM writes it is refused, quoted with its file.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from .. import options, paths, ui
from ..contest import rounds
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..model import capacity as cap_mod
from ..model import headroom as room_mod
from ..model.shape import KV_DTYPES, load_shape
from . import final_space, gpu_harness, plan_check, synth

TOPOLOGIES = {"preliminary": [(1, 1)], "final": [(1, 1), (1, 2), (2, 1)]}


def plan(round_name: str = "preliminary", tiers: list[str] | None = None, kv_dtypes: list[str] | None = None,
         card: str = "dcu", utilization: float | None = None, max_num_batched_tokens: int | None = None,
         concurrency: int | None = None) -> dict:
    contest = contest_mod.load_contest()
    rnd = rounds.load_round(contest, round_name)
    workload = synth.load_workload(contest)
    shape = load_shape()
    names = list(rnd.tier_order)
    for t in tiers or []:
        if t not in names:
            raise ForgeError(f"{options.named('--tier', 'TIER', t)} {t!r}: not a tier of the {round_name} round",
                             hint=f"tiers: {', '.join(names)}")
    for key, opt, v in (("gpu_memory_utilization", "--gpu-memory-utilization", utilization),
                        ("max_num_batched_tokens", "--max-num-batched-tokens", max_num_batched_tokens),
                        ("concurrency", "--concurrency", concurrency)):
        if rnd.unlocked:              # a round that leaves them to the team bounds them, citing its rule
            final_space.check_each(rnd, opt, [] if v is None else [v], name=opt)
        elif v is not None and v != getattr(rnd.baseline, key):     # one that locks them plans at its own value
            rule = rnd.organizers_rule
            raise ForgeError(f"{opt} {v}: the {round_name} round locks it at {getattr(rnd.baseline, key)}: "
                             f"\"{contest_mod.rule_text(contest, rule)}\" (rule '{rule}')",
                             hint=f"drop {opt}, or plan the round that unlocks it (--round final)")
    util = rnd.baseline.gpu_memory_utilization if utilization is None else utilization
    mnbt = rnd.baseline.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    rows = []
    for tier in tiers or names:
        client = rnd.client(tier)
        conc = client.concurrency if concurrency is None else concurrency
        prompts = [p for p, _ in workload["tiers"][tier]["requests"]]
        for tp, dp in TOPOLOGIES[round_name]:
            for dt in kv_dtypes or list(KV_DTYPES):
                r = cap_mod.topology_fit(shape, tp, dp, prompts, client.output_len, conc, kv_dtype=dt, card_name=card,
                                         utilization=util, max_num_batched_tokens=mnbt)
                if util > room_mod.BASELINE_UTILIZATION:   # the cap the sweep and predict serve there (headroom's too)
                    r["fit"]["planned_max_num_seqs"] = cap_mod.planned_seqs(
                        shape, tp, dp, prompts, client.output_len, conc, kv_dtype=dt, card_name=card,
                        utilization=util, max_num_batched_tokens=mnbt)
                rows.append({"tier": tier, "kv_dtype": dt, "concurrency": conc, "output_len": client.output_len, **r})
    gpu: dict = {}
    for tp in sorted({tp for tp, _ in TOPOLOGIES[round_name]}):
        for dt in kv_dtypes or list(KV_DTYPES):
            c = cap_mod.capacity(shape, tp=tp, kv_dtype=dt, card_name="dcu", utilization=util,
                                 max_num_batched_tokens=mnbt)
            entry = {"kv_cache_memory_bytes": c.kv_memory_for(), "dcu_reported_tokens": c.reported_tokens,
                     "dcu_num_blocks": c.num_blocks, "tp": tp}
            if tp == 1:
                gpu[dt] = entry                    # per rank; TP1's under the dtype alone, as before
            else:
                gpu[f"{dt}-tp{tp}"] = entry
    room = cap_mod.room(shape, cap_mod.capacity(shape, card_name=card, utilization=util, max_num_batched_tokens=mnbt), 1)
    return {"round": round_name, "card": card, "card_note": cap_mod.CARDS[card].note, "gpu_memory_utilization": util,
            "max_num_batched_tokens": mnbt, "rows": rows, "dcu_on_another_card": gpu,
            "headroom": {"outside_bytes": room.outside_bytes, "known_good": room.known_good, "max_num_seqs": room.max_seqs,
                         "why": room.why()},
            "fixed_overhead_bytes": cap_mod.fitted_fixed_overhead(shape, card),
            "source": "configs/models/qwen3.5-27b/config.json; configs/workload.yaml prompts; vLLM 0.18.1 page math"}


def render(res: dict) -> list[str]:
    L = [f"{res['round']} round, card {res['card']}, --gpu-memory-utilization {res['gpu_memory_utilization']}, "
         f"--max-num-batched-tokens {res['max_num_batched_tokens']}",
         f"{'tier':>7} {'topology':>9} {'KV':>5} {'reported tokens':>16} {'blocks':>7} {'block':>6} "
         f"{'req blocks':>10} {'resident':>13} {'conc/replica':>12} {'preempt':>10} {'planned seqs':>12}"]
    above = res["gpu_memory_utilization"] > room_mod.BASELINE_UTILIZATION
    for r in res["rows"]:
        c, f = r["capacity"], r["fit"]
        L.append(f"{r['tier']:>7} {'TP%d/DP%d' % (r['tp'], r['dp']):>9} {r['kv_dtype']:>5} {c['reported_tokens']:>16,} "
                 f"{c['usable_blocks']:>7} {c['block_size']:>6} {f['blocks_largest']:>10} "
                 f"{'%d / %d' % (f['resident_largest'], f['resident_median']):>13} {r['per_replica_concurrency']:>12} "
                 f"{f['preempt']:>10} {f['planned_max_num_seqs'] or ('none' if above else '-'):>12}")
    L.append("resident: requests of the tier's largest / median prompt + output that fit at once (blocks; the "
             "reported tokens understate it: the GDN groups take one block per request)")
    L.append("planned seqs: the --max-num-seqs that keeps them resident where the concurrency would preempt (the "
             "largest's resident count, per replica); -: no cap needed. A capacity bound, not a latency one: "
             "requests admitted together wait through each other's prefills, so the TPOT P99 can pass the SLA's "
             "limit first (predict --round final prices both)"
             + ("; above 0.95 also the cap a utilization needs (up to the concurrency the cache holds, no more than "
                "the memory left outside vLLM's budget holds); none: no --max-num-seqs runs there" if above else ""))
    h = res.get("headroom")
    if h and h["known_good"]:
        L.append(h["why"])
    elif h:
        L.append(f"outside vLLM's budget: {h['outside_bytes'] / room_mod.GiB:.2f} GiB at this utilization; "
                 + (f"at TP1 it holds the runtime (an allowance of {room_mod.CONTEXT_ALLOWANCE / room_mod.GiB:.2f} GiB), "
                    f"a margin and the CUDA-graph pool up to --max-num-seqs {h['max_num_seqs']}"
                    if h["max_num_seqs"] else "it does not hold the runtime's allowance, a margin and the CUDA-graph "
                                              "pool at any --max-num-seqs")
                 + "; TP2 is not modelled above 0.95 (model/headroom.py; the allowance is a judgement: the sweep on "
                   "the card is the check)")
    if any((r["tp"], r["dp"]) == (1, 1) for r in res["rows"]):
        L.append("one replica at TP1 (one card, as the preliminary serves it): for reference; the final round's two "
                 "topologies are two replicas at TP1 (DP2) and TP2")
    for dt, g in res["dcu_on_another_card"].items():
        tp = g.get("tp", 1)
        if g["kv_cache_memory_bytes"] < gpu_harness.MIN_KV_CACHE_BYTES:   # a size sweep and e2e-gpu refuse
            L.append(f"GPU run, {dt.split('-')[0]} KV: none; a DCU card holds no KV cache (under 256 MiB) at TP{tp} "
                     "beside the weights at this utilization and batched tokens")
            continue
        L.append(f"GPU run, {dt.split('-')[0]} KV: --kv-cache-memory-bytes {g['kv_cache_memory_bytes']} gives the DCU "
                 f"card's {g['dcu_num_blocks']} blocks at TP{tp}{' per rank' if tp > 1 else ''} "
                 f"({g['dcu_reported_tokens']:,} tokens reported)")
    return L


def number(text: str | None, what: str, lo: float, hi: float, example: str) -> float | None:
    """An option's number in (lo, hi], or None when not given."""
    if text is None:
        return None
    options.refuse_unplain(text, what, whole=False)
    v = options.parse_number(text)
    if v is None or not lo < v <= hi:
        raise ForgeError(f"{what} {text!r}: expected a number > {lo:g} and <= {hi:g}", hint=f"e.g. {options.written(what, example)}")
    return v


def whole(text: str | None, what: str, example: str) -> int | None:
    """An option's whole number >= 1, or None when not given."""
    if text is None:
        return None
    options.refuse_unplain(text, what)
    v = options.parse_whole(text)
    if v is None or v < 1:
        raise ForgeError(f"{what} {text!r}: expected a whole number >= 1", hint=f"e.g. {options.written(what, example)}")
    return v


def _out(args, stem: str, what: str):
    """--out as a folder outside the tool's sources that holds no recorded <stem>.json (unless --force)."""
    if args.out is None:          # nothing is written: a --force would be ignored
        options.idle_force(args.force, "without --out", f"give --out DIR (make plan OUT=DIR) to write {stem}.json and "
                                                        f"{stem}.md there, replacing {what} recorded there")
        return None
    out = paths.results_folder(args.out)
    # a folder of that name is no record: write_files refuses it, --force or not
    if not options.forced(args.force):
        paths.refuse_recorded(out, stem, what)
    return out


def _write(out, stem: str, res: dict, lines: list[str], verb: str) -> None:
    """<stem>.json (the result and the command) and <stem>.md (the printed lines) in --out, both or
    neither (an interrupt leaves the folder as it was)."""
    res["command"] = "forge " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    paths.write_files(out, {f"{stem}.json": json.dumps(res, indent=2) + "\n",
                            f"{stem}.md": f"<!-- Generated by `{verb}`; do not edit. -->\n\n```\n"
                                          + "\n".join(lines) + "\n```\n"})
    ui.info(f"wrote {paths.rel(out / f'{stem}.json')}, {paths.rel(out / f'{stem}.md')}")


def cmd_against(args) -> int:
    """--against RUN: the planner against a served run's report (plan_check)."""
    given = [o for o, v in (("--round", args.round), ("--tier", args.tier), ("--kv-dtype", args.kv_dtype),
                            ("--concurrency", args.concurrency),
                            ("--gpu-memory-utilization", args.gpu_memory_utilization),
                            ("--max-num-batched-tokens", args.max_num_batched_tokens)) if v is not None]
    if given:
        raise ForgeError(f"--against {args.against} with {', '.join(given)}: the run's own command gives the "
                         "configuration", hint="drop them; --card names the card the run was served on")
    out = _out(args, "plan-check", "a check")
    res = plan_check.check(args.against, args.card)
    lines = plan_check.render(res)
    for line in lines:
        print(line)
    if out is not None:
        _write(out, "plan-check", res, lines, "forge plan --against")
    return 0 if res["ok"] else 1


def cmd_plan(args) -> int:
    if args.against is not None:
        return cmd_against(args)
    # make plan KV_DTYPE=... UTIL=...: a refusal names the variable the user wrote (options.named)
    kv = final_space.kv_dtype_list(args.kv_dtype, "its rows would be printed twice",
                                   options.named("--kv-dtype", "KV_DTYPE", args.kv_dtype)) if args.kv_dtype else None
    out = _out(args, "plan", "a plan")
    util = number(args.gpu_memory_utilization,
                  options.named("--gpu-memory-utilization", "UTIL", args.gpu_memory_utilization), 0.0, 1.0, "0.95")
    mnbt = whole(args.max_num_batched_tokens, "--max-num-batched-tokens", "8192")
    conc = whole(args.concurrency, "--concurrency", "10")
    res = plan(args.round or rounds.DEFAULT_ROUND, [args.tier] if args.tier else None, kv, args.card, util, mnbt, conc)
    lines = render(res)
    for line in lines:
        print(line)
    if out is not None:
        _write(out, "plan", res, lines, "forge plan")
    return 0


def register(sub) -> None:
    p = sub.add_parser("plan", help="the KV cache and requests resident per tier and topology (capacity planner)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # no default here: --against takes the run's own configuration, so a round given with it is refused
    p.add_argument("--round", choices=rounds.ROUNDS, default=None,
                   help=f"the contest round (default {rounds.DEFAULT_ROUND}; final: its two topologies over two cards, "
                        "TP1/DP2 and TP2/DP1, and TP1/DP1, one card as the preliminary serves it, for reference); "
                        "not with --against")
    p.add_argument("--tier", help="one tier (default: every tier of the round)")
    p.add_argument("--kv-dtype", help="bf16, int8 or both comma-separated (default both)")
    p.add_argument("--card", choices=sorted(cap_mod.CARDS), default="dcu", help="the card's memory (default dcu)")
    p.add_argument("--gpu-memory-utilization",
                   help="the final round's 0.1 to 1; default: the round's baseline (0.95); the preliminary locks it "
                        "(its own value only)")
    p.add_argument("--max-num-batched-tokens",
                   help="the final round's 256 to 32768; default: the round's baseline (4096); the activation part of "
                        "the non-KV peak grows with it; the preliminary locks it (its own value only)")
    p.add_argument("--concurrency",
                   help="requests in flight, the final round's 1 to 256 (default: the round's client per tier); the "
                        "preliminary locks it at 1")
    p.add_argument("--against", metavar="RUN",
                   help="check the planner against a served run's report instead (a run id or folder with serve.json: "
                        "its command gives the configuration; exit 1 where a rank's KV cache is over 2 %% off; "
                        "a topology no contest round runs, e.g. TP4, is checked with a note saying so; "
                        "writes plan-check.json and .md with --out)")
    p.add_argument("--out", help="folder for plan.json and plan.md (a recorded plan is replaced only with --force)")
    p.add_argument("--force", action="store_true", help="replace a plan recorded in --out")
    p.set_defaults(func=cmd_plan)

