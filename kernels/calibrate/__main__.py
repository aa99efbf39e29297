# SPDX-License-Identifier: Apache-2.0
"""One calibration family in this process: `python -m calibrate FAMILY --out FILE [...]` with
kernels/ on the import path. `forge calibrate` runs each family in a child process of its own, so a
candidate that faults the GPU or kills the process costs that family, not the calibration.

Writes FILE (JSON: family, device identity, records, notes, seconds) when the family finishes;
prints progress lines as it goes; exit 0 when the family ran (whatever its candidates did), 2 for a
bad argument, anything else when the process itself failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # kernels/: forge_triton, forge_tuned, calibrate

FAMILIES = ("gemv", "prefill", "decode", "write", "gemm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=FAMILIES)
    ap.add_argument("--out", required=True, help="the family's JSON file")
    ap.add_argument("--kernels", choices=("installed", "checkout"), default="checkout",
                    help="our Triton kernels as installed in vLLM, or from this checkout's kernels/")
    ap.add_argument("--ops", choices=("vllm", "build"), default="build",
                    help="the GEMV compiled into the installed vLLM, or built from kernels/csrc")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and candidates (a first look)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes under Triton's interpreter on a CPU: the plumbing, not the numbers")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree: measure one rank's shapes (attention heads 24/tp q, max(1, 4/tp) KV)")
    ap.add_argument("--heads", default=None,
                    help="Q,KV heads of one rank (default: derived from --tp); `forge calibrate` passes the model's")
    ap.add_argument("--workdir", default=None, help="where a family keeps side files (default: beside --out)")
    ap.add_argument("--resume", action="store_true",
                    help="after a process of this family died: keep OUT.partial.jsonl's candidates, record those "
                         "in OUT.killers.jsonl as failed, measure the rest")
    args = ap.parse_args(argv)
    args.workdir = args.workdir or os.path.dirname(os.path.abspath(args.out))
    from calibrate import common
    try:
        args.heads = tuple(int(x) for x in args.heads.split(",")) if args.heads else common.rank_heads(args.tp)
        if len(args.heads) != 2 or min(args.heads) < 1 or args.heads[0] % args.heads[1]:
            raise ValueError(f"--heads {args.heads}: two counts, Q a multiple of KV")
    except ValueError as e:
        ap.error(str(e))

    import forge_tuned
    import torch
    from calibrate import attention, gemv, misc
    run = {"gemv": gemv.run, "prefill": attention.prefill, "decode": attention.decode,
           "write": misc.write, "gemm": misc.gemm}[args.family]
    args.ledger = common.Ledger(args.out, args.resume)
    t0 = time.time()
    doc = run(torch, args, lambda done, total, what: common.progress(args.family, done, total, what))
    doc.update(family=args.family, device=forge_tuned.device_identity(), seconds=round(time.time() - t0, 1),
               options={"kernels": args.kernels, "ops": args.ops, "quick": args.quick, "smoke": args.smoke,
                        "seed": args.seed, **({"tp": args.tp} if args.tp != 1 else {})},
               geometry={"tp": args.tp, "heads": list(args.heads)})
    common.write_doc(args.out, doc)
    args.ledger.finish()
    bad = [r for r in doc["records"] if common.failed(r)]
    skipped = sum(1 for r in doc["records"] if r.get("not_timed"))
    print(f"[calibrate {args.family}] done in {doc['seconds']} s: {len(doc['records'])} records, "
          f"{len(bad)} failed" + (f", {skipped} not timed" if skipped else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
