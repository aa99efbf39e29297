# SPDX-License-Identifier: Apache-2.0
"""Split-KV paged decode attention for GQA (bf16/fp16/fp32 or int8 KV cache).

Self-contained: imports only torch and triton, so the same file runs standalone and when
copied into vLLM as ``vllm/v1/attention/ops/forge_split_kv_decode.py``.

Layout
    q            (num_seqs, Hq, D)                one query token per sequence
    key/value    (num_blocks, block_size, Hkv, D) paged cache (NHD), bf16/fp16/fp32 or int8;
                 block_size is any multiple of 16 (784 and 1552 included), strides are free.
    *_scale      (num_blocks, Hkv, block_size)    fp32, int8 only (e.g. the tail of each page,
                 see ``forge_int8_kv_write.int8_kv_views``); dequantized x = q * scale.
    block_table  (num_seqs, max_blocks) int32, seq_lens (num_seqs,) int32, out (num_seqs, Hq, D).

Grid and work split
    stage 1 ``(num_seqs, Hkv, S)``: one program per (sequence, KV head, segment). The
    G = Hq/Hkv query heads sharing a KV head are packed as rows of one ``[BLOCK_M, D]`` tile
    (BLOCK_M = max(16, next_pow2(G)), padded rows are zero), so every K/V tile is read once per
    KV head. Segment ``s`` covers tokens ``[s*L, min((s+1)*L, seq_len))`` with
    ``L = roundup(cdiv(seq_len, S), TILE_N)``, computed in-kernel from ``seq_lens`` (the grid never
    depends on lengths, so the launch is CUDA-graph safe). Online softmax (base 2) over
    ``TILE_N``-token tiles; a segment writes its normalised partial output and its
    log-sum-exp; an empty segment writes ``lse = -inf``.
    stage 2 ``(num_seqs, Hq, cdiv(D, BLOCK_D))`` (BLOCK_D = 64..16 so S*BLOCK_D <= 4096): log-sum-exp merge of the S partials (segments with
    ``lse = -inf`` get weight 0 and are never read). With S == 1 stage 1 writes ``out`` directly.
    int8: with 16-bit queries Q.K runs on the int8 matrix unit, q split per row into two int8 planes
    (``q = q_scale * (hi + lo / 254)``) against the cache's own int8 K (``QK_INT8_DOT``; fp32 queries,
    or ``qk_int8=False``: K tiles converted exactly to the query dtype); the K scale is folded into the
    scores (``s = (q . k_int) * k_scale[n] * sm_scale``) and the V scale into the probabilities
    (``acc += (p * v_scale[n]) . v_int``; the normaliser uses the unscaled ``p``). A Triton that
    cannot build the int8 dot (a target without an int8 matrix instruction it lowers to) falls back
    to the converted path once, with a warning, and keeps it for the process (``QK_INT8_FAILURE``).

Bytes moved (stage 1) per sequence: ``seq_len * Hkv * D * 2 * elt`` of K/V (+ ``seq_len * Hkv * 8``
scale bytes for int8) + Q; stage 1 writes and stage 2 reads ``Hq * S * (D + 1) * 4`` bytes.
Example: 32K context, Hkv=4, D=256: 128 MiB bf16, 64 MiB + 1 MiB int8.
"""

from __future__ import annotations

import logging
import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
REDUCE_BLOCK_D = 64
MIN_TOKENS_PER_SEGMENT = 16
MAX_SEGMENTS = 128
# the built-in segment count keeps segments of the longest context at least this long (32K: 64
# segments, the H200 sweep's best at batch 1 and 4 KV heads) ...
SEGMENT_TOKENS = 512
# ... unless that leaves fewer programs than compute units (one or two KV heads per rank, batch 1):
# then down to this many, so the card is filled
FILL_SEGMENT_TOKENS = 256


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE: fp32 operands with a full-precision product (no tf32). Under the CPU interpreter
    # 16-bit operands are also upcast here (its bf16 dot is unreliable); values are the same.
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _idot(a, b, IEEE: tl.constexpr):
    # int8 x int8 with int32 sums (exact); the interpreter sums in fp32, exact below 2^24 (D <= 1024)
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, out_dtype=tl.int32)


