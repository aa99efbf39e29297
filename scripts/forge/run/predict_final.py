"""`forge predict --round final`: the finals' time model (scripts/forge/model/finals.py) per tier and
configuration for the product, which configuration it would pick per tier and why, and the contest
score of the picks against the finals' baseline with the SLA.

The product is priced as the preliminary's predictions price it: the DCU time model's components
divided by speed-ups (`--calibration DIR`: each tier's factors measured by `forge calibrate`, or
`--speedup NAME=FACTOR` / `--speedups FILE`), its GEMV route serving steps of at most 4 tokens (larger
batches run the GEMM library: the route's 1-4 token range), int8 KV's decode attention at 0.79x and
its prefill attention at 1.09x bf16's time (the H200 measurements of the project's kernels: 37 vs
47 us at 32K; 21.3 vs 19.6 ms per layer with the int8 prefix widened). The finals' baseline is vLLM
0.18.1 upstream at TP2 / 128 / 4096 / 0.95, concurrency 10, modelled on the same requests: its tok/s
is the lift's base, its TTFT P99 (per tier) and TPOT P99 (the largest tier's, for the pooled value)
the SLA's. The client: the round's requests per tier (80 / 70 / 60) from the official run's
(prompt, output) pairs in order, repeated; outputs at each request's own end-of-text (`--outputs eos`,
as the preliminary's client with --custom-output-len 1024 ran) or 1024 forced (`--outputs forced`).
The space: the round's topologies x KV dtypes x --max-num-batched-tokens x --gpu-memory-utilization x
concurrency at the baseline's --max-num-seqs (128), and beside each point whose concurrency would
preempt, the same at the capacity planner's --max-num-seqs (finals.with_planned; labelled "seqs N
(planned)"). A utilization above the baseline's leaves less memory outside vLLM's budget than the
runtime and the CUDA-graph pool need at a large --max-num-seqs: such a configuration is modelled as not
starting (model/headroom.py) and never picked.

`--validate` instead holds the model against the public DP2 / DP1 / TP2 figures and the planner's KV
tokens against the public DCU figures (model/validation.py) and writes that report.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

from .. import options, paths, ui
from ..contest import rounds
from ..errors import ForgeError
from ..model import finals, validation
from ..model.costs import LINKS, UPSTREAM, Build
from ..model.shape import KV_DTYPES, load_shape
from . import final_space, predict_calibration, runs, score
from .timemodel import SPEEDUP_HINT

INT8 = {"int8_decode_attn": 37 / 47, "int8_prefill_attn": 21.3 / 19.6}
DEFAULT_CONCURRENCY = "8,10,12,16,24,32"
DEFAULT_BATCHED = "4096,8192"
# the baseline's 0.95 and 0.97: a DCU card's cache then holds one more of the 8-16K and 16-32K tiers' largest at
# TP1, and what vLLM puts outside its budget still fits at the planned --max-num-seqs (model/headroom.py)
DEFAULT_UTILIZATION = "0.95,0.97"


def _bounds(rnd: rounds.Round, what: str) -> str:
    """The round's bounds of --concurrency (the client's) or of an unlocked option, as "lo..hi"."""
    if what == "--concurrency":
        return "locked" if rnd.concurrency_bounds is None else "{}..{}".format(*rnd.concurrency_bounds[:2])
    return rnd.unlocked_option(what).bounds()


def _values(text: str, what: str, rnd: rounds.Round, example: str, parse=options.parse_whole,
          kind: str = "whole numbers") -> list:
    """A comma-separated list of `kind` in plain digits (`parse`), each within the round's bounds; `example`:
    a good value of the option (its default) for the fix."""
    items = options.comma_items(text, what, f"e.g. {what} {example}")
    options.refuse_unplain(text, what, whole=parse is options.parse_whole)
    vals = [parse(x) for x in items]
    if not vals or any(v is None or v <= 0 for v in vals):
        raise ForgeError(f"{what} {text!r}: {kind} in plain digits within the {rnd.name} round's bounds "
                         f"({_bounds(rnd, what)}), comma-separated", hint=f"e.g. {what} {example}")
    # as plan refuses a dtype given twice: its configurations were modelled once
    options.refuse_repeats(text, what, vals, "its configurations would be modelled once")
    final_space.check_each(rnd, what, vals)
    return vals


def product_builds(args, contest: dict, workload: dict, speedups: dict | None) -> tuple[dict, dict]:
    """({tier: Build}, inputs) for the product from --calibration or the speed-ups."""
    names = [t["name"] for t in contest["tiers"]]
    if args.calibration is not None and speedups:      # the speed-ups were dropped: the product priced without them
        raise ForgeError("give one source of the product's speed-ups, not --calibration and --speedup/--speedups",
                         hint="--calibration DIR (the measured factors), or --speedup NAME=FACTOR / --speedups FILE")
    if args.calibration is not None:
        doc, records = predict_calibration.load(Path(args.calibration))
        fac = predict_calibration.factors(doc, records, workload, f"--calibration {args.calibration}")
        builds = {t: Build(f"ours ({paths.rel(Path(args.calibration))})", {c: v["factor"] for c, v in fac[t].items()},
                           gemv_rows=4, **INT8, source=f"calibration {args.calibration}") for t in names}
        # one calibration prices every topology: its factors were measured at one rank's shapes
        tp = ((doc.get("table") or {}).get("validators") or {}).get("tp") or 1
        return builds, {"calibration": str(args.calibration), "factors": fac, "calibration_tp": tp}
    if speedups:
        return ({t: Build("ours (speed-ups)", dict(speedups), gemv_rows=4, **INT8, source="--speedup") for t in names},
                {"speedups": speedups})
    raise ForgeError("--round final prices the product from --calibration DIR or --speedup NAME=FACTOR / --speedups FILE",
                     hint="e.g. forge predict --round final --calibration reports/calibration/<device>")


def predict_final(args, contest: dict, workload: dict, speedups: dict | None) -> dict:
    rnd = rounds.load_round(contest, "final")
    shape = load_shape()
    builds, inputs = product_builds(args, contest, workload, speedups)
    kv = final_space.kv_dtype_list(args.kv_dtype or ",".join(KV_DTYPES), "its configurations would be modelled once")
    space = {"topology": [tuple(t) for t in rnd.topologies], "kv_dtype": kv,
             "concurrency": _values(args.concurrency or DEFAULT_CONCURRENCY, "--concurrency", rnd, DEFAULT_CONCURRENCY),
             "max_num_batched_tokens": _values(args.max_num_batched_tokens or DEFAULT_BATCHED, "--max-num-batched-tokens",
                                             rnd, DEFAULT_BATCHED),
             "max_num_seqs": [rnd.baseline.max_num_seqs],
             "gpu_memory_utilization": _values(getattr(args, "gpu_memory_utilization", None) or DEFAULT_UTILIZATION,
                                             "--gpu-memory-utilization", rnd, DEFAULT_UTILIZATION,
                                             options.parse_number, "numbers")}
    tiers = {}
    for tier in rnd.tier_order:
        client = rnd.client(tier)
        reqs = finals.tier_requests(workload["tiers"][tier]["requests"], client.num_prompts or 50, args.outputs,
                                    client.output_len)
        base = finals.simulate_tier(finals.FINALS_BASELINE, reqs, UPSTREAM, shape=shape, link=args.link)
        configs = finals.with_planned(space, [p for p, _ in workload["tiers"][tier]["requests"]], client.output_len,
                                      shape=shape)
        planned = sum(c.planned for c in configs)
        ui.info(f"{tier}: {len(configs)} configurations ({planned} at the planner's max-num-seqs), {len(reqs)} requests "
                f"({args.outputs} outputs)")
        ranked = finals.rank_configurations(tier, configs, reqs, builds[tier], base, shape=shape, link=args.link)
        for _, p in ranked:
            refuse_no_number(tier, p, builds[tier])
        tiers[tier] = {"baseline": base, "ranked": [p for _, p in ranked], "requests": len(reqs)}
    pooled_base = max(t["baseline"]["tpot_p99_ms"] for t in tiers.values())
    for t in tiers.values():          # the SLA's TPOT limit is pooled: the baseline's largest tier P99
        for p in t["ranked"]:
            p["why"] = finals.sla_check(p, {"ttft_p99_ms": t["baseline"]["ttft_p99_ms"], "tpot_p99_ms": pooled_base})
            p["sla_ok"] = not p["why"]
        t["ranked"].sort(key=finals.rank_key)
        t["pick"] = finals.pick(t["ranked"], {"ttft_p99_ms": t["baseline"]["ttft_p99_ms"], "tpot_p99_ms": pooled_base})
        t["pick"]["reason"] = reason(t["pick"], t["ranked"], t["baseline"])
    res = score_picks(contest, tiers)
    return {"round": "final", "outputs": args.outputs, "link": args.link, "link_note": LINKS[args.link].note,
            "card": "dcu", "inputs": inputs, "space": {k: [list(x) if isinstance(x, tuple) else x for x in v]
                                                       for k, v in space.items()},
            "baseline_config": finals.FINALS_BASELINE.as_dict(), "tiers": tiers, "score": res,
            "provenance": {"commit": runs.git_commit(), "command": "forge " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                           "model": "scripts/forge/model (capacity, costs, sched, finals)"}}


def refuse_no_number(tier: str, pred: dict, build: Build) -> None:
    """A modelled tok/s or P99 that is no finite number (a time past the float range) is refused, naming
    the build's speed-ups furthest from 1 first, rather than shown as nan and ranked."""
    bad = [name for k, name in (("tok_s", "tok/s"), ("ttft_p99_ms", "TTFT P99"), ("tpot_p99_ms", "TPOT P99"))
           if pred.get(k) is not None and not finals.finite(pred[k])]
    if bad:
        sp = sorted(build.speedups.items(), key=lambda kv: -abs(math.log(kv[1])) if kv[1] > 0 else -math.inf)
        given = ", ".join(f"{c}={v:g}" for c, v in sp if v != 1) or "none"
        raise ForgeError(f"tier {tier}, {pred['label']}: the model's {', '.join(bad)} is no finite number with the "
                         f"speed-ups {given} ({build.source})", hint=SPEEDUP_HINT)


