"""The DCU time model and the arithmetic every prediction shares: vLLM 0.18.1 upstream's time on
gfx936 as prefill components (by prompt length) and per-token decode components (by context length);
a tier's tok/s from mean TTFT and TPOT at concurrency 1; the contest score of a prediction. `forge
predict` (run/predict.py) and `forge predict --calibration` (run/predict_calibration.py) both read it."""

from __future__ import annotations

import math

from ..errors import ForgeError
from ..model.dcu_time import COMPONENTS, DECODE, PREFILL
from . import score

# The DCU time model's components (model/dcu_time.py, shared with the finals' step costs): prefill of
# a prompt of S tokens in seconds, decode per output token at context C in ms.

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
    try:
        pred = predict_from_times(workload, ttft, tpot, how="components")
    except ForgeError as e:            # a factor so far from 1 that a tier's time is no number: name the factors
        given = ", ".join(f"{k}={v:g}" for k, v in check_speedups(speedups).items())
        raise ForgeError(f"the speed-ups {given}: {e.message}",
                         hint="a speed-up is how many times faster a component runs (1 = unchanged, 2 = twice "
                              "as fast); give factors that leave every tier a finite time") from None
    for t in pred:
        b = _baseline(workload, t)
        pred[t]["model"] = {"baseline": base[t], "with_speedups": new[t],
                            "model_vs_measured_ttft": base[t]["ttft_s"] * 1000 / b["mean_ttft_ms"] - 1,
                            "model_vs_measured_tpot": base[t]["tpot_ms"] / b["mean_tpot_ms"] - 1}
    return pred


# The speed-ups a user's input may give a component (--speedup, --speedups, a calibration's factors),
# either way from 1: at most 100x faster, at most 100x slower. The largest shown on the card's
# components is prefill attention's contiguous flash kernel, 138 vs ~4 TFLOP/s (~35x,
# model/dcu_time.BEST_PUBLIC); the calibrations under reports/calibration/ give 1.0 to 6.4x (one
# decision 0.16x to 3.1x); no component's regression comes near 100x. A factor past the range is a
# typo or a damaged record, and far past it the model's times leave the float range (1e-308: inf - inf,
# no number at all).
SPEEDUP_RANGE = (1e-2, 1e2)
SPEEDUP_HINT = ("a speed-up is how many times faster a component runs (1 = unchanged, 2 = twice as fast), from "
                f"{SPEEDUP_RANGE[0]:g} to {SPEEDUP_RANGE[1]:g}; e.g. --speedup prefill_attn=10")


def speedup_problem(v, text: str | None = None) -> str | None:
    """What is wrong with a component's speed-up `v` (a finite number within SPEEDUP_RANGE), or None;
    `text`: the value as the user wrote it, for the message."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        return f"{v!r} is not a finite positive factor"
    lo, hi = SPEEDUP_RANGE
    if not lo <= v <= hi:
        return f"{text or format(v, 'g')} is outside the plausible range {lo:g} to {hi:g} (at most {hi:g}x faster or slower)"
    return None


def check_speedups(sp: dict) -> dict:
    """Known components, each a finite positive factor: what the model itself needs (a limit study may
    go past SPEEDUP_RANGE; the user's inputs are held to it where they are read)."""
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
