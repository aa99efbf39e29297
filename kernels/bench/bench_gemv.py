#!/usr/bin/env python3
"""Decode GEMV benchmark on a GPU machine: kernels/csrc/forge_gemv.cu against torch.nn.functional.linear
(cuBLAS / hipBLASLt) at the Qwen3.5-27B decode shapes, M = 1, 2, 4, and the fused gate_up + SiLU-and-mul
against GEMV + separate activation.

    python3 kernels/bench/bench_gemv.py --out DIR [--quick] [--ops vllm]

Builds the extension (kernels/bench/gemv_ext.py), checks every shape against a float64 reference first
(stops on a mismatch), measures the device-to-device copy bandwidth, then times each case with CUDA
graphs: one graph holds many launches that rotate over enough weight copies to exceed the L2 cache (the
weights come from memory, as in decode), replayed several times; the median replay / launches is the
time per call. Reports µs, achieved TB/s (bytes read + written: W + x read, y written) and the fraction
of the copy reference (the fastest large device-to-device copy, also counted as read + written).
Writes DIR/bench_gemv.json (with provenance) and DIR/bench_gemv.md; prints the table last, then the
route this run supports: the VLLM_FORGE_GEMV_SHAPES value naming the (shape, token count) pairs where the
kernel's built-in launch beat what runs without it (`route()`), for a serve profile's env on the machine it
ran on. `--ops vllm` times the kernel compiled into the installed vLLM (`torch.ops._C.forge_gemv`, a forge
wheel or image) instead of building the source, so on the DCU it measures what serves; on ROCm it also
times vLLM's own GEMM route with the kernel off (wvSplitK / LLMM1 / rocBLAS), the anchor of the route
there (elsewhere F.linear).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SHAPES = [  # (name, N, K)
    ("qkv_gate", 14336, 5120), ("o_proj", 5120, 6144), ("in_proj_qkvz", 16384, 5120),
    ("in_proj_ba", 96, 5120), ("out_proj", 5120, 6144), ("gate_up", 34816, 5120),
    ("down", 5120, 17408), ("lm_head", 248320, 5120),
]
MS = (1, 2, 4)
L2_BYTES = 60 * 2**20          # H200: 60 MB (rotate past 3x that)
MEM_CAP = 40 * 2**30           # total weight copies per shape
# (block, rows) variants timed besides the built-in choice (0, 0)
VARIANTS_CUDA = [(64, 2), (64, 4), (64, 8), (128, 8), (128, 1), (128, 2), (128, 4), (256, 1), (256, 2), (256, 4), (256, 8), (512, 2), (512, 4), (640, 4),
                 (768, 4)]
VARIANTS_AMD = [(640, 2), (640, 4), (256, 4), (512, 2), (128, 4), (768, 2)]
FUSED_VARIANTS = [(64, 1), (64, 2), (128, 1), (128, 2), (256, 2), (256, 4), (640, 2)]


def sh(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=HERE).stdout.strip() or None
    except Exception:  # noqa: BLE001 - provenance is best effort
        return None


def provenance(torch, build_s: float) -> dict:
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    nvcc = sh(["nvcc", "--version"])
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": sh(["git", "rev-parse", "HEAD"]),
        "git_dirty": bool(sh(["git", "status", "--porcelain", "--untracked-files=no"])),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton_v, "cuda": torch.version.cuda, "hip": torch.version.hip,
        "nvcc": nvcc.splitlines()[-1] if nvcc else None,
        "python": platform.python_version(), "extension_build_s": round(build_s, 1),
    }


class Timer:
    def __init__(self, torch, reps: int, target_ms: float):
        self.torch, self.reps, self.target_ms = torch, reps, target_ms

    def launches(self, est_us: float, ncopies: int) -> int:
        n = math.ceil(self.target_ms * 1000 / max(est_us, 1.0))
        return max(min(max(n, 10), 400), min(ncopies, 400))

    def per_call_us(self, fn, n_launch: int) -> float:
        """fn(i) issues call i (i selects the weight copy). Median over replays of one graph of
        n_launch calls, divided by n_launch."""
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(3):
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n_launch):
                fn(i)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / n_launch)
        del g
        return statistics.median(times)


def copy_bandwidth(torch, timer: Timer) -> dict:
    """The memory roof for "% copy": the best of several large device-to-device copies, each counted as
    bytes read + bytes written (2 x the buffer). In a CUDA graph, tensor.copy_ becomes a memcpy node that
    may run on a copy engine well below what the SMs reach (2.76 TB/s on an H200 against ~4.2-4.3 TB/s
    for a kernel copy), so SM copies are timed too: an elementwise kernel (torch.mul by 1 into a
    preallocated output, 16-byte vectors) and, where Triton is present, a Triton copy. The GEMV's TB/s
    counts weight + x bytes read and y bytes written, the same convention."""
    nbytes = 1 << 30
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    methods = {
        "tensor.copy_ (graph memcpy node)": lambda i: dst.copy_(src),
        "torch.mul(src, 1, out=dst) (elementwise kernel)": lambda i: torch.mul(src, 1.0, out=dst),
    }
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)

        n = src.numel()
        methods["Triton copy kernel (BLOCK 4096)"] = lambda i: _copy[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096)
    except ImportError:
        pass
    per = {}
    for label, fn in methods.items():
        us = timer.per_call_us(fn, 10)
        if not torch.equal(dst, src):
            raise RuntimeError(f"bench_gemv: the copy reference '{label}' did not copy the buffer")
        dst.zero_()
        per[label] = {"us": round(us, 2), "tbps_read_plus_write": round(2 * nbytes / us / 1e6, 3)}
    best = max(per, key=lambda k: per[k]["tbps_read_plus_write"])
    src = dst = None  # frees the buffers (the lambdas above hold their cells)
    return {"bytes_per_side": nbytes, "convention": "bytes read + bytes written (2 x buffer) per second",
            "methods": per, "best": best, "tbps_read_write": per[best]["tbps_read_plus_write"]}


def silu_and_mul_fn(torch, F):
    """The separate activation as vLLM runs it (one kernel: _C.silu_and_mul); a Triton kernel here, or
    torch eager (two kernels) where Triton is missing. Returns (fn(gate_up, out), label)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        def eager(gu, out):
            i = out.shape[1]
            torch.mul(F.silu(gu[:, :i]), gu[:, i:], out=out)
        return eager, "silu*mul (torch eager, 2 kernels)"

    @triton.jit
    def _silu_mul(gu_ptr, out_ptr, I, s_gu, s_out, BLOCK: tl.constexpr):
        m = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        g = tl.load(gu_ptr + m * s_gu + offs, mask=mask).to(tl.float32)
        u = tl.load(gu_ptr + m * s_gu + I + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + m * s_out + offs, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16), mask=mask)

    def fused_act(gu, out):
        i = out.shape[1]
        _silu_mul[(triton.cdiv(i, 1024), out.shape[0])](gu, out, i, gu.stride(0), out.stride(0), BLOCK=1024)
    return fused_act, "silu_and_mul (1 Triton kernel)"


