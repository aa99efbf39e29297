# SPDX-License-Identifier: Apache-2.0
"""Calibration families `prefill` and `decode`: the full-attention layers as the server runs them.

prefill: decisions `prefill.16bit` (bf16 cache, block 784) and `prefill.int8` (int8 cache, block
1552); the points are the forward steps the organizers' server (4096-token chunks) runs for each
tier's median prompt, weighted by how often they occur. Candidates: our chunked-prefill kernel at
each launch (BLOCK_M rows = query tokens x the 6 heads of a KV head, TILE_N, warps, stages) that
compiles on the device within its shared memory, its built-in launch among them; the anchor is
vLLM's unified kernel with upstream's 16-row tiles. Triton tiles are powers of two, so the packed
tiles are 64 (10 tokens x 6 heads), 128 (21 x 6) and 256 (42 x 6) rows; a 192-row tile (32 x 6) is
not a Triton shape.

decode: decisions `decode.<batch>.16bit` (bf16 cache, block 784) and `decode.<batch>.int8` (block 1552)
at the batches the rounds' servers plan their decode attention at (`common.DECODE_SERVED`: 1, 4, 5, 7,
8, 16, 24), each over the requests decoding at once that run at it, as the server runs them: a step that
a FULL CUDA graph runs is padded to the graph's size with rows of length 0 and block-table rows of -1
(10 requests at batch 16 under --max-num-seqs 128; 5 requests at 5 under --max-num-seqs 5, at 8 under
128: `common.decode_key`), over the tiers' decode contexts (median prompt + 512) and 32K, on one rank's
heads (`--tp`: 24/4 at TP1, 12/2 at TP2); candidates: our split-KV kernel at each (segments, TILE_N,
warps, stages), the segments from a quarter to eight times its built-in count (`choose_num_segments`),
its built-in choice among them, at each launch of the cache kind (`DECODE_LAUNCHES`: int8 tiles go to
128 tokens, as many bytes as bf16's 64); the anchor is vLLM's unified kernel in its 3D decode mode (16
segments). The table takes one launch per cache kind (`decode.launch.16bit`, and `decode.launch.int8`
when a launch beats the int8 built-in beyond the noise: scripts/forge/run/calibration.py). Beside each
int8 decision, `decode.<batch>.qk`: the int8 cache's two Q.K paths at the batch's built-in launch, the
int8 dot on the matrix unit (the built-in) against K tiles converted to the query dtype, each asked for
by name (an int8 dot that does not build here is recorded as failed); the table's `decode.qk_int8`.

Correctness first: each candidate's output on sampled rows against float64 attention over what the
cache holds (NaN-poisoned output, random block tables, ragged lengths); a candidate over its
tolerance or that fails to compile or run is recorded and never timed.
"""

from __future__ import annotations

import math
import os
import sys

from . import common as C
from .decode_inputs import decode_batch, decode_ref, rotation

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = {"16bit": 2e-2, "int8": 3e-2}   # relative Frobenius error of sampled output rows vs float64


def kernels(kind: str):
    """(our prefill module, our decode module, vLLM's unified-attention module)."""
    if kind == "installed":
        from vllm.v1.attention.ops import forge_prefill_attention as pre
        from vllm.v1.attention.ops import forge_split_kv_decode as dec
    else:
        sys.path.insert(0, os.path.join(HERE, ".."))
        from forge_triton import prefill_attention as pre
        from forge_triton import split_kv_decode as dec
    from vllm.v1.attention.ops import triton_unified_attention as uni
    return pre, dec, uni


def prefill_grid(is_hip: bool, quick: bool, kv: str) -> list[tuple[int, int, int, int]]:
    if is_hip:
        grid = [(m, n, w, s) for m in (32, 64, 128) for n in (16, 32, 64) for w in (4, 8) for s in (1, 2)]
    else:
        grid = [(m, n, w, s) for m in (64, 128, 256) for n in (32, 64) for w in (4, 8) for s in (2, 3)]
    if kv == "int8" or quick:
        grid = [g for g in grid if g[0] in (64, 128) and g[2] in ((4,) if is_hip else (8,))]
    return grid[:3] if quick else grid