def reason(pick: dict, ranked: list[dict], base: dict) -> str:
    if not pick["sla_ok"]:
        return "no configuration keeps the SLA; the fastest shown: " + "; ".join(pick["why"])
    best = ranked[0]
    s = (f"{pick['pick_rule']}, the most output tok/s ({pick['tok_s']:.1f}, "
         f"{100 * (pick['tok_s'] / base['tok_s'] - 1):+.0f} % vs the modelled baseline {base['tok_s']:.1f}), "
         f"within {finals.PICK_TIE:.0%} of it the most SLA headroom (TTFT P99 {pick['ttft_p99_ms'] / 1000:.1f} s vs "
         f"the limit {finals.SLA_RATIO * base['ttft_p99_ms'] / 1000:.1f} s; {100 * pick['sla_use']:.0f} % of the "
         "tighter limit used)")
    if best is not pick:
        s += f"; fastest inside the SLA: {best['label']} at {best['tok_s']:.1f}"
    other = next((p for p in ranked if p["sla_ok"] and (p["config"]["tp"], p["config"]["dp"])
                  != (pick["config"]["tp"], pick["config"]["dp"])), None)
    if other:
        s += f"; best other topology {other['label']} at {other['tok_s']:.1f}"
    return s + f"; {pick['preemptions']} preemptions"


