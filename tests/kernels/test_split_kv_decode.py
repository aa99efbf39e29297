"""Split-KV decode vs float64 references: bf16/int8 caches, ragged lengths, block sizes, segments."""
import math

import pytest
import torch
from kernel_env import ON_GPU
from reference import decode_ref, make_block_table, rel_err

D = 256


def _setup(dev, kind, bs, lens, hq, hkv, gen, qdtype=torch.bfloat16, d=D, extra_blocks=3):
    B = len(lens)
    nb = sum(max(1, math.ceil(l / bs)) for l in lens) + extra_blocks
    q = torch.randn(B, hq, d, generator=gen, device=dev).to(qdtype)
    if kind == "int8":
        kc = torch.randint(-127, 128, (nb, bs, hkv, d), generator=gen, device=dev, dtype=torch.int8)
        vc = torch.randint(-127, 128, (nb, bs, hkv, d), generator=gen, device=dev, dtype=torch.int8)
        # scales with a padded stride, as in the page tail layout
        ks = (torch.rand(nb, hkv, bs + 8, generator=gen, device=dev) * 0.03 + 0.002)[..., :bs]
        vs = (torch.rand(nb, hkv, bs + 8, generator=gen, device=dev) * 0.03 + 0.002)[..., :bs]
    else:
        full = torch.randn(nb, 2, bs, hkv, d, generator=gen, device=dev).to(torch.bfloat16)
        kc, vc = full.unbind(1)  # strided planes of one (nb, 2, bs, H, D) cache
        ks = vs = None
    bt = make_block_table(B, lens, bs, nb, generator=torch.Generator().manual_seed(sum(lens)), device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, kc, vc, ks, vs, bt, sl


def _run(dec, q, kc, vc, ks, vs, bt, sl, S, dev, **kw):
    B, hq, d = q.shape
    out = torch.full((B, hq, d), float("nan"), dtype=q.dtype, device=dev)
    ws = dec.decode_workspace(B, hq, d, S, dev)
    ws[0].fill_(float("nan"))
    ws[1].fill_(float("nan"))
    dec.split_kv_decode(q, kc, vc, bt, sl, d ** -0.5, out, k_scale_cache=ks, v_scale_cache=vs,
                        num_segments=S, workspace=ws, **kw)
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten or NaN output"
    return out


if ON_GPU:
    BF16_CASES = [(16, [1, 17, 1000], 24, 4), (784, [1, 783, 785, 4097, 9000], 24, 4),
                  (1552, [3100, 32768], 24, 4), (784, [32768] * 8, 24, 4)]
else:
    BF16_CASES = [(16, [1, 17, 45], 6, 1), (784, [5, 790], 6, 1), (1552, [1553], 6, 1),
                  (784, [333, 1], 24, 4)]


@pytest.mark.parametrize("bs,lens,hq,hkv", BF16_CASES)
def test_bf16_cache(dec, dev, bs, lens, hq, hkv):
    gen = torch.Generator(device=dev).manual_seed(bs + len(lens))
    q, kc, vc, ks, vs, bt, sl = _setup(dev, "bf16", bs, lens, hq, hkv, gen)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5)
    ncu = torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 8
    for S in sorted({1, 3, dec.choose_num_segments(ncu, len(lens), hkv, 32768)}):
        out = _run(dec, q, kc, vc, ks, vs, bt, sl, S, dev)
        e = rel_err(out, ref)
        assert e <= 1e-2, (S, e)


def test_bf16_small_tile_path(dec, dev):
    # TILE_N=16 divides every block size: the one-block-id-per-tile path
    gen = torch.Generator(device=dev).manual_seed(5)
    q, kc, vc, ks, vs, bt, sl = _setup(dev, "bf16", 784, [20, 801], 6, 1, gen)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5)
    out = _run(dec, q, kc, vc, ks, vs, bt, sl, 2, dev, tile_n=16, num_warps=4, num_stages=1)
    assert rel_err(out, ref) <= 1e-2


if ON_GPU:
    INT8_CASES = [(1552, [17, 3100, 32768], 24, 4), (784, [1, 783, 785, 9000], 24, 4), (16, [5, 300], 24, 4)]
else:
    INT8_CASES = [(1552, [17, 1560], 6, 1), (16, [1, 33], 6, 1), (784, [100], 24, 4)]


