# SPDX-License-Identifier: Apache-2.0
"""Skinny GEMM on the matrix units for 1-32 token rows: ``y = x @ w.T`` (bf16/fp16/fp32 in, fp32
accumulation), and the fused gate_up + SiLU-and-mul ``y = silu(x @ gate.T) * (x @ up.T)`` with
``w = [gate; up]``.

Self-contained: imports only torch and triton (no inline assembly, no vendor intrinsics), so the same
file runs under CUDA, ROCm (MFMA through ``tl.dot``) and Triton's CPU interpreter.

Layout
    x   (M, K), 1 <= M <= 32, any strides        w   (N, K) row-major in K (stride(1) == 1 is fastest)
    y   (M, N), or (M, N // 2) fused; any strides; written once, only at rows < M and columns < N.

Tile
    One program owns BLOCK_N output columns (weight rows) and one K range. Per step it loads a
    ``[BLOCK_N, BLOCK_K]`` weight tile (contiguous along K) and the ``[BLOCK_K, BLOCK_M]`` transposed x
    tile (rows >= M masked to zero, never materialised) and accumulates ``W_tile @ x_tile.T`` into a
    ``[BLOCK_N, BLOCK_M]`` fp32 tile with ``tl.dot``: the weight is the MMA's wide operand (MFMA / wgmma
    want M >= 16 / 64), the padded token rows its narrow one ("swap AB"): BLOCK_M 16 for 1-16 rows, 32 for
    17-32 (the decode batches of a server run at a concurrency above 16, padded to the captured graphs'
    24 or 32). Every weight byte is read once; x (at most BLOCK_M * K * 2 bytes) is re-read per program
    from the cache. Weight rows past N are read
    modulo N (in bounds, discarded at the store), so only the K tail and the token rows are masked.
    The fused kernel loads the matching gate rows ``n`` and up rows ``I + n`` in the same step.

Split-K (SPLIT_K > 1)
    Program (n, s) covers ``K`` range ``[s * KS, min((s + 1) * KS, K))`` with ``KS`` a multiple of
    BLOCK_K and writes fp32 partials (an empty range writes zeros); a second small kernel sums the
    SPLIT_K partials in a fixed order (deterministic, no atomics) and, fused, applies SiLU-and-mul
    to the summed gate and up. Workspace: ``SPLIT_K * M * N`` fp32 (:func:`workspace_numel`).

Built-in launch (:func:`launch_config`): BLOCK_N 64 and the smallest power-of-two SPLIT_K that gives
at least ``WAVES * CUs`` programs (WAVES 1.5; at most 16 splits, and at least 2 K tiles per split).
BLOCK_K 128 (smaller K: the next power of two, >= 16); fused, 64, so that one step's gate and up tiles
hold as many weight bytes as a plain tile. Measured on an H200 (reports/kernels/skinny_mma, every
per-rank shape at TP1/TP2, M 1-16, the built-in launch against a sweep of 10 others): the fastest
launches are these; BLOCK_N 128 was slower by up to 16 % (gate_up at TP1), two programs per SM where
1.5 was reachable by up to 20 % (qkv+gate at TP1: split-K partials cost more than the fuller wave
saves), and the fused kernel at BLOCK_K 128 by up to 15 %. 4 warps, 3 stages on CUDA and 2 on HIP.
Every built-in launch thus reads 16 KiB of weight per K step (64 x 128 plain, 2 x 64 x 64 fused). LDS /
shared memory of the compiled kernel (kernels/aot.py; HIP's 2-stage pipeline keeps one LDS buffer and
prefetches the next tile into registers): weight tile plus the 16-row x tile (the 32-row tile above 16 rows: 4 KiB more, fused 2), 20 KiB at BLOCK_N 64 x
BLOCK_K 128 on gfx90a/gfx942, so three programs share a compute unit's 64 KiB of LDS; 36 KiB at
128 x 128 (a tuned launch); 108 KiB on sm_90 at 128 x 128 and 3 stages. Both targets use the matrix units (v_mfma_f32_16x16x16 bf16 on
gfx90a/gfx942, wgmma on sm_90) and 16-byte weight loads. gfx936 is reached only through its vendor's
Triton, which lowers ``tl.dot`` to the card's own matrix instructions (upstream Triton cannot target it;
gfx90a/gfx942 are the off-card stand-ins): the kernel tests on the card are the check there.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_M = 32
WAVES = 1.5
MAX_SPLIT_K = 16
MIN_TILES_PER_SPLIT = 2
REDUCE_BLOCK = 256


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE: fp32 operands with a full-precision product. Under the CPU interpreter 16-bit operands are
    # upcast too (its bf16 dot is unreliable); the products of bf16 values are exact in fp32 either way.
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# M (the token rows) only masks rows and sizes the partials: it is not specialised, so one compiled kernel
# serves every row count of a launch and tile height (1-16, 17-32). Triton otherwise compiles a variant for
# M == 1 and for M % 16 == 0 at its first call; a call outside the captured graphs (vLLM's LM head runs at
# the number of sampled requests) would then compile mid-tier the first time, say, 16 requests decode where
# the captured layers compiled that launch already.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, y_ptr, p_ptr,
    M, N_OUT, K, k_per_split,
    sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, FUSED: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N_OUT                       # in-bounds weight rows; columns >= N_OUT are never stored
    offs_kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    w_rows = w_ptr + rows.to(tl.int64)[:, None] * sw_n
    if FUSED:
        u_rows = w_ptr + (rows + N_OUT).to(tl.int64)[:, None] * sw_n
    x_cols = x_ptr + offs_m[None, :] * sx_m
    m_ok = offs_m[None, :] < M

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs_kk
        k_ok = offs_k < K
        xt = tl.load(x_cols + offs_k[:, None] * sx_k, mask=k_ok[:, None] & m_ok, other=0.0)    # [BK, BM]
        w = tl.load(w_rows + offs_k[None, :] * sw_k, mask=k_ok[None, :], other=0.0)              # [BN, BK]
        acc = acc + _dot(w, xt, IEEE)
        if FUSED:
            u = tl.load(u_rows + offs_k[None, :] * sw_k, mask=k_ok[None, :], other=0.0)
            acc_u = acc_u + _dot(u, xt, IEEE)

    n_ok = offs_n[:, None] < N_OUT
    if SPLIT_K == 1:
        if FUSED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        y_ptrs = y_ptr + offs_m[None, :] * sy_m + offs_n[:, None].to(tl.int64) * sy_n
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok & n_ok)
    else:
        # partials (SPLIT_K, [2,] M, N_OUT) fp32, contiguous; every program writes its whole tile
        base = pid_k.to(tl.int64) * (2 if FUSED else 1) * M * N_OUT
        p_ptrs = p_ptr + base + offs_m[None, :] * N_OUT + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=m_ok & n_ok)
        if FUSED:
            tl.store(p_ptrs + M * N_OUT, acc_u, mask=m_ok & n_ok)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    p_ptr, y_ptr, M, N_OUT, sy_m, sy_n,
    SPLIT_K: tl.constexpr, FUSED: tl.constexpr, BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N_OUT
    step = (2 if FUSED else 1) * M * N_OUT
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):                       # fixed order: the same sum on every run
        ptrs = p_ptr + s * step + m * N_OUT + offs
        acc += tl.load(ptrs, mask=ok, other=0.0)
        if FUSED:
            acc_u += tl.load(ptrs + M * N_OUT, mask=ok, other=0.0)
    if FUSED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    tl.store(y_ptr + m * sy_m + offs * sy_n, acc.to(y_ptr.dtype.element_ty), mask=ok)


class LaunchConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def num_compute_units(device=None) -> int:
    """SMs (CUDA) or CUs (ROCm) of the device; 8 under the CPU interpreter (few programs, fast)."""
    if _interpreting() or not torch.cuda.is_available():
        return 8
    return int(torch.cuda.get_device_properties(device or torch.cuda.current_device()).multi_processor_count)


def _block_k(K: int) -> int:
    return 128 if K >= 128 else max(16, triton.next_power_of_2(K))


def block_m(M: int) -> int:
    """The padded token rows of the tile: 16 up to 16 rows, 32 above (one compiled kernel each)."""
    return 16 if M <= 16 else 32


def launch_config(M: int, N: int, K: int, num_cus: int, *, fused: bool = False,
                  is_hip: bool | None = None) -> LaunchConfig:
    """The built-in launch for ``M`` rows of ``x (M, K)`` against ``w (N, K)`` (fused: ``w (N, K)`` holds
    gate and up, the output has ``N // 2`` columns) on a device of ``num_cus`` SMs/CUs: BLOCK_N 64 and
    enough splits for ``WAVES * num_cus`` programs where the shape allows it (module docstring). ``M``
    does not change the launch (the rows are padded to 16, or 32 above 16 rows: `block_m`); it is an
    argument so a tuned table can key on it. Examples at K 5120, 132 SMs: N 14336 -> SPLIT_K 1 (224 programs); N 7168 -> 2 (224);
    down 5120 x 17408 -> 4 (320); fused gate_up 34816 -> BLOCK_K 64, SPLIT_K 1 (272)."""
    if not 1 <= M <= MAX_M:
        raise ValueError(f"skinny_gemm: M={M} rows; the kernel takes 1-{MAX_M}")
    if is_hip is None:
        is_hip = getattr(torch.version, "hip", None) is not None
    n_out = N // 2 if fused else N
    want = math.ceil(WAVES * max(1, int(num_cus)))
    block_n = 64
    block_k = min(_block_k(K), 64) if fused else _block_k(K)
    blocks = triton.cdiv(n_out, block_n)
    split_k = 1
    max_split = max(1, min(MAX_SPLIT_K, triton.cdiv(K, block_k) // MIN_TILES_PER_SPLIT))
    while blocks * split_k < want and split_k * 2 <= max_split:
        split_k *= 2
    return LaunchConfig(block_n, block_k, split_k, 4, 2 if is_hip else 3)


def workspace_numel(M: int, N: int, split_k: int, fused: bool = False) -> int:
    """fp32 elements of the split-K partials (0 when ``split_k == 1``); N is the weight's rows."""
    return 0 if split_k <= 1 else split_k * M * N


def _launch(x, w, out, fused, block_n, block_k, split_k, num_warps, num_stages, workspace, num_cus):
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    M, K = x.shape
    N = w.shape[0]
    if fused:
        assert N % 2 == 0, f"fused gate_up weight has an odd row count {N}"
    n_out = N // 2 if fused else N
    if out is None:
        out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    assert out.shape == (M, n_out), (out.shape, M, n_out)
    if M == 0:
        return out
    cfg = launch_config(M, N, K, num_cus if num_cus is not None else num_compute_units(x.device), fused=fused)
    block_n = block_n or cfg.block_n
    block_k = block_k or cfg.block_k
    split_k = int(split_k or cfg.split_k)
    num_warps = num_warps or cfg.num_warps
    num_stages = num_stages or cfg.num_stages
    assert split_k >= 1 and block_n >= 16 and block_k >= 16
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    if split_k > 1:
        need = workspace_numel(M, N, split_k, fused)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=x.device)
        assert workspace.dtype == torch.float32 and workspace.is_contiguous() and workspace.numel() >= need
        part = workspace
    else:
        part = out                                   # unused pointer
    ieee = (x.dtype == torch.float32) or _interpreting()
    _skinny_gemm_kernel[(triton.cdiv(n_out, block_n), split_k)](
        x, w, out, part, M, n_out, K, k_per_split,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m(M), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, FUSED=fused, IEEE=ieee,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split_k > 1:
        _split_k_reduce_kernel[(M, triton.cdiv(n_out, REDUCE_BLOCK))](
            part, out, M, n_out, out.stride(0), out.stride(1),
            SPLIT_K=split_k, FUSED=fused, BLOCK=REDUCE_BLOCK, num_warps=4,
        )
    return out


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *, block_n=None,
                block_k=None, split_k=None, num_warps=None, num_stages=None, workspace=None,
                num_cus=None) -> torch.Tensor:
    """``x (M, K) @ w (N, K).T -> (M, N)`` in x's dtype, fp32 accumulation, 1 <= M <= 32. Launch
    parameters left None come from :func:`launch_config`; ``workspace`` (fp32, at least
    :func:`workspace_numel` elements) avoids an allocation when SPLIT_K > 1. No host sync."""
    return _launch(x, w, out, False, block_n, block_k, split_k, num_warps, num_stages, workspace, num_cus)


def skinny_gemm_silu_mul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *, block_n=None,
                         block_k=None, split_k=None, num_warps=None, num_stages=None, workspace=None,
                         num_cus=None) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T) -> (M, N // 2)`` with ``w = [gate; up]`` of ``(N, K)`` (vLLM's
    merged gate_up_proj weight): one pass over the weight, SiLU-and-mul on the fp32 sums."""
    return _launch(x, w, out, True, block_n, block_k, split_k, num_warps, num_stages, workspace, num_cus)

