"""Quantize-on-write: numerics, rounding, skipped slots, strides, padded page layout."""
import math

import pytest
import torch
from kernel_env import ON_GPU
from reference import quantize_ref

H, D = 4, 256


def _cache(nb, bs, dev, fill=-99):
    return torch.full((nb, 2, bs, H, D + 4), fill, dtype=torch.int8, device=dev)


def _fused_qkv(T, dtype, dev, gen, hq=8):
    # K and V as strided slices of a fused projection output (non-contiguous rows)
    qkv = torch.randn(T, hq + 2 * H, D, generator=gen, device=dev).to(dtype) * 2.5
    return qkv[:, hq:hq + H], qkv[:, hq + H:]


@pytest.mark.parametrize("bs,tpp", [(16, None), (784, None), (1552, None), (16, 4), (1552, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_matches_reference(wr, dev, bs, tpp, dtype):
    # tpp: tokens per program (None: the launcher's choice; 3 rounds up to 4); T is odd so the
    # last multi-token program is partial
    gen = torch.Generator(device=dev).manual_seed(bs + 7)
    T = 301 if ON_GPU else 23
    nb = max(3, 2 * math.ceil(T / bs))
    key, value = _fused_qkv(T, dtype, dev, gen)
    assert not key.is_contiguous()
    key[3, 1] = 0  # an exact zero row
    cache = _cache(nb, bs, dev)
    before = cache.clone()
    kd, vd, ks, vs = wr.int8_kv_views(cache, H, D)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(1))[:T].to(dev)
    slots[::5] = -1
    sm = slots.to(torch.int32) if dtype == torch.float16 else slots  # both index dtypes
    wr.int8_kv_write(key, value, kd, vd, ks, vs, sm, tokens_per_program=tpp)
    if ON_GPU:
        torch.cuda.synchronize()
    valid = slots >= 0
    sv = slots[valid].long()
    blk, off = sv // bs, sv % bs
    for x, d_, s_ in ((key, kd, ks), (value, vd, vs)):
        xv = x[valid]
        q_ref, s_ref = quantize_ref(xv)
        got_q = d_[blk, off]
        got_s = s_[blk, :, off]
        assert torch.isfinite(got_s).all()
        assert ((got_s.double() - s_ref.to(got_s.device)).abs() <= 1e-6 * s_ref.to(got_s.device)).all()
        diff = (got_q.int() - q_ref.to(got_q.device).int()).abs()
        assert diff.max().item() <= 1, "more than 1 LSB from the float64 reference"
        assert (diff == 0).float().mean().item() > 0.995, "too many LSB differences (not round-to-nearest?)"
        deq = got_q.double() * got_s.double().unsqueeze(-1)
        bound = got_s.double().unsqueeze(-1) * (0.5 + 1e-4) + 1e-30
        assert ((deq - xv.double()).abs() <= bound).all(), "error above scale/2"
    # the zero row: zeros, finite scale
    i0 = 3
    if slots[i0] >= 0:
        b0, o0 = int(slots[i0]) // bs, int(slots[i0]) % bs
        assert (kd[b0, o0, 1] == 0).all() and torch.isfinite(ks[b0, 1, o0])
    # every byte outside the written rows/scales is untouched (poison stays)
    written = torch.zeros_like(cache, dtype=torch.bool)
    wv = written.view(nb, 2, bs * H * (D + 4))
    n = bs * H * D
    for s in sv.tolist():
        b, o = divmod(s, bs)
        for plane in (0, 1):
            wv[b, plane, o * H * D:(o + 1) * H * D] = True
            for h in range(H):
                st = n + 4 * (h * bs + o)
                wv[b, plane, st:st + 4] = True
    assert torch.equal(cache[~written], before[~written]), "bytes outside written slots changed"


def test_rounding_is_to_nearest(wr, dev):
    # rows whose x/scale has fractional part 0.7 or -0.7: truncation gives k, nearest k+1
    T, bs = 4, 16
    s = 0.01
    k = torch.arange(D, device=dev) % 120
    base = (k.double() + 0.7) * s
    base[0] = 127 * s  # pins max|x| so scale == s exactly (up to fp32)
    x = torch.stack([base, -base, base * 1.0, -base]).unsqueeze(1).repeat(1, H, 1).float()
    cache = _cache(2, bs, dev)
    kd, vd, ks, vs = wr.int8_kv_views(cache, H, D)
    slots = torch.arange(T, device=dev)
    wr.int8_kv_write(x, x, kd, vd, ks, vs, slots)
    got = kd[0, :T].int()
    expect = torch.sign(x / s) * torch.floor((x / s).abs() + 0.5)
    assert torch.equal(got, expect.int().clamp(-127, 127)), "not round-to-nearest"
    trunc = torch.trunc(x / s).int()
    assert not torch.equal(got, trunc)


@pytest.mark.parametrize("tpp", [None, 4])
def test_all_slots_skipped_leave_cache_untouched(wr, dev, tpp):
    gen = torch.Generator(device=dev).manual_seed(3)
    key, value = _fused_qkv(6, torch.bfloat16, dev, gen)
    cache = _cache(2, 16, dev, fill=0x55)
    before = cache.clone()
    views = wr.int8_kv_views(cache, H, D)
    wr.int8_kv_write(key, value, *views, torch.full((6,), -1, dtype=torch.int64, device=dev),
                     tokens_per_program=tpp)
    assert torch.equal(cache, before)


def test_launch_params_prefill_uses_several_tokens_per_program(wr):
    assert wr._write_launch_params(4, 256, 1)[2] == 1          # decode: one token per program
    assert wr._write_launch_params(4, 256, 8192)[2] == wr.PREFILL_TOKENS_PER_PROGRAM > 1


def test_views_are_views_of_padded_pages(wr, dev):
    big = torch.zeros(5, 2, 1552, H, D + 4, dtype=torch.int8, device=dev)
    sub = big[1:4]  # block dim strided inside a larger allocation
    kd, vd, ks, vs = wr.int8_kv_views(sub, H, D)
    page = 2 * 1552 * H * (D + 4)
    assert kd.stride() == (page, H * D, D, 1) and ks.stride() == (page // 4, 1552, 1)
    for t in (kd, vd, ks, vs):
        assert t.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    kd[0, 0, 0, 0] = 7
    ks[2, 3, 1551] = 1.5
    assert big[1].view(-1)[0] == 7
    last = big[3, 0].reshape(-1)[-4:].view(torch.float32)
    assert last.item() == 1.5
