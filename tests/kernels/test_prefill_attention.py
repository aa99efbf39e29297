"""Chunked-prefill attention (cached prefix + causal chunk, one online softmax) vs float64.

Each case draws fresh random inputs, poisons the output, and compares every written element with
a float64 reference that attends over the whole sequence (prefix from the cache, dequantized for
int8, then the chunk's own K/V) with a causal mask at the chunk's positions.
"""
import math

import pytest
import torch
from kernel_env import ON_GPU
from reference import gather_kv, gather_scale, make_block_table, quantize_ref, rel_err

D = 256
# bf16 inputs, fp32 accumulation, fp32 output: stated bound vs float64. A bf16 output adds its own
# rounding (unit roundoff 2^-8, ~1.6e-3 rms relative on Gaussian data), hence the second bound.
BF16_BOUND = 2e-3
BF16_OUT_BOUND = 4e-3


def _case(dev, kind, bs, seqs, hq, hkv, gen, d=D, qdtype=torch.bfloat16):
    """seqs: [(prefix_len, q_len)]. Returns the kernel inputs and a float64 reference."""
    lens = [p + n for p, n in seqs]
    T = sum(n for _, n in seqs)
    nb = sum(max(1, math.ceil(l / bs)) for l in lens) + 2
    q = torch.randn(T, hq, d, generator=gen, device=dev).to(qdtype)
    k_new = torch.randn(T, hkv, d, generator=gen, device=dev).to(qdtype)
    v_new = torch.randn(T, hkv, d, generator=gen, device=dev).to(qdtype)
    if kind == "int8":
        kc = torch.randint(-127, 128, (nb, bs, hkv, d), generator=gen, device=dev, dtype=torch.int8)
        vc = torch.randint(-127, 128, (nb, bs, hkv, d), generator=gen, device=dev, dtype=torch.int8)
        ks = (torch.rand(nb, hkv, bs + 8, generator=gen, device=dev) * 0.02 + 0.002)[..., :bs]
        vs = (torch.rand(nb, hkv, bs + 8, generator=gen, device=dev) * 0.02 + 0.002)[..., :bs]
    else:
        full = torch.randn(nb, 2, bs, hkv, d, generator=gen, device=dev).to(qdtype)
        kc, vc = full.unbind(1)  # strided planes, as vLLM's (nb, 2, bs, H, D) cache
        ks = vs = None
    bt = make_block_table(len(seqs), lens, bs, nb,
                          generator=torch.Generator().manual_seed(int(gen.initial_seed()) % 1000),
                          device=dev)
    cu = torch.tensor([0] + list(torch.tensor([n for _, n in seqs]).cumsum(0)), dtype=torch.int32,
                      device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    ref = _reference(q, k_new, v_new, kc, vc, ks, vs, bt, seqs, d ** -0.5)
    return (q, k_new, v_new, kc, vc, bt, cu, sl, ks, vs), ref


def _reference(q, k_new, v_new, kc, vc, ks, vs, bt, seqs, scale):
    T, hq, d = q.shape
    hkv = kc.shape[2]
    g = hq // hkv
    out = torch.zeros(T, hq, d, dtype=torch.float64, device=q.device)
    start = 0
    for i, (p, n) in enumerate(seqs):
        kp = gather_kv(kc, bt[i], p).double() if p else kc.new_zeros((0, hkv, d)).double()
        vp = gather_kv(vc, bt[i], p).double() if p else vc.new_zeros((0, hkv, d)).double()
        if ks is not None and p:
            kp = kp * gather_scale(ks, bt[i], p).double().unsqueeze(-1)
            vp = vp * gather_scale(vs, bt[i], p).double().unsqueeze(-1)
        k = torch.cat([kp, k_new[start:start + n].double()])              # (p+n, Hkv, D)
        v = torch.cat([vp, v_new[start:start + n].double()])
        qi = q[start:start + n].double().view(n, hkv, g, d)
        s = torch.einsum("nhgd,lhd->hgnl", qi, k) * scale
        pos_q = torch.arange(n, device=q.device) + p
        pos_k = torch.arange(p + n, device=q.device)
        s = s.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf"))
        pr = torch.softmax(s, dim=-1)
        out[start:start + n] = torch.einsum("hgnl,lhd->nhgd", pr, v).reshape(n, hq, d)
        start += n
    return out


def _run(pre, args, dev, out_dtype=torch.float32, **kw):
    q, k_new, v_new, kc, vc, bt, cu, sl, ks, vs = args
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=q.device)
    pre.prefill_attention(q, k_new, v_new, kc, vc, bt, cu, sl, q.shape[-1] ** -0.5, out,
                          k_scale_cache=ks, v_scale_cache=vs, **kw)
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten or NaN output"
    return out


