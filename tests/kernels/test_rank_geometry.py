"""Every attention kernel at every tensor-parallel rank's geometry, against float64.

Qwen3.5-27B's full-attention layers per rank (configs/models/qwen3.5-27b, head_dim 256): q / KV heads
24/4 at TP1, 12/2 at TP2, 6/1 at TP4 and 3/1 at TP8 (the one KV head copied, group size 3: a group
that is not a power of two). Block sizes per rank: bf16 784 (400 at TP8), int8 1552 (784 at TP8)
(`rank_blocks` derives them from the model's GDN state page; tests/tree/test_rank_page_math.py checks
vLLM's own hybrid page rule gives the same at TP 1/2/4/8).

Each case draws fresh random inputs, poisons the output (NaN) and the scratch, uses ragged lengths
that cross block boundaries, and compares with float64 attention over what the cache holds. On CPU
(Triton's interpreter) at small contexts; on a GPU at the round's: batch 1, 4, 10 and 16 with mixed
contexts up to 32K, and the segment count the server plans for that batch.

Mutations these cases catch, each checked by breaking the kernel on purpose in the interpreter (CPU
cases; the case ids that failed):
  decode  head-group offset dropped (qh = rows): every 24/4 and 12/2 case; the K head offset dropped
          (kvh * sk_h): every 24/4 and 12/2 case; the int8 K scale's head offset dropped: int8 at 24/4
          and 12/2; tiles assumed never to straddle a block: every batch-3 case at 784 and 400, and
          int8 at 1552 in most draws (one wrong token in ~1550 is near the bound); the padded rows
          of a group stored (rows < BLOCK_M): the interpreter faults out of bounds.
  prefill q-head offset dropped (kvh * G): 24/4 and 12/2; the cache's head offset dropped: 24/4 and
          12/2 (bf16 and int8); the decode rows of a mixed batch dropped from the grid (+ num_seqs):
          every case.
  write   the data plane's head offset dropped: 4 and 2 KV heads; block math assuming a power-of-two
          block (slot & (bs - 1)): every case.
"""
import json
import math
import random

import pytest
import torch
from kernel_env import ON_GPU, REPO
from reference import decode_ref, gather_kv, gather_scale, make_block_table, quantize_ref, rel_err

D = 256
GEOMS = [(24, 4), (12, 2), (6, 1), (3, 1)]                 # (q heads, KV heads) per rank
TP_OF = {(24, 4): 1, (12, 2): 2, (6, 1): 4, (3, 1): 8}
ID = lambda g: f"{g[0]}q{g[1]}kv"                          # noqa: E731


def rank_heads(tp: int, cfg: dict) -> tuple[int, int]:
    """(q heads, KV heads) of one rank: KV heads are split, or copied once tp exceeds them."""
    return cfg["num_attention_heads"] // tp, max(1, cfg["num_key_value_heads"] // tp)


def rank_blocks(tp: int, cfg: dict) -> dict[str, int]:
    """The attention block size per rank that makes one attention page as large as one GDN state
    page (vLLM's hybrid page rule: a multiple of 16 tokens), for a bf16 and an int8 cache."""
    conv_dim = (cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"] * 2
                + cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]) // tp
    conv = (cfg["linear_conv_kernel_dim"] - 1) * conv_dim * 2
    ssm = cfg["linear_num_value_heads"] // tp * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4
    _, hkv = rank_heads(tp, cfg)
    out = {}
    for kind, per_head in (("bf16", D * 2), ("int8", D + 4)):
        per_token = 2 * hkv * per_head
        out[kind] = 16 * math.ceil((conv + ssm) / (16 * per_token))
    return out


def model_cfg() -> dict:
    with open(f"{REPO}/configs/models/qwen3.5-27b/config.json") as f:
        return json.load(f)["text_config"]


def test_rank_geometry_and_page_math():
    """The geometries and blocks these tests run at are the model's, at TP 1/2/4/8."""
    cfg = model_cfg()
    assert [rank_heads(tp, cfg) for tp in (1, 2, 4, 8)] == GEOMS
    blocks = {tp: rank_blocks(tp, cfg) for tp in (1, 2, 4, 8)}
    assert blocks[1] == blocks[2] == blocks[4] == {"bf16": 784, "int8": 1552}
    # at TP8 the KV head is copied (per-token bytes stay) while the GDN state halves again
    assert blocks[8] == {"bf16": 400, "int8": 784}