@triton.jit
def _tile_block_ids(bt_row, first, toks, end, sbt_b, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """The block ids of the tile of tokens `toks` (the first `first`): one where a tile never straddles a
    block, else one per token; masked by the segment's `end`, so a tile past it (an empty segment, a
    padding row, the tile after the last) reads no block-table entry."""
    if BLOCK_SIZE % TILE_N == 0:
        return tl.load(bt_row + (first // BLOCK_SIZE) * sbt_b, mask=first < end, other=0)
    else:
        return tl.load(bt_row + (toks // BLOCK_SIZE) * sbt_b, mask=toks < end, other=0)


@triton.jit
def _split_kv_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr,
    po_ptr, pl_ptr, cnt_ptr, out_ptr,
    scale_log2,
    num_segments,
    min_seg,
    sq_s, sq_h, sq_d,
    sk_b, sk_o, sk_h, sk_d,
    sv_b, sv_o, sv_h, sv_d,
    sks_b, sks_h, sks_o,
    svs_b, svs_h, svs_o,
    sbt_s, sbt_b,
    spo_s, spo_h, spo_g, spo_d,
    spl_s, spl_h, spl_g,
    scnt_s,
    so_s, so_h, so_d,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    KV_INT8: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    FUSED: tl.constexpr,
    S_PAD: tl.constexpr,
    MERGE_D: tl.constexpr,
    IEEE: tl.constexpr,
    QK_INT8: tl.constexpr,
    BT_AHEAD: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    per_seg = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_segments), TILE_N) * TILE_N, min_seg)
    start = seg * per_seg
    end = tl.minimum(start + per_seg, seq_len)

    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < QUERIES_PER_KV
    qh = kvh * QUERIES_PER_KV + rows
    d = tl.arange(0, D_PAD)
    dm = d < HEAD_SIZE
    seq64 = seq.to(tl.int64)

    q = tl.load(q_ptr + seq64 * sq_s + qh[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_mask[:, None] & dm[None, :], other=0.0)
    if IEEE:
        op_ty = tl.float32
    else:
        op_ty = q.dtype

    if QK_INT8:
        # q split into two int8 planes per row: q = q_scale * (hi + lo / 254), |hi|, |lo| <= 127,
        # within q_scale / 508 of q (1.6e-5 of the row's largest |q|): Q.K runs on the int8 matrix
        # unit against the cache's own int8 K, which is never converted
        qf = q.to(tl.float32)
        q_amax = tl.max(tl.abs(qf), 1)
        q_scale = tl.where(q_amax > 0.0, q_amax / 127.0, 1.0)
        qn = qf / q_scale[:, None]
        q_hi = tl.floor(qn + 0.5)
        q_lo = tl.floor((qn - q_hi) * 254.0 + 0.5)
        q_hi = q_hi.to(tl.int8)
        q_lo = q_lo.to(tl.int8)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    n_off = tl.arange(0, TILE_N)
    bt_row = bt_ptr + seq64 * sbt_s
    # int8 V is read as 32-bit words (4 channels each) and split into 4 byte planes: channel
    # d = 4*w + j sits in plane j, column w. Each plane is a K-major-free [TILE_N, D/4] operand,
    # so no byte-wise transposed shared-memory reads feed the P.V product.
    DW: tl.constexpr = D_PAD // 4
    w_off = tl.arange(0, DW)
    wm = w_off < HEAD_SIZE // 4
    if KV_INT8:
        acc0 = tl.zeros([BLOCK_M, DW], tl.float32)
        acc1 = tl.zeros([BLOCK_M, DW], tl.float32)
        acc2 = tl.zeros([BLOCK_M, DW], tl.float32)
        acc3 = tl.zeros([BLOCK_M, DW], tl.float32)
        v32_ptr = v_ptr.to(tl.pointer_type(tl.int32))
    else:
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # BT_AHEAD (the launcher sets it at num_stages >= 3): a tile's block ids are loaded one tile ahead,
    # so its K/V addresses depend on no load of the same iteration and the compiler can multi-buffer the
    # K/V copies; without it no launch was pipelined (kernels/NOTES.md, "Block ids one tile ahead").
    # At 1-2 stages the loop is the one-tile-in-flight loop as before (measured faster there).
    if BT_AHEAD:
        nblk = _tile_block_ids(bt_row, start, start + n_off, end, sbt_b, BLOCK_SIZE, TILE_N)
    for t in range(start, end, TILE_N):
        tok = t + n_off
        tmask = tok < end
        if BT_AHEAD:
            blk = nblk.to(tl.int64)
            nblk = _tile_block_ids(bt_row, t + TILE_N, tok + TILE_N, end, sbt_b, BLOCK_SIZE, TILE_N)
        elif BLOCK_SIZE % TILE_N == 0:
            # a tile never straddles a block: one block id per tile
            blk = tl.load(bt_row + (t // BLOCK_SIZE) * sbt_b).to(tl.int64)
        else:
            # larger tiles: gather the block id of every token
            blk = tl.load(bt_row + (tok // BLOCK_SIZE) * sbt_b, mask=tmask, other=0).to(tl.int64)
        if BLOCK_SIZE % TILE_N == 0:
            off = (t % BLOCK_SIZE) + n_off
        else:
            off = tok % BLOCK_SIZE

        kbase = blk * sk_b + off * sk_o + kvh * sk_h                      # [TILE_N] int64
        k = tl.load(k_ptr + kbase[None, :] + d[:, None] * sk_d,
                    mask=dm[:, None] & tmask[None, :], other=0)            # [D_PAD, TILE_N]
        vbase = blk * sv_b + off * sv_o + kvh * sv_h
        if KV_INT8:
            ksc = tl.load(ks_ptr + blk * sks_b + kvh * sks_h + off * sks_o, mask=tmask, other=0.0)
            vsc = tl.load(vs_ptr + blk * svs_b + kvh * svs_h + off * svs_o, mask=tmask, other=0.0)
            vw = tl.load(v32_ptr + (vbase // 4)[:, None] + w_off[None, :],
                         mask=tmask[:, None] & wm[None, :], other=0)      # [TILE_N, DW] int32
        else:
            v = tl.load(v_ptr + vbase[:, None] + d[None, :] * sv_d,
                        mask=tmask[:, None] & dm[None, :], other=0)        # [TILE_N, D_PAD]
        if QK_INT8:
            s_hi = _idot(q_hi, k, IEEE)
            s_lo = _idot(q_lo, k, IEEE)
            s = (s_hi.to(tl.float32) + s_lo.to(tl.float32) * (1.0 / 254.0)) * q_scale[:, None]
        else:
            # exact for int8 (|x| <= 127) and a no-op for a 16-bit cache
            s = _dot(q, k.to(op_ty), IEEE)                                 # [BLOCK_M, TILE_N]
        if KV_INT8:
            s = s * (ksc * scale_log2)[None, :]
        else:
            s = s * scale_log2
        s = tl.where(tmask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_INT8:
            pv = (p * vsc[None, :]).to(op_ty)
            acc0 = acc0 * alpha[:, None] + _dot(pv, ((vw << 24) >> 24).to(op_ty), IEEE)
            acc1 = acc1 * alpha[:, None] + _dot(pv, ((vw << 16) >> 24).to(op_ty), IEEE)
            acc2 = acc2 * alpha[:, None] + _dot(pv, ((vw << 8) >> 24).to(op_ty), IEEE)
            acc3 = acc3 * alpha[:, None] + _dot(pv, (vw >> 24).to(op_ty), IEEE)
        else:
            acc = acc * alpha[:, None] + _dot(p.to(op_ty), v.to(op_ty), IEEE)
        m_i = m_new

    has = l_i > 0.0
    inv_l = 1.0 / tl.where(has, l_i, 1.0)
    rm2 = row_mask[:, None] & dm[None, :]
    if DIRECT_OUT:
        obase = out_ptr + seq64 * so_s + qh[:, None] * so_h
        oty = out_ptr.dtype.element_ty
        if KV_INT8:
            wm2 = row_mask[:, None] & wm[None, :]
            tl.store(obase + (4 * w_off[None, :] + 0) * so_d, (acc0 * inv_l[:, None]).to(oty), mask=wm2)
            tl.store(obase + (4 * w_off[None, :] + 1) * so_d, (acc1 * inv_l[:, None]).to(oty), mask=wm2)
            tl.store(obase + (4 * w_off[None, :] + 2) * so_d, (acc2 * inv_l[:, None]).to(oty), mask=wm2)
            tl.store(obase + (4 * w_off[None, :] + 3) * so_d, (acc3 * inv_l[:, None]).to(oty), mask=wm2)
        else:
            tl.store(obase + d[None, :] * so_d, (acc * inv_l[:, None]).to(oty), mask=rm2)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        pbase = po_ptr + seq64 * spo_s + qh[:, None] * spo_h + seg * spo_g
        if KV_INT8:
            wm2 = row_mask[:, None] & wm[None, :]
            tl.store(pbase + (4 * w_off[None, :] + 0) * spo_d, acc0 * inv_l[:, None], mask=wm2)
            tl.store(pbase + (4 * w_off[None, :] + 1) * spo_d, acc1 * inv_l[:, None], mask=wm2)
            tl.store(pbase + (4 * w_off[None, :] + 2) * spo_d, acc2 * inv_l[:, None], mask=wm2)
            tl.store(pbase + (4 * w_off[None, :] + 3) * spo_d, acc3 * inv_l[:, None], mask=wm2)
        else:
            tl.store(pbase + d[None, :] * spo_d, acc * inv_l[:, None], mask=rm2)
        tl.store(pl_ptr + seq64 * spl_s + qh * spl_h + seg * spl_g, lse, mask=row_mask)
        if FUSED:
            # One launch: the last program of this (sequence, KV head) to finish merges the
            # partials. All of this program's stores are ordered before the ticket (CTA barrier,
            # then a gpu-scope acq_rel atomic); the winner reads the others' partials from L2.
            tl.debug_barrier()
            cnt = cnt_ptr + seq64 * scnt_s + kvh
            ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if ticket == num_segments - 1:
                tl.store(cnt, 0)  # ready for the next launch (kernel boundary orders it)
                g = tl.arange(0, S_PAD)
                gm = g < num_segments
                md = tl.arange(0, MERGE_D)
                for r in tl.static_range(QUERIES_PER_KV):
                    h = kvh * QUERIES_PER_KV + r
                    lrow = tl.load(pl_ptr + seq64 * spl_s + h * spl_h + g * spl_g, mask=gm,
                                   other=float("-inf"), cache_modifier=".cg")
                    mx = tl.max(lrow, 0)
                    mx = tl.where(mx > float("-inf"), mx, 0.0)
                    valid = lrow > float("-inf")
                    wgt = tl.where(valid, tl.exp2(lrow - mx), 0.0)
                    wsum = tl.sum(wgt, 0)
                    wgt = wgt / tl.where(wsum > 0.0, wsum, 1.0)
                    for dc in tl.static_range(D_PAD // MERGE_D):
                        dd = dc * MERGE_D + md
                        ddm = dd < HEAD_SIZE
                        po = tl.load(po_ptr + seq64 * spo_s + h * spo_h + g[:, None] * spo_g
                                     + dd[None, :] * spo_d, mask=valid[:, None] & ddm[None, :],
                                     other=0.0, cache_modifier=".cg")
                        res = tl.sum(wgt[:, None] * po, 0)
                        tl.store(out_ptr + seq64 * so_s + h * so_h + dd * so_d,
                                 res.to(out_ptr.dtype.element_ty), mask=ddm)


@triton.jit
def _split_kv_reduce_kernel(
    po_ptr, pl_ptr, out_ptr,
    num_segments,
    spo_s, spo_h, spo_g, spo_d,
    spl_s, spl_h, spl_g,
    so_s, so_h, so_d,
    HEAD_SIZE: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    db = tl.program_id(2)
    g = tl.arange(0, S_PAD)
    lse_row = pl_ptr + seq * spl_s + h * spl_h
    lse = tl.load(lse_row + g * spl_g, mask=g < num_segments, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx > float("-inf"), mx, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - mx), 0.0)
    wsum = tl.sum(w, 0)

    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < HEAD_SIZE
    # all segments in one [S_PAD, BLOCK_D] tile: no serial chain of dependent loads
    valid = lse > float("-inf")
    po = tl.load(po_ptr + seq * spo_s + h * spo_h + g[:, None] * spo_g + d[None, :] * spo_d,
                 mask=valid[:, None] & dm[None, :], other=0.0)
    acc = tl.sum(w[:, None] * po, 0)
    res = acc / tl.where(wsum > 0.0, wsum, 1.0)
    tl.store(out_ptr + seq * so_s + h * so_h + d * so_d, res.to(out_ptr.dtype.element_ty), mask=dm)


def reduce_tile(num_segments: int, head_size: int):
    """(S_PAD, BLOCK_D) of the merge kernel: S_PAD * BLOCK_D <= 4096 fp32 per program."""
    s_pad = triton.next_power_of_2(max(1, num_segments))
    block_d = max(16, min(REDUCE_BLOCK_D, 4096 // s_pad, triton.next_power_of_2(head_size)))
    return s_pad, block_d


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def segment_cap(num_compute_units: int, num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """The most segments :func:`choose_num_segments` gives a (batch, KV heads, context): segments of
    at least ``SEGMENT_TOKENS`` of ``max_context``, or ``FILL_SEGMENT_TOKENS`` where the longer ones
    would leave compute units without a program; never under ``MIN_TOKENS_PER_SEGMENT`` tokens, never
    over ``MAX_SEGMENTS``."""
    work = max(1, int(num_seqs) * int(num_kv_heads))
    cap = _pow2_floor(int(max_context) // SEGMENT_TOKENS)
    if work * cap < int(num_compute_units):
        cap = _pow2_floor(int(max_context) // FILL_SEGMENT_TOKENS)
    return min(cap, _pow2_floor(int(max_context) // MIN_TOKENS_PER_SEGMENT), MAX_SEGMENTS)


def choose_num_segments(num_compute_units: int, num_seqs: int, num_kv_heads: int,
                        max_context: int) -> int:
    """Segments per (sequence, KV head): a Python int, fixed per captured batch size, from the batch,
    the KV heads of this rank and the longest context served.

    ``S = next_pow2(2 * CUs / (num_seqs * num_kv_heads))`` (at least 2 stage-1 programs per
    compute unit), at most :func:`segment_cap`. E.g. 132 CUs, 32K context, 4 KV heads (TP1):
    batch 1 -> 64, 2 -> 64, 4 -> 32, 8 -> 16, 16 -> 8; 2 KV heads (TP2): batch 1 -> 128, 4 -> 64,
    10 -> 16, 16 -> 16; 1 KV head (TP4, TP8): batch 1 -> 128; a 60-CU DCU, 4 KV heads, batch 1 ->
    32. (H200 sweeps at 4 KV heads, 32K: batch 1 S=64 beat 128 and 256; batch 8 S=16 beat 8 and
    32. At 1-2 KV heads, batch 1, 64 segments would leave compute units idle: the 256-token floor
    is a choice to be checked by `forge calibrate` and kernels/bench/bench_decode_batched.py.)
    """
    ncu = max(1, int(num_compute_units))
    work = max(1, int(num_seqs) * int(num_kv_heads))
    want = max(1, math.ceil(2.0 * ncu / work))
    s = 1 << (want - 1).bit_length()
    return int(max(1, min(s, segment_cap(ncu, num_seqs, num_kv_heads, max_context))))


def decode_workspace(max_num_seqs: int, num_q_heads: int, head_dim: int, num_segments: int,
                     device) -> tuple:
    """Preallocated scratch ``(partial_out (N, Hq, S, D) fp32, partial_lse (N, Hq, S) fp32,
    tickets (N, Hq) int32)``.

    Allocate once (e.g. in the metadata builder) for the largest batch that uses this S. The
    kernels write every partial they later read, so those need no initialisation; ``tickets``
    (the fused merge's arrival counters, one per (sequence, KV head)) start at zero and every
    launch leaves them at zero again.
    """
    po = torch.empty((max_num_seqs, num_q_heads, num_segments, head_dim), dtype=torch.float32,
                     device=device)
    pl = torch.empty((max_num_seqs, num_q_heads, num_segments), dtype=torch.float32, device=device)
    cnt = torch.zeros((max_num_seqs, num_q_heads), dtype=torch.int32, device=device)
    return po, pl, cnt


def default_launch_config(kv_dtype: torch.dtype, head_dim: int, is_hip: bool | None = None,
                          num_seqs: int | None = None):
    """(TILE_N, num_warps, num_stages) used when the caller passes none."""
    if is_hip is None:
        is_hip = getattr(torch.version, "hip", None) is not None
    if is_hip:
        # keep LDS < 64 KiB on gfx9 (checked by kernels/aot.py)
        return (32, 4, 1) if kv_dtype == torch.int8 else (16, 4, 1)
    # bf16: H200 sweeps (reports/kernels/bench.json, sweep.json), 3 stages at batch 1, 2 at batch 8.
    # int8: 128-token tiles, 4 warps (77 KiB of shared memory): the fastest launch at every batch
    # (1-24) of two H100 decode calibrations and at batch 10 and 16 of the batched benchmark, with
    # either Q.K path (reports/calibration/2026-12-06-h100-tp1, 2026-12-06-h100-tp1-qk-int8); the
    # earlier (64, 8, 2) came from sweeps held under 64 KiB
    if kv_dtype == torch.int8:
        return (128, 4, 2)
    return (32, 4, 3) if (num_seqs is None or num_seqs < 4) else (32, 4, 2)


# Launches of at least this many stages load each tile's block ids one tile ahead (BT_AHEAD), so the
# K/V copies are multi-buffered; fewer stages keep the one-tile loop, which measured faster at 2 stages
# on the H200 (kernels/NOTES.md, "Block ids one tile ahead").
BT_AHEAD_STAGES = 3

# Fused (one-launch) merge up to this many segments. Off by default: on the H200 the last-arriving
# program's merge (one program reads S * G partial rows from L2, step by step) cost 3-11 us more
# than the separate merge kernel at every measured point (kernels/NOTES.md); opt in with fused=True.
FUSE_MAX_SEGMENTS = 0

# int8 cache, 16-bit queries: Q.K on the int8 matrix unit (q as two int8 planes, the K tile never
# converted); fp32 queries keep the exact converted path. kernels/NOTES.md has the compiled-code count.
QK_INT8_DOT = True
# Why this process's Triton could not build the int8 Q.K path (None: it could, or never tried); once
# set, the default path (qk_int8=None) runs the converted path. Only compile-time failures are caught:
# Triton raises CompilationError, or RuntimeError where a backend pass fails.
QK_INT8_FAILURE: str | None = None
_BUILD_ERRORS = (getattr(triton, "CompilationError", RuntimeError), RuntimeError)


def merge_tile(num_segments: int, head_size: int):
    """(S_PAD, MERGE_D) of the fused merge: S_PAD * MERGE_D <= 4096 fp32 per step."""
    s_pad = triton.next_power_of_2(max(1, num_segments))
    d_pad = triton.next_power_of_2(head_size)
    return s_pad, max(16, min(d_pad, 4096 // s_pad))


def split_kv_decode(q, key_cache, value_cache, block_table, seq_lens, scale, out, *,
                    k_scale_cache=None, v_scale_cache=None, num_segments, workspace,
                    tile_n=None, num_warps=None, num_stages=None, fused=None,
                    min_segment_tokens=None, qk_int8=None) -> None:
    """Decode attention of one query token per sequence over a paged KV cache.

    See the module docstring for layout, grid and bytes. ``scale`` is the softmax scale (a
    Python float); ``workspace`` comes from :func:`decode_workspace` with the same
    ``num_segments``; ``out`` may be any dtype/strides. No allocation, no host sync.
    ``fused`` (default: ``num_segments <= FUSE_MAX_SEGMENTS``) merges the segments inside the
    one launch; ``min_segment_tokens`` (default ``MIN_TOKENS_PER_SEGMENT``) is the shortest
    segment, so short sequences use fewer segments. ``qk_int8`` (default ``QK_INT8_DOT``; int8 cache
    and 16-bit queries only) runs Q.K on the int8 matrix unit with q split into two int8 planes.
    """
    num_seqs, num_q_heads, head_size = q.shape
    if num_seqs == 0:
        return
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    assert num_q_heads % num_kv_heads == 0
    assert key_cache.shape[3] == head_size and value_cache.shape == key_cache.shape
    kv_int8 = key_cache.dtype == torch.int8
    if kv_int8:
        assert value_cache.dtype == torch.int8
        assert k_scale_cache is not None and v_scale_cache is not None
        assert k_scale_cache.dtype == torch.float32 and v_scale_cache.dtype == torch.float32
        # V is read as 32-bit words
        assert head_size % 4 == 0 and value_cache.stride(3) == 1 \
            and all(x % 4 == 0 for x in value_cache.stride()[:3]) \
            and value_cache.data_ptr() % 4 == 0, "int8 V rows must be 4-byte aligned"
        ks, vs = k_scale_cache, v_scale_cache
        ks_strides, vs_strides = k_scale_cache.stride(), v_scale_cache.stride()
    else:
        ks, vs = key_cache, value_cache  # unused pointers
        ks_strides = vs_strides = (0, 0, 0)
    S = int(num_segments)
    assert S >= 1
    po, pl = workspace[0], workspace[1]
    assert po.shape[0] >= num_seqs and po.shape[1] == num_q_heads and po.shape[2] == S \
        and po.shape[3] == head_size, (po.shape, num_seqs, num_q_heads, S, head_size)
    assert pl.shape[0] >= num_seqs and pl.shape[2] == S

    g = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(g))
    d_pad = triton.next_power_of_2(head_size)
    dt, dw, ds = default_launch_config(key_cache.dtype, head_size, num_seqs=num_seqs)
    tile_n = tile_n or dt
    num_warps = num_warps or dw
    num_stages = num_stages or ds
    direct = S == 1
    if fused is None:
        fused = S <= FUSE_MAX_SEGMENTS
    fused = bool(fused) and not direct
    if fused:
        assert len(workspace) >= 3, "the fused merge needs the tickets of decode_workspace()"
        cnt = workspace[2]
        assert cnt.dtype == torch.int32 and cnt.shape[0] >= num_seqs and cnt.shape[1] >= num_kv_heads
        scnt = cnt.stride(0)
    else:
        cnt, scnt = pl, 0  # unused pointer
    min_seg = MIN_TOKENS_PER_SEGMENT if min_segment_tokens is None else int(min_segment_tokens)
    min_seg = max(tile_n, triton.cdiv(min_seg, tile_n) * tile_n)
    s_pad, merge_d = merge_tile(S, head_size) if fused else (1, 16)  # no recompiles per S

    global QK_INT8_FAILURE
    auto = qk_int8 is None
    qk = kv_int8 and q.dtype != torch.float32 and (QK_INT8_DOT and QK_INT8_FAILURE is None if auto else bool(qk_int8))
    args = (q, key_cache, value_cache, ks, vs, block_table, seq_lens, po, pl, cnt, out,
            float(scale) * LOG2E, S, min_seg, *q.stride(), *key_cache.stride(), *value_cache.stride(),
            *ks_strides, *vs_strides, *block_table.stride(), *po.stride(), *pl.stride(), scnt, *out.stride())
    consts = dict(QUERIES_PER_KV=g, BLOCK_M=block_m, HEAD_SIZE=head_size, D_PAD=d_pad,
                  BLOCK_SIZE=block_size, TILE_N=tile_n, KV_INT8=kv_int8, DIRECT_OUT=direct,
                  FUSED=fused, S_PAD=s_pad, MERGE_D=merge_d,
                  IEEE=(q.dtype == torch.float32) or _interpreting(), BT_AHEAD=num_stages >= BT_AHEAD_STAGES,
                  num_warps=num_warps, num_stages=num_stages)
    grid = (num_seqs, num_kv_heads, S)
    try:
        _split_kv_decode_kernel[grid](*args, QK_INT8=qk, **consts)
    except _BUILD_ERRORS as e:
        if not (qk and auto):          # asked for by name (a test, a benchmark): its error is the answer
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        QK_INT8_FAILURE = f"{type(e).__name__}: {first}"
        logging.getLogger(__name__).warning(
            "dcu-forge split-KV decode: the int8 Q.K path did not build here (%s); the int8 cache's decode "
            "runs the converted path (K tiles converted to the query dtype) from now on", QK_INT8_FAILURE)
        _split_kv_decode_kernel[grid](*args, QK_INT8=False, **consts)
    if not direct and not fused:
        s_pad, block_d = reduce_tile(S, head_size)
        _split_kv_reduce_kernel[(num_seqs, num_q_heads, triton.cdiv(head_size, block_d))](
            po, pl, out, S,
            *po.stride(), *pl.stride(), *out.stride(),
            HEAD_SIZE=head_size, S_PAD=s_pad, BLOCK_D=block_d,
            num_warps=2,
        )