def score_picks(contest: dict, tiers: dict) -> dict:
    run = {"tiers": {t: {"tok_s": v["pick"]["tok_s"], "ttft_p99_ms": v["pick"]["ttft_p99_ms"], "completion":
                         v["pick"]["completed"] / v["pick"]["requests"], "completed": v["pick"]["completed"],
                         "failed": v["pick"]["failed"]} for t, v in tiers.items()},
           "tpot_p99_pooled_ms": max(v["pick"]["tpot_p99_ms"] for v in tiers.values())}
    base = {"label": "the finals' baseline, modelled (upstream vLLM 0.18.1, TP2, 128 / 4096 / 0.95, concurrency 10)",
            "source": "scripts/forge/model/finals.py",
            "tiers": {t: {"tok_s": v["baseline"]["tok_s"], "ttft_p99_ms": v["baseline"]["ttft_p99_ms"]}
                      for t, v in tiers.items()},
            "tpot_p99_pooled_ms": max(v["baseline"]["tpot_p99_ms"] for v in tiers.values()), "accuracy": None}
    return score.score(contest, run, base)


def render(res: dict, top: int) -> list[str]:
    L = [f"finals' time model: outputs {res['outputs']}, link {res['link']}, product {next(iter(res['tiers'].values()))['pick']['build']}"]
    hdr = f"  {'#':>2} {'configuration':<58} {'tok/s':>7} {'TTFT P99 s':>10} {'TPOT P99 ms':>11} {'preempt':>7} {'SLA':>4}"
    for tier, t in res["tiers"].items():
        b = t["baseline"]
        L += [f"{tier} ({t['requests']} requests); baseline {b['label']}: {b['tok_s']:.1f} tok/s, TTFT P99 "
              f"{b['ttft_p99_ms'] / 1000:.1f} s, TPOT P99 {b['tpot_p99_ms']:.0f} ms", hdr]
        for i, p in enumerate(t["ranked"][:top], 1):
            L.append(f"  {i:>2} {p['label']:<58} {p['tok_s']:>7.1f} {p['ttft_p99_ms'] / 1000:>10.1f} "
                     f"{p['tpot_p99_ms']:>11.0f} {p['preemptions']:>7} {'ok' if p['sla_ok'] else 'no':>4}")
        L.append(f"  pick: {t['pick']['label']}: {t['pick']['reason']}")
    s = res["score"]
    L.append(f"predicted score {s['display']} against {s['baseline']['label']}")
    return L


