#!/usr/bin/env python3
"""GPU sweep: the split-KV decode kernel's launches (TILE_N, warps, stages) and segment counts per
cache kind, at the final round's batched load, with the KV read rate as a share of copy bandwidth.

    python3 kernels/bench/sweep_decode_launch.py --out /tmp/sweep            # int8 and bf16, 24/4 heads
    python3 kernels/bench/sweep_decode_launch.py --kv int8 --batches 10,16 --contexts 16384,32768

Needs only torch and triton (no vLLM): it answers "which launch reads the int8 cache fastest" before
a full `forge calibrate --families decode`, whose decisions also weigh vLLM's kernel. Every launch is
first checked against float64 attention on two sampled sequences (NaN-poisoned output, relative
Frobenius error <= 3e-2); a failing or non-compiling one is recorded and not timed. Timing: a CUDA
graph whose launches rotate over disjoint caches (>= 512 MiB of KV per replay), median of 20
replays. Writes OUT/sweep-decode-launch.json (provenance: commit, device, versions, command),
rewritten after every point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "kernels"))

import torch  # noqa: E402
import triton  # noqa: E402
from calibrate import common as C  # noqa: E402
from calibrate.attention import DECODE_LAUNCHES, Shape  # noqa: E402
from calibrate.decode_inputs import decode_batch, decode_ref  # noqa: E402
from forge_triton import split_kv_decode as DEC  # noqa: E402

sys.path.insert(0, HERE)
from graph_timing import copy_bandwidth  # noqa: E402  (the same copy rate as the batched benchmark)

D = 256
BLOCK = {"bf16": 784, "int8": 1552}
# the calibration's launches (kernels/calibrate/attention.py DECODE_LAUNCHES), int8 with two more
LAUNCHES = {"int8": [*DECODE_LAUNCHES[("cuda", "int8")], (128, 8, 1), (32, 8, 2)],
            "bf16": list(DECODE_LAUNCHES[("cuda", "16bit")])}
MIN_TOUCH = 512 << 20
TOL = 3e-2


def kv_bytes(lens, hkv, kv):
    per_tok = hkv * D * 2 * (1 if kv == "int8" else 2) + (hkv * 8 if kv == "int8" else 0)
    return sum(lens) * per_tok


def provenance():
    def sh(*a):
        try:
            return subprocess.run(a, cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip() or None
        except Exception:  # noqa: BLE001 - a copy without git
            return None
    return {"commit": sh("git", "rev-parse", "HEAD"), "dirty": bool(sh("git", "status", "--porcelain")),
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "command": shlex.join([sys.executable, *sys.argv])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "reports", "kernels", "decode-launch"))
    ap.add_argument("--kv", default="int8,bf16")
    ap.add_argument("--batches", default="10,16")
    ap.add_argument("--contexts", default="16384,32768")
    ap.add_argument("--heads", default="24/4", help="q/KV heads per rank")
    ap.add_argument("--seg-factors", default="0.5,1,2", help="segment counts as multiples of the built-in")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_decode_launch.py: needs a GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    hq, hkv = (int(x) for x in a.heads.split("/"))
    sh = Shape(False, (hq, hkv))                   # the calibration's decode batches and float64 reference
    cus = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    res = {"provenance": provenance(), "copy_bandwidth": bw, "heads": [hq, hkv], "points": []}
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {cus} SMs, heads {hq}/{hkv}")
    print(f"{'kv':5} {'B':>3} {'ctx':>6} {'S':>4} {'TILE_N':>6} {'warps':>5} {'stages':>6} {'us':>9} {'%bw':>6}  note")
    for kv in a.kv.split(","):
        for B in (int(x) for x in a.batches.split(",")):
            s0 = DEC.choose_num_segments(cus, B, hkv, 32768)
            segs = sorted({max(1, min(256, int(s0 * float(f)))) for f in a.seg_factors.split(",")})
            for ctx in (int(x) for x in a.contexts.split(",")):
                def batch(seed):
                    return decode_batch(torch, sh, batch=B, context=ctx, kv=kv, block=BLOCK[kv], gen=gen, seed=seed)
                one = batch(a.seed + B + ctx)
                rot = max(1, min(8, math.ceil(MIN_TOUCH / kv_bytes(one["lens"], hkv, kv))))
                cases = [one] + [batch(a.seed + B + ctx + 7919 * j) for j in range(1, rot)]
                check = sorted({0, B - 1})
                r = decode_ref(torch, sh, one, check)
                nbytes = kv_bytes(one["lens"], hkv, kv)
                builtin = (s0, *DEC.default_launch_config(torch.int8 if kv == "int8" else torch.bfloat16, D,
                                                          False, B))
                for S in segs:
                    for launch in LAUNCHES[kv]:
                        rec = {"kv": kv, "batch": B, "context": ctx, "segments": S, "launch": list(launch),
                               "builtin": (S, *launch) == builtin, "us": None, "frac": None, "err": None,
                               "error": None}
                        try:
                            fns, outs = [], []
                            for c in cases:
                                out = torch.full_like(c["q"], float("nan"))
                                ws = DEC.decode_workspace(B, hq, D, S, "cuda")
                                outs.append(out)
                                fns.append(lambda c=c, out=out, ws=ws, launch=launch, S=S: DEC.split_kv_decode(
                                    c["q"], c["kc"], c["vc"], c["bt"], c["sl"], D ** -0.5, out,
                                    k_scale_cache=c["ks"], v_scale_cache=c["vs"], num_segments=S, workspace=ws,
                                    tile_n=launch[0], num_warps=launch[1], num_stages=launch[2]))
                            fns[0]()
                            torch.cuda.synchronize()
                            err = float(torch.linalg.norm(outs[0][check].double() - r) / torch.linalg.norm(r))
                            rec["err"] = err if math.isfinite(err) else None
                            if math.isfinite(err) and err <= TOL:
                                us = C.time_graph(torch, fns, reps=20)["median"]
                                rec["us"], rec["frac"] = us, nbytes / (us * 1e-6) / bw
                        except Exception as e:  # noqa: BLE001 - does not compile / fit on this device
                            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                        res["points"].append(rec)
                        note = "built-in" if rec["builtin"] else ""
                        if rec["error"] or rec["us"] is None:
                            note = rec["error"] or f"error {rec['err']}"
                        us_s = f"{rec['us']:9.1f}" if rec["us"] else f"{'-':>9}"
                        fr_s = f"{100 * rec['frac']:5.1f}%" if rec["frac"] else f"{'-':>6}"
                        print(f"{kv:5} {B:>3} {ctx:>6} {S:>4} {launch[0]:>6} {launch[1]:>5} {launch[2]:>6} "
                              f"{us_s} {fr_s}  {note}", flush=True)
                        with open(os.path.join(a.out, "sweep-decode-launch.json"), "w") as f:
                            json.dump(res, f, indent=1)
                cases = one = None
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
