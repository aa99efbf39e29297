# SPDX-License-Identifier: Apache-2.0
"""The decode family's inputs and float64 reference (also the launch sweep's,
kernels/bench/sweep_decode_launch.py): a batch of decode requests in one paged cache, optionally padded
the way vLLM pads a CUDA graph's decode step, and how many disjoint batches a timed point rotates over."""

from __future__ import annotations

import math


def decode_batch(torch, sh, *, batch: int, context: int, kv: str, block: int, gen, seed: int,
                 pad_to: int | None = None):
    """`batch` sequences whose contexts spread over [3/4, 1] x `context` (the last one exactly
    `context`), one query token each, in one paged cache with a random block table; `pad_to`: then
    rows of length 0 up to that many, their block-table rows -1 (a CUDA graph's padded decode step).
    "lens" holds the real sequences' lengths."""
    rng = torch.Generator().manual_seed(seed)
    lens = [max(1, int(context * (0.75 + 0.25 * float(torch.rand(1, generator=rng))))) for _ in range(batch - 1)]
    lens.append(context)
    need = [math.ceil(L / block) for L in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=rng)
    bt = torch.zeros(batch, max(need), dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[pos:pos + n].to(torch.int32)
        pos += n
    dt = torch.bfloat16 if sh.dev == "cuda" else torch.float32
    q = torch.randn(batch, sh.hq, sh.d, generator=gen, device=sh.dev).to(dt)
    ks = vs = None
    if kv == "int8":
        kc = torch.randint(-127, 128, (nb, block, sh.hkv, sh.d), generator=gen, device=sh.dev, dtype=torch.int8)
        vc = torch.randint(-127, 128, (nb, block, sh.hkv, sh.d), generator=gen, device=sh.dev, dtype=torch.int8)
        ks = torch.rand(nb, sh.hkv, block, generator=gen, device=sh.dev) * 0.03 + 0.002
        vs = torch.rand(nb, sh.hkv, block, generator=gen, device=sh.dev) * 0.03 + 0.002
    else:
        kc = torch.randn(nb, block, sh.hkv, sh.d, generator=gen, device=sh.dev).to(dt)
        vc = torch.randn(nb, block, sh.hkv, sh.d, generator=gen, device=sh.dev).to(dt)
    pad = max(0, (pad_to or batch) - batch)
    if pad:
        q = torch.cat([q, torch.randn(pad, sh.hq, sh.d, generator=gen, device=sh.dev).to(dt)])
        bt = torch.cat([bt, torch.full((pad, bt.shape[1]), -1, dtype=torch.int32)])
    return dict(q=q, kc=kc, vc=vc, ks=ks, vs=vs, bt=bt.to(sh.dev), lens=lens,
                sl=torch.tensor(lens + [0] * pad, dtype=torch.int32, device=sh.dev))


def decode_ref(torch, sh, c, rows: list[int]):
    """float64 decode attention of the batch's sequences `rows` over what the cache holds."""
    g = sh.hq // sh.hkv
    out = []
    for i in rows:
        L = c["lens"][i]
        blocks = c["bt"][i, :math.ceil(L / c["kc"].shape[1])].long()
        k = c["kc"][blocks].flatten(0, 1)[:L].double()
        v = c["vc"][blocks].flatten(0, 1)[:L].double()
        if c["ks"] is not None:
            k = k * c["ks"][blocks].permute(0, 2, 1).flatten(0, 1)[:L].double().unsqueeze(-1)
            v = v * c["vs"][blocks].permute(0, 2, 1).flatten(0, 1)[:L].double().unsqueeze(-1)
        s = torch.einsum("hgd,lhd->hgl", c["q"][i].double().view(sh.hkv, g, sh.d), k) * sh.scale
        out.append(torch.einsum("hgl,lhd->hgd", torch.softmax(s, -1), v).reshape(sh.hq, sh.d))
    return torch.stack(out)


ROTATE_BYTES = 256 << 20


def rotation(sh, batch: int, context: int, kv: str) -> int:
    """How many disjoint batches a point's timed launches rotate over (1 off the GPU)."""
    if sh.dev != "cuda":
        return 1
    kv_bytes = batch * context * sh.hkv * sh.d * 2 * (1 if kv == "int8" else 2)
    return max(1, min(8, math.ceil(ROTATE_BYTES / kv_bytes)))
