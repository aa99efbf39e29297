# SPDX-License-Identifier: Apache-2.0
"""Chunked-prefill attention for GQA: a chunk's queries over the paged prefix and its own K/V.

Self-contained: imports only torch and triton, so the same file runs standalone and when copied
into vLLM as ``vllm/v1/attention/ops/forge_prefill_attention.py``.

Work (one or more sequences, varlen)
    Sequence ``s`` has ``seq_len`` tokens, of which its last ``q_len`` are this chunk's queries and
    the first ``P = seq_len - q_len`` are its cached prefix. Query ``i`` (position ``P + i``)
    attends to (a) every prefix token ``0 .. P-1``, read from the paged cache (bf16/fp16, or int8
    with per-(token, head) fp32 scales), and (b) chunk tokens ``0 .. i`` (causal), read
    contiguously from the projection output ``k_new``/``v_new``, so an int8 cache never costs the
    chunk's own keys precision. (a) and (b) are one online softmax (base 2) in one program: the
    exact log-sum-exp merge of the two parts, with no partials written to memory.

Layout
    q            (T, Hq, D)   all chunks' queries, packed; ``cu_seqlens_q`` (num_seqs+1,) int32
    k_new/v_new  (T, Hkv, D)  the same tokens' keys/values (strides free)
    key/value    (num_blocks, block_size, Hkv, D) paged cache (NHD), block_size any multiple of 16
                 (784 and 1552 included); int8 with ``*_scale`` (num_blocks, Hkv, block_size) fp32
    block_table  (num_seqs, max_blocks) int32; seq_lens (num_seqs,) int32 (prefix + chunk)
    out          (T, Hq, D)

Grid and tiles
    ``(Hkv, cdiv(T, BLOCK_Q) + num_seqs)``: one program per (KV head, query tile). A program packs
    the ``G = Hq / Hkv`` query heads of its KV head with ``BLOCK_Q = BLOCK_M // G`` consecutive
    query tokens into the rows of one ``[BLOCK_M, D]`` tile (row ``r``: token ``r // G``, head
    ``r % G``; GQA 24/4 with BLOCK_M 128 uses 126 of 128 rows), so each K/V tile is read once for
    all G heads. Query tiles run in reverse order within a sequence (the last tile, which sees the
    most keys, starts first) and the KV head varies fastest, which balances the tail. Full K/V
    tiles take no masks; only the prefix's last tile and the tiles that cross the causal diagonal
    are masked; tiles past the diagonal are never visited. A K/V tile covers ``TILE_N`` tokens;
    when ``block_size % TILE_N == 0`` one block-table entry serves the whole tile, otherwise each
    token's block is gathered.

Bytes and FLOPs (one sequence, one layer)
    Reads: prefix K/V ``ceil(q_len / BLOCK_Q) * P * Hkv * D * 2 * elt`` (each query tile streams
    the prefix once; it is L2-resident across the Hkv * tiles programs in flight), chunk K/V about
    half that for the chunk, Q and out once. FLOPs: ``4 * Hq * D * q_len * (P + (q_len + 1) / 2)``.
    At 22K tokens this is compute-bound on any GPU: the roofline is the card's bf16 matrix rate.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE: fp32 operands, full-precision products (the CPU interpreter's bf16 dot is unreliable)
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _find_seq(cu_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # largest s with cu_q[s] // BLOCK_Q + s <= tile (sequence s's tiles start there)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _softmax_step(s, m_i, l_i, acc, v, vsc, KV_INT8: tl.constexpr, op_ty: tl.constexpr,
                  IEEE: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_INT8:
        p = p * vsc[None, :]
    acc = acc * alpha[:, None] + _dot(p.to(op_ty), v.to(op_ty), IEEE)
    return m_new, l_i, acc


@triton.jit
def _prefix_tile(q, m_i, l_i, acc, t, prefix, n_off, d, dm, bt_row, sbt_b,
                 kc_ptr, vc_ptr, ks_ptr, vs_ptr, skc_b, skc_o, skc_d, svc_b, svc_o, svc_d,
                 sks_b, sks_o, svs_b, svs_o, scale_log2, MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 TILE_N: tl.constexpr, KV_INT8: tl.constexpr, op_ty: tl.constexpr,
                 IEEE: tl.constexpr):
    tok = t + n_off
    tmask = tok < prefix
    if BLOCK_SIZE % TILE_N == 0:
        # a tile never straddles a block: one block-table entry for the tile
        blk = tl.load(bt_row + (t // BLOCK_SIZE) * sbt_b).to(tl.int64)
        off = (t % BLOCK_SIZE) + n_off
    else:
        blk = tl.load(bt_row + (tok // BLOCK_SIZE) * sbt_b, mask=tmask, other=0).to(tl.int64)
        off = tok % BLOCK_SIZE
    kbase = blk * skc_b + off * skc_o            # kc_ptr/vc_ptr/ks_ptr/vs_ptr start at the KV head
    vbase = blk * svc_b + off * svc_o
    if MASKED:
        k = tl.load(kc_ptr + kbase[None, :] + d[:, None] * skc_d,
                    mask=dm[:, None] & tmask[None, :], other=0)
        v = tl.load(vc_ptr + vbase[:, None] + d[None, :] * svc_d,
                    mask=tmask[:, None] & dm[None, :], other=0)
    else:
        k = tl.load(kc_ptr + kbase[None, :] + d[:, None] * skc_d, mask=dm[:, None], other=0)
        v = tl.load(vc_ptr + vbase[:, None] + d[None, :] * svc_d, mask=dm[None, :], other=0)
    s = _dot(q, k.to(op_ty), IEEE)               # int8 -> 16-bit is exact (|x| <= 127)
    if KV_INT8:
        ksc = tl.load(ks_ptr + blk * sks_b + off * sks_o, mask=tmask, other=0.0)
        vsc = tl.load(vs_ptr + blk * svs_b + off * svs_o, mask=tmask, other=0.0)
        s = s * (ksc * scale_log2)[None, :]
    else:
        vsc = tl.zeros([TILE_N], tl.float32)
        s = s * scale_log2
    if MASKED:
        s = tl.where(tmask[None, :], s, float("-inf"))
    return _softmax_step(s, m_i, l_i, acc, v, vsc, KV_INT8, op_ty, IEEE)


@triton.jit
def _prefill_attention_kernel(
    q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
    scale_log2, num_seqs,
    sq_t, sq_h, sq_d,
    skn_t, skn_h, skn_d,
    svn_t, svn_h, svn_d,
    skc_b, skc_o, skc_h, skc_d,
    svc_b, svc_o, svc_h, svc_d,
    sks_b, sks_h, sks_o,
    svs_b, svs_h, svs_o,
    sbt_s, sbt_b,
    so_t, so_h, so_d,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    KV_INT8: tl.constexpr,
    IEEE: tl.constexpr,
):
    kvh = tl.program_id(0)
    tile = tl.program_id(1)
    seq = _find_seq(cu_q_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    n_tiles = tl.cdiv(q_len, BLOCK_Q)
    local = tile - (q_begin // BLOCK_Q + seq)
    if local >= n_tiles:
        return
    qt = n_tiles - 1 - local                     # longest tiles first
    q0 = qt * BLOCK_Q                            # first query of the tile, chunk-relative
    prefix = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    qi = rows // G
    qh = kvh * G + rows % G
    row_ok = (qi < BLOCK_Q) & (q0 + qi < q_len)
    d = tl.arange(0, D_PAD)
    dm = d < HEAD_SIZE
    tok64 = (q_begin + q0 + qi).to(tl.int64)     # packed token index of each row
    q = tl.load(q_ptr + tok64[:, None] * sq_t + qh[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & dm[None, :], other=0.0)
    if IEEE:
        op_ty = tl.float32
    else:
        op_ty = q.dtype

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    n_off = tl.arange(0, TILE_N)
    bt_row = bt_ptr + seq.to(tl.int64) * sbt_s

    # (a) the cached prefix, paged: full tiles unmasked (a loop the compiler can pipeline), then
    # the last partial tile
    prefix_full = (prefix // TILE_N) * TILE_N
    # the KV head's offset added to the cache pointers once, not in every tile: the same addresses
    # with fewer live scalars (Triton 3.4 spilled two SGPRs on gfx942 in the widened int8 variant)
    kc_ptr += kvh * skc_h
    vc_ptr += kvh * svc_h
    ks_ptr += kvh * sks_h
    vs_ptr += kvh * svs_h
    for t in range(0, prefix_full, TILE_N):
        m_i, l_i, acc = _prefix_tile(q, m_i, l_i, acc, t, prefix, n_off, d, dm, bt_row, sbt_b,
                                     kc_ptr, vc_ptr, ks_ptr, vs_ptr, skc_b, skc_o, skc_d, svc_b,
                                     svc_o, svc_d, sks_b, sks_o, svs_b, svs_o, scale_log2, False,
                                     BLOCK_SIZE, TILE_N, KV_INT8, op_ty, IEEE)
    if prefix_full < prefix:
        m_i, l_i, acc = _prefix_tile(q, m_i, l_i, acc, prefix_full, prefix, n_off, d, dm, bt_row,
                                     sbt_b, kc_ptr, vc_ptr, ks_ptr, vs_ptr, skc_b, skc_o, skc_d,
                                     svc_b, svc_o, svc_d, sks_b, sks_o, svs_b, svs_o, scale_log2,
                                     True, BLOCK_SIZE, TILE_N, KV_INT8, op_ty, IEEE)

    # (b) the chunk's own keys, contiguous and causal: tiles wholly below the diagonal unmasked,
    # the one or two that cross it masked, none past it
    q_last = tl.minimum(q0 + BLOCK_Q, q_len)     # keys 0 .. q_last-1 are seen by some row
    free_end = (q0 // TILE_N) * TILE_N           # keys < q0 are seen by every row
    kn_base = kn_ptr + q_begin.to(tl.int64) * skn_t + kvh * skn_h
    vn_base = vn_ptr + q_begin.to(tl.int64) * svn_t + kvh * svn_h
    zero_sc = tl.zeros([TILE_N], tl.float32)
    for t in range(0, free_end, TILE_N):
        j64 = (t + n_off).to(tl.int64)
        k = tl.load(kn_base + j64[None, :] * skn_t + d[:, None] * skn_d, mask=dm[:, None], other=0)
        v = tl.load(vn_base + j64[:, None] * svn_t + d[None, :] * svn_d, mask=dm[None, :], other=0)
        s = _dot(q, k.to(op_ty), IEEE) * scale_log2
        m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc, v, zero_sc, False, op_ty, IEEE)
    for t in range(free_end, q_last, TILE_N):
        j = t + n_off
        j64 = j.to(tl.int64)
        jm = j < q_last
        k = tl.load(kn_base + j64[None, :] * skn_t + d[:, None] * skn_d,
                    mask=dm[:, None] & jm[None, :], other=0)
        v = tl.load(vn_base + j64[:, None] * svn_t + d[None, :] * svn_d,
                    mask=jm[:, None] & dm[None, :], other=0)
        s = _dot(q, k.to(op_ty), IEEE) * scale_log2
        s = tl.where(j[None, :] <= (q0 + qi)[:, None], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc, v, zero_sc, False, op_ty, IEEE)

    out = acc / l_i[:, None]
    tl.store(out_ptr + tok64[:, None] * so_t + qh[:, None] * so_h + d[None, :] * so_d,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])


@triton.jit
def _widen_prefix_kernel(
    kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr,
    ko_ptr, vo_ptr, kso_ptr, vso_ptr,
    skc_b, skc_o, skc_h, skc_d,
    svc_b, svc_o, svc_h, svc_d,
    sks_b, sks_h, sks_o,
    svs_b, svs_h, svs_o,
    sbt_s, sbt_b,
    sko_s, sko_t, sko_h,
    sso_s, sso_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # grid (num_seqs, cdiv(max_seqlen_k, BLOCK_T), Hkv): BLOCK_T prefix tokens of one KV head.
    # The int8 codes are written as 16-bit integers (exact) and the scales beside them, so the
    # attention reads 16-bit operands with the same numerics as the int8 path.
    seq = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    h = tl.program_id(2)
    prefix = tl.load(seq_lens_ptr + seq) - (tl.load(cu_q_ptr + seq + 1) - tl.load(cu_q_ptr + seq))
    if t0 >= prefix:
        return
    t = t0 + tl.arange(0, BLOCK_T)
    tm = t < prefix
    d = tl.arange(0, D_PAD)
    m2 = tm[:, None] & (d < HEAD_SIZE)[None, :]
    seq64 = seq.to(tl.int64)
    blk = tl.load(bt_ptr + seq64 * sbt_s + (t // BLOCK_SIZE) * sbt_b, mask=tm, other=0).to(tl.int64)
    off = t % BLOCK_SIZE
    oty = ko_ptr.dtype.element_ty
    k = tl.load(kc_ptr + (blk * skc_b + off * skc_o + h * skc_h)[:, None] + d[None, :] * skc_d,
                mask=m2, other=0)
    v = tl.load(vc_ptr + (blk * svc_b + off * svc_o + h * svc_h)[:, None] + d[None, :] * svc_d,
                mask=m2, other=0)
    row = seq64 * sko_s + t.to(tl.int64) * sko_t + h * sko_h
    tl.store(ko_ptr + row[:, None] + d[None, :], k.to(oty), mask=m2)
    tl.store(vo_ptr + row[:, None] + d[None, :], v.to(oty), mask=m2)
    srow = seq64 * sso_s + h * sso_h + t
    tl.store(kso_ptr + srow, tl.load(ks_ptr + blk * sks_b + h * sks_h + off * sks_o, mask=tm), mask=tm)
    tl.store(vso_ptr + srow, tl.load(vs_ptr + blk * svs_b + h * svs_h + off * svs_o, mask=tm), mask=tm)


# An int8 prefix is first widened into a contiguous 16-bit copy of its codes (one pass, ~40 us for
# 24K tokens on the H200) when that copy stays under this size: the attention then feeds 16-bit
# tiles straight to the matrix units instead of converting int8 tiles inside its loop (1.7-2.1x
# slower on the H200 at 8-24K of prefix), with the same numerics (codes exact, scales applied to
# the scores and probabilities as before). The copy holds each sequence's prefix at a fixed stride
# of max_seqlen_k tokens, read as a cache of one CONTIG_BLOCK-token block per sequence.
WIDEN_MAX_BYTES = 512 << 20
CONTIG_BLOCK = 1 << 24
WIDEN_BLOCK_T = 32


# Launch table: (BLOCK_M, TILE_N, num_warps, num_stages) by target and KV-cache dtype.
# CUDA, from the H200 sweep (reports/kernels/prefill/prefill.md): 128 rows (21 query tokens x 6
# heads, 126 used) x 64-token K/V tiles, 8 warps, 2 stages ran at 330-450 TFLOP/s in bf16; 3 stages
# or 128-token tiles exceed the 227 KiB of shared memory; 256 rows or 4 warps were 2-4x slower.
# int8 runs best at (128, 32, 8, 3) (4.39 ms vs 5.48 at 2K over a 16K prefix).
# HIP (wave64, gfx9; chosen by kernels/aot.py on gfx90a/gfx942, 64 KiB LDS, no spills):
# 64 rows (10 query tokens x 6 heads) x 32-token tiles, 4 waves, 1 stage: 48 KiB LDS, 280-330
# VGPRs+AGPRs (bf16). int8 needs 16-token tiles (32 spill SGPRs; 16 fit at 36 KiB LDS, 228-242
# VGPRs). 128 rows exceed 64 KiB LDS or spill at any tile width.
LAUNCH = {
    ("cuda", "16bit"): (128, 64, 8, 2),
    ("cuda", "int8"): (128, 32, 8, 3),
    ("hip", "16bit"): (64, 32, 4, 1),
    ("hip", "int8"): (64, 16, 4, 1),
}


def launch_config(kv_dtype: torch.dtype, is_hip: bool | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for this target and cache dtype."""
    if is_hip is None:
        is_hip = getattr(torch.version, "hip", None) is not None
    return LAUNCH[("hip" if is_hip else "cuda", "int8" if kv_dtype == torch.int8 else "16bit")]


