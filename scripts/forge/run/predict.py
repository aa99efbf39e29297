"""`forge predict`: the DCU's tok/s per tier and the contest score, predicted from the official
upstream baseline run on the DCU (configs/workload.yaml: mean TTFT, mean TPOT and every request's
output length per tier) and one of:

- measured ratios: a run's per-tier mean TTFT and mean TPOT against same-run upstream (`--run` with
  `--reference`, or every profile of an e2e results folder with `--e2e`); assumes the ratios carry
  over from the machine they were measured on to the DCU;
- a component model (`--speedup NAME=FACTOR`, `--speedups FILE`): vLLM 0.18.1's time on the DCU as
  prefill components (by prompt length) and per-token decode components (by context length), each
  divided by its speed-up, so a planned kernel is priced before it is written;
- absolute times (`--ttft-s a,b,c --tpot-ms a,b,c`): mean TTFT and TPOT per tier as measured on the
  DCU (e.g. another team's published stage).

How a tier's tok/s follows from TTFT and TPOT, as `vllm bench serve` computes output throughput
(total output tokens / total duration): at concurrency 1 each request takes TTFT + (n-1) x TPOT, and
the client's request rate of 1/s adds no idle time because every request lasts longer than 1 s (the
queued arrivals start as soon as the previous request ends). Checked on the official run: the
summed request times (mean TTFT + (n-1) x mean TPOT) are 1019.6 / 1553.4 / 2177.5 s against its
measured durations 1020.9 / 1553.8 / 2181.8 s (within 0.2 %), so no request-rate spacing is added.
"""

from __future__ import annotations

import math
from pathlib import Path

from .. import paths, ui
from ..errors import ForgeError
from . import archive, results, runs, score, synth
from . import contest as contest_mod

# The DCU time model: vLLM 0.18.1 upstream on gfx936, from public request-window profiles.
# Prefill of a prompt of S tokens, in seconds; decode per output token at
# context C, in ms. Each entry: (what, function of S or C, source).
ATTN_FLOPS_PER_S2 = 196_608          # causal full-attention FLOPs per S^2, 16 layers
ATTN_BASE_FLOPS = 4.0e12             # the paged unified 2D kernel on gfx936: ~3.6-4.1 TFLOP/s
DECODE_ATTN_REF_CTX = 14_000         # decode attention 2.9 ms per token at 14K context

PREFILL = {
    "prefill_attn": ("full-attention prefill, 196,608 x S^2 FLOPs at ~4 TFLOP/s",
                     lambda s: ATTN_FLOPS_PER_S2 * s * s / ATTN_BASE_FLOPS),
    "prefill_gemm": ("GEMMs, 0.153 ms per prompt token", lambda s: 0.153e-3 * s),
    "prefill_gdn": ("GDN chunk kernels, 0.61 s at 21.7K tokens", lambda s: 0.61 * s / 21_700),
    "prefill_elementwise": ("elementwise, norms, copies, 0.42 s at 21.7K tokens", lambda s: 0.42 * s / 21_700),
    "prefill_other": ("fixed per-request cost, 0.1 s", lambda s: 0.1),
}
DECODE = {
    "gemv": ("GEMV/GEMM of all linear layers, 63.1 ms", lambda c: 63.1),
    "decode_attn": ("decode attention, 2.9 ms at 14K context, linear in context",
                    lambda c: 2.9 * c / DECODE_ATTN_REF_CTX),
    "decode_gdn": ("GDN recurrent + conv update, 0.9 ms", lambda c: 0.9),
    "decode_elementwise": ("elementwise (inductor-fused), 2.5 ms", lambda c: 2.5),
    "host": ("host / graph launch gap, 1.6 ms", lambda c: 1.6),
}
COMPONENTS = {**PREFILL, **DECODE}

ASSUMPTIONS = {
    "throughput": "tier tok/s = total output tokens / sum over requests of (TTFT + (n-1) x TPOT), with the "
                  "official run's output length n of every request (end-of-text as upstream produced it); "
                  "no request-rate spacing (checked on the official run: within 0.2 % of its durations)",
    "ratios": "per-tier mean TTFT and TPOT ratios measured against same-run upstream carry over from the "
              "machine they were measured on to the DCU unchanged",
    "components": "each component's time is divided by its speed-up; the model's per-tier sums are used as "
                  "shares: predicted time = the official run's measured mean x model(speed-ups) / model(1), "
                  "so all speed-ups 1 reproduce the baseline exactly; decode context = the prompt length",
    "sla": "TTFT P99 = baseline TTFT P99 x the tier's TTFT ratio; pooled TPOT P99 = the baseline's x the "
           "largest tier TPOT ratio; completion 100 %; accuracy not applied",
}


