"""Kernels of a torch-profiler trace of a vLLM server, by model step: each GPU kernel is assigned to
the step (`execute_context_N(T)_generation_M(U)`) whose launch it came from, through the launch's
correlation id, and named into groups (full attention, GDN, GEMM, the rest); prefill steps (T > 0) and
decode steps (one token per request) are kept apart. Used by `forge prefill-profile` and `e2e-gpu
--profile-prefill/--profile-decode` (forge.lab.prefill_profile)."""

from __future__ import annotations

import bisect
import gzip
import json
import re
from pathlib import Path

from ..errors import ForgeError

# vLLM's record_function around one model step: execute_context_<requests>(<tokens>)_generation_<n>(<tokens>)
STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
# (category, name fragments), first match wins; names are matched lower-cased
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("full attention", ("unified_attention", "prefill_attention", "widen_prefix", "reshape_and_cache",
                        "int8_kv", "kv_write", "reduce_segments", "split_kv")),
    ("GDN", ("gated_delta", "chunk_fwd", "chunk_local", "chunk_scaled", "fused_recurrent", "causal_conv1d",
             "solve_tril", "recompute_w_u", "l2norm", "gdn", "kkt", "merge_16x16", "sigmoid_gating")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk", "gemv", "wvsplitk", "llmm1")),
]
ORDER = ["full attention", "GDN", "GEMM", "rest"]


# inductor's generated kernels are elementwise and reductions, whatever ops their names list (one fused
# around a custom GEMM op is named after it: triton_poi_fused_..._forge_unquantized_gemm_...)
INDUCTOR = ("triton_poi_", "triton_red_", "triton_per_")


def category(kernel: str) -> str:
    low = kernel.lower()
    if low.startswith(INDUCTOR):
        return "rest"
    for cat, frags in CATEGORIES:
        if any(f in low for f in frags):
            return cat
    return "rest"



# --- the trace ------------------------------------------------------------------------------------

def _load(trace: Path) -> list[dict]:
    opener = gzip.open if trace.suffix == ".gz" else open
    try:
        with opener(trace, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError, EOFError) as e:
        raise ForgeError(f"{trace}: not a readable Chrome trace ({type(e).__name__}: {e})")
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def digest(trace: Path) -> dict:
    """GPU kernel time by name per model step that had prompt tokens to process: {"steps":
    [{"prefill_tokens", "decode_tokens", "cpu_ms", "gpu_span_ms", "kernels": {name: [count, us]}}],
    "outside": {...}} (outside: kernels launched outside those steps)."""
    launches: dict = {}
    fwd: list[tuple[float, float]] = []
    toks: list[tuple[int, int]] = []
    gpu: list[dict] = []
    for e in _load(trace):
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launches[c] = float(e["ts"])
        elif (cat == "user_annotation" and (m := STEP.fullmatch(e.get("name", "")))
              and (int(m.group(2)) > 0 or int(m.group(4)) > 0)):
            fwd.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
            toks.append((int(m.group(2)), int(m.group(4))))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append(e)
    order = sorted(range(len(fwd)), key=lambda i: fwd[i])
    fwd, toks = [fwd[i] for i in order], [toks[i] for i in order]
    starts = [s for s, _ in fwd]
    steps = [{"prefill_tokens": p, "decode_tokens": d, "cpu_ms": round((b - a) / 1000, 3), "kernels": {},
              "_span": [None, None]} for (a, b), (p, d) in zip(fwd, toks)]
    outside: dict = {"kernels": {}, "_span": [None, None]}
    for k in gpu:
        t = launches.get((k.get("args") or {}).get("correlation"))
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        slot = steps[i] if i >= 0 and t <= fwd[i][1] else outside
        name = k["name"] if k.get("cat") == "kernel" else f"[{k['cat']}] {k['name']}"
        acc = slot["kernels"].setdefault(name, [0, 0.0])
        acc[0] += 1
        acc[1] += float(k.get("dur", 0))
        a, b = float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))
        span = slot["_span"]
        span[0] = a if span[0] is None else min(span[0], a)
        span[1] = b if span[1] is None else max(span[1], b)
    prefill = [st for st in steps if st["prefill_tokens"] > 0]
    decode = [st for st in steps if st["prefill_tokens"] == 0]      # one token per request, after the prefill
    firsts = [st["_span"][0] for st in prefill if st["_span"][0] is not None]
    lasts = [st["_span"][1] for st in prefill if st["_span"][1] is not None]
    span_ms = round((max(lasts) - min(firsts)) / 1000, 3) if firsts else 0.0
    for slot in (*steps, outside):
        s = slot.pop("_span")
        slot["gpu_span_ms"] = round((s[1] - s[0]) / 1000, 3) if s[0] is not None else 0.0
        slot["kernels"] = {n: [c, round(us, 1)] for n, (c, us) in sorted(slot["kernels"].items())}
    if not prefill:
        raise ForgeError(f"{trace}: no model step with prompt tokens (no execute_context_N(T) annotation, T > 0)",
                         hint="the profiler did not see the prefill; was the request served while it ran?")
    out = {"prefill_span_ms": span_ms, "steps": prefill, "outside": outside}
    if decode:
        out["decode_steps"] = decode
    return out


def by_category(kernels: dict) -> dict[str, float]:
    out = {c: 0.0 for c in ORDER}
    for name, (_, us) in kernels.items():
        out[category(name)] += us / 1000
    return out


def totals(dig: dict) -> dict[str, float]:
    out = {c: 0.0 for c in ORDER}
    for slot in (*dig["steps"], dig["outside"]):
        for c, ms in by_category(slot["kernels"]).items():
            out[c] += ms
    return out


def decode_summary(steps: list[dict]) -> dict:
    """Per decode step (one token): the median GPU span and CPU time, kernel time by group and the largest
    kernels, each as a mean over the steps (launches and µs per step)."""
    n = len(steps)
    spans = sorted(s["gpu_span_ms"] for s in steps)
    cpus = sorted(s["cpu_ms"] for s in steps)
    cats = {c: 0.0 for c in ORDER}
    kern: dict[str, list[float]] = {}
    for s in steps:
        for c, ms in by_category(s["kernels"]).items():
            cats[c] += ms / n
        for k, (cnt, us) in s["kernels"].items():
            acc = kern.setdefault(k, [0.0, 0.0])
            acc[0] += cnt / n
            acc[1] += us / n
    return {"steps": n, "gpu_span_ms_median": round(spans[n // 2], 3), "cpu_ms_median": round(cpus[n // 2], 3),
            "gpu_busy_ms": round(sum(cats.values()), 3), "categories_ms": {c: round(v, 3) for c, v in cats.items()},
            "top_kernels": [{"name": k, "category": category(k), "launches": round(c, 2), "us": round(us, 1)}
                            for k, (c, us) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:25]]}
