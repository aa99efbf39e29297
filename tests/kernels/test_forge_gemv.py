"""kernels/csrc/forge_gemv.cu on a GPU machine (skips without CUDA): built as a torch extension, checked
against a float64 reference at every Qwen3.5-27B decode shape and M = 1, 2, 3, 4 (and M = 1..16, the skinny
GEMM, at the end of this file), at odd K (scalar path),
partial row groups, strided/unaligned x, every built block/rows configuration, and the fused
gate_up + SiLU-and-mul variant against float64 silu(g) * u.

Tolerance (bf16 output): |y - ref| <= 1e-2 * max(|ref|, 1e-2 * rms(ref)) per element. Rounding the fp32
result to bf16 alone costs up to 2^-9 relative (0.2 %); fp32 accumulation over K <= 17408 adds ~1e-6
relative to sum |x w|, which the rms floor covers for outputs that cancel to near zero. A wrong index,
a missed K chunk or an unwritten output (outputs are poisoned with NaN first) fails by orders of
magnitude. Inputs are fresh random tensors per test (the seed is in the failure message)."""

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import bench_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU machine)")

# (name, N, K) at batch 1 decode of Qwen3.5-27B, one card
SHAPES = [
    ("qkv_gate", 14336, 5120), ("o_proj", 5120, 6144), ("in_proj_qkvz", 16384, 5120),
    ("in_proj_ba", 96, 5120), ("out_proj", 5120, 6144), ("gate_up", 34816, 5120),
    ("down", 5120, 17408), ("lm_head", 248320, 5120),
]
TOL = 1e-2


@pytest.fixture(scope="module")
def ext():
    m, _ = bench_module("gemv_ext").load()
    return m


class Rng:
    def __init__(self):
        self.seed_value = int.from_bytes(os.urandom(4), "little")
        self.g = torch.Generator(device="cuda").manual_seed(self.seed_value)


@pytest.fixture
def gen():
    return Rng()


def rand(shape, rng, scale=1.0):
    return (torch.randn(shape, device="cuda", dtype=torch.float32, generator=rng.g) * scale).to(torch.bfloat16)


def ref_gemv(x, w):
    """float64 x @ w^T, in row chunks (the LM head's float64 copy would be 10 GB at once)."""
    xd = x.double()
    return torch.cat([xd @ w[i:i + 32768].double().T for i in range(0, w.shape[0], 32768)], dim=1)


def check(y, ref, what, g):
    assert not torch.isnan(y).any(), f"{what}: unwritten (NaN-poisoned) outputs remain (seed {g.seed_value})"
    yd = y.double()
    floor = TOL * ref.pow(2).mean().sqrt().item()
    err = ((yd - ref).abs() / ref.abs().clamp_min(floor)).max().item()
    assert err <= TOL, f"{what}: max relative error {err:.3e} > {TOL} (seed {g.seed_value})"


def poisoned(M, N):
    return torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("name,N,K", SHAPES, ids=[s[0] for s in SHAPES])
def test_issue_shapes(ext, gen, name, N, K):
    w = rand((N, K), gen, K ** -0.5)
    for M in (1, 2, 3, 4):
        x = rand((M, K), gen)
        y = poisoned(M, N)
        ext.forge_gemv(y, x, w)
        torch.cuda.synchronize()
        check(y, ref_gemv(x, w), f"{name} {N}x{K} M={M}", gen)
    del w
    torch.cuda.empty_cache()


@pytest.mark.parametrize("M", [1, 2, 4])
def test_fused_gate_up_silu(ext, gen, M):
    I, K = 17408, 5120
    w = rand((2 * I, K), gen, K ** -0.5)
    x = rand((M, K), gen, 2.0)  # gates over a wide range of silu
    y = poisoned(M, I)
    ext.forge_gemv_silu_mul(y, x, w)
    torch.cuda.synchronize()
    g_, u_ = ref_gemv(x, w[:I]), ref_gemv(x, w[I:])
    check(y, F.silu(g_) * u_, f"gate_up+silu M={M}", gen)