@pytest.mark.parametrize("bs,lens,hq,hkv", INT8_CASES)
def test_int8_cache_vs_dequantized(dec, dev, bs, lens, hq, hkv):
    gen = torch.Generator(device=dev).manual_seed(bs * 3 + len(lens))
    for qdt, tol in ((torch.float32, 1e-3), (torch.bfloat16, 1e-2)):
        q, kc, vc, ks, vs, bt, sl = _setup(dev, "int8", bs, lens, hq, hkv, gen, qdtype=qdt)
        ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5, ks, vs)
        out = _run(dec, q, kc, vc, ks, vs, bt, sl, 4, dev)
        e = rel_err(out, ref)
        assert e <= tol, (qdt, e)


QK_CASES = [(1552, [17, 1560, 3107], 24, 4), (784, [1, 785, 9000], 12, 2), (400, [399, 401], 3, 1)] if ON_GPU \
    else [(1552, [17, 1560], 6, 1), (784, [100, 785], 24, 4)]


@pytest.mark.parametrize("bs,lens,hq,hkv", QK_CASES)
def test_int8_qk_on_the_int8_matrix_unit(dec, dev, bs, lens, hq, hkv):
    # bf16 queries, fp32 output (no output rounding): Q.K on the int8 unit (q as two int8 planes) stays
    # within 2e-4 of float64 on the cache's values, sharp attention included; one int8 plane alone (q
    # rounded to 127 levels per row) is ~1e-3 off, so the bound checks the second plane is there
    gen = torch.Generator(device=dev).manual_seed(bs + hq)
    for sharp in (1.0, 4.0):
        q, kc, vc, ks, vs, bt, sl = _setup(dev, "int8", bs, lens, hq, hkv, gen, qdtype=torch.float32)
        q = (q * sharp).to(torch.bfloat16)
        ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5, ks, vs)
        for S in (1, 4):
            out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=dev)
            ws = dec.decode_workspace(len(lens), hq, D, S, dev)
            dec.split_kv_decode(q, kc, vc, bt, sl, D ** -0.5, out, k_scale_cache=ks, v_scale_cache=vs,
                                num_segments=S, workspace=ws, qk_int8=True)
            if ON_GPU:
                torch.cuda.synchronize()
            # on the GPU P.V takes bf16 probabilities (as on the converted path): its rounding bounds it there
            tol = 4e-3 if ON_GPU else 2e-4
            assert rel_err(out, ref) <= tol, (sharp, S, rel_err(out, ref))


def test_an_int8_qk_path_that_does_not_build_falls_back_to_the_converted_path(dec, dev, monkeypatch, caplog):
    # a Triton whose target has no int8 matrix instruction it lowers to: the default path (qk_int8=None)
    # warns once, runs the converted path (correct against float64), and keeps it for the process; asked
    # for by name (qk_int8=True) the build error is raised, not hidden
    real = dec._split_kv_decode_kernel
    tried = []

    class NoInt8Dot:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append(kw["QK_INT8"])
                if kw["QK_INT8"]:
                    raise RuntimeError("PassManager::run failed: int8 dot: no matrix instruction for this target")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(dec, "_split_kv_decode_kernel", NoInt8Dot())
    monkeypatch.setattr(dec, "QK_INT8_FAILURE", None)
    gen = torch.Generator(device=dev).manual_seed(5)
    lens = [17, 1560]
    q, kc, vc, ks, vs, bt, sl = _setup(dev, "int8", 1552, lens, 6, 1, gen, qdtype=torch.float32)
    q = q.to(torch.bfloat16)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5, ks, vs)
    for call in range(2):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=dev)
        with caplog.at_level("WARNING"):
            dec.split_kv_decode(q, kc, vc, bt, sl, D ** -0.5, out, k_scale_cache=ks, v_scale_cache=vs,
                                num_segments=2, workspace=dec.decode_workspace(len(lens), 6, D, 2, dev))
        if ON_GPU:
            torch.cuda.synchronize()
        assert rel_err(out, ref) <= (4e-3 if ON_GPU else 1e-2), (call, rel_err(out, ref))
    assert tried == [True, False, False]                      # tried once, then remembered
    assert "no matrix instruction" in dec.QK_INT8_FAILURE
    warned = [r for r in caplog.records if "int8 Q.K path did not build" in r.getMessage()]
    assert len(warned) == 1
    with pytest.raises(RuntimeError, match="no matrix instruction"):
        dec.split_kv_decode(q, kc, vc, bt, sl, D ** -0.5, out, k_scale_cache=ks, v_scale_cache=vs, num_segments=2,
                            workspace=dec.decode_workspace(len(lens), 6, D, 2, dev), qk_int8=True)


