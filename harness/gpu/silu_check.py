"""On a GPU machine: the harness stand-in's silu_and_mul (one Triton pass) against the native forward
vLLM's SiluAndMul runs (an eager SiLU, then the product), on Qwen3.5-27B's gate_up output (17,408 columns
per half) at prefill chunk sizes: the share of bf16 elements equal to the native result, the largest
difference, and the median time of each over 20 CUDA-event-timed calls (fresh random inputs per size).

    python3 harness/gpu/silu_check.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "kernels"))
from calibrate.common import time_events  # noqa: E402  (the calibration's event timing)

STANDIN = HERE / "overlay" / "vllm" / "_C.py"
HALF = 17408


def timed(fn, reps: int = 20) -> float:
    """Median milliseconds per call, one CUDA event pair per call."""
    return time_events(torch, fn, reps=reps)["median"] / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the results here as JSON")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("standin_C", STANDIN)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    rows = []
    for tokens in (1, 4, 1904, 4096):
        x = torch.randn(tokens, 2 * HALF, device="cuda").bfloat16() * 4
        o = torch.full((tokens, HALF), float("nan"), device="cuda", dtype=torch.bfloat16)
        ran = m._one_pass(o, x)
        ref = F.silu(x[:, :HALF]) * x[:, HALF:]
        diff = (o.float() - ref.float()).abs()
        plain_out = torch.empty_like(o)
        rows.append({"tokens": tokens, "one_pass": ran, "nan": int(o.isnan().sum()),
                     "equal_to_native": round((o == ref).float().mean().item(), 6),
                     "max_abs_diff": diff.max().item(),
                     "one_pass_ms": round(timed(lambda: m._one_pass(o, x)), 4),
                     "native_ms": round(timed(lambda: torch.mul(F.silu(x[:, :HALF]), x[:, HALF:], out=plain_out)), 4)})
    print("| tokens | one pass | NaN | equal to native | max |diff| | one pass ms | native eager ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['one_pass']} | {r['nan']} | {r['equal_to_native']:.6f} | {r['max_abs_diff']:.3g} | "
              f"{r['one_pass_ms']:.4f} | {r['native_ms']:.4f} |")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    bad = [r for r in rows if not r["one_pass"] or r["nan"] or r["equal_to_native"] < 0.99]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