def render_validation(v: dict) -> list[str]:
    L = ["| figure | tier | public | model | error | gate | ok |", "|---|---|---|---|---|---|---|"]
    for k in v["kv"]:
        L.append(f"| {k['figure']} | - | {k['public']:,} | {k['model']:,} | {100 * k['error']:+.1f} % | {k['gate']} | "
                 f"{'yes' if k['ok'] else 'NO'} |")
    for r in v["rows"]:
        pub = f"{r['public_tok_s']:.1f} tok/s" if r["public_tok_s"] else "-"
        err = f"{100 * r['error']:+.1f} %" if r["error"] is not None else "-"
        ok = "-" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        pt = f", TTFT P99 {r['public_ttft_p99_s']:.1f} s" if r["public_ttft_p99_s"] else ""
        pp = f", TPOT P99 {r['public_tpot_p99_ms']:.1f} ms" if r["public_tpot_p99_ms"] else ""
        L.append(f"| {r['run']} tok/s | {r['tier']} | {pub}{pt}{pp} | {r['model_tok_s']:.1f} tok/s, TTFT P99 "
                 f"{r['model_ttft_p99_s']:.1f} s, TPOT P99 {r['model_tpot_p99_ms']:.1f} ms, {r['preemptions']} "
                 f"preemptions | {err} | {r['gate']} | {ok} |")
    for r in v["tp2_info"]:
        L.append(f"| TP2 c10 duration (information) | {r['tier']} | {r['public_duration_s']:.1f} s | "
                 f"{r['model_duration_s']:.1f} s | {100 * r['error']:+.1f} % | none | - |")
    return L


