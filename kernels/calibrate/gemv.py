# SPDX-License-Identifier: Apache-2.0
"""Calibration family `gemv`: every bf16 linear layer of a Qwen3.5-27B decode step at 1-16 tokens
(decode batches up to the round's concurrency: 1-4 the GEMV, 5-16 the same kernel's skinny GEMM) and at
24 and 32 tokens: a server run above concurrency 16 decodes batches of 17-32, which vLLM pads to its
captured graph sizes 24 and 32, so those two are the token counts such a batch's linear layers run at.
There only the platform's GEMM (the upstream anchor, and on ROCm F.linear beside vLLM's route as at 1-16;
for the fused decision, the platform GEMM plus the separate activation) and the skinny GEMM on the matrix
units ("mma", plain and fused) are measured: our
GEMV's launches stop at 16 tokens (forge_tuned.GEMV_MAX_TOKENS) and vLLM's skinny kernels at fewer, so
neither is a candidate there (GRAPH_TOKENS).

Decisions `gemv.plain.NxK.M` (our GEMV at any of its launches, our skinny GEMM on the matrix units, or
the platform's GEMM) and `gemv.fused.34816x5120.M` (the MLP's gate_up + SiLU-and-mul as one kernel of
ours, or the platform's GEMM plus the separate activation). Candidates: F.linear (rocBLAS / hipBLASLt / cuBLAS: what vLLM runs
there without our route, the upstream anchor; on ROCm vLLM's own route with our kernel off), the
kernel's built-in launch (block = rows = 0, today's choice) and each (block, rows) variant; the
Triton skinny GEMM on the matrix units (kernels/forge_triton/skinny_gemm.py, plain `skinny_gemm` and,
for gate_up, the fused `skinny_gemm_silu_mul`) at its built-in launch and at every token count, launch
"mma" (what the table then names); on ROCm, vLLM's skinny kernels (wvSplitK / LLMM1) where the
installed vLLM has `_rocm_C`, timed as vendor paths this build does not route to. Every candidate is
checked against float64 on fresh random inputs (into a NaN-poisoned output where it takes one) before it
is timed; one that is wrong or fails is recorded and never timed. A skinny GEMM that cannot take the row
count (an installed wheel built before the kernel's 32-row tile, at 24 and 32 tokens) is recorded as not
timed, with the reason and the fix, never as failed (`mma_not_timed`).

Timing: CUDA/HIP graphs of many launches rotating over enough weight copies to exceed the L2 cache
(weights come from memory, as in decode), replayed; median, p10, p90 per launch.
"""

from __future__ import annotations

import math
import os
import sys

import forge_tuned

from . import common as C

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"cuda": [(64, 2), (64, 4), (128, 2), (128, 4), (256, 1), (256, 2), (256, 4), (512, 2),
                     (640, 2), (640, 4)],
            "hip": [(256, 2), (256, 4), (512, 2), (512, 4), (640, 1), (640, 2), (640, 4), (768, 2)]}
FUSED_VARIANTS = [(64, 1), (64, 2), (128, 1), (128, 2), (256, 2), (640, 1), (640, 2)]
# 5-16 tokens (the kernel's MT = 8 and 16 builds: at most 16 partial sums per thread, 32 on NVIDIA in blocks
# of up to 256 threads); a launch the platform does not build is recorded as refused, never timed
SKINNY_VARIANTS = {"cuda": [(64, 2), (64, 4), (128, 2), (128, 4), (256, 2), (512, 1)],
                   "hip": [(256, 1), (256, 2), (512, 1), (640, 1), (640, 2)]}
SKINNY_FUSED_VARIANTS = [(64, 1), (64, 2), (128, 1), (640, 1)]
MMA = forge_tuned.GEMV_MMA   # the skinny GEMM's launch in a record and in the table
# the token counts above the GEMV's 16 that a decode step runs at: the captured graph sizes vLLM pads a batch
# of 17-32 to; measured for the platform GEMM and the skinny GEMM only (at most forge_tuned.MMA_MAX_TOKENS)
GRAPH_TOKENS = (24, 32)
TOL = 2e-2          # relative to max(|ref|, 1 % RMS): bf16 output rounding is 2^-8 = 3.9e-3
MEM_CAP = 24 << 30  # bytes of weight copies per shape