# --- the model -----------------------------------------------------------------------------------

def tier_tok_s(outputs: list[int], ttft_s: float, tpot_s: float) -> float:
    """Output tok/s of a tier at concurrency 1: total output tokens over the summed request times."""
    if not outputs:
        raise ForgeError("a tier needs at least one request")
    total = sum(ttft_s + (n - 1) * tpot_s for n in outputs)
    return sum(outputs) / total


def _baseline(workload: dict, tier: str) -> dict:
    return workload["tiers"][tier]["baseline"]


def predict_from_times(workload: dict, ttft_ms: dict, tpot_ms: dict, how: str = "times") -> dict:
    """Per tier: {ttft_ms, tpot_ms, ttft_ratio, tpot_ratio, tok_s, baseline_tok_s_model, ...}."""
    out = {}
    for tier, w in workload["tiers"].items():
        b = w["baseline"]
        outs = [o for _, o in w["requests"]]
        t, p = float(ttft_ms[tier]), float(tpot_ms[tier])
        for name, v in (("TTFT", t), ("TPOT", p)):
            if not (math.isfinite(v) and v > 0):
                raise ForgeError(f"tier {tier}: {name} {v} is not a finite positive time")
        tok = tier_tok_s(outs, t / 1000, p / 1000)
        base = tier_tok_s(outs, b["mean_ttft_ms"] / 1000, b["mean_tpot_ms"] / 1000)
        dur = sum(t / 1000 + (n - 1) * p / 1000 for n in outs)
        out[tier] = {"ttft_ms": t, "tpot_ms": p, "ttft_ratio": t / b["mean_ttft_ms"], "tpot_ratio": p / b["mean_tpot_ms"],
                     "tok_s": tok, "baseline_tok_s_model": base, "baseline_tok_s_measured": b["output_tok_s"],
                     "ttft_share": len(outs) * t / 1000 / dur, "output_tokens": sum(outs), "requests": len(outs),
                     "how": how}
    return out


def predict_from_ratios(workload: dict, ttft_ratio: dict, tpot_ratio: dict) -> dict:
    """Scale the official baseline's mean TTFT and TPOT per tier by measured ratios."""
    return predict_from_times(
        workload, {t: _baseline(workload, t)["mean_ttft_ms"] * ttft_ratio[t] for t in workload["tiers"]},
        {t: _baseline(workload, t)["mean_tpot_ms"] * tpot_ratio[t] for t in workload["tiers"]}, how="ratios")


def component_times(workload: dict, speedups: dict | None = None) -> dict:
    """Per tier, the model's mean TTFT (s) and TPOT (ms) per component, with speed-ups applied."""
    sp = check_speedups(speedups or {})
    out = {}
    for tier, w in workload["tiers"].items():
        lens = [s for s, _ in w["requests"]]
        pre = {k: sum(f(s) for s in lens) / len(lens) / sp.get(k, 1.0) for k, (_, f) in PREFILL.items()}
        dec = {k: sum(f(s) for s in lens) / len(lens) / sp.get(k, 1.0) for k, (_, f) in DECODE.items()}
        out[tier] = {"prefill_s": pre, "decode_ms": dec, "ttft_s": sum(pre.values()), "tpot_ms": sum(dec.values())}
    return out


def predict_from_components(workload: dict, speedups: dict) -> dict:
    """The DCU prediction for speed-ups per component (COMPONENTS; 1 = unchanged): each tier's model
    time relative to the model's baseline, applied to the official run's measured means."""
    base = component_times(workload)
    new = component_times(workload, speedups)
    ttft = {t: _baseline(workload, t)["mean_ttft_ms"] * new[t]["ttft_s"] / base[t]["ttft_s"] for t in new}
    tpot = {t: _baseline(workload, t)["mean_tpot_ms"] * new[t]["tpot_ms"] / base[t]["tpot_ms"] for t in new}
    pred = predict_from_times(workload, ttft, tpot, how="components")
    for t in pred:
        b = _baseline(workload, t)
        pred[t]["model"] = {"baseline": base[t], "with_speedups": new[t],
                            "model_vs_measured_ttft": base[t]["ttft_s"] * 1000 / b["mean_ttft_ms"] - 1,
                            "model_vs_measured_tpot": base[t]["tpot_ms"] / b["mean_tpot_ms"] - 1}
    return pred