def prefill_attention(q, k_new, v_new, key_cache, value_cache, block_table, cu_seqlens_q,
                      seq_lens, scale, out, *, k_scale_cache=None, v_scale_cache=None,
                      max_seqlen_q=None, max_seqlen_k=None, int8_prefix=None, block_m=None,
                      tile_n=None, num_warps=None, num_stages=None) -> None:
    """Causal attention of each sequence's chunk (its last ``q_len`` tokens) over its cached
    prefix and the chunk itself. See the module docstring for layout, grid and bytes.

    ``scale`` is the softmax scale (a Python float); ``out`` may be any dtype/strides. The grid
    depends on ``q.shape[0]`` and ``num_seqs`` only (no host sync). ``max_seqlen_q`` is accepted
    for symmetry with vLLM's kernels and not needed.

    int8 caches: ``int8_prefix="widen"`` (the default when ``max_seqlen_k``, a host-side bound on
    every ``seq_lens`` entry, is given, the copy fits ``WIDEN_MAX_BYTES`` and no graph is being
    captured) first copies each
    prefix's int8 codes into a contiguous 16-bit tensor of the query dtype (exact) with its scales
    (the only allocations), then attends over that copy; ``"inline"`` converts int8 tiles inside the
    attention loop (no allocation). Both compute the same function to rounding.
    """
    del max_seqlen_q
    num_tokens, num_q_heads, head_size = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_new.shape != (num_tokens, num_kv_heads, head_size) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new/v_new must be {(num_tokens, num_kv_heads, head_size)}, "
                         f"got {tuple(k_new.shape)} / {tuple(v_new.shape)}")
    if key_cache.shape[3] != head_size or value_cache.shape != key_cache.shape:
        raise ValueError(f"cache shapes {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do "
                         f"not match head size {head_size}")
    if block_size % 16:
        raise ValueError(f"block size {block_size} is not a multiple of 16")
    kv_int8 = key_cache.dtype == torch.int8
    if kv_int8:
        if k_scale_cache is None or v_scale_cache is None or value_cache.dtype != torch.int8:
            raise ValueError("an int8 cache needs int8 K and V and both fp32 scale views")
        if int8_prefix is None:
            fits = (max_seqlen_k is not None and num_seqs * int(max_seqlen_k) * num_kv_heads
                    * (head_size * q.element_size() + 4) * 2 <= WIDEN_MAX_BYTES)
            # under CUDA/HIP graph capture the copy's size (a host int) would be frozen into the
            # graph: the inline path needs no allocation and no host-side bound
            int8_prefix = "widen" if fits and not _capturing() else "inline"
        if int8_prefix == "widen":
            if max_seqlen_k is None:
                raise ValueError("int8_prefix='widen' needs max_seqlen_k")
            key_cache, value_cache, k_scale_cache, v_scale_cache, block_table = _widen_prefix(
                key_cache, value_cache, k_scale_cache, v_scale_cache, block_table, cu_seqlens_q,
                seq_lens, int(max_seqlen_k),
                # the CPU interpreter's int8 -> bf16 cast is unreliable; it computes in fp32 anyway
                torch.float32 if _interpreting() else q.dtype)
            block_size = CONTIG_BLOCK
        elif int8_prefix != "inline":
            raise ValueError(f"int8_prefix must be 'widen' or 'inline', not {int8_prefix!r}")
        ks, vs = k_scale_cache, v_scale_cache
        ks_strides, vs_strides = ks.stride(), vs.stride()
    else:
        ks, vs = key_cache, value_cache          # unused pointers
        ks_strides = vs_strides = (0, 0, 0)
    g = num_q_heads // num_kv_heads
    dbm, dtn, dw, ds = launch_config(key_cache.dtype)
    block_m = block_m or dbm
    tile_n = tile_n or dtn
    if block_m < g:
        raise ValueError(f"BLOCK_M {block_m} holds fewer rows than the {g} heads of a KV head")
    block_q = block_m // g
    grid = (num_kv_heads, triton.cdiv(num_tokens, block_q) + num_seqs)
    _prefill_attention_kernel[grid](
        q, k_new, v_new, key_cache, value_cache, ks, vs,
        block_table, cu_seqlens_q, seq_lens, out,
        float(scale) * LOG2E, num_seqs,
        *q.stride(), *k_new.stride(), *v_new.stride(),
        *key_cache.stride(), *value_cache.stride(),
        *ks_strides, *vs_strides,
        *block_table.stride(),
        *out.stride(),
        G=g, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_SIZE=head_size,
        D_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size, TILE_N=tile_n,
        KV_INT8=kv_int8, IEEE=(q.dtype == torch.float32) or _interpreting(),
        num_warps=num_warps or dw, num_stages=num_stages or ds,
    )


