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
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk", "gemv", "wvsplitk", "llmm1",
              "split_k_reduce")),     # the last: the skinny GEMM's split-K sum (forge_skinny_gemm.py)
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


def assign(trace: Path) -> tuple[list[dict], dict]:
    """Every model step with tokens to process, in time order, with the GPU kernels its launches ran:
    [{"context_requests", "prefill_tokens", "decode_requests", "decode_tokens", "cpu_ms", "kernels":
    {name: [count, us]}, "gpu_span_ms", "gpu_start_us", "gpu_end_us"}] (a context request is one with no
    output token yet, as vLLM counts it), and the kernels launched outside those steps ({"kernels",
    "gpu_span_ms"})."""
    launches: dict = {}
    fwd: list[tuple[float, float]] = []
    counts: list[tuple[int, int, int, int]] = []
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
            counts.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append(e)
    order = sorted(range(len(fwd)), key=lambda i: fwd[i])
    fwd, counts = [fwd[i] for i in order], [counts[i] for i in order]
    starts = [s for s, _ in fwd]
    steps = [{"context_requests": cr, "prefill_tokens": p, "decode_requests": dr, "decode_tokens": d,
              "cpu_ms": round((b - a) / 1000, 3), "kernels": {}, "_span": [None, None]}
             for (a, b), (cr, p, dr, d) in zip(fwd, counts)]
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
    for slot in (*steps, outside):
        s = slot.pop("_span")
        slot["gpu_span_ms"] = round((s[1] - s[0]) / 1000, 3) if s[0] is not None else 0.0
        slot["gpu_start_us"], slot["gpu_end_us"] = s
        slot["kernels"] = {n: [c, round(us, 1)] for n, (c, us) in sorted(slot["kernels"].items())}
    outside.pop("gpu_start_us")
    outside.pop("gpu_end_us")
    return steps, outside


def digest(trace: Path) -> dict:
    """GPU kernel time by name per model step that had prompt tokens to process: {"steps":
    [{"prefill_tokens", "decode_tokens", "cpu_ms", "gpu_span_ms", "kernels": {name: [count, us]}}],
    "outside": {...}} (outside: kernels launched outside those steps); the steps of one token per
    request after them as "decode_steps"."""
    steps, outside = assign(trace)
    prefill = [st for st in steps if st["prefill_tokens"] > 0]
    firsts = [st["gpu_start_us"] for st in prefill if st["gpu_start_us"] is not None]
    lasts = [st["gpu_end_us"] for st in prefill if st["gpu_end_us"] is not None]
    span_ms = round((max(lasts) - min(firsts)) / 1000, 3) if firsts else 0.0
    kept = [{k: st[k] for k in ("prefill_tokens", "decode_tokens", "cpu_ms", "kernels", "gpu_span_ms")}
            for st in steps]
    prefill = [st for st in kept if st["prefill_tokens"] > 0]
    decode = [st for st in kept if st["prefill_tokens"] == 0]      # one token per request, after the prefill
    if not prefill:
        raise ForgeError(f"{trace}: no model step with prompt tokens (no execute_context_N(T) annotation, T > 0)",
                         hint="the profiler did not see the prefill; was the request served while it ran?")
    out = {"prefill_span_ms": span_ms, "steps": prefill, "outside": outside}
    if decode:
        out["decode_steps"] = decode
    return out


def batch_digest(trace: Path, batch: int) -> dict:
    """The decode steps of `batch` requests at once (no request in its prefill: execute_context_0(0)_
    generation_<batch>(T)), kernels by name per step as in digest(), in time order; every other step
    is left out and counted by kind ("excluded": steps with a prefill chunk beside decoding requests
    ("mixed"), prefill-only steps, decode steps at another batch), and "gpu_period_ms" lists, for each
    two counted steps in a row, the time from one's first kernel to the next's (the step's GPU time
    with the gaps between steps)."""
    steps, outside = assign(trace)
    counted: list[dict] = []
    periods: list[float] = []
    mixed = prefill_only = 0
    other: dict[str, int] = {}
    prev = None
    for st in steps:
        ok = st["context_requests"] == 0 and st["decode_requests"] == batch
        if st["context_requests"] and st["decode_requests"]:
            mixed += 1
        elif st["context_requests"]:
            prefill_only += 1
        elif not ok:
            other[str(st["decode_requests"])] = other.get(str(st["decode_requests"]), 0) + 1
        if ok:
            if prev is not None and prev["gpu_start_us"] is not None and st["gpu_start_us"] is not None:
                periods.append(round((st["gpu_start_us"] - prev["gpu_start_us"]) / 1000, 3))
            counted.append({k: st[k] for k in ("decode_requests", "decode_tokens", "cpu_ms", "kernels",
                                               "gpu_span_ms")})
        prev = st if ok else None
    if not counted:
        seen = ", ".join(f"{st['context_requests']}+{st['decode_requests']}" for st in steps[:12]) or "none"
        raise ForgeError(f"{trace}: no decode step of {batch} requests (execute_context_0(0)_generation_{batch}(T)); "
                         f"steps seen (prefilling+decoding requests): {seen}",
                         hint="were all the requests decoding while the profiler ran?")
    return {"batch": batch, "decode_steps": counted, "gpu_period_ms": periods, "steps_in_trace": len(steps),
            "excluded": {"mixed": mixed, "prefill": prefill_only, "decode_other_batch": other},
            "outside": outside}


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
