"""float64 references and input builders for the kernel tests (and the benchmark)."""

from __future__ import annotations

import math

import torch


def quantize_ref(x: torch.Tensor, floor: float = 1.0e-10):
    """Reference per-row symmetric int8 quantization in float64 (round half away from zero).

    x: (..., D). Returns (q int8 (..., D), scale float64 (...)).
    """
    x64 = x.double()
    amax = x64.abs().amax(-1)
    scale = torch.clamp(amax / 127.0, min=floor)
    y = x64 / scale.unsqueeze(-1)
    q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return q.clamp(-127, 127).to(torch.int8), scale


def make_block_table(num_seqs: int, seq_lens, block_size: int, num_blocks: int,
                     generator=None, device="cpu"):
    """Random, non-overlapping block tables (int32) covering each sequence's length."""
    need = [max(1, math.ceil(int(l) / block_size)) for l in seq_lens]
    total = sum(need)
    assert total <= num_blocks, (total, num_blocks)
    perm = torch.randperm(num_blocks, generator=generator)
    max_blocks = max(need)
    bt = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[pos:pos + n].to(torch.int32)
        # padding entries point at a real block too (a kernel must never use them)
        bt[i, n:] = perm[(pos + n) % num_blocks].to(torch.int32)
        pos += n
    return bt.to(device)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(nb, bs, H, D) paged cache -> (seq_len, H, D) contiguous, for one sequence."""
    bs = cache.shape[1]
    nblk = math.ceil(seq_len / bs)
    blocks = block_table_row[:nblk].long().to(cache.device)
    kv = cache[blocks].reshape(nblk * bs, *cache.shape[2:])
    return kv[:seq_len]


def gather_scale(scale: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(nb, H, bs) scales -> (seq_len, H)."""
    bs = scale.shape[2]
    nblk = math.ceil(seq_len / bs)
    blocks = block_table_row[:nblk].long().to(scale.device)
    s = scale[blocks].permute(0, 2, 1).reshape(nblk * bs, scale.shape[1])
    return s[:seq_len]


def decode_ref(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None):
    """float64 reference of paged GQA decode attention, computed on the cache's device.

    Returns (num_seqs, Hq, D) float64 on that device."""
    num_seqs, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    out = torch.zeros(num_seqs, hq, d, dtype=torch.float64, device=k_cache.device)
    for i in range(num_seqs):
        L = int(seq_lens[i])
        if L == 0:
            continue
        k = gather_kv(k_cache, block_table[i], L).double()
        v = gather_kv(v_cache, block_table[i], L).double()
        if k_scale is not None:
            k = k * gather_scale(k_scale, block_table[i], L).double().unsqueeze(-1)
            v = v * gather_scale(v_scale, block_table[i], L).double().unsqueeze(-1)
        qi = q[i].to(k_cache.device).double().view(hkv, g, d)                    # (Hkv, G, D)
        s = torch.einsum("hgd,lhd->hgl", qi, k) * scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("hgl,lhd->hgd", p, v).reshape(hq, d)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().double()
    b = b.detach().double().to(a.device)
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