def _widen_prefix(key_cache, value_cache, k_scale, v_scale, block_table, cu_seqlens_q, seq_lens,
                  max_seqlen_k: int, dtype):
    """Contiguous copies of every sequence's int8 prefix: codes as ``dtype`` (num_seqs, L, Hkv, D),
    scales fp32 (num_seqs, Hkv, L), L = max_seqlen_k rounded up to 16, and the one-entry block
    table that reads them as a cache of CONTIG_BLOCK-token blocks."""
    num_seqs = seq_lens.shape[0]
    _, block_size, hkv, d = key_cache.shape
    if max_seqlen_k >= CONTIG_BLOCK:
        raise ValueError(f"max_seqlen_k {max_seqlen_k} >= {CONTIG_BLOCK}")
    length = max(16, triton.cdiv(max_seqlen_k, 16) * 16)
    ko = torch.empty((num_seqs, length, hkv, d), dtype=dtype, device=key_cache.device)
    vo = torch.empty_like(ko)
    kso = torch.empty((num_seqs, hkv, length), dtype=torch.float32, device=key_cache.device)
    vso = torch.empty_like(kso)
    grid = (num_seqs, triton.cdiv(length, WIDEN_BLOCK_T), hkv)
    _widen_prefix_kernel[grid](
        key_cache, value_cache, k_scale, v_scale, block_table, cu_seqlens_q, seq_lens,
        ko, vo, kso, vso,
        *key_cache.stride(), *value_cache.stride(), *k_scale.stride(), *v_scale.stride(),
        *block_table.stride(), *ko.stride()[:3], *kso.stride()[:2],
        BLOCK_SIZE=block_size, HEAD_SIZE=d, D_PAD=triton.next_power_of_2(d),
        BLOCK_T=WIDEN_BLOCK_T, num_warps=4,
    )
    bt = torch.arange(num_seqs, dtype=torch.int32, device=key_cache.device).view(num_seqs, 1)
    # (num_seqs, 1, Hkv, L) -> scale views (blocks, Hkv, block_size) with one block per sequence
    return ko, vo, kso, vso, bt