if ON_GPU:
    CASES = [  # (kind, block size, [(prefix, chunk)], Hq, Hkv)
        ("bf16", 784, [(16384, 2048)], 24, 4),
        ("bf16", 784, [(0, 8192)], 24, 4),
        ("bf16", 1552, [(1553, 1000), (0, 1), (20000, 1), (3105, 777)], 24, 4),
        ("int8", 1552, [(24576, 2048)], 24, 4),
        ("int8", 784, [(785, 333), (12000, 4096), (0, 65)], 24, 4),
        ("bf16", 16, [(17, 45), (0, 1), (5, 64)], 6, 1),
    ]
else:
    CASES = [
        ("bf16", 784, [(790, 23), (0, 9)], 24, 4),
        ("int8", 1552, [(1553, 12)], 24, 4),
        ("bf16", 16, [(17, 45), (0, 1), (5, 30)], 6, 1),
        ("int8", 16, [(40, 20), (0, 7)], 6, 1),
    ]


@pytest.mark.parametrize("kind,bs,seqs,hq,hkv,mode", [
    (*c, m) for c in CASES for m in (("inline", "widen") if c[0] == "int8" else (None,))])
def test_prefill_vs_float64(pre, dev, kind, bs, seqs, hq, hkv, mode):
    gen = torch.Generator(device=dev).manual_seed(torch.randint(0, 2**31, (1,)).item())
    args, ref = _case(dev, kind, bs, seqs, hq, hkv, gen)
    kw = {} if ON_GPU else dict(block_m=32, tile_n=16)
    if mode:
        # "widen": the prefix codes are first copied to 16 bits (one slot per sequence)
        kw.update(int8_prefix=mode, max_seqlen_k=max(p + n for p, n in seqs))
    out = _run(pre, args, dev, **kw)
    e = rel_err(out, ref)
    print(f"{kind} bs={bs} seqs={seqs}: rel err {e:.3g}")
    assert e <= BF16_BOUND, e
    out16 = _run(pre, args, dev, out_dtype=args[0].dtype, **kw)
    assert rel_err(out16, ref) <= BF16_OUT_BOUND


@pytest.mark.parametrize("tile_n,block_m", [(16, 16), (32, 64)] if not ON_GPU else
                         [(16, 64), (32, 128), (64, 128), (64, 64)])
def test_tile_shapes_agree(pre, dev, tile_n, block_m):
    """Tiles that straddle blocks (784 % 32 != 0) and tiles that do not give the same answer."""
    gen = torch.Generator(device=dev).manual_seed(torch.randint(0, 2**31, (1,)).item())
    seqs = [(800, 37)] if not ON_GPU else [(9000, 1500), (784, 5)]
    args, ref = _case(dev, "bf16", 784, seqs, 24, 4, gen)
    out = _run(pre, args, dev, tile_n=tile_n, block_m=block_m)
    assert rel_err(out, ref) <= BF16_BOUND


def test_fp32_is_exact_to_rounding(pre, dev):
    """fp32 inputs: the kernel must match float64 to fp32 rounding (catches any masking slip that
    a bf16 tolerance could hide)."""
    gen = torch.Generator(device=dev).manual_seed(torch.randint(0, 2**31, (1,)).item())
    seqs = [(33, 21), (0, 16), (16, 1)] if not ON_GPU else [(3000, 300), (0, 129)]
    args, ref = _case(dev, "bf16", 16, seqs, 6, 1, gen, qdtype=torch.float32)
    kw = {} if ON_GPU else dict(block_m=16, tile_n=16)
    if ON_GPU:
        kw = dict(block_m=64, tile_n=32, num_stages=1)
    out = _run(pre, args, dev, **kw)
    assert rel_err(out, ref) <= 1e-5