def test_segment_count_independence(dec, dev):
    gen = torch.Generator(device=dev).manual_seed(11)
    lens = [700, 3, 1200] if not ON_GPU else [7000, 3, 32000]
    q, kc, vc, ks, vs, bt, sl = _setup(dev, "int8", 16, lens, 6, 1, gen, qdtype=torch.float32)
    outs = [_run(dec, q, kc, vc, ks, vs, bt, sl, S, dev) for S in (1, 2, 7, 16)]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) <= 2e-6


def test_empty_segments_and_short_sequences(dec, dev):
    # seq_len 1 with 16 segments: 15 empty segments must be ignored by the merge
    gen = torch.Generator(device=dev).manual_seed(2)
    q, kc, vc, ks, vs, bt, sl = _setup(dev, "bf16", 16, [1, 2, 17], 6, 1, gen)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5)
    out = _run(dec, q, kc, vc, ks, vs, bt, sl, 16, dev)
    assert rel_err(out, ref) <= 1e-2


def _quantized_pair(wr, dev, bs, lens, hkv, gen, outlier):
    nb = sum(math.ceil(l / bs) for l in lens) + 1
    T = nb * bs
    k = torch.randn(T, hkv, D, generator=gen, device=dev)
    v = torch.randn(T, hkv, D, generator=gen, device=dev)
    if outlier:
        ch = torch.randperm(D, generator=torch.Generator().manual_seed(0))[:4].to(dev)
        k[..., ch] *= torch.linspace(20, 50, 4, device=dev)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    cache = torch.empty(nb, 2, bs, hkv, D + 4, dtype=torch.int8, device=dev)
    kd, vd, ks, vs = wr.int8_kv_views(cache, hkv, D)
    wr.int8_kv_write(k, v, kd, vd, ks, vs, torch.arange(T, device=dev))
    return k.view(nb, bs, hkv, D), v.view(nb, bs, hkv, D), kd, vd, ks, vs, nb


def _dequantized(data, scale):
    """(nb, bs, H, D) int8 x (nb, H, bs) fp32 -> float64 values."""
    return data.double() * scale.double().permute(0, 2, 1).unsqueeze(-1)