@pytest.mark.parametrize("K", [1, 7, 13, 1000, 5121, 5125])
@pytest.mark.parametrize("M", [1, 3, 4, 7, 16])
def test_odd_k_scalar_path(ext, gen, K, M):
    N = 257
    w = rand((N, K), gen)
    x = rand((M, K), gen)
    y = poisoned(M, N)
    ext.forge_gemv(y, x, w)
    ys = poisoned(M, N // 2)
    fused = not (torch.version.hip and M > 8)   # the fused kernel stops at 8 rows on AMD
    if fused:
        ext.forge_gemv_silu_mul(ys, x, w[: 2 * (N // 2)])
    torch.cuda.synchronize()
    check(y, ref_gemv(x, w), f"odd K={K} M={M}", gen)
    if not fused:
        return
    I = N // 2
    check(ys, F.silu(ref_gemv(x, w[:I])) * ref_gemv(x, w[I:2 * I]), f"fused odd K={K} M={M}", gen)


@pytest.mark.parametrize("N", [1, 3, 97, 1001])
def test_partial_row_groups(ext, gen, N):
    K = 4096
    w = rand((N, K), gen)
    for M in (1, 2, 4):
        x = rand((M, K), gen)
        for block, rows in ((0, 0), (256, 8), (128, 4), (640, 2)):
            if M > 2 and rows == 8:
                continue
            y = poisoned(M, N)
            ext.forge_gemv(y, x, w, block, rows)
            torch.cuda.synchronize()
            check(y, ref_gemv(x, w), f"N={N} M={M} block={block} rows={rows}", gen)


def test_strided_and_unaligned_x(ext, gen):
    N, K = 512, 5120
    w = rand((N, K), gen)
    big = rand((4, K + 64), gen)
    x = big[:, 8:K + 8]               # row stride K + 64, 16-byte aligned: vector path
    y = poisoned(4, N)
    ext.forge_gemv(y, x, w)
    xu = big[:, 1:K + 1]              # 2-byte offset: scalar path
    yu = poisoned(4, N)
    ext.forge_gemv(yu, xu, w)
    out_big = poisoned(4, N + 10)     # strided output rows
    ext.forge_gemv(out_big[:, :N], x, w)
    x1 = rand((K, 1), gen).t()       # one row whose reported row stride is 1
    y1 = poisoned(1, N)
    ext.forge_gemv(y1, x1, w)
    torch.cuda.synchronize()
    check(y1, ref_gemv(x1, w), "single row, stride(0) = 1", gen)
    check(y, ref_gemv(x, w), "strided x", gen)
    check(yu, ref_gemv(xu, w), "unaligned x", gen)
    check(out_big[:, :N], ref_gemv(x, w), "strided out", gen)
    assert torch.isnan(out_big[:, N:]).all(), "wrote past the output view"


# The rule `Built` in forge_gemv.cu states, restated: the sweep expects a refusal ("is not built")
# for every other configuration. A refusal is a C++ exception: where the compiler linked its own C++
# runtime into the extension (gemv_ext.own_cxx_runtime: the GPU machine's default /opt/gcc g++), it
# crashes the process instead, so the refusal cases are skipped there with that reason; built with
# CXX=/usr/bin/g++ they run.
def _built(M: int, block: int, rows: int, silu: bool, on_amd: bool) -> bool:
    mt = 1 if M <= 1 else 2 if M <= 2 else 4 if M <= 4 else 8 if M <= 8 else 16
    if silu and rows == 8:
        return False
    nv = (2 if silu else 1) * rows * mt
    if mt <= 4:
        return (not on_amd and block < 640) or nv <= 16
    return nv <= 16 or (not on_amd and block <= 256 and nv <= 32)


def _sweep_built_configs(ext, gen, silu, ms):
    """Every (block, rows) of the menu at each M in `ms`: the built ones against float64, the others
    refused without writing their output. K = 17408: uneven chunk counts for every block size.
    Returns (built, refused)."""
    K, N = 17408, 640   # K / 8 = 2176
    w = rand((N, K), gen, K ** -0.5)
    built = refused = 0
    for M in ms:
        x = rand((M, K), gen)
        ref = ref_gemv(x, w)
        if silu:
            ref = F.silu(ref[:, : N // 2]) * ref[:, N // 2:]
        for block in (64, 128, 256, 512, 640, 768):
            for rows in (1, 2, 4, 8):
                what = f"silu={silu} M={M} block={block} rows={rows}"
                # named before the call, so a crash inside it names the configuration (run with -s)
                print(f"config {what}", flush=True)
                y = poisoned(M, N // 2 if silu else N)
                fn = ext.forge_gemv_silu_mul if silu else ext.forge_gemv
                if not _built(M, block, rows, silu, torch.version.hip is not None):
                    refused += 1
                    if not ext.unsafe_refusals:
                        with pytest.raises(RuntimeError, match="is not built"):
                            fn(y, x, w, block, rows)
                        assert torch.isnan(y).all(), f"{what}: a refused call wrote its output"
                    continue
                fn(y, x, w, block, rows)
                torch.cuda.synchronize()
                built += 1
                check(y, ref, what, gen)
    return built, refused


@pytest.mark.parametrize("silu", [False, True])
def test_every_built_config(ext, gen, silu):
    built, refused = _sweep_built_configs(ext, gen, silu, (1, 2, 3, 4))
    assert built >= 40
    assert refused >= 4   # the rule leaves some out: the sweep covers both sides of it


def test_bad_inputs_are_refused(ext, gen):
    if ext.unsafe_refusals:
        pytest.skip(ext.unsafe_refusals)
    w = rand((64, 256), gen)
    x = rand((1, 256), gen)
    y = poisoned(1, 64)
    cases = [
        (lambda: ext.forge_gemv(poisoned(17, 64), rand((17, 256), gen), w), "handles 1..16"),
        (lambda: ext.forge_gemv(y.half(), x.half(), w.half()), "bfloat16"),
        (lambda: ext.forge_gemv(y, x, w.t().contiguous().t()), "contiguous"),
        (lambda: ext.forge_gemv(y, rand((1, 128), gen), w), "K ="),
        (lambda: ext.forge_gemv(poisoned(1, 63), x, w), "out must be"),
        (lambda: ext.forge_gemv_silu_mul(poisoned(1, 32), x, rand((63, 256), gen)), "2*I rows"),
        (lambda: ext.forge_gemv(y, x, w, 100, 4), "is not built"),
        # CPU tensors: torch's dispatcher refuses first (the op has only a CUDA kernel)
        (lambda: ext.forge_gemv(y.cpu(), x.cpu(), w.cpu()), "GPU|'CPU' backend"),
    ]
    for fn, msg in cases:
        with pytest.raises(RuntimeError, match=msg.replace("*", r"\*").replace("(", r"\(")):
            fn()


def test_graph_capture_replays(ext, gen):
    """The launch is capturable (no host sync, no allocation) and replays with new inputs."""
    N, K = 5120, 6144
    w = rand((N, K), gen, K ** -0.5)
    x = rand((2, K), gen)
    y = poisoned(2, N)
    ext.forge_gemv(y, x, w)   # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ext.forge_gemv(y, x, w)
    x.copy_(rand((2, K), gen))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    check(y, ref_gemv(x, w), "graph replay", gen)


# ---- 5-16 rows of x (the skinny GEMM: MT = 8 and 16, one weight read for all rows) ----------------------
SKINNY_SHAPES = [("o_proj", 5120, 6144), ("down", 5120, 17408), ("in_proj_ba", 96, 5120),
                 ("down_tp2", 5120, 8704), ("ragged", 1001, 5128)]


@pytest.mark.parametrize("name,N,K", SKINNY_SHAPES, ids=[s[0] for s in SKINNY_SHAPES])
def test_every_token_count_1_to_16(ext, gen, name, N, K):
    """The built-in launch at M = 1..16, fresh x per M (rows past M do not exist: x is its own tensor),
    ragged N (1001: partial row groups) and K (5128: not a multiple of any block's sweep), poisoned output.
    Mutations it catches (each tried on a GPU by building the source with it): M = 9..16 sent to the MT = 8
    kernel (rows 8..15 never written: NaN); the rows loop's `break` at m >= M turned into a skip of row 0
    (wrong sums); the pipelined loop leaving out its last chunk (wrong sums at every M >= 5)."""
    w = rand((N, K), gen, K ** -0.5)
    for M in range(1, 17):
        x = rand((M, K), gen)
        y = poisoned(M, N)
        ext.forge_gemv(y, x, w)
        torch.cuda.synchronize()
        check(y, ref_gemv(x, w), f"{name} {N}x{K} M={M}", gen)


@pytest.mark.parametrize("I,K", [(17408, 5120), (8704, 5120), (999, 4096)], ids=["tp1", "tp2", "ragged"])
def test_fused_gate_up_silu_1_to_16(ext, gen, I, K):
    """The fused gate_up + SiLU-and-mul at M = 1..16 (built-in launch; on AMD the fused kernel stops at 8
    rows: M = 9..16 must be refused there) against float64 silu(g) * u. Catches the gate/up row offset at
    MT = 8/16 (an up row read from the gate half: wrong values) and unwritten rows (NaN)."""
    w = rand((2 * I, K), gen, K ** -0.5)
    on_amd = torch.version.hip is not None
    for M in range(1, 17):
        x = rand((M, K), gen, 2.0)
        y = poisoned(M, I)
        if on_amd and M > 8:
            if not ext.unsafe_refusals:
                with pytest.raises(RuntimeError, match="is not built"):
                    ext.forge_gemv_silu_mul(y, x, w)
            continue
        ext.forge_gemv_silu_mul(y, x, w)
        torch.cuda.synchronize()
        g_, u_ = ref_gemv(x, w[:I]), ref_gemv(x, w[I:])
        check(y, F.silu(g_) * u_, f"gate_up+silu I={I} M={M}", gen)


@pytest.mark.parametrize("silu", [False, True])
def test_every_built_config_5_to_16(ext, gen, silu):
    """M = 5, 8, 9, 16: both sides of the MT = 8 / 16 switch."""
    built, refused = _sweep_built_configs(ext, gen, silu, (5, 8, 9, 16))
    assert built >= 10 and refused >= 20   # AMD builds the fewest: 12 fused launches at these M


def test_skinny_strided_x_and_out(ext, gen):
    """M = 12 with a row stride != K for x and out (the rows loop indexes x by its stride), and the
    unaligned (scalar) path at M = 12."""
    N, K = 512, 5120
    w = rand((N, K), gen)
    big = rand((12, K + 64), gen)
    x = big[:, 8:K + 8]
    out_big = poisoned(12, N + 10)
    ext.forge_gemv(out_big[:, :N], x, w)
    xu = big[:, 1:K + 1]
    yu = poisoned(12, N)
    ext.forge_gemv(yu, xu, w)
    torch.cuda.synchronize()
    check(out_big[:, :N], ref_gemv(x, w), "strided x/out M=12", gen)
    check(yu, ref_gemv(xu, w), "unaligned x M=12", gen)
    assert torch.isnan(out_big[:, N:]).all(), "wrote past the output view"
