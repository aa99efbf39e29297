#!/usr/bin/env python3
"""Chunked-prefill attention on a GPU machine: our kernel against vLLM's unified 2D kernel
(upstream tiles and our 64-row tiles) and torch SDPA's flash backend on the same work.

    python3 kernels/bench/bench_unified_int8.py --prepare build/gpu-prefill   # dev machine (needs build/vllm)
    python3 kernels/bench/bench_prefill.py --payload build/gpu-prefill --out <dir> [--quick]

Shapes: Qwen3.5-27B full attention, 24 query / 4 KV heads, head_dim 256, bf16 queries.
Cases: one sequence, chunk C in {2048, 8192} over a cached prefix P in {0, 8K, 16K, 24K}; bf16
cache at block 784 and int8 cache at block 1552 (the hybrid page sizes). The chunk's own K/V are
written into the cache too (vLLM writes before attention), so the unified kernel reads them from
there while ours reads them from the projection output.

Whole prompt: a 22,000-token prompt in chunks of 2048 or 8192 (the per-chunk times summed),
against SDPA flash over the whole prompt at once (causal, GQA expanded) — the anchor.
FLOPs counted: 4 * Hq * D * (C * P + C * (C + 1) / 2) per chunk.
Timing: triton.testing.do_bench median (ms), inputs far beyond L2 at long prefixes. The bf16
matrix peak is measured in the same run (8192^3 torch.matmul) and each kernel's rate is given as a
fraction of it. Writes <out>/prefill.json and <out>/prefill.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
HQ, HKV, D = 24, 4, 256
SCALE = D ** -0.5
PROMPT = 22000


def _load_ours():
    sys.path.insert(0, os.path.join(REPO, "kernels"))   # the import root of our kernels (forge_triton)
    from forge_triton import prefill_attention
    return prefill_attention


def flops(c: int, p: int) -> float:
    return 4.0 * HQ * D * (c * p + c * (c + 1) / 2)


def make_case(torch, *, prefix, chunk, kv, block_size, gen):
    dev = "cuda"
    total = prefix + chunk
    nblk = math.ceil(total / block_size)
    nb = nblk + 2
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(prefix + chunk))
    bt = perm[:nblk].to(torch.int32)[None].to(dev)
    q = torch.randn(chunk, HQ, D, generator=gen, device=dev).to(torch.bfloat16)
    k_all = torch.randn(total, HKV, D, generator=gen, device=dev).to(torch.bfloat16)
    v_all = torch.randn(total, HKV, D, generator=gen, device=dev).to(torch.bfloat16)
    blocks = bt[0].long()
    pad = nblk * block_size - total
    def paged(x):
        x = torch.cat([x, x.new_zeros(pad, HKV, D)]).view(nblk, block_size, HKV, D)
        return x
    if kv == "int8":
        kc = torch.zeros(nb, block_size, HKV, D, dtype=torch.int8, device=dev)
        vc = torch.zeros_like(kc)
        ks = torch.ones(nb, HKV, block_size, dtype=torch.float32, device=dev)
        vs = torch.ones_like(ks)
        for src, dst, sc in ((k_all, kc, ks), (v_all, vc, vs)):
            xf = src.float()
            s = (xf.abs().amax(-1) / 127.0).clamp_min(1e-10)                 # (total, H)
            qv = torch.round(xf / s[..., None]).clamp(-127, 127).to(torch.int8)
            dst[blocks] = paged(qv)
            sp = torch.cat([s, s.new_ones(pad, HKV)]).view(nblk, block_size, HKV).permute(0, 2, 1)
            sc[blocks] = sp
    else:
        kc = torch.zeros(nb, block_size, HKV, D, dtype=torch.bfloat16, device=dev)
        vc = torch.zeros_like(kc)
        kc[blocks] = paged(k_all)
        vc[blocks] = paged(v_all)
        ks = vs = None
    if kv == "int8":
        # the reference sees what the cache holds: the prefix dequantized, the chunk as computed
        def deq(cache, sc):
            x = cache[blocks].float() * sc[blocks].permute(0, 2, 1)[..., None]
            return x.reshape(nblk * block_size, HKV, D)[:prefix]
        k_ref = torch.cat([deq(kc, ks), k_all[prefix:].float()])
        v_ref = torch.cat([deq(vc, vs), v_all[prefix:].float()])
    else:
        k_ref, v_ref = k_all, v_all
    return dict(q=q, k_new=k_all[prefix:].contiguous(), v_new=v_all[prefix:].contiguous(),
                k_all=k_all, v_all=v_all, k_ref=k_ref, v_ref=v_ref, kc=kc, vc=vc, ks=ks, vs=vs, bt=bt,
                cu=torch.tensor([0, chunk], dtype=torch.int32, device=dev),
                sl=torch.tensor([total], dtype=torch.int32, device=dev),
                prefix=prefix, chunk=chunk)


def run_ours(pre, c, out, **kw):
    # as the TRITON_ATTN route calls it: with the batch's max_seqlen_k (an int8 prefix is widened
    # to 16 bits first unless int8_prefix="inline")
    pre.prefill_attention(c["q"], c["k_new"], c["v_new"], c["kc"], c["vc"], c["bt"], c["cu"],
                          c["sl"], SCALE, out, k_scale_cache=c["ks"], v_scale_cache=c["vs"],
                          max_seqlen_k=c["prefix"] + c["chunk"], **kw)


def run_unified(torch, u, c, out):
    one = torch.ones((1, HKV), dtype=torch.float32, device="cuda")
    u.unified_attention(q=c["q"], k=c["kc"], v=c["vc"], out=out, cu_seqlens_q=c["cu"],
                        max_seqlen_q=c["chunk"], seqused_k=c["sl"],
                        max_seqlen_k=c["prefix"] + c["chunk"], softmax_scale=SCALE, causal=True,
                        window_size=(-1, -1), block_table=c["bt"], softcap=0, q_descale=None,
                        k_descale=one, v_descale=one, k_scale_cache=c["ks"],
                        v_scale_cache=c["vs"])


def ref_rows(torch, c, rows):
    """float64 attention of the given chunk rows over prefix + chunk (the bf16 values)."""
    g = HQ // HKV
    q = c["q"][rows].double().view(len(rows), HKV, g, D)
    k = c["k_ref"].double()
    v = c["v_ref"].double()
    s = torch.einsum("nhgd,lhd->hgnl", q, k) * SCALE
    pos_q = torch.tensor(rows, device="cuda") + c["prefix"]
    s = s.masked_fill(torch.arange(k.shape[0], device="cuda")[None, :] > pos_q[:, None],
                      float("-inf"))
    return torch.einsum("hgnl,lhd->nhgd", torch.softmax(s, -1), v).reshape(len(rows), HQ, D)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payload", required=True, help="folder made by bench_unified_int8.py --prepare")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true",
                    help="prefix 16K only; whole prompt for our kernel only; no sweep")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.payload))
    import torch
    import triton
    from triton.testing import do_bench
    from vllm import envs as shim_envs
    from vllm.v1.attention.ops import triton_unified_attention as u
    pre = _load_ours()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    bench = lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192 ** 3 / (bench(lambda: a @ b) * 1e-3) / 1e12
    a = b = None  # frees them (the lambda above holds the cells)
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s (the peak the fractions below use)")

    rows = []
    chunks = [2048, 8192]
    prefixes = [0, 8192, 16384, 24576] if not args.quick else [16384]
    kinds = [("bf16", 784), ("int8", 1552)]
    for kv, bs in kinds:
        for chunk in chunks:
            for prefix in prefixes:
                c = make_case(torch, prefix=prefix, chunk=chunk, kv=kv, block_size=bs, gen=gen)
                out = torch.full_like(c["q"], float("nan"))
                run_ours(pre, c, out)
                torch.cuda.synchronize()
                sample = sorted({0, chunk // 3, chunk - 1})
                ref = ref_rows(torch, c, sample)
                got = out[sample].double()
                err = float((got - ref).norm() / ref.norm())
                r = dict(kv=kv, block=bs, chunk=chunk, prefix=prefix, gflop=flops(chunk, prefix) / 1e9,
                         rel_err_vs_f64=err, all_written=bool(torch.isfinite(out).all()))
                r["ours_ms"] = bench(lambda: run_ours(pre, c, out))
                if kv == "int8":
                    r["ours_inline_ms"] = bench(lambda: run_ours(pre, c, out, int8_prefix="inline"))
                o2 = torch.empty_like(out)
                shim_envs.VLLM_FORGE_PREFILL_TILES = True
                r["tiles64_ms"] = bench(lambda: run_unified(torch, u, c, o2))
                if kv == "bf16":
                    shim_envs.VLLM_FORGE_PREFILL_TILES = False
                    r["upstream_ms"] = bench(lambda: run_unified(torch, u, c, o2))
                    shim_envs.VLLM_FORGE_PREFILL_TILES = True
                # SDPA flash on the same work: chunk-over-prefix (no mask) + chunk causal
                qs = c["q"].permute(1, 0, 2)[None]
                kk = c["k_all"].repeat_interleave(HQ // HKV, 1).permute(1, 0, 2)[None]
                vv = c["v_all"].repeat_interleave(HQ // HKV, 1).permute(1, 0, 2)[None]
                kp, vp = kk[:, :, :prefix], vv[:, :, :prefix]
                kn, vn = kk[:, :, prefix:], vv[:, :, prefix:]
                from torch.nn.attention import SDPBackend, sdpa_kernel
                F = torch.nn.functional
                def sdpa():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        if prefix:
                            F.scaled_dot_product_attention(qs, kp, vp)
                        F.scaled_dot_product_attention(qs, kn, vn, is_causal=True)
                try:
                    r["sdpa_flash_ms"] = bench(sdpa)
                except RuntimeError as e:  # no flash backend for this shape/device
                    r["sdpa_flash_ms"] = None
                    r["sdpa_error"] = str(e)[:200]
                for key in ("ours", "tiles64", "upstream", "sdpa_flash"):
                    ms = r.get(f"{key}_ms")
                    if ms:
                        r[f"{key}_tflops"] = r["gflop"] / ms
                rows.append(r)
                print(f"{kv:5s} C={chunk:5d} P={prefix:5d}: ours {r['ours_ms']:.3f} ms "
                      f"({r['ours_tflops']:.0f} TF/s), tiles64 {r['tiles64_ms']:.3f}, "
                      f"upstream {r.get('upstream_ms') or float('nan'):.3f}, "
                      f"sdpa {r.get('sdpa_flash_ms') or float('nan'):.3f}; err {err:.2e}", flush=True)
                c = out = o2 = kk = vv = None  # frees them (the lambdas above hold the cells)

    # whole 22K prompt in chunks, per layer
    whole = []
    for kv, bs in kinds:
        for chunk in chunks:
            t = {"ours": 0.0, "tiles64": 0.0, "upstream": 0.0}
            for start in range(0, PROMPT, chunk):
                n = min(chunk, PROMPT - start)
                c = make_case(torch, prefix=start, chunk=n, kv=kv, block_size=bs, gen=gen)
                out = torch.empty_like(c["q"])
                t["ours"] += bench(lambda: run_ours(pre, c, out))
                if args.quick:
                    del c, out
                    continue
                shim_envs.VLLM_FORGE_PREFILL_TILES = True
                t["tiles64"] += bench(lambda: run_unified(torch, u, c, out))
                if kv == "bf16":
                    shim_envs.VLLM_FORGE_PREFILL_TILES = False
                    t["upstream"] += bench(lambda: run_unified(torch, u, c, out))
                    shim_envs.VLLM_FORGE_PREFILL_TILES = True
                del c, out
            whole.append(dict(kv=kv, block=bs, chunk=chunk, prompt=PROMPT,
                              ours_ms=t["ours"], tiles64_ms=t["tiles64"] or None,
                              upstream_ms=(t["upstream"] or None) if kv == "bf16" else None))
    qf = torch.randn(1, HQ, PROMPT, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kf = torch.randn(1, HKV, PROMPT, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kf = kf.repeat_interleave(HQ // HKV, 1)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_whole = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            qf, kf, kf, is_causal=True))
    whole_flop = flops(PROMPT, 0) / 1e9
    for w in whole:
        w["sdpa_flash_whole_ms"] = sdpa_whole
        w["ours_vs_sdpa"] = w["ours_ms"] / sdpa_whole
        w["ours_tflops"] = whole_flop / w["ours_ms"]
        print(f"22K prompt {w['kv']} chunks of {w['chunk']}: ours {w['ours_ms']:.1f} ms/layer "
              f"({w['ours_vs_sdpa']:.2f}x SDPA flash {sdpa_whole:.1f}), tiles64 {w['tiles64_ms'] or float('nan'):.1f}, "
              f"upstream {w['upstream_ms'] or float('nan'):.1f}", flush=True)

    sweep = []
    if not args.quick:
        variants = [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 3),
                    (128, 64, 8, 3), (128, 128, 8, 2), (256, 32, 8, 2), (64, 32, 4, 3)]
        for kv, bs in kinds:
            for chunk, prefix in ((2048, 16384), (8192, 0)):
                c = make_case(torch, prefix=prefix, chunk=chunk, kv=kv, block_size=bs, gen=gen)
                out = torch.empty_like(c["q"])
                for bm, tn, nw, ns in variants:
                    try:
                        run_ours(pre, c, out, block_m=bm, tile_n=tn, num_warps=nw, num_stages=ns)
                        ms = bench(lambda: run_ours(pre, c, out, block_m=bm, tile_n=tn,
                                                    num_warps=nw, num_stages=ns))
                    except Exception as e:  # e.g. out of shared memory
                        ms = None
                        print(f"variant {(bm, tn, nw, ns)}: {type(e).__name__}: {str(e)[:120]}")
                    sweep.append(dict(kv=kv, chunk=chunk, prefix=prefix, launch=[bm, tn, nw, ns],
                                      ms=ms, tflops=(flops(chunk, prefix) / 1e9 / ms) if ms else None))
                    print(f"sweep {kv} C={chunk} P={prefix} {(bm, tn, nw, ns)}: "
                          f"{ms if ms is None else round(ms, 3)} ms", flush=True)
                del c, out

    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    prov = {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "kernels")),
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
            "default_launch": {"16bit": pre.launch_config(torch.bfloat16, False),
                               "int8": pre.launch_config(torch.int8, False)},
            "bf16_matmul_tflops": peak}
    payload_prov = os.path.join(args.payload, "provenance.json")
    if os.path.exists(payload_prov):
        prov["payload"] = json.load(open(payload_prov))
    doc = {"provenance": prov, "cases": rows, "whole_prompt": whole, "sweep": sweep}
    with open(os.path.join(args.out, "prefill.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "prefill.md"), "w") as f:
        f.write(render(doc))
    print(render(doc))
    bad = [r for r in rows if not r["all_written"] or not r["rel_err_vs_f64"] < 4e-3]
    if bad:
        print(f"FAILED correctness in {len(bad)} case(s)")
        return 1
    return 0


def render(doc: dict) -> str:
    p = doc["provenance"]
    peak = p["bf16_matmul_tflops"]
    out = ["# Chunked-prefill attention: ours vs vLLM's unified 2D kernel and SDPA flash",
           "", f"Generated by `{p['command']}` at commit `{p['commit'][:10]}`"
           f"{' (kernels dirty)' if p['dirty'] else ''} on {p['device']}, torch {p['torch']}, "
           f"triton {p['triton']}, {p['date']}. bf16 matmul peak measured in the same run: "
           f"{peak:.0f} TFLOP/s. 24 q / 4 kv heads, head_dim 256; times are per layer (median, ms).",
           "", "ours: the route's call (an int8 prefix widened to 16 bits first); ours inline: int8 tiles "
           "converted inside the loop.",
           "", "| cache | chunk | prefix | ours | TF/s | % peak | ours inline | 64-row tiles | upstream tiles | SDPA flash | vs 64-row | err vs f64 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"
    ratio = lambda a, b: "-" if not a else f"{a / b:.1f}x"
    for r in doc["cases"]:
        out.append(f"| {r['kv']}@{r['block']} | {r['chunk']} | {r['prefix']} | {r['ours_ms']:.3f} | "
                   f"{r['ours_tflops']:.0f} | {100 * r['ours_tflops'] / peak:.0f} | {fmt(r.get('ours_inline_ms'))} | {fmt(r['tiles64_ms'])} | "
                   f"{fmt(r.get('upstream_ms'))} | {fmt(r.get('sdpa_flash_ms'))} | "
                   f"{r['tiles64_ms'] / r['ours_ms']:.2f}x | {r['rel_err_vs_f64']:.1e} |")
    out += ["", f"## A {PROMPT}-token prompt in chunks (sum over chunks, per layer)", "",
            "| cache | chunk | ours (ms) | TF/s | vs SDPA flash whole prompt | 64-row tiles | upstream tiles | upstream / ours |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w in doc["whole_prompt"]:
        up = w["upstream_ms"]
        out.append(f"| {w['kv']}@{w['block']} | {w['chunk']} | {w['ours_ms']:.1f} | {w['ours_tflops']:.0f} | "
                   f"{w['ours_vs_sdpa']:.2f}x ({w['sdpa_flash_whole_ms']:.1f} ms) | {fmt(w['tiles64_ms'])} | "
                   f"{fmt(up)} | {ratio(up, w['ours_ms'])} |")
    if doc["sweep"]:
        out += ["", "## Launch sweep (BLOCK_M, TILE_N, warps, stages)", "",
                "| cache | chunk | prefix | launch | ms | TF/s |", "|---|---:|---:|---|---:|---:|"]
        for s in doc["sweep"]:
            out.append(f"| {s['kv']} | {s['chunk']} | {s['prefix']} | {tuple(s['launch'])} | "
                       f"{fmt(s['ms'])} | {'-' if not s['tflops'] else round(s['tflops'])} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