def load_ops(torch, ops: str):
    """(ops object with forge_gemv / forge_gemv_silu_mul, note). ops: 'vllm' (the installed vLLM's
    _C: what serves) or 'build' (compile kernels/csrc/forge_gemv.cu of this checkout)."""
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))
    import gemv_ext
    if ops == "vllm":
        import vllm._C  # noqa: F401  (registers torch.ops._C.*)
        if not hasattr(torch.ops._C, "forge_gemv"):
            raise RuntimeError("the installed vLLM has no _C.forge_gemv: it is not built from the patch series")
        return gemv_ext.Ops(torch.ops._C), "torch.ops._C.forge_gemv of the installed vLLM"
    ext, secs = gemv_ext.load()
    return ext, f"kernels/csrc/forge_gemv.cu built as a torch extension ({secs:.0f} s)"


def load_mma(kernels: str):
    """(the skinny GEMM's module, note): 'installed' the installed vLLM's copy (the kernel overlay's
    vllm/model_executor/layers/forge_skinny_gemm.py), 'checkout' kernels/forge_triton/skinny_gemm.py;
    (None, why) when the installed vLLM has none."""
    if kernels == "installed":
        try:
            # imports torch and triton: only where the family runs on a GPU
            from vllm.model_executor.layers import forge_skinny_gemm as sk
        except ImportError as e:
            return None, f"the skinny GEMM (mma) is not in the installed vLLM ({C.short_error(e)}): not timed"
        return sk, "the skinny GEMM (mma) of the installed vLLM"
    sys.path.insert(0, os.path.join(HERE, ".."))
    from forge_triton import skinny_gemm as sk  # imports triton: only where the family runs on a GPU
    return sk, "the skinny GEMM (mma) from kernels/forge_triton/skinny_gemm.py"


def mma_not_timed(sk, M: int, kernels: str) -> str | None:
    """Why the skinny GEMM module `sk` is not timed at M tokens, or None when it takes M rows. Read from the
    module itself, no GPU: its MAX_M (every copy of the kernel names it; 16 in one built before the 32-row
    tile, so an older installed wheel cannot run the graphs' 24 and 32). Such a candidate is recorded as not
    timed, never as failed: it is not wrong, it is a kernel older than this calibration."""
    if M <= sk.MAX_M:
        return None
    takes = f"takes 1-{sk.MAX_M} rows (its MAX_M {sk.MAX_M})"
    # one reason for every count above the limit, so the family's notes and the report say it once
    if kernels == "installed":
        return (f"not timed above {sk.MAX_M} tokens: the installed vLLM's skinny GEMM (vllm/model_executor/layers/"
                f"forge_skinny_gemm.py) {takes}, a wheel built before the kernel's 32-row tile; rebuild and install "
                "the wheel from this checkout (make wheel), or calibrate with --kernels checkout")
    return (f"not timed above {sk.MAX_M} tokens: the skinny GEMM of kernels/forge_triton/skinny_gemm.py {takes}; "
            "update the checkout's kernels")


def mma_workspace(torch, sk, N: int, K: int, fused: bool, device="cuda"):
    """The fp32 split-K workspace of the skinny GEMM's built-in launch at up to its most rows for an
    (N, K) weight, preallocated so a timed launch allocates nothing (the split count does not depend on
    the rows, the workspace grows with them)."""
    cfg = sk.launch_config(sk.MAX_M, N, K, sk.num_compute_units(), fused=fused)
    need = sk.workspace_numel(sk.MAX_M, N, cfg.split_k, fused)
    return torch.empty(max(1, need), device=device, dtype=torch.float32)


def upstream_gemm(torch, F):
    """What vLLM runs for the layer without our kernel: on ROCm its rocm_unquantized_gemm with
    VLLM_FORGE_GEMV=0 (rocBLAS on gfx936); elsewhere F.linear (cuBLAS)."""
    if torch.version.hip:
        try:
            os.environ["VLLM_FORGE_GEMV"] = "0"
            import vllm.model_executor.layers.utils as U
            for f in ("forge_gemv_enabled", "forge_gemv_table"):
                if hasattr(getattr(U, f, None), "cache_clear"):
                    getattr(U, f).cache_clear()
            if hasattr(U, "_FORGE_GEMV_ON"):     # the route, decided once per process: decide it again
                U._FORGE_GEMV_ON = None
            return (lambda x, w: U.rocm_unquantized_gemm_impl(x, w, None)), "vLLM ROCm route (kernel off)"
        except ImportError:
            pass
    return (lambda x, w: F.linear(x, w)), "F.linear"


