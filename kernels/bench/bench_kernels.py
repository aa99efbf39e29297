#!/usr/bin/env python3
"""GPU benchmark of the forge kernels against vLLM 0.18.1's own Triton decode kernels.

    python kernels/bench/prepare_payload.py --vllm-src <vllm-0.18.1 tree>     # on the dev machine
    python3 kernels/bench/bench_kernels.py --payload build/gpu-payload --out <dir>   # on the GPU

One run: (1) correctness of every kernel against float64 references (fresh random inputs,
poisoned outputs), (2) device copy bandwidth, (3) a launch-config sweep of the split-KV decode,
(4) decode timings, batch 1-8, contexts 1K-32K, bf16 (block 784) and int8 (block 1552), side by
side with vLLM's unified attention (3D kernel, 16 segments, as TRITON_ATTN configures it) and
vLLM's grouped split-KV decode (64 splits), (5) the quantize-on-write kernel (Triton and the
CUDA source) at decode (1 token x 16 layers) and prefill (8192 tokens). Timing: CUDA graphs
whose R launches rotate over R disjoint KV caches (>= 256 MiB touched per replay, so the 60 MB
L2 does not flatter short contexts); the median of the per-launch times of 30 replays.
Writes bench.json + bench.md (+ PNG via plot.py) to --out and prints a short table last.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "kernels"))   # the import root of our kernels (forge_triton)

import torch  # noqa: E402
import triton  # noqa: E402
from forge_triton import int8_kv_write as WR  # noqa: E402
from forge_triton import split_kv_decode as DEC  # noqa: E402

sys.path.insert(0, HERE)
from graph_timing import copy_bandwidth, time_graph  # noqa: E402  (beside this file)

HQ, HKV, D = 24, 4, 256
SCALE = D ** -0.5
MiB = 1 << 20


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


REF = _load("forge_kernel_reference", os.path.join(REPO, "tests", "kernels", "reference.py"))

LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


# ----------------------------------------------------------------------------- vLLM kernels
class Upstream:
    def __init__(self, payload):
        sys.path.insert(0, os.path.abspath(payload))
        from vllm.v1.attention.ops import triton_decode_attention as tda
        from vllm.v1.attention.ops import triton_unified_attention as tua
        self.tua, self.tda = tua, tda
        self.one = torch.ones(1, dtype=torch.float32, device="cuda")
        self.seg = 16
        self.thr = 32
        self.so = torch.empty(self.thr, HQ, self.seg, D, dtype=torch.float32, device="cuda")
        self.sm = torch.empty(self.thr, HQ, self.seg, dtype=torch.float32, device="cuda")
        self.se = torch.empty(self.thr, HQ, self.seg, dtype=torch.float32, device="cuda")
        self.cu = {}

    def unified(self, q, k, v, out, bt, sl, max_len):
        B = q.shape[0]
        if B not in self.cu:
            self.cu[B] = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        kd = self.one.expand(B, HKV)
        self.tua.unified_attention(
            q=q, k=k, v=v, out=out, cu_seqlens_q=self.cu[B], max_seqlen_q=1, seqused_k=sl,
            max_seqlen_k=max_len, softmax_scale=SCALE, causal=True, window_size=(-1, -1),
            block_table=bt, softcap=0, q_descale=None, k_descale=kd, v_descale=kd,
            seq_threshold_3D=self.thr, num_par_softmax_segments=self.seg,
            softmax_segm_output=self.so, softmax_segm_max=self.sm, softmax_segm_expsum=self.se)

    def grouped(self, q, kbuf, vbuf, out, lse, bt, sl, logits, splits, page):
        self.tda.decode_attention_fwd(q, kbuf, vbuf, out, lse, bt, sl, logits, splits, SCALE,
                                      page_size=page, k_scale=self.one, v_scale=self.one)


# ----------------------------------------------------------------------------- data
def make_pool(kind, nb, bs, gen=None):
    """kind: 'bf16' -> (nb,2,bs,H,D) bf16 (vLLM layout); 'int8' -> (nb,2,bs,H,D+4) int8 pages;
    'split' -> separate contiguous (nb,bs,H,D) bf16 K and V (for vLLM's grouped decode)."""
    if kind == "bf16":
        c = torch.randn(nb, 2, bs, HKV, D, dtype=torch.bfloat16, device="cuda")
        k, v = c.unbind(1)
        return dict(cache=c, k=k, v=v, ks=None, vs=None)
    if kind == "split":
        return dict(k=torch.randn(nb, bs, HKV, D, dtype=torch.bfloat16, device="cuda"),
                    v=torch.randn(nb, bs, HKV, D, dtype=torch.bfloat16, device="cuda"), ks=None, vs=None)
    c = torch.empty(nb, 2, bs, HKV, D + 4, dtype=torch.int8, device="cuda")
    k, v, ks, vs = WR.int8_kv_views(c, HKV, D)
    k.random_(-127, 128)
    v.random_(-127, 128)
    ks.uniform_(0.002, 0.03)
    vs.uniform_(0.002, 0.03)
    return dict(cache=c, k=k, v=v, ks=ks, vs=vs)


def block_tables(R, B, nbps, nb):
    perm = torch.randperm(nb, device="cuda")[: R * B * nbps].to(torch.int32)
    return perm.view(R, B, nbps).contiguous()


# ----------------------------------------------------------------------------- correctness
def check_decode(results, up):
    torch.manual_seed(1234)
    ncu = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [("bf16", 784, [1, 1000, 5001]), ("int8", 1552, [17, 3100, 32768]),
             ("bf16", 1552, [32768]), ("int8", 784, [1, 783, 785, 9000]), ("bf16", 16, [5, 300])]
    for kind, bs, lens in cases:
        B = len(lens)
        nbps = max(math.ceil(l / bs) for l in lens)
        nb = B * nbps + 3
        pool = make_pool(kind, nb, bs)
        bt = REF.make_block_table(B, lens, bs, nb, device="cuda")
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        for qdt in ((torch.bfloat16,) if kind == "bf16" else (torch.bfloat16, torch.float32)):
            q = torch.randn(B, HQ, D, dtype=qdt, device="cuda")
            ref = REF.decode_ref(q, pool["k"], pool["v"], bt, sl, SCALE, pool["ks"], pool["vs"])
            variants = [(S, None) for S in sorted({1, DEC.choose_num_segments(ncu, B, HKV, 32768), 128})]
            variants.append((16, True))  # the opt-in one-launch merge
            for S, fused in variants:
                out = torch.full((B, HQ, D), float("nan"), dtype=qdt, device="cuda")
                ws = DEC.decode_workspace(B, HQ, D, S, "cuda")
                ws[0].fill_(float("nan"))
                ws[1].fill_(float("nan"))
                for _ in range(2 if fused else 1):  # twice: the tickets must be reset
                    DEC.split_kv_decode(q, pool["k"], pool["v"], bt, sl, SCALE, out,
                                        k_scale_cache=pool["ks"], v_scale_cache=pool["vs"],
                                        num_segments=S, workspace=ws, fused=fused)
                torch.cuda.synchronize()
                e = REF.rel_err(out, ref)
                tol = 1e-3 if qdt == torch.float32 else 1e-2
                ok = e <= tol and not bool(ws[2].any())
                results.append(dict(test="decode", kernel="forge", kv=kind, block=bs, lens=lens,
                                    q=str(qdt).split(".")[-1], S=S, fused=bool(fused), rel_err=e,
                                    tol=tol, ok=ok))
            if kind == "bf16" and bs != 16 and qdt == torch.bfloat16:
                out = torch.full((B, HQ, D), float("nan"), dtype=qdt, device="cuda")
                up.unified(q, pool["k"], pool["v"], out, bt, sl, max(lens))
                torch.cuda.synchronize()
                e = REF.rel_err(out, ref)
                results.append(dict(test="decode", kernel="vllm_unified_3d", kv=kind, block=bs,
                                    lens=lens, rel_err=e, tol=1e-2, ok=e <= 1e-2))
                kb = pool["k"].contiguous()
                vb = pool["v"].contiguous()
                out = torch.full((B, HQ, D), float("nan"), dtype=qdt, device="cuda")
                lse = torch.empty(B, HQ, dtype=torch.float32, device="cuda")
                logits = torch.empty(B, HQ, 64, D + 1, dtype=torch.float32, device="cuda")
                up.grouped(q, kb, vb, out, lse, bt, sl, logits, 64, bs)
                torch.cuda.synchronize()
                e = REF.rel_err(out, ref)
                results.append(dict(test="decode", kernel="vllm_grouped", kv=kind, block=bs,
                                    lens=lens, rel_err=e, tol=1e-2, ok=e <= 1e-2))
        del pool
    # int8 vs the bf16 cache it was quantized from, normal and outlier keys
    for outlier in (False, True):
        lens = [4000, 32768]
        bs = 1552
        B = len(lens)
        nb = sum(math.ceil(l / bs) for l in lens) + 2
        bf = make_pool("bf16", nb, bs)
        if outlier:
            ch = torch.randperm(D, device="cuda")[:4]
            mult = torch.linspace(20, 50, 4, device="cuda").to(torch.bfloat16)
            bf["k"][..., ch] *= mult
        i8 = make_pool("int8", nb, bs)
        T = nb * bs
        slots = torch.arange(T, device="cuda")
        WR.int8_kv_write(bf["k"].reshape(T, HKV, D), bf["v"].reshape(T, HKV, D),
                         i8["k"], i8["v"], i8["ks"], i8["vs"], slots)
        bt = REF.make_block_table(B, lens, bs, nb, device="cuda")
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda")
        ref = REF.decode_ref(q, bf["k"], bf["v"], bt, sl, SCALE)
        S = DEC.choose_num_segments(ncu, B, HKV, 32768)
        out = torch.full((B, HQ, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        DEC.split_kv_decode(q, i8["k"], i8["v"], bt, sl, SCALE, out, k_scale_cache=i8["ks"],
                            v_scale_cache=i8["vs"], num_segments=S,
                            workspace=DEC.decode_workspace(B, HQ, D, S, "cuda"))
        torch.cuda.synchronize()
        e = REF.rel_err(out, ref)
        kq = REF.rel_err(WR.int8_kv_dequant(i8["k"], i8["ks"]), bf["k"].float())
        # Gaussian K/V: the int8 step alone gives ~0.7% (V) + ~0.7% (K via the scores) -> ~1%;
        # outliers are recorded, not judged
        results.append(dict(test="int8_vs_bf16_cache", outlier_keys=outlier, lens=lens,
                            rel_err=e, k_quant_rel_err=kq, tol=1.5e-2 if not outlier else None,
                            ok=(e <= 1.5e-2) if not outlier else bool(math.isfinite(e))))
        del bf, i8


def load_cuda_writer(out_dir):
    src = os.path.join(REPO, "kernels", "csrc", "int8_kv_write.cu")
    so = os.path.join("/tmp", "forge_int8_kv_write.so")
    cmd = ["nvcc", "-O3", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC", "-DFORGE_STANDALONE",
           "-Xptxas", "-v", src, "-o", so]
    r = subprocess.run(cmd, capture_output=True, text=True)
    info = (r.stdout + r.stderr)[-3000:]
    if r.returncode != 0:
        raise RuntimeError("nvcc failed: " + info)
    lib = ctypes.CDLL(so)
    f = lib.forge_int8_kv_write_raw
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_void_p]
    dmap = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

    def call(key, value, kd, vd, ks, vs, slots):
        strides = (ctypes.c_int64 * 20)(*key.stride(), *value.stride(), *kd.stride(), *vd.stride(),
                                       *ks.stride(), *vs.stride())
        rc = f(key.data_ptr(), value.data_ptr(), kd.data_ptr(), vd.data_ptr(), ks.data_ptr(),
               vs.data_ptr(), slots.data_ptr(), int(slots.dtype == torch.int64), dmap[key.dtype],
               key.shape[0], key.shape[1], key.shape[2], kd.shape[1], strides,
               torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"forge_int8_kv_write_raw rc={rc}")
    call.keep = lib
    return call, info


def check_write(results, cuda_write):
    torch.manual_seed(7)
    for bs in (16, 784, 1552):
        T = 333
        nb = max(6, 2 * math.ceil(T / bs))
        qkv = torch.randn(T, HQ + 2 * HKV, D, dtype=torch.bfloat16, device="cuda") * 3
        qkv[5, HQ:HQ + HKV] = 0  # an exact zero K row
        key, value = qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
        slots = torch.randperm(nb * bs, device="cuda")[:T]
        slots[::7] = -1
        outs = {}
        for name, fn in (("triton", WR.int8_kv_write), ("cuda", cuda_write)):
            if fn is None:
                continue
            c = torch.full((nb, 2, bs, HKV, D + 4), -99, dtype=torch.int8, device="cuda")
            kd, vd, ks, vs = WR.int8_kv_views(c, HKV, D)
            fn(key, value, kd, vd, ks, vs, slots)
            torch.cuda.synchronize()
            outs[name] = c
            valid = slots >= 0
            sv = slots[valid].long()
            blk, off = sv // bs, sv % bs
            qk_ref, sk_ref = REF.quantize_ref(key[valid])
            got_q = kd[blk, off]
            got_s = ks[blk, :, off]
            lsb = (got_q.int() - qk_ref.int()).abs().max().item()
            srel = ((got_s.double() - sk_ref) / sk_ref).abs().max().item()
            deq = got_q.double() * got_s.double().unsqueeze(-1)
            err_ok = bool(((deq - key[valid].double()).abs() <= got_s.double().unsqueeze(-1) * 0.5001 + 1e-12).all())
            mask = torch.ones(nb * bs, dtype=torch.bool, device="cuda")
            mask[sv] = False
            kd_flat = kd.reshape(nb * bs, HKV, D)
            poison_ok = bool((kd_flat[mask] == -99).all())
            finite = bool(torch.isfinite(ks.reshape(nb, HKV, bs).permute(0, 2, 1).reshape(-1, HKV)[sv]).all())
            ok = lsb <= 1 and srel < 1e-6 and err_ok and poison_ok and finite
            results.append(dict(test="write", kernel=name, block=bs, max_lsb_diff=lsb, scale_rel=srel,
                                err_bound_ok=err_ok, poison_ok=poison_ok, ok=ok))
        if len(outs) == 2:
            diff = (outs["triton"].view(-1).int() - outs["cuda"].view(-1).int()).abs()
            results.append(dict(test="write_cuda_vs_triton", block=bs,
                                bytes_differing=int((diff > 0).sum()), ok=True))


# ----------------------------------------------------------------------------- timings
def rotation(bytes_per_call, cap=32):
    return int(max(2, min(cap, math.ceil(256 * MiB / max(1, bytes_per_call)))))


def kv_bytes(kind, B, L):
    elt = 1 if kind == "int8" else 2
    b = B * L * HKV * D * 2 * elt
    if kind == "int8":
        b += B * L * HKV * 2 * 4
    return b


def bench_point(kind, bs, B, L, cfgs, up, ncu, which=("forge", "unified", "grouped"), S_list=None,
                dec=None, label="forge"):
    """Time all requested kernels at one (kv kind, block, batch, context). Returns records.
    ``cfgs``: (tile, warps, stages[, fused, min_segment_tokens]) tuples; ``dec``: the decode
    module to time (default: the current one; e.g. a kept earlier version)."""
    dec = dec or DEC
    recs = []
    nbps = math.ceil(L / bs)
    bpc = kv_bytes(kind, B, L)
    R = rotation(bpc)
    nb = R * B * nbps + 1
    pool = make_pool(kind, nb, bs)
    bts = block_tables(R, B, nbps, nb)
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qs = [torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda") for _ in range(R)]
    out = torch.empty(B, HQ, D, dtype=torch.bfloat16, device="cuda")
    base = dict(kv=kind, block=bs, batch=B, context=L, rotation=R, kv_bytes=bpc)
    if "forge" in which:
        for cfg in cfgs:
            tile, warps, stages = cfg[:3]
            if tile is None:  # the launcher's own defaults, recorded
                tile, warps, stages = dec.default_launch_config(
                    torch.int8 if kind == "int8" else torch.bfloat16, D, is_hip=False,
                    **({"num_seqs": B} if "num_seqs" in dec.default_launch_config.__code__.co_varnames else {}))
            extra = {}
            if len(cfg) > 3 and cfg[3] is not None:
                extra["fused"] = cfg[3]
            if len(cfg) > 4 and cfg[4] is not None:
                extra["min_segment_tokens"] = cfg[4]
            for S in (S_list or [dec.choose_num_segments(ncu, B, HKV, 32768)]):
                ws = dec.decode_workspace(B, HQ, D, S, "cuda")
                fns = [lambda r=r: dec.split_kv_decode(
                    qs[r], pool["k"], pool["v"], bts[r], sl, SCALE, out, k_scale_cache=pool["ks"],
                    v_scale_cache=pool["vs"], num_segments=S, workspace=ws, tile_n=tile,
                    num_warps=warps, num_stages=stages, **extra) for r in range(R)]
                info = dict(base, kernel=label, tile=tile, warps=warps, stages=stages, S=S,
                            fused=extra.get("fused", getattr(dec, "FUSE_MAX_SEGMENTS", 0) >= S > 1),
                            min_seg=extra.get("min_segment_tokens"))
                try:
                    med, lo, hi = time_graph(fns)
                    recs.append(dict(info, us=med, us_min=lo, us_max=hi))
                except Exception as e:
                    recs.append(dict(info, error=f"{type(e).__name__}: {e}"[:300]))
    if "unified" in which and kind == "bf16":
        fns = [lambda r=r: up.unified(qs[r], pool["k"], pool["v"], out, bts[r], sl, L)
               for r in range(R)]
        try:
            med, lo, hi = time_graph(fns)
            recs.append(dict(base, kernel="vllm_unified_3d", S=16, us=med, us_min=lo, us_max=hi))
        except Exception as e:
            recs.append(dict(base, kernel="vllm_unified_3d", error=str(e)[:300]))
    pool = None  # frees the cache (the lambdas above hold the cell)
    if "grouped" in which and kind == "bf16":
        sp = make_pool("split", nb, bs)
        lse = torch.empty(B, HQ, dtype=torch.float32, device="cuda")
        logits = torch.empty(B, HQ, 64, D + 1, dtype=torch.float32, device="cuda")
        fns = [lambda r=r: up.grouped(qs[r], sp["k"], sp["v"], out, lse, bts[r], sl, logits, 64, bs)
               for r in range(R)]
        try:
            med, lo, hi = time_graph(fns)
            recs.append(dict(base, kernel="vllm_grouped", S=64, us=med, us_min=lo, us_max=hi))
        except Exception as e:
            recs.append(dict(base, kernel="vllm_grouped", error=str(e)[:300]))
        del sp
    torch.cuda.empty_cache()
    return recs


def bench_write(cuda_write, copy_bw, extra_writers=()):
    recs = []
    bs = 1552
    for name, fn in (("triton", WR.int8_kv_write), ("cuda", cuda_write), *extra_writers):
        if fn is None:
            continue
        # decode: 1 token into each of 16 layer caches, one graph
        layers = [torch.empty(64, 2, bs, HKV, D + 4, dtype=torch.int8, device="cuda") for _ in range(16)]
        views = [WR.int8_kv_views(c, HKV, D) for c in layers]
        qkv = [torch.randn(1, HQ + 2 * HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(16)]
        slot = torch.tensor([12345], dtype=torch.int64, device="cuda")
        fns = [lambda i=i: fn(qkv[i][:, HQ:HQ + HKV], qkv[i][:, HQ + HKV:], *views[i], slot)
               for i in range(16)]
        med, lo, hi = time_graph(fns)
        recs.append(dict(kernel=name, case="decode_1tok_x16layers", tokens=1, us_per_layer=med,
                         us_min=lo, us_max=hi))
        layers = views = None  # frees them (the lambdas above hold the cells)
        # prefill: 8192 tokens, rotating over 4 inputs and 4 caches
        T = 8192
        R = 4
        caches = [torch.empty(T // bs + 2, 2, bs, HKV, D + 4, dtype=torch.int8, device="cuda") for _ in range(R)]
        views = [WR.int8_kv_views(c, HKV, D) for c in caches]
        qkvs = [torch.randn(T, HQ + 2 * HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(R)]
        slots = torch.arange(T, dtype=torch.int64, device="cuda") + 7
        fns = [lambda i=i: fn(qkvs[i][:, HQ:HQ + HKV], qkvs[i][:, HQ + HKV:], *views[i], slots)
               for i in range(R)]
        med, lo, hi = time_graph(fns)
        nbytes = T * HKV * (2 * D * 2 + 2 * (D + 4)) + T * 8
        recs.append(dict(kernel=name, case="prefill_8192", tokens=T, us=med, us_min=lo, us_max=hi,
                         bytes=nbytes, tb_s=nbytes / med * 1e-6, frac_copy_bw=nbytes / (med * 1e-6) / copy_bw))
        caches = views = qkvs = None  # frees them (the lambdas above hold the cells)
        torch.cuda.empty_cache()
    return recs


# ----------------------------------------------------------------------------- main
MINI_SWEEP = [("bf16", 784, 8, 32768, [(32, 4, 2), (32, 4, 3), (64, 4, 2)], 16),
              ("bf16", 784, 8, 1024, [(32, 4, 2), (32, 4, 3)], 16),
              ("int8", 1552, 1, 32768, [(64, 8, 2), (64, 8, 3), (128, 8, 1), (64, 8, 2, True)], 64),
              ("int8", 1552, 8, 1024, [(64, 8, 2), (64, 4, 2)], 16)]
SWEEP_CFGS = [(16, 4, 2), (16, 4, 3), (16, 4, 4), (32, 4, 2), (32, 4, 3), (32, 8, 3), (64, 4, 2), (64, 8, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--payload", default=os.path.join(REPO, "build", "gpu-payload"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/forge-bench"))
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--mini-sweep", action="store_true",
                    help="with --no-sweep: a few informational variants (not used for the table)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    prov = {}
    pp = os.path.join(a.payload, "provenance.json")
    if os.path.exists(pp):
        prov = json.load(open(pp))
    dev = torch.cuda.get_device_properties(0)
    ncu = dev.multi_processor_count
    prov.update(device=dev.name, compute_units=ncu, l2_bytes=getattr(dev, "L2_cache_size", None),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                command="python3 " + " ".join(shlex.quote(x) for x in sys.argv))
    res = dict(provenance=prov, correctness=[], sweep=[], decode=[], write=[], errors=[])

    def save():
        with open(os.path.join(a.out, "bench.json"), "w") as f:
            json.dump(res, f, indent=1)

    up = Upstream(a.payload)
    cuda_write = None
    try:
        cuda_write, info = load_cuda_writer(a.out)
        res["cuda_writer_ptxas"] = info
    except Exception as e:
        res["errors"].append(f"cuda writer: {e}"[:2000])
    log(f"== {dev.name}, {ncu} SMs, torch {torch.__version__}, triton {triton.__version__}")
    for name, fn in (("decode", lambda: check_decode(res["correctness"], up)),
                     ("write", lambda: check_write(res["correctness"], cuda_write))):
        try:
            fn()
        except Exception:
            res["errors"].append(f"check {name}: " + traceback.format_exc()[-2000:])
    for r in res["correctness"]:
        log("check", {k: (round(v, 7) if isinstance(v, float) else v) for k, v in r.items()})
    save()
    try:
        res["copy_bw_Bps"] = copy_bandwidth()
    except Exception:
        res["errors"].append("copy bw: " + traceback.format_exc()[-1500:])
        res["copy_bw_Bps"] = 4.22e12
    log(f"copy bandwidth {res['copy_bw_Bps'] / 1e12:.3f} TB/s (read+write)")

    # launch-config sweep at the points that matter most; choose the best per kv kind
    best = {"bf16": DEC.default_launch_config(torch.bfloat16, D, is_hip=False),
            "int8": DEC.default_launch_config(torch.int8, D, is_hip=False)}
    if not a.no_sweep:
        for kind, bs in (("bf16", 784), ("int8", 1552)):
            score = {}
            for (B, L) in ((1, 32768), (1, 4096), (8, 32768)):
                S_list = sorted({DEC.choose_num_segments(ncu, B, HKV, 32768),
                                 max(1, DEC.choose_num_segments(ncu, B, HKV, 32768) // 2),
                                 min(256, DEC.choose_num_segments(ncu, B, HKV, 32768) * 2)})
                try:
                    recs = bench_point(kind, bs, B, L, SWEEP_CFGS, up, ncu, which=("forge",),
                                       S_list=S_list)
                except Exception:
                    res["errors"].append("sweep: " + traceback.format_exc()[-1500:])
                    continue
                res["sweep"] += recs
                S0 = DEC.choose_num_segments(ncu, B, HKV, 32768)
                for r in recs:
                    if "us" in r and r["S"] == S0:
                        key = (r["tile"], r["warps"], r["stages"])
                        score[key] = score.get(key, 0.0) + r["us"] / (r["kv_bytes"] / 1e9)
            if score:
                best[kind] = min(score, key=score.get)
            log(f"sweep {kind}: best (tile, warps, stages) = {best[kind]}")
            save()
    if a.no_sweep:
        # the table times the launcher's defaults (per batch size), as served
        best = {"bf16": (None, None, None), "int8": (None, None, None)}
        if a.mini_sweep:
            for kind, bs, B, L, cfgs, S in MINI_SWEEP:
                try:
                    res["sweep"] += bench_point(kind, bs, B, L, cfgs, up, ncu, which=("forge",),
                                                S_list=[S])
                except Exception:
                    res["errors"].append("mini sweep: " + traceback.format_exc()[-1500:])
            save()
    res["chosen_config"] = {k: ("launcher defaults" if v[0] is None else list(v)) for k, v in best.items()}

    ctxs = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    for kind, bs in (("bf16", 784), ("int8", 1552)):
        for B in batches:
            for L in ctxs:
                try:
                    res["decode"] += bench_point(kind, bs, B, L, [best[kind]], up, ncu)
                except Exception:
                    res["errors"].append(f"decode {kind} B={B} L={L}: " + traceback.format_exc()[-1500:])
        save()
    res["decode_extra"] = []
    for kind, bs in (("bf16", 1552), ("int8", 784)):
        for L in (4096, 32768):
            try:
                res["decode_extra"] += bench_point(kind, bs, 1, L, [best[kind]], up, ncu)
            except Exception:
                res["errors"].append(f"extra {kind} bs={bs} L={L}: " + traceback.format_exc()[-1500:])
    save()
    try:
        res["write"] = bench_write(cuda_write, res["copy_bw_Bps"], extra_writers=[
            (f"triton tpp{t} w{w}", (lambda t, w: lambda *x: WR.int8_kv_write(
                *x, tokens_per_program=t, num_warps=w))(t, w)) for t, w in ((4, 4), (8, 8))]
            if a.mini_sweep else ())
    except Exception:
        res["errors"].append("write bench: " + traceback.format_exc()[-1500:])
    res["wall_s"] = time.time() - t_start
    save()
    sys.path.insert(0, HERE)
    try:
        import report
        report.write_reports(res, a.out)
    except Exception:
        res["errors"].append("report: " + traceback.format_exc()[-1500:])
        save()
    print_summary(res)


def print_summary(res):
    bw = res.get("copy_bw_Bps", 0)
    idx = {}
    for r in res["decode"]:
        if "us" in r:
            idx[(r["kernel"], r["kv"], r["batch"], r["context"])] = r
    print("\n== decode (us, CUDA-graph, rotated caches); frac = KV bytes / time / copy BW")
    print(f"{'B':>2} {'ctx':>6} | {'forge bf16':>10} {'frac':>5} | {'forge int8':>10} {'frac':>5} | "
          f"{'vllm 3D':>8} {'grouped':>8} | {'x vs 3D bf16/int8':>17}")
    for (k, kv, B, L), r in sorted(idx.items(), key=lambda x: (x[0][2], x[0][3])):
        if k != "forge" or kv != "bf16":
            continue
        i8 = idx.get(("forge", "int8", B, L))
        u = idx.get(("vllm_unified_3d", "bf16", B, L))
        gq = idx.get(("vllm_grouped", "bf16", B, L))
        fb = r["kv_bytes"] / (r["us"] * 1e-6) / bw if bw else 0
        fi = i8["kv_bytes"] / (i8["us"] * 1e-6) / bw if (i8 and bw) else 0
        sp = f"{u['us'] / r['us']:.2f}/{u['us'] / i8['us']:.2f}" if (u and i8) else "-"
        print(f"{B:>2} {L:>6} | {r['us']:>10.1f} {fb:>5.2f} | {i8['us'] if i8 else float('nan'):>10.1f} "
              f"{fi:>5.2f} | {u['us'] if u else float('nan'):>8.1f} {gq['us'] if gq else float('nan'):>8.1f} | {sp:>17}")
    for w in res.get("write", []):
        print("write", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in w.items()})
    bad = [c for c in res["correctness"] if not c.get("ok")]
    print(f"correctness: {len(res['correctness']) - len(bad)}/{len(res['correctness'])} ok; "
          f"errors: {len(res['errors'])}; chosen {res.get('chosen_config')}; wall {res.get('wall_s', 0):.0f}s")
    for c in bad:
        print("FAILED CHECK", c)
    for e in res["errors"]:
        print("ERROR", e[-600:])


if __name__ == "__main__":
    main()
