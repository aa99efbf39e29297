"""kernels/forge_triton/skinny_gemm.py: the skinny GEMM on the matrix units (1-32 token rows) and its fused
gate_up + SiLU-and-mul, against float64 references on fresh random inputs (the seed is in each failure
message). On a CPU: Triton's interpreter at small, ragged sizes (N and K not multiples of the blocks,
a split-K range left empty), every M in 1-16 and 17, 24, 31, 32 (the 32-row tile), split-K off and on. On a GPU: every bf16 linear layer of
Qwen3.5-27B per rank at TP1 and TP2 (kernels/calibrate/common.linear) at the built-in launch and a forced
split-K.

Outputs are views into a NaN-poisoned buffer one row and a few columns larger: every cell of the view
must be written and right, every cell around it left alone. Split-K partials are poisoned too, so a
program that skips its (possibly empty) range is seen. Tolerance as tests/kernels/test_forge_gemv.py:
|y - ref| <= 1e-2 * max(|ref|, 1e-2 * rms(ref)) per element (bf16 rounding of the result is 2^-9).

Mutants tried by hand on the kernel, one at a time in the interpreter (each made the named tests fail,
then was reverted):
- K mask off by one (`offs_k < K` -> `offs_k <= K`, reads x[m + 1, 0]): test_plain_every_m, test_fused_every_m
  (both modes), test_builtin_launch[200-360], test_strided_x.
- the fused kernel's up rows at `rows` instead of `rows + N_OUT` (the gate half twice): test_fused_every_m,
  test_builtin_launch.
- SiLU on the up half (`silu(up) * gate`), in the main kernel / in the split-K reduce: test_fused_every_m
  [nosplit] / [split], test_builtin_launch.
- split-K: a program with an empty K range stores no partial (mask `& (k_lo < K)`): test_plain_every_m[split],
  test_fused_every_m[split] (the poisoned partial of the empty split reaches the sum).
- the reduce sums SPLIT_K - 1 partials: test_builtin_launch[320-512], test_strided_x (in the [split] tests the
  dropped last range is the empty one, by design of those tests).
- the store mask at `offs_n <= N_OUT` / `offs_m <= M`: test_plain_every_m (the poisoned slack is overwritten),
  then the interpreter aborts on the out-of-bounds store of an allocated output.
- x's row stride taken as K (`offs_m * K` instead of `* sx_m`): test_strided_x.
"""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from calibrate import common as CAL
from forge_triton import skinny_gemm as SK
from kernel_env import ON_GPU, REPO

TOL = 1e-2
DEV = "cuda" if ON_GPU else "cpu"


class Rng:
    def __init__(self):
        self.seed_value = int.from_bytes(os.urandom(4), "little")
        self.g = torch.Generator(device=DEV).manual_seed(self.seed_value)

    def randn(self, *shape, scale=1.0):
        return (torch.randn(*shape, device=DEV, generator=self.g) * scale).bfloat16()


def ref_plain(x, w):
    xd = x.double()
    return torch.cat([xd @ w[i:i + 32768].double().T for i in range(0, w.shape[0], 32768)], dim=1)


def ref_fused(x, w):
    r = ref_plain(x, w)
    i = w.shape[0] // 2
    return F.silu(r[:, :i]) * r[:, i:]


def poisoned_out(M, n, dtype=torch.bfloat16):
    """A (M, n) view of a NaN buffer with one more row and 5 more columns (the slack must stay NaN)."""
    buf = torch.full((M + 1, n + 5), float("nan"), device=DEV, dtype=dtype)
    return buf, buf[:M, :n]


def check(buf, y, ref, what):
    M, n = y.shape
    assert not torch.isnan(y).any(), f"{what}: {int(torch.isnan(y).sum())} outputs not written"
    yd = y.double()
    floor = 1e-2 * ref.pow(2).mean().sqrt().item()
    bad = (yd - ref).abs() > TOL * ref.abs().clamp_min(floor)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs off, first at "
                           f"{bad.nonzero()[0].tolist()}: {yd[bad][0].item()} vs {ref[bad][0].item()}")
    assert buf is None or (torch.isnan(buf[M]).all() and torch.isnan(buf[:M, n:]).all()), \
        f"{what}: wrote outside the output"


