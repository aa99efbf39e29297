#!/usr/bin/env python3
"""Skinny GEMM benchmark on a GPU machine: kernels/csrc/forge_gemv.cu at 1-16 tokens against
torch.nn.functional.linear (cuBLAS / hipBLASLt) and against the weight bytes at the device's copy
bandwidth, at every bf16 linear layer of Qwen3.5-27B per rank at TP1 and TP2 (shapes derived from the
model's config), and the fused gate_up + SiLU-and-mul against F.linear + the activation.

    python3 kernels/bench/bench_skinny.py --out DIR [--tp 1,2] [--ms 1-16] [--quick] [--no-variants]

Builds the extension (kernels/bench/gemv_ext.py), checks every (shape, M) of the kernel's built-in launch
against float64 first (stops on a mismatch), measures the device-to-device copy bandwidth in the same run
(bench_gemv.copy_bandwidth), then times each case with CUDA graphs rotating over enough weight copies to
exceed the L2 (bench_gemv.Timer). Convention as bench_gemv.py: TB/s counts W + x read and y written; "% copy"
is that over the copy's read + write rate; "floor" is those bytes at the copy rate. Writes
DIR/bench_skinny.json (provenance: commit, device, versions, command) and DIR/bench_skinny.md, and prints
the table; its last section is the `gemv` part of a tuned table (kernels/forge_tuned) listing the
(shape, token count) pairs where the kernel's fastest timed launch beat F.linear in this run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import bench_gemv as BG  # noqa: E402  (beside this file: Timer, copy_bandwidth, provenance, the activation)

CONFIG = REPO / "configs" / "models" / "qwen3.5-27b" / "config.json"
L2_BYTES = 60 * 2**20
MEM_CAP = 24 * 2**30
# (block, rows) variants timed besides the built-in launch, per MT class (5-8 rows: MT 8, 9-16: MT 16);
# the ones a platform does not build are skipped (refused "is not built")
VARIANTS = {8: [(64, 2), (64, 4), (128, 2), (256, 4), (512, 2)], 16: [(64, 1), (64, 2), (128, 2), (256, 2), (512, 1)],
            4: [(64, 2), (64, 4), (128, 4)], 2: [(64, 4), (128, 4)], 1: [(128, 1), (640, 4)]}
FUSED_VARIANTS = {8: [(64, 1), (64, 2), (128, 2)], 16: [(64, 1), (128, 1)], 4: [(64, 1), (128, 2)], 2: [(128, 2)],
                  1: [(128, 1)]}


def mt_of(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8 if m <= 8 else 16


def shapes(config: dict, tp: int) -> list[tuple[str, int, int]]:
    """(layer, N, K) per rank at tensor-parallel degree `tp`: column-parallel layers split N, row-parallel
    ones K; KV heads are copied when tp exceeds them (vLLM's QKVParallelLinear)."""
    t = config.get("text_config", config)
    h, hd, hq, hkv = t["hidden_size"], t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
    nk, dk = t["linear_num_key_heads"], t["linear_key_head_dim"]
    nv, dv = t["linear_num_value_heads"], t["linear_value_head_dim"]
    inter, vocab = t["intermediate_size"], t["vocab_size"]
    gate = 2 if t.get("attn_output_gate") else 1
    for what, n in (("attention heads", hq), ("GDN heads", nk), ("GDN value heads", nv), ("MLP", inter),
                    ("vocabulary", vocab)):
        if n % tp:
            raise SystemExit(f"bench_skinny: --tp {tp} does not divide the model's {what} ({n})")
    kv_rank = max(1, hkv // tp)
    return [
        ("qkv_gate", gate * hq * hd // tp + 2 * kv_rank * hd, h),
        ("o_proj/out_proj" if hq * hd == nv * dv else "o_proj", h, hq * hd // tp),
        *([] if hq * hd == nv * dv else [("out_proj", h, nv * dv // tp)]),
        ("in_proj_qkvz", (2 * nk * dk + 2 * nv * dv) // tp, h),
        ("in_proj_ba", 2 * nv // tp, h),
        ("gate_up", 2 * inter // tp, h),
        ("down", h, inter // tp),
        ("lm_head", vocab // tp, h),
    ]


def parse_ms(text: str, top: int = 16) -> list[int]:
    """The token counts of --ms (ranges and single counts), each within 1-`top` (the kernel's range)."""
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        if not (a.strip().isdigit() and (not b or b.strip().isdigit())):
            raise SystemExit(f"bench_skinny: --ms {text!r}: expected token counts such as 1-16 or 1,2,4,8")
        out |= set(range(int(a), int(b or a) + 1))
    if not out or min(out) < 1 or max(out) > top:
        raise SystemExit(f"bench_skinny: --ms {text!r}: token counts must lie in 1-{top} (the kernel's range)")
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for bench_skinny.json and bench_skinny.md")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel degrees whose per-rank shapes are timed (default 1,2)")
    ap.add_argument("--ms", default="1-16", help="token counts (default 1-16)")
    ap.add_argument("--quick", action="store_true", help="smoke test: M = 1, 5, 16, no variants, fewer repetitions")
    ap.add_argument("--no-variants", action="store_true", help="time only the built-in launch besides F.linear")
    ap.add_argument("--config", default=str(CONFIG), help="the model's config.json (default: configs/models/qwen3.5-27b)")
    ap.add_argument("--define", action="append", default=[], metavar="MACRO",
                    help="build the kernel with -DMACRO (an A/B of a variant the source guards with a macro)")
    args = ap.parse_args()
    try:
        tps = sorted({int(t) for t in args.tp.split(",")})
    except ValueError:
        ap.error(f"--tp {args.tp!r}: expected degrees such as 1,2")
    ms = [1, 5, 16] if args.quick else parse_ms(args.ms)
    try:
        config = json.loads(Path(args.config).read_text())
    except (OSError, ValueError) as e:
        ap.error(f"--config {args.config}: cannot read it as JSON ({e})")
    cases = [(tp, *s) for tp in tps for s in shapes(config, tp)]

    import torch
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        print("bench_skinny: no CUDA/ROCm device visible; run this on a GPU machine", file=sys.stderr)
        return 2
    import gemv_ext

    t_start = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ext, build_s = gemv_ext.load(defines=tuple(args.define))
    print(f"extension built/loaded in {build_s:.1f} s", flush=True)
    timer = BG.Timer(torch, reps=5 if args.quick else 9, target_ms=1.0 if args.quick else 2.0)
    act, act_label = BG.silu_and_mul_fn(torch, F)
    result = {"provenance": {**BG.provenance(torch, build_s), "defines": args.define, "config": args.config},
              "convention": "tbps = (W + x read + y written) / time; frac_copy = tbps / copy.tbps_read_write; "
                            "floor_us = those bytes at the copy rate", "tp": tps, "ms": ms}
    g = torch.Generator(device="cuda").manual_seed(4321)

    def err(y, r):
        if torch.isnan(y).any():
            return float("inf")
        floor = 1e-2 * r.pow(2).mean().sqrt().item()
        return ((y.double() - r).abs() / r.abs().clamp_min(floor)).max().item()

    copy = BG.copy_bandwidth(torch, timer)
    bw = copy["tbps_read_write"]
    result["copy"] = copy
    print(f"copy reference: {bw:.2f} TB/s ({copy['best']})", flush=True)

    rows, correctness = [], []
    for tp, name, N, K in cases:
        wbytes = N * K * 2
        ncopies = max(2, min(math.ceil(3 * L2_BYTES / wbytes), MEM_CAP // wbytes))
        w0 = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
        ws = [w0] + [w0.clone() for _ in range(ncopies - 1)]
        xall = torch.randn(max(ms), K, device="cuda", generator=g).bfloat16()
        ref_all = torch.cat([xall.double() @ w0[i:i + 32768].double().T for i in range(0, N, 32768)], dim=1)
        fused = name == "gate_up"
        if fused:
            I = N // 2
            fref_all = F.silu(ref_all[:, :I]) * ref_all[:, I:]
        for M in ms:
            x = xall[:M].clone()
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            ext.forge_gemv(y, x, w0)
            c = {"tp": tp, "shape": name, "M": M, "max_rel_err": err(y, ref_all[:M])}
            if fused:
                ys = torch.full((M, I), float("nan"), device="cuda", dtype=torch.bfloat16)
                try:
                    ext.forge_gemv_silu_mul(ys, x, w0)
                    c["fused_max_rel_err"] = err(ys, fref_all[:M])
                except RuntimeError as e:   # the fused kernel stops at 8 rows on AMD
                    if "is not built" not in str(e):
                        raise
            correctness.append(c)
            if max(c["max_rel_err"], c.get("fused_max_rel_err", 0)) > 1e-2:
                result["correctness"] = correctness
                (out_dir / "bench_skinny.json").write_text(json.dumps(result, indent=1) + "\n")
                print(f"bench_skinny: differs from the float64 reference: {c}", file=sys.stderr)
                return 1
            nbytes = wbytes + M * K * 2 + M * N * 2
            n_launch = timer.launches(nbytes / (bw * 1e6) * 1.2, ncopies)

            def rec(impl, us, kind="plain", nb=nbytes, **kw):
                rows.append({"tp": tp, "shape": name, "N": N, "K": K, "M": M, "kind": kind, "impl": impl,
                             "us": round(us, 2), "tbps": round(nb / us / 1e6, 3),
                             "frac_copy": round(nb / us / 1e6 / bw, 3), "floor_us": round(nb / (bw * 1e6), 2),
                             "bytes": nb, **kw})

            rec("F.linear", timer.per_call_us(lambda i: F.linear(x, ws[i % ncopies]), n_launch))
            variants = [(0, 0)] + ([] if args.quick or args.no_variants else VARIANTS[mt_of(M)])
            for block, nrows in variants:
                try:
                    us = timer.per_call_us(lambda i: ext.forge_gemv(y, x, ws[i % ncopies], block, nrows), n_launch)
                except RuntimeError as e:
                    if "is not built" in str(e):
                        continue
                    raise
                rec("forge" if block == 0 else f"forge b{block} r{nrows}", us, launch=[block, nrows])
            if fused and "fused_max_rel_err" in c:
                fb = wbytes + M * K * 2 + M * I * 2
                ya = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
                rec(f"F.linear + {act_label}", timer.per_call_us(lambda i: act(F.linear(x, ws[i % ncopies]), ya),
                                                                 n_launch), kind="fused", nb=fb)
                fvariants = [(0, 0)] + ([] if args.quick or args.no_variants else FUSED_VARIANTS[mt_of(M)])
                for block, nrows in fvariants:
                    try:
                        us = timer.per_call_us(
                            lambda i: ext.forge_gemv_silu_mul(ys, x, ws[i % ncopies], block, nrows), n_launch)
                    except RuntimeError as e:
                        if "is not built" in str(e):
                            continue
                        raise
                    rec("forge fused" if block == 0 else f"forge fused b{block} r{nrows}", us, kind="fused", nb=fb,
                        launch=[block, nrows])
        print(f"  TP{tp} {name} {N}x{K}: done ({time.time() - t_start:.0f} s)", flush=True)
        ws = w0 = None
        torch.cuda.empty_cache()

    result["correctness"] = correctness
    result["rows"] = rows
    summary, tuned = [], {"plain": {}, "fused": {}}
    for tp, name, N, K in cases:
        for kind in ("plain", "fused"):
            for M in ms:
                rs = [r for r in rows if r["tp"] == tp and r["shape"] == name and r["M"] == M and r["kind"] == kind]
                if not rs:
                    continue
                base = next(r for r in rs if r["impl"].startswith("F.linear"))
                ours = [r for r in rs if r["impl"].startswith("forge")]
                dflt = next((r for r in ours if r["launch"] == [0, 0]), None)
                best = min(ours, key=lambda r: r["us"])
                summary.append({"tp": tp, "shape": name, "kind": kind, "N": N, "K": K, "M": M,
                                "linear_us": base["us"], "default_us": dflt["us"] if dflt else None,
                                "best_impl": best["impl"], "best_us": best["us"], "best_frac_copy": best["frac_copy"],
                                "linear_frac_copy": base["frac_copy"], "floor_us": best["floor_us"],
                                "best_vs_linear": round(best["us"] / base["us"], 3)})
                if best["us"] < base["us"]:
                    tuned[kind].setdefault(f"{N}x{K}", {})[str(M)] = best["launch"]
    result["summary"] = summary
    result["tuned_gemv"] = tuned
    result["wall_s"] = round(time.time() - t_start, 1)
    p = result["provenance"]
    lines = [f"# Skinny GEMM benchmark ({p['device']})", "",
             f"{p['date']}, commit `{(p['git_commit'] or '?')[:12]}`{' (dirty)' if p['git_dirty'] else ''}, "
             f"torch {torch.__version__}, " + (f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}")
             + f", command `{p['command']}`", "",
             f"Copy reference {bw:.2f} TB/s (read + write, {copy['best']}). µs per call (CUDA graphs, weights rotated "
             "past the L2, median of replays); % copy = (W + x + y bytes) / time / copy rate; floor = those bytes at "
             "the copy rate. ours = the fastest launch of the kernel timed (built-in and variants).", "",
             "| TP | layer | kind | N x K | M | floor µs | F.linear µs | % copy | ours µs | % copy | ours / F.linear | launch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['tp']} | {s['shape']} | {s['kind']} | {s['N']}x{s['K']} | {s['M']} | {s['floor_us']:.1f} | "
                     f"{s['linear_us']:.1f} | {100 * s['linear_frac_copy']:.0f} | {s['best_us']:.1f} | "
                     f"{100 * s['best_frac_copy']:.0f} | {s['best_vs_linear']:.3f} | {s['best_impl']} |")
    lines += ["", "The `gemv` part of a tuned table from this run (pairs where ours beat F.linear; launch [block, rows], "
              "[0, 0] = built-in); both TP degrees' shapes together, so split them per table:", "",
              "```json", json.dumps(tuned, sort_keys=True), "```", "",
              f"Wall time {result['wall_s']} s (extension build {build_s:.0f} s)."]
    (out_dir / "bench_skinny.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "bench_skinny.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