def _lens(B: int, bs: int, rng: random.Random, top: int) -> list[int]:
    """Mixed contexts: batch 1 the longest; otherwise up to a quarter (at least one) at a block
    boundary + 1, 1 token, a boundary - 1 and two blocks + 3, the rest random up to `top`."""
    if B == 1:
        return [top]
    edge = [bs + 1, 1, bs - 1, 2 * bs + 3]
    out = [min(top, e) for e in edge[:max(1, min(4, B // 4))]]
    out += [rng.randint(1, top) for _ in range(B - len(out))]
    rng.shuffle(out)
    return out


def _dec_setup(dev, kind, bs, lens, hq, hkv, gen, qdtype):
    B = len(lens)
    nb = sum(max(1, math.ceil(l / bs)) for l in lens) + 2
    q = torch.randn(B, hq, D, generator=gen, device=dev).to(qdtype)
    if kind == "int8":
        kc = torch.randint(-127, 128, (nb, bs, hkv, D), generator=gen, device=dev, dtype=torch.int8)
        vc = torch.randint(-127, 128, (nb, bs, hkv, D), generator=gen, device=dev, dtype=torch.int8)
        ks = (torch.rand(nb, hkv, bs + 4, generator=gen, device=dev) * 0.03 + 0.002)[..., :bs]
        vs = (torch.rand(nb, hkv, bs + 4, generator=gen, device=dev) * 0.03 + 0.002)[..., :bs]
    else:
        full = torch.randn(nb, 2, bs, hkv, D, generator=gen, device=dev).to(torch.bfloat16)
        kc, vc = full.unbind(1)
        ks = vs = None
    bt = make_block_table(B, lens, bs, nb, generator=torch.Generator().manual_seed(int(gen.initial_seed()) % 997),
                          device=dev)
    return q, kc, vc, ks, vs, bt, torch.tensor(lens, dtype=torch.int32, device=dev)


def _dec_run(dec, q, kc, vc, ks, vs, bt, sl, S, dev):
    B, hq, d = q.shape
    out = torch.full((B, hq, d), float("nan"), dtype=q.dtype, device=dev)
    ws = dec.decode_workspace(B, hq, d, S, dev)
    ws[0].fill_(float("nan"))
    ws[1].fill_(float("nan"))
    dec.split_kv_decode(q, kc, vc, bt, sl, d ** -0.5, out, k_scale_cache=ks, v_scale_cache=vs,
                        num_segments=S, workspace=ws)
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten or NaN output"
    return out


# (kind, block): bf16 at its TP1-4 and TP8 blocks, int8 at 1552
KINDS = [("bf16", 784), ("bf16", 400), ("int8", 1552)]
if ON_GPU:
    DEC_CASES = [(g, k, bs, B) for g in GEOMS for k, bs in KINDS for B in (1, 4, 10, 16)] + \
        [((3, 1), "int8", 784, B) for B in (1, 4, 10, 16)]                      # int8 at TP8
    TOP = 32768
else:
    # one batch of 3 per (geometry, kind), and a batch of 16 at two geometries
    DEC_CASES = [(g, k, bs, 3) for g in GEOMS for k, bs in KINDS] + \
        [((12, 2), "bf16", 400, 16), ((3, 1), "int8", 784, 16)]
    TOP = None


@pytest.mark.parametrize("geom,kind,bs,B", DEC_CASES,
                         ids=[f"{ID(c[0])}-{c[1]}-bs{c[2]}-b{c[3]}" for c in DEC_CASES])
def test_decode_at_rank_geometry(dec, dev, geom, kind, bs, B):
    hq, hkv = geom
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    top = TOP or (bs + 40 if B <= 3 else 120)
    lens = _lens(B, bs, rng, top)
    # fp32 queries on CPU (the interpreter's bf16 dot is unreliable), bf16 on the GPU
    qdt = torch.bfloat16 if ON_GPU else torch.float32
    q, kc, vc, ks, vs, bt, sl = _dec_setup(dev, kind, bs, lens, hq, hkv, gen, qdt)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5, ks, vs)
    ncu = torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 8
    planned = dec.choose_num_segments(ncu, B, hkv, 32768 if ON_GPU else max(lens))
    tol = 1e-2 if qdt == torch.bfloat16 else 1e-3
    # on CPU the direct-output path (S = 1) runs only in the batch-16 cases (interpreter time)
    for S in sorted({1, planned} if ON_GPU or B > 3 else {planned}):
        e = rel_err(_dec_run(dec, q, kc, vc, ks, vs, bt, sl, S, dev), ref)
        assert e <= tol, (seed, lens, S, e)


# ---------------------------------------------------------------- chunked prefill, mixed batches

def _pre_case(dev, kind, bs, seqs, hq, hkv, gen, qdtype):
    lens = [p + n for p, n in seqs]
    T = sum(n for _, n in seqs)
    nb = sum(max(1, math.ceil(l / bs)) for l in lens) + 2
    q = torch.randn(T, hq, D, generator=gen, device=dev).to(qdtype)
    k_new = torch.randn(T, hkv, D, generator=gen, device=dev).to(qdtype)
    v_new = torch.randn(T, hkv, D, generator=gen, device=dev).to(qdtype)
    if kind == "int8":
        kc = torch.randint(-127, 128, (nb, bs, hkv, D), generator=gen, device=dev, dtype=torch.int8)
        vc = torch.randint(-127, 128, (nb, bs, hkv, D), generator=gen, device=dev, dtype=torch.int8)
        ks = (torch.rand(nb, hkv, bs + 4, generator=gen, device=dev) * 0.02 + 0.002)[..., :bs]
        vs = (torch.rand(nb, hkv, bs + 4, generator=gen, device=dev) * 0.02 + 0.002)[..., :bs]
    else:
        full = torch.randn(nb, 2, bs, hkv, D, generator=gen, device=dev).to(qdtype)
        kc, vc = full.unbind(1)
        ks = vs = None
    bt = make_block_table(len(seqs), lens, bs, nb, generator=torch.Generator().manual_seed(T), device=dev)
    cu = torch.tensor([0] + list(torch.tensor([n for _, n in seqs]).cumsum(0)), dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    g = hq // hkv
    ref = torch.zeros(T, hq, D, dtype=torch.float64, device=dev)
    start = 0
    for i, (p, n) in enumerate(seqs):
        kp = gather_kv(kc, bt[i], p).double() if p else torch.zeros(0, hkv, D, dtype=torch.float64, device=dev)
        vp = gather_kv(vc, bt[i], p).double() if p else torch.zeros(0, hkv, D, dtype=torch.float64, device=dev)
        if ks is not None and p:
            kp = kp * gather_scale(ks, bt[i], p).double().unsqueeze(-1)
            vp = vp * gather_scale(vs, bt[i], p).double().unsqueeze(-1)
        k = torch.cat([kp, k_new[start:start + n].double()])
        v = torch.cat([vp, v_new[start:start + n].double()])
        qi = q[start:start + n].double().view(n, hkv, g, D)
        s = torch.einsum("nhgd,lhd->hgnl", qi, k) * D ** -0.5
        pos_q = torch.arange(n, device=dev) + p
        s = s.masked_fill(torch.arange(p + n, device=dev)[None, :] > pos_q[:, None], float("-inf"))
        ref[start:start + n] = torch.einsum("hgnl,lhd->nhgd", torch.softmax(s, -1), v).reshape(n, hq, D)
        start += n
    return (q, k_new, v_new, kc, vc, bt, cu, sl, ks, vs), ref


if ON_GPU:
    PRE_CASES = [(g, k, bs) for g in GEOMS for k, bs in KINDS] + [((3, 1), "int8", 784)]

    def _mixed(bs, rng):
        # a 4096-token chunk of a long prompt, a short prompt, and decode rows at mixed contexts
        # (the float64 reference holds heads x chunk x context scores: 2048 x 18K at most)
        return [(rng.randint(bs, 16384), 2048), (0, rng.randint(1, 300))] + \
            [(rng.randint(1, 32767), 1) for _ in range(9)]
else:
    PRE_CASES = [(g, k, bs) for g, (k, bs) in zip(GEOMS, [("bf16", 784), ("int8", 1552), ("bf16", 400),
                                                           ("int8", 784)])] + \
        [((24, 4), "bf16", 400), ((3, 1), "bf16", 784)]

    def _mixed(bs, rng):
        # a chunk after a prefix one past a block, a fresh prompt, two decode rows
        return [(bs + 1, 9), (0, rng.randint(2, 7)), (rng.randint(1, 40), 1), (3, 1)]


@pytest.mark.parametrize("geom,kind,bs", PRE_CASES, ids=[f"{ID(c[0])}-{c[1]}-bs{c[2]}" for c in PRE_CASES])
def test_mixed_prefill_decode_at_rank_geometry(pre, dev, geom, kind, bs):
    """A mixed batch (prefill chunks and decode rows in one forward), as the server sends the
    chunked-prefill kernel under load."""
    hq, hkv = geom
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    seqs = _mixed(bs, rng)
    qdt = torch.bfloat16 if ON_GPU else torch.float32
    args, ref = _pre_case(dev, kind, bs, seqs, hq, hkv, gen, qdt)
    q = args[0]
    kw = {} if ON_GPU else dict(block_m=32, tile_n=32)
    if kind == "int8":
        kw["max_seqlen_k"] = max(p + n for p, n in seqs)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=dev)
    pre.prefill_attention(*args[:8], D ** -0.5, out, k_scale_cache=args[8], v_scale_cache=args[9], **kw)
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten or NaN output"
    e = rel_err(out, ref)
    assert e <= (4e-3 if qdt == torch.bfloat16 else 1e-5), (seed, seqs, e)


# ---------------------------------------------------------------- int8 quantize-on-write

WRITE_CASES = [(h, bs) for h in (4, 2, 1) for bs in (1552, 784, 400)]


@pytest.mark.parametrize("hkv,bs", WRITE_CASES, ids=[f"{c[0]}kv-bs{c[1]}" for c in WRITE_CASES])
def test_int8_write_at_rank_heads(wr, dev, hkv, bs):
    """Quantize-on-write at each rank's KV heads (4, 2, 1) and block sizes: every written code
    within 1 LSB of float64 (99.5 % exact), scales to fp32 rounding, every other byte untouched."""
    seed = random.randrange(2**31)
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = 517 if ON_GPU else 19
    nb = max(3, 2 * math.ceil(T / bs))
    qkv = torch.randn(T, 6 + 2 * hkv, D, generator=gen, device=dev).to(torch.bfloat16) * 2.0
    key, value = qkv[:, 6:6 + hkv], qkv[:, 6 + hkv:]
    cache = torch.full((nb, 2, bs, hkv, D + 4), -77, dtype=torch.int8, device=dev)
    before = cache.clone()
    kd, vd, ks, vs = wr.int8_kv_views(cache, hkv, D)
    # distinct slots across the whole cache, the last slot of a block and the first of the next first
    # (drawn apart from the permutation: a slot written twice has no single expected value), every 7th
    # token after them skipped (-1)
    perm = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(seed % 1000))
    perm = perm[(perm != bs - 1) & (perm != bs)]
    slots = torch.cat([torch.tensor([bs - 1, bs]), perm[:T - 2]])
    slots[2::7] = -1
    slots = slots.to(dev)
    wr.int8_kv_write(key, value, kd, vd, ks, vs, slots)
    if ON_GPU:
        torch.cuda.synchronize()
    ok = slots >= 0
    sv = slots[ok].long()
    assert sv.unique().numel() == sv.numel(), "the test's slots repeat: a slot written twice has no single value"
    blk, off = sv // bs, sv % bs
    for x, dd, ss in ((key, kd, ks), (value, vd, vs)):
        q_ref, s_ref = quantize_ref(x[ok])
        got_q, got_s = dd[blk, off], ss[blk, :, off]
        s_ref = s_ref.to(got_s.device)
        assert ((got_s.double() - s_ref).abs() <= 1e-6 * s_ref).all(), (seed, "scales")
        diff = (got_q.int() - q_ref.to(got_q.device).int()).abs()
        assert diff.max().item() <= 1 and (diff == 0).float().mean().item() > 0.995, (seed, "codes")
    written = torch.zeros(nb, 2, bs * hkv * (D + 4), dtype=torch.bool, device=dev)
    n = bs * hkv * D
    for s in sv.tolist():
        b, o = divmod(s, bs)
        written[b, :, o * hkv * D:(o + 1) * hkv * D] = True
        for h in range(hkv):
            written[b, :, n + 4 * (h * bs + o):n + 4 * (h * bs + o) + 4] = True
    written = written.view(cache.shape)
    assert torch.equal(cache[~written], before[~written]), "bytes outside the written slots changed"