def check_speedups(sp: dict) -> dict:
    for k, v in sp.items():
        if k not in COMPONENTS:
            raise ForgeError(f"unknown component {k!r} in the speed-ups",
                             hint=f"components: {', '.join(COMPONENTS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ForgeError(f"speed-up of {k}: {v!r} is not a finite positive factor",
                             hint="e.g. --speedup prefill_attn=10 (10x faster); 1 = unchanged")
    return {k: float(v) for k, v in sp.items()}


def score_prediction(contest: dict, workload: dict, pred: dict, baseline_name: str | None = None) -> dict:
    """The contest score of the predicted tok/s against a configured baseline set, with the SLA
    estimated as ASSUMPTIONS['sla'] says."""
    base = score.baseline_from_config(contest, baseline_name)
    tiers = {}
    for t, p in pred.items():
        b = _baseline(workload, t)
        tiers[t] = {"tok_s": p["tok_s"], "ttft_p99_ms": b["p99_ttft_ms"] * p["ttft_ratio"], "completion": 1.0,
                    "completed": p["requests"], "failed": 0}
    pooled = max(_baseline(workload, t)["p99_tpot_ms"] for t in pred) * max(p["tpot_ratio"] for p in pred.values())
    return score.score(contest, {"tiers": tiers, "tpot_p99_pooled_ms": pooled}, base)


# --- measured ratios from run folders -------------------------------------------------------------

def run_means(run: Path, tier: str) -> tuple[float, float]:
    """Mean TTFT and mean TPOT (ms) of a tier's successful requests, as vLLM's client defines them,
    from its result file read and checked as score and compare read it."""
    p = run / f"{tier}.json"
    return results.mean_times_ms(results.read_result(p), paths.rel(p))


def measured_ratios(run: Path, ref: Path, contest: dict) -> tuple[dict, dict, dict]:
    ttft, tpot, detail = {}, {}, {}
    for t in contest_mod.tier_names(contest):
        for d in (run, ref):
            if not (d / f"{t}.json").is_file():
                raise ForgeError(f"{paths.rel(d)}: tier {t} has no result ({t}.json)",
                                 hint="give run folders with all three tiers")
        a, b = run_means(run, t), run_means(ref, t)
        ttft[t], tpot[t] = a[0] / b[0], a[1] / b[1]
        detail[t] = {"run_ttft_ms": a[0], "run_tpot_ms": a[1], "ref_ttft_ms": b[0], "ref_tpot_ms": b[1]}
    return ttft, tpot, detail


# --- output ---------------------------------------------------------------------------------------

