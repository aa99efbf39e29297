#!/usr/bin/env python3
"""GPU check + benchmark of the PATCHED unified attention kernels with an int8 KV cache.

    python3 kernels/bench/bench_unified_int8.py --prepare build/gpu-int8      # dev machine
    python3 kernels/bench/bench_unified_int8.py --payload build/gpu-int8 --out <dir>   # GPU

--prepare copies the patched vllm/v1/attention/ops/triton_unified_attention.py and the overlay's
forge_int8_kv_write.py from build/vllm into <dir>/vllm/... and writes a minimal `vllm` shim
(logger, platforms.current_platform.fp8_dtype, batch_invariant, triton_utils) so the kernel file
imports unchanged on a machine without vLLM. A provenance.json records the tree's commit.

On the GPU, one run does:
 1. correctness at real sizes (24 q / 4 kv heads, head_dim 256, blocks 784 and 1552, random
    block tables, 0xFF-poisoned cache, NaN-poisoned output, K/V written by int8_kv_write):
    decode batch 1 at 32K context (3D kernel, 16 segments, as TRITON_ATTN runs it) and a
    4K-token prefill chunk over 28K cached tokens (2D kernel). fp16 queries: error vs float64
    attention over the dequantized cache (relative Frobenius, gate 1e-3), and vs the same
    kernel on an fp16 cache (max abs / max|V|, gate 1e-2); bf16 queries reported beside.
 2. benchmark: 2D kernel, 4K-token prefill chunk over 0/8K/16K/28K cached tokens, bf16 queries,
    bf16 cache (block 784, the bf16 hybrid block) vs int8 cache (block 1552, and 784 for a
    same-block comparison). CUDA graphs of R launches over R disjoint caches/queries (so L2
    never holds the next launch's K/V), median over replays of per-launch time.
Writes <out>/unified_int8.json and <out>/unified_int8.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

SHIM = {
    "vllm/__init__.py": "",
    "vllm/envs.py": ("import os\n\nVLLM_FORGE_PREFILL_TILES = "
                     "os.getenv('VLLM_FORGE_PREFILL_TILES', '1').lower() in ('true', '1')\n"),
    "vllm/logger.py": "import logging\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/platforms/__init__.py": (
        "import torch\n\nclass _P:\n    @staticmethod\n    def fp8_dtype():\n"
        "        return torch.float8_e4m3fnuz if getattr(torch.version, 'hip', None) "
        "else torch.float8_e4m3fn\n\ncurrent_platform = _P()\n"),
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/batch_invariant.py": "def vllm_is_batch_invariant():\n    return False\n",
    "vllm/triton_utils/__init__.py": "import triton\nimport triton.language as tl\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/ops/__init__.py": "",
}
COPY = ["vllm/v1/attention/ops/triton_unified_attention.py",
        "vllm/v1/attention/ops/forge_int8_kv_write.py"]


def prepare(dst: str) -> None:
    tree = os.path.join(REPO, "build", "vllm")
    shutil.rmtree(dst, ignore_errors=True)
    for rel, text in SHIM.items():
        p = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
    for rel in COPY:
        shutil.copyfile(os.path.join(tree, rel), os.path.join(dst, rel))
    shutil.copyfile(os.path.abspath(__file__), os.path.join(dst, "bench_unified_int8.py"))
    git = lambda *a, cwd: subprocess.run(["git", *a], cwd=cwd, capture_output=True, text=True).stdout.strip()
    prov = {"tree_commit": git("rev-parse", "HEAD", cwd=tree),
            "tree_subject": git("log", "-1", "--format=%s", cwd=tree),
            "repo_commit": git("rev-parse", "HEAD", cwd=REPO),
            "prepared": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(os.path.join(dst, "provenance.json"), "w") as f:
        json.dump(prov, f, indent=1)
    print(f"prepared {dst}: {prov}")


# ------------------------------------------------------------------ GPU part
HQ, HKV, D = 24, 4, 256
SCALE = D ** -0.5


def _setup(payload):
    sys.path.insert(0, payload)
    import torch
    from vllm.v1.attention.ops import forge_int8_kv_write as w
    from vllm.v1.attention.ops import triton_unified_attention as u
    return torch, w, u


def make_case(torch, w, *, ctx, q_len, block_size, kv, q_dtype, gen, dev="cuda"):
    """One sequence of `ctx` tokens whose last `q_len` are queries. Returns a dict of tensors."""
    nblk = math.ceil(ctx / block_size)
    num_blocks = nblk + 2
    perm = torch.randperm(num_blocks, generator=gen)
    bt = perm[:nblk].to(torch.int32)[None].to(dev)
    pos = torch.arange(ctx)
    slots = (perm[:nblk][pos // block_size].long() * block_size + pos % block_size).to(dev)
    k = (torch.randn(ctx, HKV, D, generator=gen) *
         torch.exp(0.25 * torch.randn(ctx, HKV, 1, generator=gen))).to(dev, torch.bfloat16)
    v = (torch.randn(ctx, HKV, D, generator=gen) *
         torch.exp(0.25 * torch.randn(ctx, HKV, 1, generator=gen))).to(dev, torch.bfloat16)
    q = torch.randn(q_len, HQ, D, generator=gen).to(dev, q_dtype)
    c = dict(ctx=ctx, q_len=q_len, bt=bt, q=q, k=k, v=v, block_size=block_size,
             seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
             cu=torch.tensor([0, q_len], dtype=torch.int32, device=dev))
    if kv == "int8":
        page = 2 * block_size * HKV * (D + 4)
        raw = torch.full((num_blocks * page,), -1, dtype=torch.int8, device=dev)
        cache = raw.view(num_blocks, 2, block_size, HKV, D + 4)
        kd, vd, ks, vs = w.int8_kv_views(cache, HKV, D)
        w.int8_kv_write(k, v, kd, vd, ks, vs, slots)
        c.update(kc=kd, vc=vd, ks=ks, vs=vs)
        pos_b, pos_o = slots // block_size, slots % block_size
        c["k_deq"] = kd[pos_b, pos_o].float() * ks[pos_b, :, pos_o][..., None]
        c["v_deq"] = vd[pos_b, pos_o].float() * vs[pos_b, :, pos_o][..., None]
    else:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[kv]
        cache = torch.full((num_blocks, 2, block_size, HKV, D), float("nan"), dtype=dt, device=dev)
        kc, vc = cache.unbind(1)
        kc[slots // block_size, slots % block_size] = k.to(dt)
        vc[slots // block_size, slots % block_size] = v.to(dt)
        c.update(kc=kc, vc=vc, ks=None, vs=None)
    return c


class _Launch2D:
    """Stand-in for kernel_unified_attention_2d that relaunches it with another tile/launch
    config (BLOCK_M, TILE_SIZE, num_warps, num_stages) and the grid that goes with that BLOCK_M.
    Used only by the variant sweep; the launcher's own choice is what the main bench times."""

    def __init__(self, kernel, cfg, num_q_tokens):
        self.kernel, self.cfg, self.n = kernel, cfg, num_q_tokens

    def __getitem__(self, grid):
        def launch(**kw):
            c = self.cfg
            for k in ("num_warps", "num_stages"):
                kw.pop(k, None)
            bm = c["BLOCK_M"]
            bq = bm // kw["num_queries_per_kv"]
            kw.update(BLOCK_M=bm, BLOCK_Q=bq, TILE_SIZE=c["TILE"])
            g = (self.n // bq + kw["num_seqs"], grid[1])
            return self.kernel[g](**kw, num_warps=c["warps"], num_stages=c["stages"])
        return launch


def run_kernel(torch, u, c, out, *, three_d=False, bufs=None, cfg=None):
    if cfg is not None and not three_d:
        real = u.kernel_unified_attention_2d
        u.kernel_unified_attention_2d = _Launch2D(real, cfg, c["q"].shape[0])
        try:
            return run_kernel(torch, u, c, out, bufs=bufs)
        finally:
            u.kernel_unified_attention_2d = real
    kw = {}
    if three_d:
        kw = dict(seq_threshold_3D=8, num_par_softmax_segments=16, softmax_segm_output=bufs[0],
                  softmax_segm_max=bufs[1], softmax_segm_expsum=bufs[2])
    one = torch.ones((1, HKV), dtype=torch.float32, device="cuda")
    u.unified_attention(q=c["q"], k=c["kc"], v=c["vc"], out=out, cu_seqlens_q=c["cu"],
                        max_seqlen_q=c["q_len"], seqused_k=c["seq_lens"], max_seqlen_k=c["ctx"],
                        softmax_scale=SCALE, causal=True, window_size=(-1, -1),
                        block_table=c["bt"], softcap=0, q_descale=None, k_descale=one,
                        v_descale=one, k_scale_cache=c["ks"], v_scale_cache=c["vs"], **kw)


def ref_attn(torch, q, k, v, ctx, rows):
    """float64 causal attention for query rows `rows` (indices into the q_len queries)."""
    q_len = q.shape[0]
    g = HQ // HKV
    kk = k.double().repeat_interleave(g, 1)      # (ctx, HQ, D)
    vv = v.double().repeat_interleave(g, 1)
    qq = q[rows].double()                         # (r, HQ, D)
    s = torch.einsum("rhd,khd->hrk", qq, kk) * SCALE
    qpos = (ctx - q_len + rows)[:, None]
    s = s.masked_fill(torch.arange(ctx, device=q.device)[None, :] > qpos, float("-inf"))
    return torch.einsum("hrk,khd->rhd", torch.softmax(s, -1), vv)


# Launch-config variants of the 2D kernel for the sweep (--variants); None = the launcher's choice.
# m16w4s3t32 is what upstream picks on CUDA (BLOCK_M 16 for 6 q heads per KV head, TILE 32,
# Triton's default 4 warps / 3 stages).
VARIANTS = {
    "m16w4s3t32": dict(BLOCK_M=16, TILE=32, warps=4, stages=3),
    "m64w8s1t32": dict(BLOCK_M=64, TILE=32, warps=8, stages=1),
    "m64w8s2t32": dict(BLOCK_M=64, TILE=32, warps=8, stages=2),
    "m64w8s2t16": dict(BLOCK_M=64, TILE=16, warps=8, stages=2),
    "m64w8s2t64": dict(BLOCK_M=64, TILE=64, warps=8, stages=2),
    "m64w8s1t64": dict(BLOCK_M=64, TILE=64, warps=8, stages=1),   # int8 prefill choice on CUDA
}
# (kv, block, variant) rows timed per history
MAIN_ROWS = [("bf16", 784, None), ("int8", 1552, None), ("int8", 784, None)]
SWEEP_ROWS = [("bf16", 784, None), ("int8", 1552, None)] + \
    [("int8", 1552, v) for v in VARIANTS if v != "m16w4s3t32"] + \
    [("bf16", 784, "m64w8s2t32"), ("bf16", 784, "m64w8s2t64")]


def correctness(torch, w, u, cases=None, variants=(None,)):
    """cases: None = all (decode 3D + prefill 2D, blocks 784/1552, fp16/bf16 queries), else a
    list of (name, block, q dtype name). variants: 2D launch configs to check on each case."""
    res = []
    gen = torch.Generator().manual_seed(1234)
    bufs = (torch.empty(8, HQ, 16, D, device="cuda"), torch.empty(8, HQ, 16, device="cuda"),
            torch.empty(8, HQ, 16, device="cuda"))
    for name, ctx, q_len, three_d in (("decode_b1_32k_3d", 32768, 1, True),
                                      ("prefill_4k_over_28k_2d", 32768, 4096, False)):
        for bs in (784, 1552):
            for q_dtype in (torch.float16, torch.bfloat16):
                seed = int(torch.randint(0, 2**31, (1,), generator=gen))
                rows = torch.randperm(q_len, generator=gen)[:64].cuda() if q_len > 64 else \
                    torch.arange(q_len, device="cuda")
                qn = str(q_dtype).split(".")[-1]
                if cases is not None and (name, bs, qn) not in cases:
                    continue
                g1 = torch.Generator().manual_seed(seed)
                c8 = make_case(torch, w, ctx=ctx, q_len=q_len, block_size=bs, kv="int8",
                               q_dtype=q_dtype, gen=g1)
                g2 = torch.Generator().manual_seed(seed)
                c16 = make_case(torch, w, ctx=ctx, q_len=q_len, block_size=bs, kv="fp16",
                                q_dtype=q_dtype, gen=g2)
                c16["q"] = c16["q"].to(torch.float16)
                ref = ref_attn(torch, c8["q"], c8["k_deq"], c8["v_deq"], ctx, rows)
                ref16 = ref_attn(torch, c8["q"], c8["k"].float(), c8["v"].float(), ctx, rows)
                vmax = float(c8["v"].float().abs().max())
                for var in variants:
                    cfg = VARIANTS[var] if var else None
                    o8 = torch.full((q_len, HQ, D), float("nan"), dtype=q_dtype, device="cuda")
                    o16 = torch.full((q_len, HQ, D), float("nan"), dtype=torch.float16,
                                     device="cuda")
                    run_kernel(torch, u, c8, o8, three_d=three_d, bufs=bufs, cfg=cfg)
                    run_kernel(torch, u, c16, o16, three_d=three_d, bufs=bufs, cfg=cfg)
                    torch.cuda.synchronize()
                    a, b = o8[rows].double(), o16[rows].double()
                    r = dict(case=name, block_size=bs, q_dtype=qn, variant=var or "default",
                             nan=bool(torch.isnan(o8).any() or torch.isnan(o16).any()),
                             err_deq=float((a - ref).norm() / ref.norm()),
                             err_fp16cache_vs_f64=float((b - ref16).norm() / ref16.norm()),
                             err_int8_vs_fp16cache=float((a - b).abs().max()) / vmax,
                             err_int8_vs_fp16cache_normrel=float((a - b).norm() / b.norm()))
                    gate = 1e-3 if q_dtype == torch.float16 else 1e-2
                    r["pass"] = (not r["nan"]) and r["err_deq"] <= gate and \
                        r["err_int8_vs_fp16cache"] <= 1e-2
                    res.append(r)
                    print("CHECK", json.dumps(r), flush=True)
                del c8, c16
    return res


def bench(torch, w, u, table=MAIN_ROWS, hists=(0, 8192, 16384, 28672), reps=20, rot=4):
    """Time each (kv, block, variant) of `table` at each history. Caches and queries are made
    once per (history, kv, block) and shared by that group's variants."""
    rows = []
    gen = torch.Generator().manual_seed(99)
    for hist in hists:
        ctx = hist + 4096
        groups = {}
        for kv, bs, var in table:
            groups.setdefault((kv, bs), []).append(var)
        order = []
        for kv, bs, var in table:
            if (kv, bs) not in [o[:2] for o in order]:
                order.append((kv, bs))
        results = {}
        for kv, bs in order:
            cases = [make_case(torch, w, ctx=ctx, q_len=4096, block_size=bs, kv=kv,
                               q_dtype=torch.bfloat16, gen=gen) for _ in range(rot)]
            for c in cases:
                for key in ("k_deq", "v_deq", "k", "v"):
                    c.pop(key, None)
            outs = [torch.empty(4096, HQ, D, dtype=torch.bfloat16, device="cuda") for _ in range(rot)]
            for var in groups[(kv, bs)]:
                cfg = VARIANTS[var] if var else None
                for c, o in zip(cases, outs):      # compile + warm up
                    run_kernel(torch, u, c, o, cfg=cfg)
                torch.cuda.synchronize()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    for c, o in zip(cases, outs):
                        run_kernel(torch, u, c, o, cfg=cfg)
                torch.cuda.synchronize()
                g.replay()
                torch.cuda.synchronize()
                times = []
                for _ in range(reps):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    g.replay()
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1) * 1000 / rot)
                times.sort()
                us = times[len(times) // 2]
                flops = 4 * HQ * D * 4096 * (hist + 2048)      # causal: avg keys per query
                row = dict(history=hist, chunk=4096, kv=kv, block_size=bs,
                           variant=var or "default", us=round(us, 1),
                           tflops=round(flops / us / 1e6, 1),
                           spread_pct=round(100 * (times[-1] - times[0]) / us, 1))
                results[(kv, bs, var)] = row
                print("BENCH", json.dumps(row), flush=True)
                del g
            del cases, outs
            torch.cuda.empty_cache()
        rows += [results[t] for t in table]
    return rows


def write_report(out, prov, env, checks, rows, cmd, reps=20):
    os.makedirs(out, exist_ok=True)
    slow = []
    for hist in sorted({r["history"] for r in rows}):
        b = next(r for r in rows if r["history"] == hist and r["kv"] == "bf16"
                 and r.get("variant", "default") == "default")
        for r in rows:
            if r["history"] == hist and r is not b:
                r["vs_bf16_pct"] = round(100 * (r["us"] / b["us"] - 1), 1)
                if r["kv"] == "int8" and r["block_size"] == 1552 and \
                        r.get("variant", "default") == "default":
                    slow.append(r["vs_bf16_pct"])
    doc = dict(generated_by="kernels/bench/bench_unified_int8.py", command=cmd, provenance=prov,
               environment=env, correctness=checks, benchmark=rows,
               goal="int8 (block 1552) no more than 3 % slower than bf16 (block 784)",
               goal_met=bool(slow) and all(x <= 3.0 for x in slow),
               all_checks_pass=all(c["pass"] for c in checks), variants=VARIANTS)
    with open(os.path.join(out, "unified_int8.json"), "w") as f:
        json.dump(doc, f, indent=1)
    L = ["<!-- generated by kernels/bench/bench_unified_int8.py; do not edit -->",
         "# Unified attention (patched TRITON_ATTN kernels): int8 KV cache vs bf16", "",
         f"- command: `{cmd}`",
         f"- tree commit: `{prov.get('tree_commit')}` ({prov.get('tree_subject')}); repo commit `{prov.get('repo_commit')}`",
         f"- device: {env['device']}; torch {env['torch']}, triton {env['triton']}, Python {env['python']}; date {env['date']}",
         "", "## Correctness at real sizes (24 q / 4 kv heads, head_dim 256, 32K context)", "",
         "| case | block | q dtype | 2D launch | rel. err vs f64 (dequantized) | fp16-cache kernel vs f64 | int8 vs fp16 cache, max abs / max abs(V) | same, norm-rel | pass |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        L.append(f"| {c['case']} | {c['block_size']} | {c['q_dtype']} | {c.get('variant', 'default')} | {c['err_deq']:.2e} | "
                 f"{c['err_fp16cache_vs_f64']:.2e} | {c['err_int8_vs_fp16cache']:.2e} | "
                 f"{c['err_int8_vs_fp16cache_normrel']:.2e} | {c['pass']} |")
    L += ["", "Gates: fp16 queries rel. err <= 1e-3 (bf16 queries: <= 1e-2, the bf16 output rounding "
          "alone is ~1e-3); int8 vs fp16 cache max abs error <= 1e-2 * max|V|.", "",
          "## Prefill: 2D kernel, 4096-token chunk over cached history (bf16 queries)", "",
          "2D launch: `default` = what unified_attention() picks; otherwise a forced config "
          "(mBLOCK_M wWARPS sSTAGES tTILE, see VARIANTS in the script). vs bf16: against the "
          "default bf16 row of the same history.", "",
          "| history | kv | block | 2D launch | µs | TFLOP/s | vs bf16 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['history']} | {r['kv']} | {r['block_size']} | {r.get('variant', 'default')} | {r['us']} | {r['tflops']} | "
                 f"{('%+.1f %%' % r['vs_bf16_pct']) if 'vs_bf16_pct' in r else '—'} |")
    L += ["", f"Goal: {doc['goal']} — met: **{doc['goal_met']}**. "
          f"Timing: CUDA graph of 4 launches over 4 disjoint caches, median of {reps} replays."]
    with open(os.path.join(out, "unified_int8.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    print("\n".join(L))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare")
    ap.add_argument("--payload")
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="time SWEEP_ROWS (forced 2D launch configs) instead of MAIN_ROWS, and "
                         "check the prefill case at block 1552 (fp16 queries) for each variant")
    ap.add_argument("--extra", action="append", default=[], metavar="KV:BLOCK:VARIANT",
                    help="also time this row with a forced 2D launch config, e.g. "
                         "bf16:784:m64w8s1t64 (bf16 with the int8 prefill tiles)")
    ap.add_argument("--hists", default="0,8192,16384,28672")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if a.prepare:
        prepare(a.prepare)
        return
    torch, w, u = _setup(a.payload)
    import platform

    import triton
    prov = json.load(open(os.path.join(a.payload, "provenance.json")))
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    import traceback
    checks, rows = [], []
    try:
        if a.skip_check:
            checks = []
        elif a.variants:
            checks = correctness(torch, w, u, cases=[("prefill_4k_over_28k_2d", 1552, "float16")],
                                 variants=[None, "m64w8s2t32", "m64w8s2t64"])
        else:
            checks = correctness(torch, w, u)
    except Exception:
        traceback.print_exc()
        checks = [dict(case="crashed", block_size=0, q_dtype="-", nan=True, err_deq=float("nan"),
                       err_fp16cache_vs_f64=float("nan"), err_int8_vs_fp16cache=float("nan"),
                       err_int8_vs_fp16cache_normrel=float("nan"), **{"pass": False})]
    torch.cuda.empty_cache()
    table = SWEEP_ROWS if a.variants else MAIN_ROWS + [(e.split(":")[0], int(e.split(":")[1]), e.split(":")[2]) for e in a.extra]
    hists = tuple(int(x) for x in a.hists.split(","))
    rows = bench(torch, w, u, table=table, hists=hists, reps=a.reps)
    write_report(a.out, prov, env, checks, rows, "python3 " + " ".join(sys.argv), reps=a.reps)


if __name__ == "__main__":
    main()
