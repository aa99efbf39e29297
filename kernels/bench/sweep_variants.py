#!/usr/bin/env python3
"""One GPU run comparing decode variants (and the write kernel's tokens per program) at the
points that decide the defaults, side by side with the kept previous version and vLLM.

    python3 kernels/bench/sweep_variants.py --payload build/gpu-payload --out <dir>

(1) correctness checks of the current kernels (as bench_kernels.py), (2) copy bandwidth,
(3) at (B=1: 1K, 4K, 32K; B=8: 1K, 32K), bf16 (block 784) and int8 (block 1552): the previous
version (kernels/bench/baseline/split_kv_decode_v2.py, its own defaults), vLLM's unified 3D and
grouped kernels (bf16), and the current kernel over launch configs x segment counts x fused /
two-launch merge x minimum segment length, (4) write kernel: previous version vs 1/2/4/8 tokens
per program. Writes sweep.json and prints a short table last (best variant per point).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as BK  # noqa: E402

V2 = BK._load("forge_split_kv_decode_v2", os.path.join(BK.HERE, "baseline", "split_kv_decode_v2.py"))
W1 = BK._load("forge_int8_kv_write_v1", os.path.join(BK.HERE, "baseline", "int8_kv_write_v1.py"))

CFGS = {"bf16": [(32, 4, 2), (64, 4, 2), (32, 4, 3), (16, 4, 4)],
        "int8": [(64, 4, 2), (32, 4, 3), (64, 8, 2), (32, 4, 2)]}
POINTS = [(1, 1024), (1, 4096), (1, 32768), (8, 1024), (8, 32768)]


def svars(B, L):
    """(S, fused, min_segment_tokens) variants per point."""
    if B == 1:
        v = [(16, True, None), (32, True, None), (32, False, None), (64, False, None)]
        if L <= 4096:
            v += [(32, True, 128), (64, False, 128)]
        return v
    return [(4, True, None), (8, True, None), (16, True, None), (8, False, None)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--payload", default=os.path.join(BK.REPO, "build", "gpu-payload"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/forge-sweep"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    dev = BK.torch.cuda.get_device_properties(0)
    ncu = dev.multi_processor_count
    res = dict(device=dev.name, torch=BK.torch.__version__, triton=BK.triton.__version__,
               correctness=[], points=[], write=[], errors=[])

    def save():
        json.dump(res, open(os.path.join(a.out, "sweep.json"), "w"), indent=1)

    up = BK.Upstream(a.payload)
    try:
        BK.check_decode(res["correctness"], up)
    except Exception:
        res["errors"].append("check decode: " + traceback.format_exc()[-2000:])
    try:
        BK.check_write(res["correctness"], None)
    except Exception:
        res["errors"].append("check write: " + traceback.format_exc()[-2000:])
    bad = [c for c in res["correctness"] if not c.get("ok")]
    print(f"correctness {len(res['correctness']) - len(bad)}/{len(res['correctness'])} ok", flush=True)
    for c in bad:
        print("FAILED CHECK", c)
    res["copy_bw_Bps"] = BK.copy_bandwidth()
    save()
    for kind, bs in (("bf16", 784), ("int8", 1552)):
        for B, L in POINTS:
            try:
                recs = BK.bench_point(kind, bs, B, L, [BK.DEC.default_launch_config(
                    BK.torch.int8 if kind == "int8" else BK.torch.bfloat16, BK.D, is_hip=False)],
                    up, ncu, which=("forge", "unified", "grouped"), dec=V2, label="v2")
                for S, fused, ms in svars(B, L):
                    recs += BK.bench_point(kind, bs, B, L, [c + (fused, ms) for c in CFGS[kind]],
                                           up, ncu, which=("forge",), S_list=[S])
                res["points"] += recs
            except Exception:
                res["errors"].append(f"{kind} B={B} L={L}: " + traceback.format_exc()[-1500:])
            print(f"{kind} B={B} L={L} done {time.time() - t0:.0f}s", flush=True)
            save()
    writers = [("v1", W1.int8_kv_write)] + [
        (f"tpp{t}", (lambda t: lambda *x: BK.WR.int8_kv_write(*x, tokens_per_program=t))(t))
        for t in (1, 2, 8)]
    try:
        res["write"] = BK.bench_write(None, res["copy_bw_Bps"], extra_writers=writers)
    except Exception:
        res["errors"].append("write: " + traceback.format_exc()[-1500:])
    res["wall_s"] = time.time() - t0
    save()
    # short table: per point, v2 / vLLM / best current variant and the current defaults' variant
    print("\n== sweep (us)")
    for kind in ("bf16", "int8"):
        for B, L in POINTS:
            rs = [r for r in res["points"] if r["kv"] == kind and r["batch"] == B and r["context"] == L and "us" in r]
            v2 = [r for r in rs if r["kernel"] == "v2"]
            u = [r for r in rs if r["kernel"] == "vllm_unified_3d"]
            cur = sorted((r for r in rs if r["kernel"] == "forge"), key=lambda r: r["us"])
            top = "; ".join(f"{r['tile']},{r['warps']},{r['stages']} S{r['S']}{'F' if r['fused'] else ''}"
                            f"{'m' + str(r['min_seg']) if r['min_seg'] else ''}={r['us']:.1f}" for r in cur[:4])
            print(f"{kind} B={B} L={L}: v2 {v2[0]['us'] if v2 else float('nan'):.1f} 3D "
                  f"{u[0]['us'] if u else float('nan'):.1f} | {top}")
    for w in res["write"]:
        print("write", w["kernel"], w["case"], round(w.get("us_per_layer", w.get("us", 0)), 2),
              round(w.get("frac_copy_bw", 0) or 0, 3))
    print(f"copy {res['copy_bw_Bps'] / 1e12:.3f} TB/s; errors {len(res['errors'])}; wall {res['wall_s']:.0f}s")
    for e in res["errors"]:
        print("ERROR", e[-800:])


if __name__ == "__main__":
    main()