def test_int8_prefix_vs_unquantized(pre, dev):
    """int8 end to end: the prefix quantized per (token, head) as the cache stores it, against
    attention on the unquantized values. Stated bound: per-element quantization error is at most
    scale/2 = amax/254, i.e. <= 0.4 % of a row's largest entry; on Gaussian rows the measured
    output error is ~3e-3 relative (2e-3 rms), so 1e-2 leaves margin and still catches a lost or
    misapplied scale (which gives O(1) errors)."""
    gen = torch.Generator(device=dev).manual_seed(torch.randint(0, 2**31, (1,)).item())
    bs = 1552 if ON_GPU else 16
    seqs = [(4000, 500)] if ON_GPU else [(40, 12)]
    hq, hkv = (24, 4)
    args, _ = _case(dev, "bf16", bs, seqs, hq, hkv, gen)
    q, k_new, v_new, kc, vc, bt, cu, sl, _, _ = args
    kq, ksc = quantize_ref(kc.float())
    vq, vsc = quantize_ref(vc.float())
    ks8 = ksc.float().permute(0, 2, 1).contiguous()
    vs8 = vsc.float().permute(0, 2, 1).contiguous()
    ref = _reference(q, k_new, v_new, kc, vc, None, None, bt, seqs, D ** -0.5)
    kw = {} if ON_GPU else dict(block_m=32, tile_n=16)
    out = _run(pre, (q, k_new, v_new, kq.contiguous(), vq.contiguous(), bt, cu, sl, ks8, vs8),
               dev, **kw)
    e = rel_err(out, ref)
    print(f"int8 prefix vs unquantized: rel err {e:.3g}")
    assert e <= 1e-2, e


def test_int8_default_mode_follows_the_bound(pre, dev):
    """With max_seqlen_k the int8 prefix is widened first (same answer as inline), without it
    the inline path runs; an unknown mode is refused."""
    gen = torch.Generator(device=dev).manual_seed(torch.randint(0, 2**31, (1,)).item())
    seqs = [(40, 9), (0, 5)] if not ON_GPU else [(5000, 700)]
    args, ref = _case(dev, "int8", 16, seqs, 6, 1, gen)
    kw = {} if ON_GPU else dict(block_m=16, tile_n=16)
    calls = []
    real = pre._widen_prefix
    pre._widen_prefix = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        a = _run(pre, args, dev, max_seqlen_k=max(p + n for p, n in seqs), **kw)
        b = _run(pre, args, dev, **kw)
    finally:
        pre._widen_prefix = real
    assert calls == [1]
    assert rel_err(a, ref) <= BF16_BOUND and rel_err(b, ref) <= BF16_BOUND
    # while a graph is being captured the copy's size would be frozen into it: inline instead
    real_cap = pre._capturing
    pre._capturing = lambda: True
    pre._widen_prefix = lambda *a, **k: calls.append(2) or real(*a, **k)
    try:
        c = _run(pre, args, dev, max_seqlen_k=max(p + n for p, n in seqs), **kw)
    finally:
        pre._capturing, pre._widen_prefix = real_cap, real
    assert calls == [1] and rel_err(c, ref) <= BF16_BOUND
    with pytest.raises(ValueError, match="int8_prefix"):
        _run(pre, args, dev, int8_prefix="fast", **kw)


def test_refuses_bad_shapes(pre, dev):
    gen = torch.Generator(device=dev).manual_seed(1)
    args, _ = _case(dev, "bf16", 16, [(3, 4)], 6, 1, gen)
    q, k_new, v_new, kc, vc, bt, cu, sl, ks, vs = args
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="k_new/v_new"):
        pre.prefill_attention(q, k_new[:2], v_new, kc, vc, bt, cu, sl, 0.1, out)
    with pytest.raises(ValueError, match="int8 cache"):
        pre.prefill_attention(q, k_new, v_new, kc.to(torch.int8), vc.to(torch.int8), bt, cu, sl,
                              0.1, out)
