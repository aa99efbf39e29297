#!/usr/bin/env python3
"""On a GPU machine: check that the GEMV's GPU tests fail on a kernel broken on purpose. Each mutation
below is one textual change to kernels/csrc/forge_gemv.cu; the tool writes the mutant beside the build
(FORGE_GEMV_BUILD_DIR), builds it (gemv_ext, a cache folder per source) and runs the named tests of
tests/kernels/test_forge_gemv.py against it (FORGE_GEMV_SOURCE). A mutant the tests pass is a gap in them.

    python3 kernels/bench/gemv_mutants.py [--out FILE] [NAME ...]

Exit 0 when every mutant run fails its tests (killed), 1 when one survives, 2 on a mutation that no
longer applies to the source (the source changed: update the mutation). Prints one line per mutant.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import gemv_ext  # noqa: E402

SKINNY_TESTS = "1_to_16 or 5_to_16 or skinny"
# name -> (the text replaced, its replacement, the tests that must fail)
MUTANTS = {
    "mt8-takes-9-16": ("if (p.M <= 8) return Launcher<BLOCK, ROWS, 8, SILU, VEC>::go(p, stream);",
                       "if (p.M <= 16) return Launcher<BLOCK, ROWS, 8, SILU, VEC>::go(p, stream);", SKINNY_TESTS),
    "rows-loop-skips-row-0": ("    if (m >= M) break;  // uniform in the block; rows past M are never read\n",
                              "    if (m >= M) break;  // uniform in the block; rows past M are never read\n"
                              "    if (m == 0) continue;\n", SKINNY_TESTS),
    "rows-pipeline-drops-last-chunk": (
        "          fma_chunk_rows<NWR, MT>(acc, w0, p.x, p.x_stride, kv, p.M);\n          if (next >= K8) break;\n",
        "          if (next >= K8) break;\n          fma_chunk_rows<NWR, MT>(acc, w0, p.x, p.x_stride, kv, p.M);\n",
        SKINNY_TESTS),
    "rows-loop-x-stride-rounded": ("reinterpret_cast<const uint4*>(x + m * x_stride)[kv]",
                                   "reinterpret_cast<const uint4*>(x + m * (x_stride & ~int64_t(127)))[kv]",
                                   "skinny_strided"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"mutants to run (default: all: {', '.join(MUTANTS)})")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--build-only", action="store_true", help="build the mutants (in parallel) and stop")
    args = ap.parse_args()
    names = args.names or list(MUTANTS)
    for n in names:
        if n not in MUTANTS:
            ap.error(f"unknown mutant {n!r}; known: {', '.join(MUTANTS)}")
    src = gemv_ext.SOURCE.read_text()
    folder = gemv_ext.build_dir() / "mutants"
    folder.mkdir(parents=True, exist_ok=True)
    results, rc, paths = {}, 0, {}
    for n in names:
        old, new, _ = MUTANTS[n]
        if src.count(old) != 1:
            print(f"{n}: the text it replaces is not in the source once ({src.count(old)} times): update it", flush=True)
            results[n] = "stale"
            rc = max(rc, 2)
            continue
        paths[n] = folder / f"{n}.cu"
        paths[n].write_text(src.replace(old, new))
    # the mutants' builds run side by side (one compiler process each), then the tests one mutant at a time
    build = "import sys; sys.path.insert(0, sys.argv[1]); import gemv_ext; gemv_ext.load()"
    procs = {n: subprocess.Popen([sys.executable, "-c", build, str(HERE)], env=dict(os.environ, FORGE_GEMV_SOURCE=str(pth)),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n, pth in paths.items()}
    for n, pr in procs.items():
        log, _ = pr.communicate()
        if pr.returncode != 0:
            print(f"{n}: the mutant does not build:\n{log[-2000:]}", flush=True)
    if args.build_only:
        return rc
    for n, path in paths.items():
        tests = MUTANTS[n][2]
        env = dict(os.environ, FORGE_GEMV_SOURCE=str(path))
        r = subprocess.run([sys.executable, "-m", "pytest", "tests/kernels/test_forge_gemv.py", "-q", "-x",
                            "-p", "no:cacheprovider", "-k", tests], cwd=REPO, env=env, capture_output=True, text=True)
        last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
        killed = r.returncode == 1      # 1: tests failed; 0: passed (survived); else: could not run
        results[n] = {"killed": killed, "pytest_rc": r.returncode, "summary": last}
        print(f"{n}: {'killed' if killed else 'SURVIVED' if r.returncode == 0 else 'error'} ({last})", flush=True)
        if not killed:
            rc = max(rc, 1)
            if r.returncode not in (0, 1):
                print(r.stdout[-3000:] + r.stderr[-3000:], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