def skinny(torch):
    """vLLM's skinny kernels where the installed vLLM has them (ROCm _rocm_C), else {}."""
    if not torch.version.hip:
        return {}
    try:
        import vllm._rocm_C  # noqa: F401
    except ImportError:
        return {}
    ns = torch.ops._rocm_C
    cus = torch.cuda.get_device_properties(0).multi_processor_count
    out = {}
    if hasattr(ns, "wvSplitK"):
        out["wvSplitK"] = lambda x, w: ns.wvSplitK(w, x, cus, None)
    if hasattr(ns, "LLMM1"):
        out["LLMM1"] = lambda x, w: ns.LLMM1(w, x, 4)
    return out


def activation(torch, F):
    """The separate SiLU-and-mul as vLLM runs it: _C.silu_and_mul where the installed vLLM has it,
    else one Triton kernel (kernels/bench/bench_gemv.py's)."""
    try:
        import vllm._C  # noqa: F401
        if hasattr(torch.ops._C, "silu_and_mul"):
            return (lambda gu, out: torch.ops._C.silu_and_mul(out, gu)), "_C.silu_and_mul"
    except ImportError:
        pass
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))
    import bench_gemv
    return bench_gemv.silu_and_mul_fn(torch, F)


def token_counts(quick: bool = False) -> tuple[int, ...]:
    """The token counts measured: 1-16 and GRAPH_TOKENS (--quick: 1, 2 and 8)."""
    return (1, 2, 8) if quick else (*range(1, forge_tuned.GEMV_MAX_TOKENS + 1), *GRAPH_TOKENS)


def gemv_measured(M: int) -> bool:
    """Whether our GEMV (and vLLM's skinny kernels, which stop below it) are candidates at M tokens."""
    return M <= forge_tuned.GEMV_MAX_TOKENS


def launches(M: int, fused: bool, on_amd: bool, quick: bool = False) -> list[tuple[int, int]]:
    """The (block, rows) launches of our kernel measured at M tokens: the built-in choice (0, 0) and the
    variants of the platform and token range (--quick: the first two), less those forge_gemv.cu does not
    build at M (forge_tuned.gemv_launch_problem: they would only be recorded as failures); none above
    its 16 tokens."""
    if not gemv_measured(M):
        return []
    if M <= 4:
        menu = FUSED_VARIANTS if fused else VARIANTS["hip" if on_amd else "cuda"]
    else:
        menu = SKINNY_FUSED_VARIANTS if fused else SKINNY_VARIANTS["hip" if on_amd else "cuda"]
    cands = [(0, 0)] + menu[: 2 if quick else None]
    return [(b, r) for b, r in cands if forge_tuned.gemv_launch_problem(b, r, M, fused, on_amd) is None]