def poisoned_workspace(M, N, split_k):
    return torch.full((max(1, SK.workspace_numel(M, N, split_k)),), float("nan"), device=DEV, dtype=torch.float32)


# ---- CPU (interpreter) sizes: ragged against BLOCK_N 64 / BLOCK_K 64 and 128 --------------------------------
SMALL_N, SMALL_K, SMALL_I = 200, 360, 100
# K 300 at BLOCK_K 128 and SPLIT_K 4: ranges of 128, the fourth one empty
# 1-16 rows (BLOCK_M 16) and 17-32 (BLOCK_M 32: the captured graphs' 24 and 32, and ragged counts)
EVERY_M = [*range(1, 17), 17, 24, 31, 32]
SPLITS = {"nosplit": dict(block_n=64, block_k=64, split_k=1), "split": dict(block_n=64, block_k=128, split_k=4)}


@pytest.mark.parametrize("mode", sorted(SPLITS))
def test_plain_every_m(mode):
    r = Rng()
    K = SMALL_K if mode == "nosplit" else 300
    w = r.randn(SMALL_N, K, scale=K ** -0.5)
    xall = r.randn(32, K)
    for M in EVERY_M:
        x = xall[:M].clone()
        buf, y = poisoned_out(M, SMALL_N)
        ws = poisoned_workspace(M, SMALL_N, SPLITS[mode]["split_k"])
        SK.skinny_gemm(x, w, y, workspace=ws, **SPLITS[mode])
        check(buf, y, ref_plain(x, w), f"M={M} {mode} N={SMALL_N} K={K} seed={r.seed_value}")


@pytest.mark.parametrize("mode", sorted(SPLITS))
def test_fused_every_m(mode):
    r = Rng()
    K = 328 if mode == "nosplit" else 300
    w = r.randn(2 * SMALL_I, K, scale=K ** -0.5)
    xall = r.randn(32, K)
    for M in EVERY_M:
        x = xall[:M].clone()
        buf, y = poisoned_out(M, SMALL_I)
        ws = poisoned_workspace(M, 2 * SMALL_I, SPLITS[mode]["split_k"])
        SK.skinny_gemm_silu_mul(x, w, y, workspace=ws, **SPLITS[mode])
        check(buf, y, ref_fused(x, w), f"fused M={M} {mode} I={SMALL_I} K={K} seed={r.seed_value}")


@pytest.mark.parametrize("N,K", [(96, 256), (320, 512), (200, 360)])
def test_builtin_launch(N, K):
    """The launch the kernel picks by itself (here: the interpreter's 8 compute units), plain and fused."""
    r = Rng()
    w = r.randn(N, K, scale=K ** -0.5)
    for M in (1, 6, 16, 24):
        x = r.randn(M, K)
        y = SK.skinny_gemm(x, w)
        assert y.shape == (M, N) and y.dtype == torch.bfloat16
        check(None, y, ref_plain(x, w), f"built-in M={M} {N}x{K} seed={r.seed_value}")
        yf = SK.skinny_gemm_silu_mul(x, w)
        check(None, yf, ref_fused(x, w),
              f"built-in fused M={M} {N}x{K} seed={r.seed_value}")


def test_strided_x():
    """x a column slice of a wider activation (row stride > K), as a split of a fused projection."""
    r = Rng()
    N, K = 136, 264
    w = r.randn(N, K, scale=K ** -0.5)
    for M in (3, 16):
        wide = r.randn(M, K + 40)
        x = wide[:, 24:24 + K]
        buf, y = poisoned_out(M, N)
        SK.skinny_gemm(x, w, y, block_n=64, block_k=64, split_k=2, workspace=poisoned_workspace(M, N, 2))
        check(buf, y, ref_plain(x, w), f"strided x M={M} seed={r.seed_value}")


def test_rows_outside_1_to_32_are_refused():
    with pytest.raises(ValueError, match="M=33"):
        SK.launch_config(33, 1024, 1024, 132)
    with pytest.raises(ValueError, match="M=0"):
        SK.launch_config(0, 1024, 1024, 132)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("cus,hip", [(132, False), (80, True)])