@pytest.mark.parametrize("outlier", [False, True])
def test_int8_vs_bf16_cache(wr, dec, dev, outlier):
    """int8 end to end (quantize-on-write + decode) against attention on the bf16 cache.

    Stated bounds, each checked against an independent float64 computation:

    1. Quantization (per token and KV head, symmetric, fp32 scale ``amax / 127``, round to nearest):
       every dequantized element is within ``scale / 2`` of the bf16 value, plus the fp32 rounding
       of ``x / scale`` (127 * 2^-23 of the scale).
    2. The kernel on the int8 cache is within 1e-2 (relative, bf16 queries: as for the bf16 cache)
       of float64 attention on the dequantized cache: the int8 path adds no error of its own.
    3. Without outlier channels the end-to-end error is within 1e-2 of attention on the bf16
       cache. With outlier channels (4 channels 20-50x larger) the scale is set by the outliers and
       the other channels keep only a few levels: the worst-case propagation of bound 1 (score error
       <= |q|_1 * scale / (2 sqrt(D)), so the output moves by at most max(v_scale) / 2 +
       (exp(2 * score error) - 1) * max|v|) exceeds the outputs themselves, so no end-to-end
       bound is asserted there; the error is printed (see reports/kernels) and bounds 1 and 2 hold.
    """
    gen = torch.Generator(device=dev).manual_seed(21)
    hq, hkv = (24, 4) if ON_GPU else (6, 1)
    bs = 1552 if ON_GPU else 16
    lens = [4000, 32768] if ON_GPU else [300, 64]
    kb, vb, kd, vd, ks, vs, nb = _quantized_pair(wr, dev, bs, lens, hkv, gen, outlier)
    # 1. the quantization bound, against the bf16 inputs
    for x, data, scale in ((kb, kd, ks), (vb, vd, vs)):
        x64 = x.double()
        sc = scale.double().permute(0, 2, 1).unsqueeze(-1)            # (nb, bs, H, 1)
        amax = x64.abs().amax(-1, keepdim=True)
        assert torch.allclose(sc, (amax / 127).clamp_min(1e-10), rtol=2e-6, atol=0), "scale is not amax/127"
        err = (_dequantized(data, scale) - x64).abs()
        # scale / 2, plus the fp32 rounding of x / scale before it is rounded (<= 127 * 2^-23 in
        # units of the scale: a tie can round either way)
        assert bool((err <= sc * (0.5 + 127 * 2 ** -23)).all()), float((err / sc).max())
    if outlier:
        assert float(ks.median()) > 10 * float(vs.median()), "the outlier channels did not set the K scales"
    bt = make_block_table(len(lens), lens, bs, nb, generator=torch.Generator().manual_seed(4), device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    # queries aligned with a few cached keys (peaked attention, as in real decoding) plus noise
    idx = torch.randint(0, min(lens), (len(lens), hq), generator=torch.Generator().manual_seed(8))
    q = torch.randn(len(lens), hq, D, generator=gen, device=dev)
    for i in range(len(lens)):
        for h in range(hq):
            t = int(idx[i, h])
            blk = int(bt[i, t // bs])
            q[i, h] += 0.5 * kb[blk, t % bs, h // (hq // hkv)].float()
    q = q.to(torch.bfloat16)
    ref = decode_ref(q, kb, vb, bt, sl, D ** -0.5)
    ref_deq = decode_ref(q, _dequantized(kd, ks), _dequantized(vd, vs), bt, sl, D ** -0.5)
    out = _run(dec, q, kd, vd, ks, vs, bt, sl, 4, dev)
    # 2. the kernel against float64 attention on what the cache holds
    e_kernel = rel_err(out, ref_deq)
    assert e_kernel <= 1e-2, e_kernel
    e = rel_err(out, ref)
    print(f"int8 vs bf16 cache, outlier keys={outlier}: rel err {e:.4g} (kernel vs dequantized {e_kernel:.3g})")
    # 3. end to end, where a bound is informative
    if not outlier:
        assert e <= 1e-2, e


def test_choose_num_segments(dec):
    cap = dec.MAX_SEGMENTS
    assert cap == 128
    assert dec.choose_num_segments(132, 1, 4, 32768) * 4 >= 132  # >= 1 program per CU, ~2
    for ncu in (60, 64, 80, 104, 120, 132, 304):
        for b in (1, 2, 4, 8, 10, 16, 32):
            for hkv in (1, 2, 4, 8):
                s = dec.choose_num_segments(ncu, b, hkv, 32768)
                c = dec.segment_cap(ncu, b, hkv, 32768)
                assert isinstance(s, int) and 1 <= s <= c <= cap and s & (s - 1) == 0
                # at least 2 programs per compute unit unless the cap stops it, and never more
                # than twice that (the next power of two)
                assert b * hkv * s >= 2 * ncu or s == c, (ncu, b, hkv, s)
                assert s == 1 or b * hkv * (s // 2) < 2 * ncu, (ncu, b, hkv, s)
                # segments of at least 512 tokens of 32K, or 256 where longer ones leave a
                # compute unit without a program
                assert 32768 // s >= (512 if b * hkv * 64 >= ncu else 256), (ncu, b, hkv, s)
    assert dec.choose_num_segments(10_000, 1, 1, 1 << 20) == cap        # the cap binds
    # the docstring's examples: TP1 (4 KV heads), TP2 (2), TP4/TP8 (1) on 132 CUs; a 60-CU DCU
    assert [dec.choose_num_segments(132, b, 4, 32768) for b in (1, 2, 4, 8, 16)] == [64, 64, 32, 16, 8]
    assert [dec.choose_num_segments(132, b, 2, 32768) for b in (1, 4, 10, 16)] == [128, 64, 16, 16]
    assert dec.choose_num_segments(132, 1, 1, 32768) == 128
    assert dec.choose_num_segments(60, 1, 4, 32768) == 32
    assert dec.choose_num_segments(132, 1, 4, 40) <= 2
    po, pl, cnt = dec.decode_workspace(8, 24, 256, 16, "cpu")
    assert po.shape == (8, 24, 16, 256) and pl.shape == (8, 24, 16) and po.dtype == torch.float32
    assert cnt.dtype == torch.int32 and cnt.shape == (8, 24) and not cnt.any()


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_fused_merge_matches_two_launch_and_resets_tickets(dec, dev, kind):
    """One launch (last-arriving program merges) == stage 1 + merge kernel; the tickets are back
    at zero after every launch, so a replayed launch (CUDA graph) merges again correctly."""
    gen = torch.Generator(device=dev).manual_seed(31)
    lens = [1, 250, 97] if not ON_GPU else [1, 7000, 32768]
    q, kc, vc, ks, vs, bt, sl = _setup(dev, kind, 16, lens, 6, 1, gen, qdtype=torch.float32)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5, ks, vs)
    S = 8
    outs = {}
    for fused in (False, True):
        ws = dec.decode_workspace(len(lens), 6, D, S, dev)
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
        for rep in range(2):
            out = torch.full_like(q, float("nan"))
            dec.split_kv_decode(q, kc, vc, bt, sl, D ** -0.5, out, k_scale_cache=ks,
                                v_scale_cache=vs, num_segments=S, workspace=ws, fused=fused)
            if ON_GPU:
                torch.cuda.synchronize()
            assert torch.isfinite(out).all(), (fused, rep)
            assert not ws[2].any(), "tickets not reset"
            outs[(fused, rep)] = out
    assert rel_err(outs[(True, 0)], ref) <= 1e-3
    for k in outs:
        assert rel_err(outs[k], outs[(False, 0)]) <= 2e-6, k


def test_min_segment_tokens(dec, dev):
    # long minimum segments: fewer, longer segments for short sequences, same result
    gen = torch.Generator(device=dev).manual_seed(41)
    q, kc, vc, ks, vs, bt, sl = _setup(dev, "int8", 16, [3, 130, 500], 6, 1, gen, qdtype=torch.float32)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5, ks, vs)
    for mst in (16, 48, 128, 1000):
        out = _run(dec, q, kc, vc, ks, vs, bt, sl, 8, dev, min_segment_tokens=mst)
        assert rel_err(out, ref) <= 1e-3, mst


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("fused", [False, True])
def test_graph_padded_rows_are_never_read(dec, dev, kind, fused):
    """A decode step under a FULL CUDA graph: vLLM pads the batch to the graph's size with rows of
    length 0 whose block-table rows are -1. The real rows match float64 at every segment count; a
    padding row reads no cache block (its block ids are out of range), so its output is the empty
    attention's 0; the tickets are back at zero for the graph's next replay."""
    gen = torch.Generator(device=dev).manual_seed(53)
    real = [333, 1] if not ON_GPU else [7000, 1, 32768]
    pad = 2 if not ON_GPU else 13                    # 3 real requests run in the graph of 16
    bs, hq, hkv = (784, 24, 4) if ON_GPU or kind == "bf16" else (1552, 6, 1)
    q, kc, vc, ks, vs, bt, sl = _setup(dev, kind, bs, real, hq, hkv, gen, qdtype=torch.float32)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5, ks, vs)
    q = torch.cat([q, torch.randn(pad, hq, D, generator=gen, device=dev)])
    bt = torch.cat([bt, torch.full((pad, bt.shape[1]), -1, dtype=torch.int32, device=dev)])
    sl = torch.cat([sl, torch.zeros(pad, dtype=torch.int32, device=dev)])
    n = len(real)
    for S in (1, 4, dec.choose_num_segments(8, n + pad, hkv, 32768)):
        ws = dec.decode_workspace(n + pad, hq, D, S, dev)
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
        out = torch.full_like(q, float("nan"))
        dec.split_kv_decode(q, kc, vc, bt, sl, D ** -0.5, out, k_scale_cache=ks, v_scale_cache=vs,
                            num_segments=S, workspace=ws, fused=fused)
        if ON_GPU:
            torch.cuda.synchronize()
        assert rel_err(out[:n], ref) <= 1e-3, (S, fused)
        assert (out[n:] == 0).all(), (S, fused, "a padding row read the cache")
        assert not ws[2].any(), "tickets not reset"