def run(torch, args, emit) -> dict:
    import torch.nn.functional as F
    notes = []
    if not C.on_gpu(torch):
        return {"records": [], "notes": ["skipped: the GEMV is HIP/CUDA code and needs a GPU"]}
    ext, how = load_ops(torch, args.ops)
    notes.append(how)
    base, base_name = upstream_gemm(torch, F)
    vendors = skinny(torch)
    if torch.version.hip and not vendors:
        notes.append("vLLM's skinny kernels (wvSplitK / LLMM1) are not in the installed vLLM (no _rocm_C): not timed")
    act, act_name = activation(torch, F)
    sk, sk_note = load_mma(args.kernels)
    notes.append(sk_note)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20) or (64 << 20)
    ms = token_counts(args.quick)
    per_rank = C.linear(getattr(args, "tp", 1))          # --tp: one rank's shapes
    shapes = per_rank[:3] if args.quick else per_rank
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    L = args.ledger
    total = len(shapes) * len(ms)
    step = 0
    for layer, N, K in shapes:
        wbytes = N * K * 2
        ncopies = max(2, min(math.ceil(3 * l2 / wbytes), MEM_CAP // wbytes))
        w0 = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
        ws = [w0] + [w0.clone() for _ in range(ncopies - 1)]
        n_launch = max(10, min(200, math.ceil(3e9 / max(wbytes, 1) / 8)), ncopies)
        mma_ws = mma_workspace(torch, sk, N, K, False) if sk else None
        mma_fws = mma_workspace(torch, sk, N, K, True) if sk and layer == "gate_up" else None
        for M in ms:
            step += 1
            emit(step, total, f"{layer} {N}x{K} M={M}")
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            xd = x.double()
            ref = torch.cat([xd @ w0[i:i + 32768].double().T for i in range(0, N, 32768)], dim=1)
            point = f"M={M}"
            dec = f"gemv.plain.{N}x{K}.{M}"

            def timed(fn):
                return C.time_graph(torch, [lambda i=i: fn(ws[i % ncopies]) for i in range(n_launch)],
                                    reps=5 if args.quick else 12)

            def candidate(name, kind, fn, launch=None, selectable=True, decision=dec, reference=ref,
                          shape_out=(M, N), poison=None, not_timed=None):
                if not L.begin(decision, name, kind, launch):
                    return
                if not_timed:       # the kernel in use cannot take this point: said, not run, not failed
                    L.add(C.record(decision, name, kind, point=point, launch=launch, selectable=selectable,
                                   tol=TOL, weight=C.CALLS_PER_TOKEN[layer], not_timed=not_timed))
                    return
                r = C.record(decision, name, kind, point=point, launch=launch, selectable=selectable,
                             tol=TOL, weight=C.CALLS_PER_TOKEN[layer])
                try:
                    if poison is not None:
                        poison.fill_(float("nan"))   # an output the candidate does not write stays NaN
                    y = fn(w0)
                    torch.cuda.synchronize()
                    if tuple(y.shape) != shape_out:
                        raise RuntimeError(f"output shape {tuple(y.shape)}, expected {shape_out}")
                    r["err"] = C.rel_err(torch, y, reference)
                    r["ok"] = r["err"] <= TOL
                    if r["ok"]:
                        r["us"] = timed(fn)
                except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded, not fatal
                    r["error"] = C.short_error(e)
                    r["ok"] = False
                L.add(r)

            candidate(base_name, "upstream", lambda w: base(x, w))
            if base_name != "F.linear":
                candidate("F.linear", "vendor", lambda w: F.linear(x, w), selectable=False)
            for vname, vfn in (vendors if gemv_measured(M) else {}).items():
                candidate(vname, "vendor", lambda w, f=vfn: f(x, w), selectable=False)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            for block, rows in launches(M, False, bool(torch.version.hip), args.quick):
                def ours(w, b=block, r=rows):
                    ext.forge_gemv(y, x, w, b, r)
                    return y
                name = "forge built-in" if (block, rows) == (0, 0) else f"forge b{block} r{rows}"
                candidate(name, "builtin" if (block, rows) == (0, 0) else "ours", ours, launch=[block, rows],
                          poison=y)
            mma_why = mma_not_timed(sk, M, args.kernels) if sk else None
            if mma_why and mma_why not in notes:
                notes.append(mma_why)
            if sk:
                candidate("forge mma", "ours", lambda w: sk.skinny_gemm(x, w, y, workspace=mma_ws), launch=MMA,
                          poison=y, not_timed=mma_why)
            if layer == "gate_up":
                half = N // 2
                fref = F.silu(ref[:, :half]) * ref[:, half:]
                fdec = f"gemv.fused.{N}x{K}.{M}"
                ya = torch.empty(M, half, device="cuda", dtype=torch.bfloat16)

                def unfused(w):
                    act(base(x, w), ya)
                    return ya
                candidate(f"{base_name} + {act_name}", "upstream", unfused, decision=fdec, reference=fref,
                          shape_out=(M, half), poison=ya)
                ys = torch.empty(M, half, device="cuda", dtype=torch.bfloat16)
                for block, rows in launches(M, True, bool(torch.version.hip), args.quick):
                    def fused(w, b=block, r=rows):
                        ext.forge_gemv_silu_mul(ys, x, w, b, r)
                        return ys
                    name = "forge fused built-in" if (block, rows) == (0, 0) else f"forge fused b{block} r{rows}"
                    candidate(name, "builtin" if (block, rows) == (0, 0) else "ours", fused, launch=[block, rows],
                              decision=fdec, reference=fref, shape_out=(M, half), poison=ys)
                if sk:
                    candidate("forge fused mma", "ours", lambda w: sk.skinny_gemm_silu_mul(x, w, ys, workspace=mma_fws),
                              launch=MMA, decision=fdec, reference=fref, shape_out=(M, half), poison=ys,
                              not_timed=mma_why)
        ws = w0 = mma_ws = mma_fws = None
        torch.cuda.empty_cache()
    return {"records": L.records, "notes": notes}