def render_md(label: str, how: str, pred: dict, res: dict, inputs: dict) -> str:
    # a column for the score's baseline tok/s (what each lift is against) where they are not the official run's
    other = any(res["tiers"][t]["baseline_tok_s"] != p["baseline_tok_s_measured"] for t, p in pred.items())
    L = ["<!-- Generated by `forge predict`; do not edit. -->", "",
         f"# DCU prediction: {label}", "",
         f"Predicted contest score **{res['display']}** against {res['baseline']['label']} "
         f"(exact {res['total']:.2f}; from {how}).", "",
         "| tier | TTFT s | TTFT ratio | TPOT ms | TPOT ratio | TTFT share | tok/s | baseline tok/s (measured / model) "
         + (f"| {res['baseline']['label']} tok/s " if other else "") + "| lift | score |",
         "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if other else "")]
    for t, p in pred.items():
        s = res["tiers"][t]
        L.append(f"| {t} | {p['ttft_ms'] / 1000:.2f} | {p['ttft_ratio']:.3f} | {p['tpot_ms']:.1f} | {p['tpot_ratio']:.3f} "
                 f"| {100 * p['ttft_share']:.0f} % | {p['tok_s']:.2f} | {p['baseline_tok_s_measured']:.2f} / "
                 f"{p['baseline_tok_s_model']:.2f} | " + (f"{s['baseline_tok_s']:.2f} | " if other else "")
                 + f"{100 * s['lift']:+.1f} % | {s['contribution']:.2f} / {s['weight']:.0f}"
                 + (f" (zero: {'; '.join(s['zeroed_by'])})" if s["zeroed_by"] else "") + " |")
    if how == "components":
        L += ["", "Component model (mean per request; speed-ups applied):", "",
              "| tier | " + " | ".join(COMPONENTS) + " | model vs measured baseline (TTFT / TPOT) |",
              "|---|" + "---|" * (len(COMPONENTS) + 1)]
        for t, p in pred.items():
            m = p["model"]["with_speedups"]
            cells = [f"{m['prefill_s'][k]:.2f} s" for k in PREFILL] + [f"{m['decode_ms'][k]:.2f} ms" for k in DECODE]
            L.append(f"| {t} | " + " | ".join(cells) + f" | {100 * p['model']['model_vs_measured_ttft']:+.0f} % / "
                     f"{100 * p['model']['model_vs_measured_tpot']:+.0f} % |")
    L += ["", "Inputs: " + ", ".join(f"{k} {v}" for k, v in inputs.items()), "", "What the prediction assumes:", ""]
    keys = ["throughput", {"ratios": "ratios", "components": "components"}.get(how), "sla"]
    L += [f"- {k}: {ASSUMPTIONS[k]}" for k in keys if k]
    L += [f"- baseline run: {synth_source()}"]
    return "\n".join(L) + "\n"


def synth_source() -> str:
    return "configs/workload.yaml (the official upstream vLLM 0.18.1 run on the DCU)"


def chart(label: str, pred: dict, res: dict, path: Path) -> bool:
    plt = ui.pyplot()
    if plt is None:
        return False
    names = list(pred)
    x = list(range(len(names)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    ax = axes[0]
    ax.bar([i - 0.2 for i in x], [res["tiers"][n]["baseline_tok_s"] for n in names], 0.4,
           label=f"baseline: {res['baseline']['label']}")
    ax.bar([i + 0.2 for i in x], [pred[n]["tok_s"] for n in names], 0.4, label="predicted")
    ax.set_xticks(x, names)
    ax.set_ylabel("output tok/s")
    ax.set_title("Throughput per tier")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize="small", frameon=False)
    ax = axes[1]
    for off, key, lab in ((-0.2, "base", "baseline"), (0.2, "pred", "predicted")):
        ttft, dec = [], []
        for n in names:
            p = pred[n]
            t = (p["ttft_ms"] / p["ttft_ratio"]) if key == "base" else p["ttft_ms"]
            q = (p["tpot_ms"] / p["tpot_ratio"]) if key == "base" else p["tpot_ms"]
            per_req_out = p["output_tokens"] / p["requests"]
            ttft.append(t / 1000)
            dec.append((per_req_out - 1) * q / 1000)
        ax.bar([i + off for i in x], ttft, 0.4, label=f"TTFT ({lab})")
        ax.bar([i + off for i in x], dec, 0.4, bottom=ttft, label=f"decode ({lab})", alpha=0.6)
    ax.set_xticks(x, names)
    ax.set_ylabel("s per request (mean)")
    ax.set_title("Where a request's time goes")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize="small", frameon=False)
    fig.suptitle(f"DCU prediction {label}: score {res['display']} vs {res['baseline']['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_outputs(out: Path, label: str, how: str, pred: dict, res: dict, inputs: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = {"label": label, "how": how, "inputs": inputs, "tiers": pred, "score": res,
            "assumptions": {k: ASSUMPTIONS[k] for k in ("throughput", how if how in ASSUMPTIONS else "", "sla") if k},
            "components": {k: v[0] for k, v in COMPONENTS.items()}, "baseline_run": synth_source()}
    runs.write_json(out / "predict.json", data)
    (out / "predict.md").write_text(render_md(label, how, pred, res, inputs))
    files = [out / "predict.json", out / "predict.md"]
    if chart(label, pred, res, out / "predict.png"):
        files.append(out / "predict.png")
    return files


def print_table(label: str, pred: dict, res: dict) -> None:
    print(f"{label}")
    print(f"{'tier':>7} {'TTFT s':>8} {'ratio':>6} {'TPOT ms':>8} {'ratio':>6} {'TTFT%':>6} {'tok/s':>7} "
          f"{'base':>6} {'lift':>7} {'score':>6}")
    for t, p in pred.items():
        s = res["tiers"][t]
        print(f"{t:>7} {p['ttft_ms'] / 1000:>8.2f} {p['ttft_ratio']:>6.3f} {p['tpot_ms']:>8.1f} {p['tpot_ratio']:>6.3f} "
              f"{100 * p['ttft_share']:>5.0f}% {p['tok_s']:>7.2f} {s['baseline_tok_s']:>6.2f} "
              f"{100 * s['lift']:>+6.1f}% {s['contribution']:>6.2f}")
    print(f"predicted score {res['display']}  (exact {res['total']:.2f}; baseline {res['baseline']['label']})")


# --- command line --------------------------------------------------------------------------------

def parse_speedups(items: list[str], file: str | None) -> dict:
    sp: dict = {}
    if file is not None:
        from ..config import load_yaml
        data = load_yaml(Path(file))
        if not isinstance(data, dict) or not data:
            raise ForgeError(f"{file}: " + ("holds no speed-ups" if data in ({}, None) else
                                            "expected a mapping of component: factor"),
                             hint="e.g. a line `prefill_attn: 10` per component (1 = unchanged)")
        sp.update(data)
    for it in items or []:
        if "=" not in it:
            raise ForgeError(f"--speedup {it!r}: expected NAME=FACTOR", hint="e.g. --speedup prefill_attn=10")
        k, v = it.split("=", 1)
        if k.strip() in sp:
            raise ForgeError(f"--speedup {it!r}: {k.strip()} is given twice" + (f" (also in {file})" if file else ""),
                             hint="give each component once")
        try:
            sp[k.strip()] = float(v)
        except ValueError:
            raise ForgeError(f"--speedup {it!r}: {v!r} is not a number")
    return check_speedups(sp)


def e2e_jobs(root: Path, folder: Path, ref_name: str, contest: dict, workload: dict) -> list:
    """(label, how, prediction, inputs) for every profile of an e2e results folder read from `folder`
    (the folder itself, or a packed record's extraction) against its reference profile."""
    rdir = folder / "runs"
    have = sorted(p.name for p in rdir.iterdir() if p.is_dir()) if rdir.is_dir() else []
    if ref_name not in have:
        raise ForgeError(f"{root}: no runs/{ref_name}/ (the reference profile's results)"
                         + (f"; its profiles: {', '.join(have)}" if have else ""),
                         hint="--reference PROFILE, one of its profiles" if have else archive.read_hint(
                             root, "give an e2e results folder (reports/e2e/<date>-<device>) and --reference PROFILE"))
    jobs = []
    for name in (n for n in have if n != ref_name and not n.startswith("fault-")):
        if not all((rdir / name / f"{t}.json").is_file() for t in contest_mod.tier_names(contest)):
            ui.warn(f"{root}/runs/{name}: not every tier has a result; left out")
            continue
        tt, tp, detail = measured_ratios(rdir / name, rdir / ref_name, contest)
        jobs.append((name, "ratios", predict_from_ratios(workload, tt, tp),
                     {"run": str(root / "runs" / name), "reference": str(root / "runs" / ref_name), "measured": detail}))
    if not jobs:
        raise ForgeError(f"{root}: no profile with all tiers besides {ref_name}")
    return jobs


def cmd_predict(args) -> int:
    contest = contest_mod.load_contest()
    workload = synth.load_workload(contest)
    names = contest_mod.tier_names(contest)
    if args.check_e2e is not None and args.calibration is None:
        raise ForgeError("--check-e2e goes with --calibration (it checks a calibration's prediction)")
    modes = [m for m, on in (("--run", args.run is not None), ("--e2e", args.e2e is not None),
                             ("--calibration", args.calibration is not None),
                             ("--speedup/--speedups", bool(args.speedup) or args.speedups is not None),
                             ("--ttft-s/--tpot-ms", args.ttft_s is not None or args.tpot_ms is not None)) if on]
    if len(modes) != 1:
        raise ForgeError("give one source of the prediction" + (f", not {' and '.join(modes)}" if modes else ""),
                         hint="--run RUN --reference RUN | --e2e DIR | --speedup NAME=FACTOR ... | "
                              "--ttft-s a,b,c --tpot-ms a,b,c")
    label = paths.plain_name(args.label, "--label") if args.label is not None else None
    if label and args.e2e is not None:
        raise ForgeError("--label names one prediction; --e2e makes one per profile, named by the profile")
    out_arg = paths.target_folder(args.out, "--out") if args.out is not None else None
    score.baseline_from_config(contest, args.baseline_name)        # an unknown set is refused before any work
    if args.calibration is not None:
        from . import predict_calibration
        return predict_calibration.run(args, contest, workload)
    jobs = []     # (label, how, pred, inputs)
    if args.run:
        if not args.reference:
            raise ForgeError("--run needs --reference (the same run's upstream)")
        run, ref = runs.resolve_run(args.run), runs.resolve_run(args.reference)
        tt, tp, detail = measured_ratios(run, ref, contest)
        jobs.append((label or run.name, "ratios", predict_from_ratios(workload, tt, tp),
                     {"run": str(run), "reference": str(ref), "measured": detail}))
    elif args.e2e:
        with archive.readable(Path(args.e2e)) as folder:
            jobs = e2e_jobs(Path(args.e2e), folder, args.reference or "upstream", contest, workload)
    elif args.speedup or args.speedups is not None:
        sp = parse_speedups(args.speedup, args.speedups)
        jobs.append((label or ", ".join(f"{k} x{v:g}" for k, v in sp.items()), "components",
                     predict_from_components(workload, sp), {"speedups": sp}))
    else:
        if not (args.ttft_s and args.tpot_ms):
            raise ForgeError("--ttft-s and --tpot-ms go together (mean TTFT in s and mean TPOT in ms per tier)")
        tt = contest_mod.per_tier_values(args.ttft_s, "--ttft-s", names, "time")
        tp = contest_mod.per_tier_values(args.tpot_ms, "--tpot-ms", names, "time")
        jobs.append((label or "given times", "times",
                     predict_from_times(workload, {t: 1000 * v for t, v in tt.items()}, tp),
                     {"ttft_s": tt, "tpot_ms": tp}))
    for name, how, pred, inputs in jobs:
        res = score_prediction(contest, workload, pred, args.baseline_name)
        print_table(name, pred, res)
        out = out_arg / name if out_arg and args.e2e else \
            out_arg if out_arg else paths.BUILD / "predict" / name.replace(" ", "_").replace(",", "")
        files = write_outputs(out, name, how, pred, res, inputs)
        ui.info("wrote " + ", ".join(paths.rel(f) for f in files))
    return 0


def register(sub) -> None:
    p = sub.add_parser("predict", help="predict the DCU tok/s per tier and the contest score",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--run", help="a run folder measured with its own upstream reference (needs --reference)")
    p.add_argument("--reference", help="the same run's upstream folder (with --run), or with --e2e the "
                                       "reference profile's name (default upstream)")
    p.add_argument("--e2e", help="an e2e results folder: predict every profile in its runs/ against the reference")
    p.add_argument("--speedup", action="append", metavar="NAME=FACTOR",
                   help="component speed-up, repeatable (components: " + ", ".join(COMPONENTS) + ")")
    p.add_argument("--speedups", metavar="FILE", help="YAML mapping of component: factor")
    p.add_argument("--calibration", metavar="DIR",
                   help="a `forge calibrate` output folder: each component's speed-up from its measured kernels")
    p.add_argument("--check-e2e", metavar="DIR",
                   help="with --calibration: an e2e results folder of the same device (contest and upstream side by "
                        "side); compares the predicted tok/s ratio per tier with the measured one")
    p.add_argument("--ttft-s", help="mean TTFT per tier in seconds, comma-separated (DCU measurements)")
    p.add_argument("--tpot-ms", help="mean TPOT per tier in ms, comma-separated (with --ttft-s)")
    p.add_argument("--baseline-name", default="official",
                   help="baseline set of configs/contest.yaml to score against (default: official, the run the "
                        "prediction is built on)")
    p.add_argument("--label", help="name of the prediction, a plain name (default: the run's, the speed-ups' or "
                                   "'given times'); not with --e2e, whose profiles name theirs")
    p.add_argument("--out", help="folder for predict.json, predict.md and predict.png (default build/predict/<label>; "
                                 "with --e2e one subfolder per profile)")
    p.set_defaults(func=cmd_predict)