def smoke_grid(grid: list) -> list:
    """Under the interpreter (the tool's own test): two launches, enough to choose between."""
    return grid[:2]


class Shape:
    """One rank's attention: `heads` = (q, KV) heads per rank (--tp; default the whole model's); the smoke
    run keeps the group size at head_dim 64 with half the heads."""

    def __init__(self, smoke: bool, heads=None):
        hq, hkv = heads or (C.HQ, C.HKV)
        self.hq, self.hkv, self.d = (max(hq // 2, hq // hkv), max(1, hkv // 2), 64) if smoke else (hq, hkv, C.D)
        self.scale = self.d ** -0.5
        self.dev = "cuda" if not smoke else "cpu"


def make_case(torch, sh: Shape, *, prefix: int, chunk: int, kv: str, block: int, gen, dtype=None):
    """One sequence of prefix + chunk tokens in a paged cache with a random block table (two spare
    blocks); the chunk's K/V are in the cache too (vLLM writes before attention)."""
    # the CPU interpreter's bf16 dot is unreliable: the smoke run computes in fp32
    dt = dtype or (torch.bfloat16 if sh.dev == "cuda" else torch.float32)
    total = prefix + chunk
    nblk = math.ceil(total / block)
    nb = nblk + 2
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(total))
    bt = perm[:nblk].to(torch.int32)[None].to(sh.dev)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=sh.dev).to(dt)  # noqa: E731
    q, k_all, v_all = rnd(chunk, sh.hq, sh.d), rnd(total, sh.hkv, sh.d), rnd(total, sh.hkv, sh.d)
    blocks = bt[0].long()
    pad = nblk * block - total

    def paged(x):
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]).view(nblk, block, *x.shape[1:])

    ks = vs = None
    if kv == "int8":
        kc = torch.zeros(nb, block, sh.hkv, sh.d, dtype=torch.int8, device=sh.dev)
        vc = torch.zeros_like(kc)
        ks = torch.ones(nb, sh.hkv, block, dtype=torch.float32, device=sh.dev)
        vs = torch.ones_like(ks)
        refs = []
        for src, dst, sc in ((k_all, kc, ks), (v_all, vc, vs)):
            xf = src.float()
            s = (xf.abs().amax(-1) / 127.0).clamp_min(1e-10)
            qv = torch.round(xf / s[..., None]).clamp(-127, 127)
            dst[blocks] = paged(qv.to(torch.int8))
            sc[blocks] = paged(s).permute(0, 2, 1)
            refs.append(torch.cat([(qv * s[..., None])[:prefix].double(), src[prefix:].double()]))
        k_ref, v_ref = refs
    else:
        kc = torch.zeros(nb, block, sh.hkv, sh.d, dtype=dt, device=sh.dev)
        vc = torch.zeros_like(kc)
        kc[blocks] = paged(k_all)
        vc[blocks] = paged(v_all)
        k_ref, v_ref = k_all.double(), v_all.double()
    return dict(q=q, k_new=k_all[prefix:].contiguous(), v_new=v_all[prefix:].contiguous(), kc=kc, vc=vc,
                ks=ks, vs=vs, bt=bt, k_ref=k_ref, v_ref=v_ref, prefix=prefix, chunk=chunk,
                cu=torch.tensor([0, chunk], dtype=torch.int32, device=sh.dev),
                sl=torch.tensor([total], dtype=torch.int32, device=sh.dev))


