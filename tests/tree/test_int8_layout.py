"""int8 KV cache page layout and quantize-on-write through the patched TRITON_ATTN backend (CPU).

The cache is allocated the way vLLM's model runner does it: one int8 tensor of
num_blocks * FullAttentionSpec.page_size_bytes, viewed with get_kv_cache_shape(..., "int8").
"""

import json
import textwrap

import pytest

LAYOUT = textwrap.dedent(
    """
    import json, torch
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.utils.torch_utils import kv_cache_scale_bytes
    nb, bs, H, D = 3, {bs}, 4, 256
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=D, dtype=torch.int8,
                             kv_scale_bytes=kv_cache_scale_bytes("int8"))
    raw = torch.zeros(nb * spec.page_size_bytes, dtype=torch.int8)
    shape = TritonAttentionBackend.get_kv_cache_shape(nb, bs, H, D, cache_dtype_str="int8")
    order = TritonAttentionBackend.get_kv_cache_stride_order()
    kv = raw.view(shape)                       # as _reshape_kv_cache_tensors does (identity order)
    impl = TritonAttentionImpl(num_heads=24, head_size=D, scale=D ** -0.5, num_kv_heads=H,
                               alibi_slopes=None, sliding_window=None, kv_cache_dtype="int8")
    views = impl._int8_kv_cache_views(kv)
    again = impl._int8_kv_cache_views(kv)
    # mark every byte with the id of the view that owns it
    owner = torch.zeros(raw.numel(), dtype=torch.int32)
    base = raw.data_ptr()
    aligned = []
    for i, v in enumerate(views):
        b = v.view(torch.int8) if v.dtype != torch.int8 else v
        # per-block base of each view
        for blk in range(nb):
            aligned.append((v[blk].data_ptr() - base) % 16 == 0)
        idx = torch.arange(v.numel()).view(v.shape)
        off = torch.as_strided(torch.arange(raw.numel() // v.element_size()), v.shape,
                               v.stride(), (v.data_ptr() - base) // v.element_size())
        for e in range(v.element_size()):
            owner.index_add_(0, (off.flatten() * v.element_size() + e).long(),
                             torch.full((off.numel(),), 1 << i, dtype=torch.int32))
    print("JSON" + json.dumps(dict(
        shape=list(shape), numel=kv.numel(), page=spec.page_size_bytes, order=list(order),
        shapes=[list(v.shape) for v in views], dtypes=[str(v.dtype) for v in views],
        strides=[list(v.stride()) for v in views], aligned=all(aligned),
        owners=sorted(set(owner.tolist())), cached=all(a is b for a, b in zip(views, again)))))
    """
)


@pytest.mark.parametrize("bs", [16, 1552])
def test_int8_cache_views_aligned_and_disjoint(run_in_vllm, bs):
    res = run_in_vllm(LAYOUT.replace("{bs}", str(bs)))
    r = json.loads([l for l in res.stdout.splitlines() if l.startswith("JSON")][-1][4:])
    H, D, nb = 4, 256, 3
    assert r["shape"] == [nb, 2, bs, H, D + 4]
    assert r["numel"] == nb * r["page"] == nb * bs * 2 * H * (D + 4)   # 2080 B/token
    assert r["order"] == [0, 1, 2, 3, 4]
    assert r["shapes"] == [[nb, bs, H, D]] * 2 + [[nb, H, bs]] * 2
    assert r["dtypes"] == ["torch.int8"] * 2 + ["torch.float32"] * 2
    page = bs * 2 * H * (D + 4)
    assert r["strides"][0] == [page, H * D, D, 1]
    assert r["strides"][2] == [page // 4, bs, 1]
    assert r["aligned"]                     # every view's per-block base is 16-byte aligned
    assert r["owners"] == [1, 2, 4, 8]      # every byte owned by exactly one view, none unowned
    assert r["cached"]                      # views built once per cache tensor


WRITE = textwrap.dedent(
    """
    import os, sys, json
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    sys.path.insert(0, "tests/kernels")
    from reference import quantize_ref
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.utils.torch_utils import kv_cache_scale_bytes
    import types
    g = torch.Generator().manual_seed(7)
    nb, bs, H, D, T = 4, 784, 4, 256, 37
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=D, dtype=torch.int8,
                             kv_scale_bytes=kv_cache_scale_bytes("int8"))
    raw = torch.full((nb * spec.page_size_bytes,), -1, dtype=torch.int8)   # poison
    kv = raw.view(TritonAttentionBackend.get_kv_cache_shape(nb, bs, H, D, cache_dtype_str="int8"))
    impl = TritonAttentionImpl(num_heads=24, head_size=D, scale=D ** -0.5, num_kv_heads=H,
                               alibi_slopes=None, sliding_window=None, kv_cache_dtype="int8")
    key = (torch.randn(T + 5, H, D, generator=g) * torch.exp(torch.randn(T + 5, H, 1, generator=g))).bfloat16()
    val = torch.randn(T + 5, H, D, generator=g).bfloat16()
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[::9] = -1                                          # padding rows
    one = torch.ones(())
    layer = types.SimpleNamespace(_k_scale=one, _v_scale=one)
    impl.do_kv_cache_update(layer, key, val, kv, slots)      # key/value longer than slot_mapping
    kd, vd, ks, vs = impl._int8_kv_cache_views(kv)
    ok = slots >= 0
    s = slots[ok]
    b, o = s // bs, s % bs
    qk, sk = quantize_ref(key[:T][ok].float())
    qv, sv = quantize_ref(val[:T][ok].float())
    dk = (kd[b, o].int() - qk.int()).abs(); dv = (vd[b, o].int() - qv.int()).abs()
    code_mismatch = int((dk != 0).sum() + (dv != 0).sum())
    code_maxdiff = int(max(dk.max(), dv.max()))
    n_codes = dk.numel() + dv.numel()
    scale_err = float(max(((ks[b, :, o] - sk) / sk).abs().max(), ((vs[b, :, o] - sv) / sv).abs().max()))
    written = torch.zeros(nb, bs, dtype=torch.bool); written[b, o] = True
    untouched_ok = bool((kd[~written] == -1).all() and torch.isnan(ks.transpose(1, 2)[~written]).all()
                        and (vd[~written] == -1).all() and torch.isnan(vs.transpose(1, 2)[~written]).all())
    print("JSON" + json.dumps(dict(code_mismatch=code_mismatch, code_maxdiff=code_maxdiff,
                                   n_codes=n_codes, scale_err=scale_err,
                                   untouched_ok=untouched_ok, n=int(ok.sum()))))
    """
)


def test_do_kv_cache_update_int8(run_in_vllm):
    res = run_in_vllm(WRITE)
    r = json.loads([l for l in res.stdout.splitlines() if l.startswith("JSON")][-1][4:])
    assert r["n"] > 20
    # int8 codes equal the float64 reference quantizer, except fp32-vs-fp64 ties at .5 (+-1)
    assert r["code_maxdiff"] <= 1, r
    assert r["code_mismatch"] <= 1e-3 * r["n_codes"], r
    assert r["scale_err"] <= 1e-6, r
    assert r["untouched_ok"], r             # slot -1 and unwritten slots keep their poison