def check_correct(torch, F, ext, shapes, ms) -> list[dict]:
    """Every shape and M against float64 (tolerance as tests/kernels/test_forge_gemv.py)."""
    out = []
    g = torch.Generator(device="cuda").manual_seed(1234)

    def ref(x, w):
        xd = x.double()
        return torch.cat([xd @ w[i:i + 32768].double().T for i in range(0, w.shape[0], 32768)], dim=1)

    def err(y, r):
        floor = 1e-2 * r.pow(2).mean().sqrt().item()
        if torch.isnan(y).any():
            return float("inf")
        return ((y.double() - r).abs() / r.abs().clamp_min(floor)).max().item()

    for name, N, K in shapes:
        w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
        for M in ms:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            ext.forge_gemv(y, x, w)
            r = ref(x, w)
            rec = {"shape": name, "M": M, "max_rel_err": err(y, r)}
            if name == "gate_up":
                ys = torch.full((M, N // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
                ext.forge_gemv_silu_mul(ys, x, w)
                rec["fused_max_rel_err"] = err(ys, F.silu(r[:, : N // 2]) * r[:, N // 2:])
                act, _ = silu_and_mul_fn(torch, F)   # the separate activation timed against the fused kernel
                ya = torch.full((M, N // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
                act(y, ya)
                yd = y.double()
                rec["act_max_rel_err"] = err(ya, F.silu(yd[:, : N // 2]) * yd[:, N // 2:])
            out.append(rec)
        del w
    torch.cuda.empty_cache()
    return out


SHAPE_NK = {name: (N, K) for name, N, K in SHAPES}
GATE_UP = SHAPE_NK["gate_up"]


ROUTE_IMPL = "vLLM route without the kernel"


def route(result: dict) -> dict:
    """The (N, K) -> token counts one run says should take the kernel, as the route calls it (the
    built-in launch, block = rows = 0): where it was faster than what vLLM runs without it, its own
    GEMM route where the run timed that (`--ops vllm` on ROCm: wvSplitK / LLMM1 / rocBLAS), else
    F.linear (and the same + the activation for the fused kernel). 3 tokens run the 4-row kernel
    and follow M = 4; shapes that share (N, K) (o_proj and out_proj) take it only where every one won.
    Returns {"plain": [[N, K, [M...]], ...], "fused": [[N, K, [M...]]], "env": str}: "plain" is the
    GEMV's own table, "fused" the fused gate_up + SiLU-and-mul's (against F.linear + the activation), and
    "env" the VLLM_FORGE_GEMV_SHAPES value (it replaces both tables; gate_up's entry follows the fused
    kernel, the MLP's path with the switch on). Shapes or M the run did not time are left out."""
    plain: dict = {}
    for r in result["summary"]:
        won = r["default_us"] < (r.get("route_us") or r["linear_us"])
        for m in ((3, 4) if r["M"] == 4 else (r["M"],)):
            cell = plain.setdefault(SHAPE_NK[r["shape"]], {})
            cell[m] = cell.get(m, True) and won
    fused: dict = {}
    for M in sorted({r["M"] for r in result.get("fused_gate_up", [])}):
        rows = [r for r in result["fused_gate_up"] if r["M"] == M]
        ref = ([r["us"] for r in rows if r["impl"].startswith(ROUTE_IMPL)]
               or [r["us"] for r in rows if r["impl"].startswith("F.linear")])
        ours = [r["us"] for r in rows if r["impl"] == "forge_gemv_silu_mul"]
        if ref and ours:
            for m in ((3, 4) if M == 4 else (M,)):
                fused[m] = ours[0] < ref[0]

    def table(d: dict) -> list:
        return sorted([n, k, sorted(m for m, w in ms.items() if w)] for (n, k), ms in d.items()
                      if any(ms.values()))

    chosen = {nk: {m for m, w in ms.items() if w} for nk, ms in plain.items()}
    if fused:
        chosen[GATE_UP] = {m for m, w in fused.items() if w}
    items = []
    for (n, k), ms in sorted(chosen.items()):
        if ms == {1, 2, 3, 4}:
            items.append(f"{n}x{k}")
        else:
            items += [f"{n}x{k}/{m}" for m in sorted(ms)]
    return {"plain": table(plain), "fused": [[*GATE_UP, sorted(m for m, w in fused.items() if w)]] if fused else [],
            "env": ",".join(items)}


def vllm_ops(torch):
    """The kernel compiled into the installed vLLM's _C (the patch series' build), as gemv_ext.Ops."""
    import gemv_ext
    try:
        import vllm
        import vllm._C  # noqa: F401  (registers torch.ops._C.*)
    except ImportError as e:
        raise SystemExit(f"bench_gemv --ops vllm: the installed vLLM's compiled extension does not import ({e}); "
                         "run it where a forge wheel or image is installed, or leave --ops at 'build'")
    if not hasattr(torch.ops._C, "forge_gemv") or not hasattr(torch.ops._C, "forge_gemv_silu_mul"):
        raise SystemExit(f"bench_gemv --ops vllm: vLLM {vllm.__version__} has no _C.forge_gemv / forge_gemv_silu_mul: "
                         "it is not built from the patch series (make wheel / make image); under the GPU harness's "
                         "stand-in _C, set VLLM_FORGE_GEMV=1 (it registers the op only then)")
    return gemv_ext.Ops(torch.ops._C), vllm.__version__


def vllm_route(torch):
    """On ROCm, with the installed vLLM: its GEMM route for a bf16 linear layer with the forge kernel
    switched off (rocm_unquantized_gemm: wvSplitK / LLMM1 where VLLM_ROCM_USE_SKINNY_GEMM and the arch
    allow, else rocBLAS / hipBLASLt), the call the kernel replaces; fn(x, w). None elsewhere (there the
    route without the kernel is F.linear, timed anyway)."""
    if not torch.version.hip:
        return None
    os.environ["VLLM_FORGE_GEMV"] = "0"
    import vllm.model_executor.layers.utils as U
    for f in ("forge_gemv_enabled", "forge_gemv_table"):
        if hasattr(getattr(U, f, None), "cache_clear"):
            getattr(U, f).cache_clear()
    return lambda x, w: U.rocm_unquantized_gemm_impl(x, w, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for bench_gemv.json and bench_gemv.md")
    ap.add_argument("--quick", action="store_true", help="smoke test: three shapes (o_proj, in_proj_ba, gate_up), M = 1, fewer repetitions")
    ap.add_argument("--verbose-build", action="store_true")
    ap.add_argument("--define", action="append", default=[], metavar="MACRO",
                    help="build the kernel with -DMACRO (repeatable), for an A/B of a variant the source guards with "
                         "a macro; the build is cached apart and the macros are recorded in the provenance")
    ap.add_argument("--ops", choices=("build", "vllm"), default="build",
                    help="build (default): compile kernels/csrc/forge_gemv.cu as a torch extension; vllm: time the "
                         "kernel compiled into the installed vLLM (torch.ops._C.forge_gemv: a forge wheel or image)")
    args = ap.parse_args()
    if args.ops == "vllm" and args.define:
        ap.error("--define builds the source; it does not apply to --ops vllm (the installed build)")

    import torch
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        print("bench_gemv: no CUDA/ROCm device visible; run this on a GPU machine", file=sys.stderr)
        return 2
    import gemv_ext

    t_start = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    vllm_version = None
    route_fn = None
    if args.ops == "vllm":
        ext, vllm_version = vllm_ops(torch)
        route_fn = vllm_route(torch)
        build_s = 0.0
        print(f"kernel: torch.ops._C.forge_gemv of the installed vLLM {vllm_version}", flush=True)
    else:
        ext, build_s = gemv_ext.load(verbose=args.verbose_build, defines=tuple(args.define))
        print(f"extension built/loaded in {build_s:.1f} s", flush=True)
    on_amd = torch.version.hip is not None
    shapes = [s for s in SHAPES if s[0] in ("o_proj", "in_proj_ba", "gate_up")] if args.quick else SHAPES
    ms = (1,) if args.quick else MS
    variants = [(0, 0)] + ([] if args.quick else (VARIANTS_AMD if on_amd else VARIANTS_CUDA))
    fused_variants = [(0, 0)] + ([] if args.quick else FUSED_VARIANTS)
    timer = Timer(torch, reps=5 if args.quick else 9, target_ms=1.0 if args.quick else 2.0)

    result = {"provenance": {**provenance(torch, build_s), "defines": args.define, "ops": args.ops,
                             "vllm": vllm_version}, "quick": args.quick,
              "convention": "tbps = (bytes read + bytes written) / time; GEMV: W + x read, y written; "
                            "frac_copy = tbps / copy.tbps_read_write (the fastest device-to-device copy, "
                            "read + written)"}
    correct = check_correct(torch, F, ext, shapes, ms)
    result["correctness"] = correct
    bad = [c for c in correct if max(c["max_rel_err"], c.get("fused_max_rel_err", 0), c.get("act_max_rel_err", 0)) > 1e-2]
    if bad:
        (out_dir / "bench_gemv.json").write_text(json.dumps(result, indent=1) + "\n")
        print("bench_gemv: results differ from the float64 reference (rel err > 1e-2):", file=sys.stderr)
        for c in bad:
            print(f"  {c}", file=sys.stderr)
        return 1
    print(f"correct at {len(correct)} (shape, M) cases (max rel err "
          f"{max(c['max_rel_err'] for c in correct):.2e})", flush=True)

    copy = copy_bandwidth(torch, timer)
    result["copy"] = copy
    bw = copy["tbps_read_write"]
    for label, m in copy["methods"].items():
        print(f"device-to-device copy, {label}: {m['tbps_read_plus_write']:.2f} TB/s (read + write)", flush=True)
    print(f"copy reference: {bw:.2f} TB/s ({copy['best']})", flush=True)

    rows = []
    fused_rows = []
    for name, N, K in shapes:
        wbytes = N * K * 2
        ncopies = max(2, min(math.ceil(3 * L2_BYTES / wbytes), MEM_CAP // wbytes))
        ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(1)]
        ws += [torch.empty_like(ws[0]).copy_(ws[0]) for _ in range(ncopies - 1)]
        for M in ms:
            x = torch.randn(M, K, device="cuda").bfloat16()
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            nbytes = wbytes + M * K * 2 + M * N * 2
            n_launch = timer.launches(nbytes / (bw * 1e6) * 1.2, ncopies)

            def rec(impl, us, **kw):
                r = {"shape": name, "N": N, "K": K, "M": M, "impl": impl, "us": round(us, 2),
                     "tbps": round(nbytes / us / 1e6, 3), "frac_copy": round(nbytes / us / 1e6 / bw, 3),
                     "bytes": nbytes, "weight_copies": ncopies, "launches_per_graph": n_launch, **kw}
                rows.append(r)
                return r

            rec("F.linear", timer.per_call_us(lambda i: F.linear(x, ws[i % ncopies]), n_launch))
            if route_fn is not None:
                rec(ROUTE_IMPL, timer.per_call_us(lambda i: route_fn(x, ws[i % ncopies]), n_launch))
            for block, nrows in variants:
                try:
                    us = timer.per_call_us(lambda i: ext.forge_gemv(y, x, ws[i % ncopies], block, nrows), n_launch)
                except RuntimeError as e:
                    if "is not built" in str(e):
                        continue
                    raise
                rec("forge_gemv" if block == 0 else f"forge_gemv b{block} r{nrows}", us, block=block, rows=nrows)

            if name == "gate_up":
                I = N // 2
                ys = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
                fbytes = wbytes + M * K * 2 + M * I * 2

                def frec(impl, us):
                    fused_rows.append({"M": M, "impl": impl, "us": round(us, 2),
                                       "tbps": round(fbytes / us / 1e6, 3),
                                       "frac_copy": round(fbytes / us / 1e6 / bw, 3)})

                act, act_label = silu_and_mul_fn(torch, F)
                act_out = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)

                def lin_act(i):
                    act(F.linear(x, ws[i % ncopies]), act_out)

                def gemv_act(i):
                    ext.forge_gemv(y, x, ws[i % ncopies])
                    act(y, act_out)

                frec(f"F.linear + {act_label}", timer.per_call_us(lin_act, n_launch))
                if route_fn is not None:
                    frec(f"{ROUTE_IMPL} + {act_label}",
                         timer.per_call_us(lambda i: act(route_fn(x, ws[i % ncopies]), act_out), n_launch))
                frec(f"forge_gemv + {act_label}", timer.per_call_us(gemv_act, n_launch))
                for block, nrows in fused_variants:
                    try:
                        us = timer.per_call_us(
                            lambda i: ext.forge_gemv_silu_mul(ys, x, ws[i % ncopies], block, nrows), n_launch)
                    except RuntimeError as e:
                        if "is not built" in str(e):
                            continue
                        raise
                    frec("forge_gemv_silu_mul" if block == 0 else f"forge_gemv_silu_mul b{block} r{nrows}", us)
            print(f"  {name} M={M}: done", flush=True)
        ws = None  # frees the weight copies (the lambdas above hold the cell)
        torch.cuda.empty_cache()

    result["rows"] = rows
    result["fused_gate_up"] = fused_rows
    result["wall_s"] = round(time.time() - t_start, 1)

    # summary: per (shape, M) the cuBLAS row, our default and our best variant
    lines = [f"# Decode GEMV benchmark ({result['provenance']['device']})", "",
             f"{result['provenance']['date']}, commit `{(result['provenance']['git_commit'] or '?')[:12]}`"
             f"{' (dirty)' if result['provenance']['git_dirty'] else ''}, torch {torch.__version__}, "
             + (f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}")
             + f", command `{result['provenance']['command']}`"
             + (f", kernel built with {', '.join('-D' + d for d in args.define)}" if args.define else "")
             + (f", the kernel of the installed vLLM {vllm_version} (_C)" if vllm_version else ""), "",
             f"Copy reference: {bw:.2f} TB/s, the fastest large device-to-device copy ({copy['best']}; "
             + ", ".join(f"{k} {v['tbps_read_plus_write']:.2f}" for k, v in copy["methods"].items())
             + "). Convention: every TB/s here counts bytes read + bytes written; a copy moves 2 x its "
             "buffer, a GEMV reads W and x and writes y; % copy = TB/s / copy reference. Times: CUDA "
             "graphs, weights rotated past the L2, median of replays.", "",
             "| shape | N x K | M | F.linear µs | TB/s | % copy | forge_gemv µs | TB/s | % copy | best variant | µs | "
             "best / F.linear |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    for name, N, K in shapes:
        for M in ms:
            rs = [r for r in rows if r["shape"] == name and r["M"] == M]
            lin = next(r for r in rs if r["impl"] == "F.linear")
            ours = [r for r in rs if r["impl"].startswith("forge_gemv")]
            dflt = next(r for r in ours if r["impl"] == "forge_gemv")
            best = min(ours, key=lambda r: r["us"])
            summary.append({"shape": name, "M": M, "linear_us": lin["us"], "default_us": dflt["us"],
                            "best_impl": best["impl"], "best_us": best["us"],
                            "default_vs_linear": round(dflt["us"] / lin["us"], 3),
                            "best_vs_linear": round(best["us"] / lin["us"], 3)})
            vr = next((r for r in rs if r["impl"] == ROUTE_IMPL), None)
            if vr:
                summary[-1].update(route_us=vr["us"], default_vs_route=round(dflt["us"] / vr["us"], 3))
            lines.append(f"| {name} | {N}x{K} | {M} | {lin['us']:.1f} | {lin['tbps']:.2f} | {100 * lin['frac_copy']:.0f} | "
                         f"{dflt['us']:.1f} | {dflt['tbps']:.2f} | {100 * dflt['frac_copy']:.0f} | {best['impl']} | "
                         f"{best['us']:.1f} | {best['us'] / lin['us']:.3f} |")
    result["summary"] = summary
    if any("route_us" in c for c in summary):
        lines += ["", "vLLM's own GEMM route with the kernel switched off (the call the kernel replaces: "
                  "rocm_unquantized_gemm, wvSplitK / LLMM1 / rocBLAS), the anchor of the route below:", "",
                  "| shape | M | vLLM route µs | forge_gemv µs | forge_gemv / route |", "|---|---|---|---|---|"]
        lines += [f"| {c['shape']} | {c['M']} | {c['route_us']:.1f} | {c['default_us']:.1f} | {c['default_vs_route']:.3f} |"
                  for c in summary if "route_us" in c]
    if fused_rows:
        lines += ["", "Fused gate_up (34816 x 5120) + SiLU-and-mul, output (M, 17408):", "",
                  "| M | impl | µs | TB/s | % copy |", "|---|---|---|---|---|"]
        for r in fused_rows:
            lines.append(f"| {r['M']} | {r['impl']} | {r['us']:.1f} | {r['tbps']:.2f} | {100 * r['frac_copy']:.0f} |")
    result["route"] = route(result)
    anchor = "vLLM's route without it" if any("route_us" in c for c in summary) else "F.linear"
    lines += ["", f"Route from this run (the built-in launch faster than {anchor}; 3 tokens follow 4; gate_up follows "
              "the fused kernel): " + (f"`VLLM_FORGE_GEMV_SHAPES={result['route']['env']}`" if result["route"]["env"]
                                       else "no pair (leave VLLM_FORGE_GEMV off on this machine)"),
              "", f"Wall time {result['wall_s']} s (extension build {build_s:.0f} s)."]
    (out_dir / "bench_gemv.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "bench_gemv.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