def test_builtin_launch_fills_the_device(tp, cus, hip):
    """At the real per-rank shapes: at least WAVES (1.5) programs per SM/CU wherever BLOCK_N 64 and the
    split-K cap allow it, K ranges of whole BLOCK_K tiles, and on HIP one step's tiles within a third of gfx9's 64 KiB
    of LDS per compute unit (three programs per CU)."""
    for layer, N, K in CAL.linear(tp):
        for fused in ((False, True) if layer == "gate_up" else (False,)):
            c = SK.launch_config(16, N, K, cus, fused=fused, is_hip=hip)
            n_out = N // 2 if fused else N
            programs = math.ceil(n_out / c.block_n) * c.split_k
            reachable = math.ceil(n_out / 64) * min(SK.MAX_SPLIT_K, K // c.block_k // SK.MIN_TILES_PER_SPLIT)
            assert programs >= min(math.ceil(SK.WAVES * cus), reachable), (layer, tp, cus, c, programs)
            assert K % c.block_k == 0 and (K // c.block_k) >= c.split_k * SK.MIN_TILES_PER_SPLIT, (layer, c)
            lds = (2 if fused else 1) * c.block_n * c.block_k * 2 + c.block_k * 16 * 2
            assert not hip or lds <= 65536 // 3, (layer, c, lds)


BENCH = os.path.join(REPO, "reports", "kernels", "skinny_mma", "bench_skinny_mma.json")


def test_builtin_launch_is_the_fastest_the_recorded_benchmark_timed():
    """reports/kernels/skinny_mma (an H200, every per-rank linear shape at TP1 and TP2, M 1-16, the kernel's
    launch at the time and 10 others timed in one run): at each point the launch launch_config now picks
    was timed, and it is within 4 % (or 0.5 us: in_proj_ba's whole call is ~4.5 us) of the fastest timed
    there. The launch the kernel picked before (two programs per SM, BLOCK_N 128 where that reached it,
    BLOCK_K 128 fused) was up to 21 % slower."""
    with open(BENCH) as f:
        doc = json.load(f)
    cus = doc["provenance"]["compute_units"]
    points = {}
    for r in doc["rows"]:
        if r["impl"].startswith("mma"):
            points.setdefault((r["tp"], r["shape"], r["kind"], r["N"], r["K"], r["M"]), []).append(r)
    assert len(points) == 256
    slow = []
    for (tp, shape, kind, N, K, M), rows in points.items():
        c = list(SK.launch_config(M, N, K, cus, fused=kind == "fused", is_hip=False))
        mine = [r["us"] for r in rows if r["launch"] == c]
        assert mine, f"TP{tp} {shape} {kind} M={M}: launch {c} was not timed by the benchmark"
        best = min(r["us"] for r in rows)
        if mine[0] > best * 1.04 and mine[0] - best > 0.5:
            slow.append((tp, shape, kind, M, c, round(mine[0] / best, 3)))
    assert not slow, slow


# ---- GPU: the real per-rank shapes -----------------------------------------------------------------------
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA/ROCm device (GPU machine)")
GPU_SHAPES = sorted({(N, K, layer) for tp in (1, 2) for layer, N, K in CAL.linear(tp)})


@gpu
@pytest.mark.parametrize("N,K,layer", GPU_SHAPES)
def test_gpu_per_rank_shapes(N, K, layer):
    r = Rng()
    w = r.randn(N, K, scale=K ** -0.5)
    xall = r.randn(32, K)
    ref_all = ref_plain(xall, w)
    fused = layer == "gate_up"
    for M in (1, 2, 5, 8, 11, 16, 17, 24, 32):
        x = xall[:M].clone()
        for split in (None, 4):
            buf, y = poisoned_out(M, N)
            ws = poisoned_workspace(M, N, split or SK.launch_config(M, N, K, SK.num_compute_units()).split_k)
            SK.skinny_gemm(x, w, y, split_k=split, workspace=ws)
            check(buf, y, ref_all[:M], f"{layer} {N}x{K} M={M} split={split} seed={r.seed_value}")
            if fused:
                i = N // 2
                buf, y = poisoned_out(M, i)
                SK.skinny_gemm_silu_mul(x, w, y, split_k=split,
                                        workspace=poisoned_workspace(M, N, split or SK.MAX_SPLIT_K))
                check(buf, y, F.silu(ref_all[:M, :i]) * ref_all[:M, i:],
                      f"fused {layer} {N}x{K} M={M} split={split} seed={r.seed_value}")
    del w
    torch.cuda.empty_cache()


@gpu
def test_gpu_split_k_is_deterministic():
    r = Rng()
    N, K = 5120, 17408
    w = r.randn(N, K, scale=K ** -0.5)
    x = r.randn(13, K)
    first = SK.skinny_gemm(x, w, split_k=8)
    for _ in range(5):
        assert torch.equal(SK.skinny_gemm(x, w, split_k=8), first), f"seed={r.seed_value}"


@gpu
@pytest.mark.parametrize("N,K,fused", [(5120, 17408, False), (248320, 5120, False), (34816, 5120, True),
                                       (96, 5120, False), (17408, 5120, True)])
def test_gpu_the_route_s_call_replays_in_a_graph(N, K, fused):
    """As vLLM's route calls it (patch "gemv: the route runs the matrix-unit skinny GEMM ..."): no `out`, no
    workspace (the split-K partials allocated inside the call), the built-in launch; captured in a CUDA/HIP
    graph as vLLM captures its decode steps (after a warm-up call that compiles the kernel), then replayed on
    fresh inputs copied into the static input, each replay against float64. Fails if the launch allocates or
    synchronises in a way capture forbids, or if a replay reads stale inputs or partials."""
    r = Rng()
    w = r.randn(N, K, scale=K ** -0.5)
    fn = SK.skinny_gemm_silu_mul if fused else SK.skinny_gemm
    cus = SK.num_compute_units()
    for M in (5, 8, 16, 24, 32):
        x_static = r.randn(M, K)
        fn(x_static, w, num_cus=cus)                       # warm-up: the Triton compile, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = fn(x_static, w, num_cus=cus)
        for _ in range(2):
            x_static.copy_(r.randn(M, K))
            y_static.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref = ref_plain(x_static, w)
            if fused:
                i = N // 2
                ref = F.silu(ref[:, :i]) * ref[:, i:]
            check(None, y_static, ref, f"graph {N}x{K} fused={fused} M={M} split="
                                       f"{SK.launch_config(M, N, K, cus, fused=fused).split_k} seed={r.seed_value}")
        del graph
    del w
    torch.cuda.empty_cache()


def _compiled(kernel) -> int:
    """Compiled variants of a Triton kernel on the current device (the JIT's per-device cache: its first
    member is the compiled-kernel dict in Triton 3.4-3.7)."""
    from triton.runtime import driver  # noqa: PLC0415 - only on a GPU machine
    return len(kernel.device_caches[driver.active.get_current_device()][0])


@gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_one_compile_serves_every_row_count(fused):
    """The route calls the kernel outside captured graphs too (vLLM's LM head, at the number of sampled
    requests): a row count first seen mid-tier must not compile a new variant. After a first call at 5 rows,
    calls at 1, 16 and 11 rows (Triton's special values 1 and multiples of 16 included) add no compiled
    kernel; the first call above 16 rows adds the BLOCK_M 32 kernel, and 32 and 17 rows then add none.
    Each result matches float64. Fails where M is specialised."""
    r = Rng()
    N, K = (2048, 5120) if fused else (1024, 5120)
    w = r.randn(N, K, scale=K ** -0.5)
    fn = SK.skinny_gemm_silu_mul if fused else SK.skinny_gemm
    seen = {}
    for M in (5, 1, 16, 11, 24, 32, 17):
        x = r.randn(M, K)
        buf, y = poisoned_out(M, N // 2 if fused else N)
        fn(x, w, y, split_k=2)                               # the split-K reduce kernel too
        check(buf, y, ref_fused(x, w) if fused else ref_plain(x, w), f"N={N} K={K} fused={fused} M={M} "
                                                                     f"seed={r.seed_value}")
        seen[M] = (_compiled(SK._skinny_gemm_kernel), _compiled(SK._split_k_reduce_kernel))
    assert seen[1] == seen[16] == seen[11] == seen[5], f"compiled variants after each row count: {seen}"
    assert seen[32] == seen[17] == seen[24] and seen[24][0] <= seen[5][0] + 1, f"compiled variants: {seen}"
