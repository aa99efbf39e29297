#!/usr/bin/env python3
"""What bounds a split-KV decode launch, read from its compiled code (no GPU needed).

    python kernels/bench/decode_launch_ptx.py                  # int8 and bf16, the calibration's launches
    python kernels/bench/decode_launch_ptx.py --kv int8 --launch 64,8,2 --launch 128,4,2 --json out.json

Compiles ``split_kv_decode``'s stage-1 kernel for sm_90 (``triton.compile`` with the signature the JIT
specializes, as kernels/aot.py does; head_dim 256, 24 q / 4 KV heads, block 784 bf16 / 1552 int8) at
each (TILE_N, warps, stages) and prints, per launch:

  smem, regs        shared memory per program, registers per thread (ptxas)
  prog/SM           programs resident per SM: min(by registers, by shared memory, 64 warps)
  tile KiB          K + V bytes one tile reads (TILE_N tokens x 256 x 2 x element bytes)
  KiB/SM            the most KV bytes an SM has in flight: prog/SM x tile (each program keeps one tile
                    in flight: its loop waits for all its copies, `cp.async.wait_group 0`, and issues
                    the next tile's once per iteration; column `waits` lists the wait_group counts)
  instr/tile        PTX instructions per thread in the tile loop (a proxy: SASS differs)
  instr/B           instructions over all threads per KV byte
  issue@copy        the SM issue slots (4 schedulers x 32 lanes per cycle) those instructions take
                    when the KV streams at the copy rate (--copy-tbs over --sms at --ghz)
  dequant           of instr/tile: int8 -> bf16 conversions and byte extraction (cvt, prmt, bfe,
                    sub.bf16x2, and)

These are static facts of the compiled code, not timings: the GPU sweep
(kernels/bench/sweep_decode_launch.py) and `forge calibrate --families decode` measure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import aot  # noqa: E402
import triton  # noqa: E402
from calibrate.attention import DECODE_LAUNCHES  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

BLOCK = {"bf16": 784, "int8": 1552}
DEQUANT = ("cvt.rn.bf16.s32", "cvt.s32.s8", "prmt", "bfe", "sub.bf16x2", "and")
REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM = 65536, 233472, 64


def loop_body(ptx: str) -> list[str]:
    """The instructions of the longest backward-branch span (the tile loop)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\w+):", line.strip()))}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"bra(?:\.uni)?\s+(\$L__BB\w+);", line)) and labels.get(m.group(1), i) < i]
    if not spans:
        return []
    s, e = max(spans, key=lambda x: x[1] - x[0])
    out = []
    for line in lines[s:e + 1]:
        t = line.strip()
        if not t or t.startswith(("//", ".", "{", "}", "$")):
            continue
        if t.startswith("@"):
            t = t.split(None, 1)[1]
        out.append(t.split()[0])
    return out


def analyse(dec, kv: str, launch: tuple, args) -> dict:
    fn, kargs, const, warps, stages, _ = aot._decode_spec(dec, kv, BLOCK[kv], 8, False, launch=launch)
    c = triton.compile(aot._source(fn, kargs, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = c.asm["ptx"]
    st = aot._cuda_stats(ptx, 90)
    regs = st.get("registers")
    threads = 32 * warps
    smem = int(c.metadata.shared)
    by_regs = REGS_PER_SM // (-(-regs // 8) * 8 * threads) if regs else None
    progs = min(x for x in (by_regs, SMEM_PER_SM // (smem + 1024), WARPS_PER_SM // warps) if x is not None)
    tile = launch[0] * aot.HEAD * 2 * (1 if kv == "int8" else 2)
    body = loop_body(ptx)
    ops = Counter(body)
    deq = sum(n for op, n in ops.items() if op.startswith(DEQUANT))
    per_byte = len(body) * threads / tile
    bytes_per_cycle = args.copy_tbs * 1e12 / args.sms / (args.ghz * 1e9)
    return {"kv": kv, "launch": list(launch), "smem": smem, "regs": regs, "spills": st.get("spills"),
            "programs_per_sm": progs, "tile_bytes": tile, "in_flight_per_sm": progs * tile,
            "loop_instructions": len(body), "instructions_per_byte": per_byte,
            "issue_share_at_copy_rate": per_byte * bytes_per_cycle / 128.0, "dequant_instructions": deq,
            "mma": sum(n for op, n in ops.items() if op.startswith("mma")),
            "wait_groups": [int(x) for x in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", default="int8,bf16", help="cache kinds: int8, bf16")
    ap.add_argument("--launch", action="append", help="TILE_N,warps,stages (repeat; default: the calibration's)")
    ap.add_argument("--copy-tbs", type=float, default=4.13, help="copy bandwidth, TB/s (H200 measured: 4.13)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--ghz", type=float, default=1.98, help="SM clock under load")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    dec = aot.load_kernels()[1]
    rows = []
    print(f"{'kv':5} {'launch':>10} {'smem':>6} {'regs':>4} {'prog/SM':>7} {'tile KiB':>8} {'KiB/SM':>6} "
          f"{'instr/tile':>10} {'instr/B':>7} {'issue@copy':>10} {'dequant':>7}  waits")
    for kv in args.kv.split(","):
        kind = "int8" if kv == "int8" else "16bit"
        launches = [tuple(int(x) for x in s.split(",")) for s in args.launch] if args.launch \
            else DECODE_LAUNCHES[("cuda", kind)]
        for launch in launches:
            try:
                r = analyse(dec, kv, launch, args)
            except Exception as e:  # noqa: BLE001 - a launch that does not compile is reported, not fatal
                print(f"{kv:5} {','.join(map(str, launch)):>10}  does not compile: {type(e).__name__}")
                continue
            rows.append(r)
            print(f"{kv:5} {','.join(map(str, launch)):>10} {r['smem']:>6} {r['regs'] or '-':>4} "
                  f"{r['programs_per_sm']:>7} {r['tile_bytes'] / 1024:>8.0f} {r['in_flight_per_sm'] / 1024:>6.0f} "
                  f"{r['loop_instructions']:>10} {r['instructions_per_byte']:>7.2f} "
                  f"{100 * r['issue_share_at_copy_rate']:>9.0f}% {r['dequant_instructions']:>7}  "
                  f"{sorted(set(r['wait_groups']))}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "target": "cuda:90", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