def ref_rows(torch, sh: Shape, c, rows: list[int]):
    """float64 causal attention of the chunk's `rows` over prefix + chunk."""
    g = sh.hq // sh.hkv
    q = c["q"][rows].double().view(len(rows), sh.hkv, g, sh.d)
    s = torch.einsum("nhgd,lhd->hgnl", q, c["k_ref"]) * sh.scale
    pos = torch.tensor(rows, device=q.device) + c["prefix"]
    s = s.masked_fill(torch.arange(c["k_ref"].shape[0], device=q.device)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hgnl,lhd->nhgd", torch.softmax(s, -1), c["v_ref"]).reshape(len(rows), sh.hq, sh.d)


def run_unified(torch, uni, sh: Shape, c, out, *, decode_segments=None, ws=None):
    one = torch.ones((1, sh.hkv), dtype=torch.float32, device=sh.dev)
    extra = {}
    if decode_segments:
        extra = dict(seq_threshold_3D=1, num_par_softmax_segments=decode_segments, softmax_segm_output=ws[0],
                     softmax_segm_max=ws[1], softmax_segm_expsum=ws[2])
    uni.unified_attention(q=c["q"], k=c["kc"], v=c["vc"], out=out, cu_seqlens_q=c["cu"],
                          max_seqlen_q=c["chunk"], seqused_k=c["sl"], max_seqlen_k=c["prefix"] + c["chunk"],
                          softmax_scale=sh.scale, causal=True, window_size=(-1, -1), block_table=c["bt"],
                          softcap=0, q_descale=None, k_descale=one, v_descale=one, k_scale_cache=c["ks"],
                          v_scale_cache=c["vs"], **extra)


def prefill(torch, args, emit) -> dict:
    sh = Shape(args.smoke, getattr(args, "heads", None))
    pre, _, uni = kernels(args.kernels)
    os.environ["VLLM_FORGE_PREFILL_TILES"] = "0"     # the unified kernel with upstream's 16-row tiles
    is_hip = bool(getattr(torch.version, "hip", None))
    points = [(0, 32, 1.0), (48, 32, 1.0)] if args.smoke else C.prefill_points()
    if args.quick and not args.smoke:
        points = [p for p in points if p[0] in (0, 16384)]
    gen = torch.Generator(device=sh.dev).manual_seed(args.seed)
    L, notes = args.ledger, []
    kinds = [("16bit", C.BLOCK_BF16)] + ([] if args.quick else [("int8", C.BLOCK_INT8)])
    for kv, block in kinds:
        builtin = tuple(pre.launch_config(torch.int8 if kv == "int8" else torch.bfloat16, is_hip))
        grid = prefill_grid(is_hip, args.quick or args.smoke, kv)
        grid = smoke_grid(grid) if args.smoke else grid
        cands = [("builtin", builtin)] + [("ours", g) for g in grid if g != builtin]
        cases = [make_case(torch, sh, prefix=p, chunk=c, kv=kv, block=block, gen=gen) for p, c, _ in points]
        check_at = {0, len(points) - 1}
        refs = {}
        for i in check_at:
            rows = sorted({0, points[i][1] // 2, points[i][1] - 1})
            refs[i] = (rows, ref_rows(torch, sh, cases[i], rows))
        total = len(cands) + 1
        for n, (kind, launch) in enumerate([("upstream", None)] + cands, 1):
            name = "vLLM unified (16-row tiles)" if kind == "upstream" else \
                "BLOCK_M {} TILE_N {} warps {} stages {}".format(*launch)
            emit(n, total, f"prefill {kv}: {name}")
            if not L.begin(f"prefill.{kv}", name, kind, list(launch) if launch else None):
                continue
            kw = {} if launch is None else dict(block_m=launch[0], tile_n=launch[1], num_warps=launch[2],
                                                num_stages=launch[3])
            outs = [torch.full_like(c["q"], float("nan")) for c in cases]

            def call(i, kw=kw, kind=kind):
                c = cases[i]
                if kind == "upstream":
                    run_unified(torch, uni, sh, c, outs[i])
                else:
                    pre.prefill_attention(c["q"], c["k_new"], c["v_new"], c["kc"], c["vc"], c["bt"], c["cu"],
                                          c["sl"], sh.scale, outs[i], k_scale_cache=c["ks"], v_scale_cache=c["vs"],
                                          max_seqlen_k=c["prefix"] + c["chunk"], **kw)
            err, failure = 0.0, None
            try:
                for i, (rows, ref) in refs.items():
                    call(i)
                    err = max(err, C.frob_err(torch, outs[i][rows], ref))
            except Exception as e:  # noqa: BLE001 - does not compile / fit / run on this device
                failure = C.short_error(e)
            ok = failure is None and err <= TOL[kv]
            for i, (p, c, w) in enumerate(points):
                us = None
                if ok:
                    try:
                        us = C.time_events(torch, lambda i=i: call(i), reps=3 if args.quick else 8)
                    except Exception as e:  # noqa: BLE001
                        failure, ok = C.short_error(e), False
                L.add(C.record(f"prefill.{kv}", name, kind, point=f"P={p} C={c}", weight=w,
                                        launch=list(launch) if launch else None, ok=ok,
                                        err=None if failure else err, tol=TOL[kv], error=failure, us=us))
        cases = outs = None
        if sh.dev == "cuda":
            torch.cuda.empty_cache()
    return {"records": L.records, "notes": notes}


# (TILE_N, warps, stages) per cache kind, all within kernels/forge_tuned DECODE_LAUNCH; the built-in
# launch first, then the one the quick run adds. An int8 token's K (V) row is half the bytes of a bf16
# one, and each program keeps one tile in flight (kernels/NOTES.md, "What bounds int8 decode"): the
# int8 launches trade tile bytes (TILE_N 128: as many as bf16's 64) against programs per SM (4 warps:
# more of them); at 3 stages two K/V buffers per program (kernels/NOTES.md, "Block ids one tile ahead").
# HIP: within 64 KiB of LDS and without register spills (gfx90a, gfx942: kernels/aot.py).
DECODE_LAUNCHES = {
    ("cuda", "16bit"): [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 2)],
    ("cuda", "int8"): [(64, 8, 2), (128, 4, 2), (64, 4, 2), (128, 8, 2), (32, 4, 2), (64, 8, 3), (64, 4, 3),
                       (32, 4, 3), (128, 4, 1), (64, 4, 1)],
    ("hip", "16bit"): [(16, 4, 1), (32, 4, 1), (32, 4, 2)],
    ("hip", "int8"): [(32, 4, 1), (64, 4, 1), (16, 4, 1), (32, 4, 2), (32, 8, 1)],
}


def decode_grid(is_hip: bool, quick: bool, builtin_s: int, kv: str = "16bit"):
    """(segments, TILE_N, warps, stages) candidates: the powers of two around the built-in count (a
    quarter of it to eight times it, 1-256: what the table holds) and, beside each, one and a half times
    it (3 x a power of two), at each launch of the cache kind (`DECODE_LAUNCHES`; the quick run: the
    first two launches, the powers from half to twice the built-in). Eight times, not four: at 1-2 KV
    heads per rank (TP2 and beyond) and batch 10, the H200's fastest int8 count sat at four times the
    built-in, the edge of a four-times grid (reports/kernels/decode-batched-h200-int8). The counts
    between the powers: the grid's programs fill whole waves of the card at some of them (batch 10 at
    2 KV heads: 24 segments are 480 programs, 1.8 waves of 132 SMs x 2; 32 are 2.4), 1.08-1.10x faster
    than 32 on an H100 (reports/kernels/decode-segments-between-powers)."""
    launches = DECODE_LAUNCHES[("hip" if is_hip else "cuda", kv)]
    powers = {s for s in (builtin_s // 4, builtin_s // 2, builtin_s, builtin_s * 2, builtin_s * 4, builtin_s * 8)
              if 1 <= s <= 256}
    segs = sorted(powers | {s * 3 // 2 for s in powers if 2 <= s and s * 3 // 2 <= 256})
    if quick:
        segs = sorted(s for s in powers if builtin_s // 2 <= s <= builtin_s * 2)
    return [(s, *l) for s in segs for l in (launches[:2] if quick else launches)]


def decode_candidates(is_hip: bool, quick: bool, smoke: bool, builtin: tuple, kv: str) -> list:
    """[(kind, launch)] of one decode decision: vLLM's kernel (launch None), our built-in (segments,
    TILE_N, warps, stages), then the grid's other launches and segment counts (the smoke run: two)."""
    grid = [g for g in decode_grid(is_hip, quick or smoke, builtin[0], kv) if g != tuple(builtin)]
    grid = smoke_grid(grid) if smoke else grid
    return [("upstream", None), ("builtin", tuple(builtin))] + [("ours", g) for g in grid]


def run_unified_decode(torch, uni, sh: Shape, c, out, ws, segments: int):
    """vLLM's unified kernel on a decode batch, in its 3D (segmented) mode as the server runs it."""
    B = c["q"].shape[0]
    one = torch.ones((B, sh.hkv), dtype=torch.float32, device=sh.dev)
    uni.unified_attention(q=c["q"], k=c["kc"], v=c["vc"], out=out,
                          cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=sh.dev), max_seqlen_q=1,
                          seqused_k=c["sl"], max_seqlen_k=max(c["lens"]), softmax_scale=sh.scale, causal=True,
                          window_size=(-1, -1), block_table=c["bt"], softcap=0, q_descale=None, k_descale=one,
                          v_descale=one, k_scale_cache=c["ks"], v_scale_cache=c["vs"], seq_threshold_3D=B,
                          num_par_softmax_segments=segments, softmax_segm_output=ws[0], softmax_segm_max=ws[1],
                          softmax_segm_expsum=ws[2])


def decode_points(smoke: bool, quick: bool) -> tuple[dict[int, list[int]], tuple[int, ...]]:
    """({planned batch: [requests decoding at once]}, contexts): the rounds' decode steps
    (`C.DECODE_SERVED`, each at the batch its server's attention plans: `C.decode_key`) and each tier's
    decode context (its median prompt and half the 1024 output tokens) plus the longest, 32K; the smoke
    run: two tiny points, the second 3 requests padded to 4."""
    if smoke:
        return C.decode_plan(((1, 128), (3, 128))), (97,)
    contexts = tuple(sorted({*(p + 512 for p in C.TIER_PROMPTS.values()), C.MAX_CONTEXT}))
    if quick:
        return C.decode_plan(C.DECODE_SERVED_QUICK), (contexts[0], contexts[-1])
    return C.decode_plan(C.DECODE_SERVED), contexts


def decode_point(P: int, B: int, L: int) -> str:
    """A decode record's point: its context, and the requests decoding at once where the step is padded."""
    return f"ctx={L}" if B == P else f"n={B} ctx={L}"


def requests_at(P: int, reals: list[int]) -> str:
    """The requests decoding at once that run at planned batch P, as the progress line and notes say them."""
    return ", ".join(f"{B} requests" + (f" padded to {P}" if B != P else "") for B in reals)


def decode(torch, args, emit) -> dict:
    """One decision per planned batch, `decode.<batch>.<16bit|int8>` (the batch the server's attention
    plans and looks the table up by), over the tier contexts and the requests decoding at once that run at
    that batch, on this rank's heads (--tp): the segment count and launch of our split-KV kernel, against
    vLLM's unified kernel in its 3D mode (16 segments, as the server runs it), both on the real requests
    followed by a CUDA graph's padding rows where the step is padded."""
    sh = Shape(args.smoke, getattr(args, "heads", None))
    _, dec, uni = kernels(args.kernels)
    is_hip = bool(getattr(torch.version, "hip", None))
    plan, contexts = decode_points(args.smoke, args.quick)
    gen = torch.Generator(device=sh.dev).manual_seed(args.seed + 1)
    led = args.ledger
    cus = torch.cuda.get_device_properties(0).multi_processor_count if C.on_gpu(torch) else 16
    for kv, block in (("16bit", C.BLOCK_BF16), ("int8", C.BLOCK_INT8)):
        for P, reals in plan.items():
            # the server plans (and looks the table up) per batch P: the built-in choice is P's
            builtin_s = dec.choose_num_segments(cus, P, sh.hkv, C.MAX_CONTEXT)
            builtin = (builtin_s, *dec.default_launch_config(torch.int8 if kv == "int8" else torch.bfloat16, sh.d,
                                                               is_hip, P))
            cands = decode_candidates(is_hip, args.quick, args.smoke, builtin, kv)
            # a point's launches rotate over disjoint batches (>= ROTATE_BYTES of KV per replay on a GPU):
            # the L2 cache does not hold the next launch's KV at small batches and contexts
            cases = {(B, L): [decode_batch(torch, sh, batch=B, context=L, kv=kv, block=block, gen=gen,
                                           seed=args.seed + B + L + 7919 * j, pad_to=P)
                              for j in range(rotation(sh, B, L, kv))]
                     for B in reals for L in contexts}
            checks = {B: sorted({0, B - 1}) for B in reals}
            refs = {(B, L): decode_ref(torch, sh, cases[(B, L)][0], checks[B]) for B, L in cases}
            decision = f"decode.{P}.{kv}"
            shown = requests_at(P, reals)
            _decode_candidates(torch, args, emit, sh, uni, dec, decision, shown, cands, cases, refs, checks, P, kv)
            if kv == "int8":
                # the int8 cache's Q.K path at the built-in launch: the int8 dot against converted K tiles
                _decode_candidates(torch, args, emit, sh, uni, dec, f"decode.{P}.qk", shown,
                                   [("builtin", builtin), ("ours", builtin)], cases, refs, checks, P, kv, qk=True)
            cases = refs = None
            if sh.dev == "cuda":
                torch.cuda.empty_cache()
    runs_at = "; ".join(f"batch {P}: {requests_at(P, reals)}" for P, reals in plan.items())
    return {"records": led.records, "heads": [sh.hq, sh.hkv],
            "notes": [f"decode at {sh.hq} q / {sh.hkv} KV heads per rank, at the batches the servers' attention "
                      f"plans ({runs_at}), contexts {', '.join(map(str, contexts))}; launches and segment counts "
                      f"for both cache kinds"]}


QK_NAMES = {"builtin": "int8 Q.K dot (built-in)", "ours": "Q.K on K tiles converted to the query dtype"}


def _decode_candidates(torch, args, emit, sh, uni, dec, decision, shown, cands, cases, refs, checks, P, kv,
                       qk=False) -> None:
    """Check and time each (kind, launch) of one decode decision over its cases (`qk`: the two Q.K paths
    of the int8 cache, asked for by name, so a path that does not build is recorded as failed)."""
    led = args.ledger
    for n, (kind, launch) in enumerate(cands, 1):
        name = QK_NAMES[kind] if qk else "vLLM unified 3D (16 segments)" if kind == "upstream" else \
            "segments {} TILE_N {} warps {} stages {}".format(*launch)
        emit(n, len(cands), f"{decision} ({shown}; {sh.hq}/{sh.hkv} heads): {name}")
        if not led.begin(decision, name, kind, list(launch) if launch else None):
            continue
        extra = {"qk_int8": kind == "builtin"} if qk else {}
        for (B, L), batches in cases.items():
            fns, outs = [], []
            for c in batches:
                out = torch.full_like(c["q"], float("nan"))
                outs.append(out)
                if kind == "upstream":
                    ws = (torch.empty(P, sh.hq, 16, sh.d, dtype=torch.float32, device=sh.dev),
                          torch.empty(P, sh.hq, 16, dtype=torch.float32, device=sh.dev),
                          torch.empty(P, sh.hq, 16, dtype=torch.float32, device=sh.dev))

                    def call(c=c, out=out, ws=ws):
                        run_unified_decode(torch, uni, sh, c, out, ws, 16)
                else:
                    ws = dec.decode_workspace(P, sh.hq, sh.d, launch[0], sh.dev)

                    def call(c=c, out=out, ws=ws, launch=launch):
                        dec.split_kv_decode(c["q"], c["kc"], c["vc"], c["bt"], c["sl"], sh.scale, out,
                                            k_scale_cache=c["ks"], v_scale_cache=c["vs"],
                                            num_segments=launch[0], workspace=ws, tile_n=launch[1],
                                            num_warps=launch[2], num_stages=launch[3], **extra)
                fns.append(call)
            us, failure, err, ok = None, None, None, False
            try:
                fns[0]()
                err = C.frob_err(torch, outs[0][checks[B]], refs[(B, L)])
                ok = err <= TOL[kv]
                if ok:
                    us = C.time_graph(torch, fns, reps=5 if args.quick else 15) if C.on_gpu(torch) \
                        else C.time_events(torch, fns[0], reps=2)
            except Exception as e:  # noqa: BLE001 - does not compile / fit / run on this device
                failure, ok = C.short_error(e), False
            led.add(C.record(decision, name, kind, point=decode_point(P, B, L),
                             launch=list(launch) if launch else None, ok=ok, err=err, tol=TOL[kv],
                             error=failure, us=us))