def run(args, contest: dict, workload: dict, speedups: dict | None) -> int:
    """The --round final branch of `forge predict`."""
    out = paths.results_folder(args.out) if args.out is not None else None
    name = "validation" if args.validate else "predict-final"
    if out is None:                   # the round's prediction is written only to --out: a --force would be ignored
        options.idle_force(args.force, "without --out (--round final writes its files only there)",
                           f"give --out DIR to write {name}.json and {name}.md there, replacing a result recorded there")
    # a folder of that name is no record: write_files refuses it, --force or not
    if out is not None and not options.forced(args.force):
        paths.refuse_recorded(out, name, "a result")
    if args.link not in LINKS:
        raise ForgeError(f"--link {args.link!r}: not a link the model knows", hint=f"one of {', '.join(LINKS)}")
    if args.validate:
        v = validation.validate({t: workload["tiers"][t]["requests"] for t in workload["tiers"]})
        lines = render_validation(v)
        v["provenance"] = {"commit": runs.git_commit(), "command": "forge " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
        doc = validation_md(v, lines)
        data = v
    else:
        data = predict_final(args, contest, workload, speedups)
        lines = render(data, args.top)
        doc = predict_md(data, lines)
    print("\n".join(lines))
    if out is not None:
        # both files or neither: an interrupt leaves the folder as it was
        paths.write_files(out, {f"{name}.md": doc, f"{name}.json": json.dumps(data, indent=2) + "\n"})
        ui.info(f"wrote {paths.rel(out / (name + '.json'))}, {paths.rel(out / (name + '.md'))}")
    if args.validate and not data["passed"]:
        ui.warn("the model does not reproduce the public figures within their gates: do not use its ranking")
        return 1
    return 0


ASSUMPTIONS = [
    "the product: the DCU time model's components divided by the given speed-ups (a calibration's factors keep "
    "their label: measured on the card, or on a stand-in GPU); its GEMV route serves steps of at most 4 tokens; "
    "int8 KV at 0.79x bf16's decode attention and 1.09x its prefill attention (H200 kernel measurements)",
    "the finals' baseline: upstream vLLM 0.18.1 at TP2 / 128 / 4096 / 0.95, concurrency 10, modelled on the same "
    "requests (no measured finals' baseline is published): the lift's base and the SLA's limits",
    "the pooled TPOT P99 stands in as the largest tier's P99, for the picks and for the baseline",
    "TP2's collectives over PCIe through RCCL (custom all-reduce off): ~20 us + bytes / 40 GB/s each; DP2: two "
    "replicas, each a TP1 server with its own KV cache and half the concurrency",
    "vLLM's scheduler stepped synchronously (0.18.1 schedules one step ahead by default; the host gap of the DCU "
    "profiles was measured that way); no prefix caching (off for the hybrid model by default)",
]


def predict_md(data: dict, lines: list[str]) -> str:
    inputs = data["inputs"]
    src = inputs.get("calibration") or ", ".join(f"{k}={v:g}" for k, v in inputs.get("speedups", {}).items())
    labels = sorted({f["label"] for t in inputs.get("factors", {}).values() for f in t.values()})
    return "\n".join([
        "<!-- Generated by `forge predict --round final`; do not edit. -->", "",
        "# The finals' time model: per tier, the product's configurations and the pick", "",
        f"- command: `{data['provenance']['command']}`; commit {_commit(data['provenance']['commit'])}",
        f"- product priced from: {src}" + (f" ({'; '.join(labels)})" if labels else "")
        + (f"; its speed-ups were measured at one rank's shapes at TP{inputs['calibration_tp']} and are applied to "
           "every topology (TP1 and TP2 alike)" if inputs.get("calibration_tp") else ""),
        f"- outputs: {data['outputs']} ({'each request its own end-of-text, capped at 1024' if data['outputs'] == 'eos' else '1024 forced'}); "
        f"the round's requests per tier from configs/workload.yaml's pairs in order", "",
        "```", *lines, "```", "", "What the prediction assumes:", "", *[f"- {a}" for a in ASSUMPTIONS], ""])


def _commit(c: dict) -> str:
    return f"{(c.get('commit') or 'unknown')[:12]}" + (" (dirty)" if c.get("dirty") else "")


def validation_md(v: dict, lines: list[str]) -> str:
    return "\n".join([
        "<!-- Generated by `forge predict --round final --validate`; do not edit. -->", "",
        "# The finals' time model against the public figures", "",
        f"- command: `{v['provenance']['command']}`; commit {_commit(v['provenance']['commit'])}",
        f"- build priced: {v['build']}",
        f"- runs: {v['requests']} requests per tier at concurrency {v['concurrency']}, 1024 forced outputs, the first "
        "requests of each tier's official run order (configs/workload.yaml); TP2: the full tiers at concurrency 10",
        f"- verdict: **{'passed' if v['passed'] else 'FAILED'}** (every gated row within its gate)", "",
        *lines, "",
        "Sources: contest-facts \"The final round\" (one finalist team's public DP1 / DP2 / TP2 reports; public, "
        "unofficial). The TP2 durations came from that team's own final TP2 build, whose components were not "
        "published, so they are shown, not gated.", ""])
