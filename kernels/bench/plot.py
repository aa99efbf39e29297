#!/usr/bin/env python3
"""Re-create bench.md and bench.png from a bench.json: python kernels/bench/plot.py JSON [OUT_DIR]."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

if __name__ == "__main__":
    src = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(src))
    res = json.load(open(src))
    report.write_reports(res, out)
    print("wrote", os.path.join(out, "bench.md"), "and bench.png" if report.plot(res, os.path.join(out, "bench.png")) else "(no matplotlib: no PNG)")
