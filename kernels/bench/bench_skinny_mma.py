#!/usr/bin/env python3
"""Skinny GEMM on the matrix units (kernels/forge_triton/skinny_gemm.py) at 1-16 tokens and at 24 and 32 on a
GPU machine, against torch.nn.functional.linear (cuBLAS / hipBLASLt), the CUDA-core GEMV (kernels/csrc/forge_gemv.cu,
where it builds; 1-16 tokens only, where its launches stop) and the weight bytes at the device's copy bandwidth,
at every bf16 linear layer of Qwen3.5-27B per rank at TP1 and TP2, and the fused gate_up + SiLU-and-mul against
F.linear + the activation. 24 and 32 are the captured graph sizes vLLM pads a decode batch of 17-32 to (a server
run above concurrency 16): the kernel's 32-row tile, against the platform GEMM only.

    python3 kernels/bench/bench_skinny_mma.py --out DIR [--quick] [--tp 1,2] [--ms 1-16,24,32] [--no-sweep] [--force]
    python3 kernels/bench/bench_skinny_mma.py --out DIR --smoke      # CPU: Triton's interpreter, tiny shapes

Shapes from the model's config as kernels/bench/bench_skinny.py derives them; timing, copy reference and
provenance from kernels/bench/bench_gemv.py (CUDA graphs rotating over enough weight copies to exceed the
L2; % copy = (W + x read + y written) / time / the copy's read + write rate). Every launch is checked
against float64 before it is timed: a wrong one is recorded (ok: false), never timed, and the run exits 1.
Timed launches of the new kernel: the built-in one (launch_config from M, N, K and the device's SM/CU
count) and a small sweep around it (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages). Writes DIR/bench_skinny_mma.json
(provenance: commit, device, versions, command) and DIR/bench_skinny_mma.md and prints the table; its last
section lists the (shape, M) pairs where the new kernel's fastest launch beat F.linear, with that launch.
--smoke proves the plumbing on a CPU (the numbers mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "kernels"))

import bench_gemv as BG  # noqa: E402  (beside this file: Timer, copy_bandwidth, provenance, the activation)
import bench_skinny as BS  # noqa: E402  (beside this file: the per-rank shapes, --ms parsing)
import forge_tuned  # noqa: E402  (kernels/: the GEMV's and the skinny GEMM's token ranges)

OUT_NAME = "bench_skinny_mma"
TOL = 1e-2
# F.linear + the separate activation rounds gate and up to bf16 before SiLU-and-mul (and torch eager rounds
# SiLU's output once more): three bf16 roundings, up to ~1.2 % against float64 at the smoke sizes
TOL_ROUNDED = 2e-2
SMOKE_SHAPES = [("smoke", 200, 360), ("gate_up", 192, 256)]
# launch overrides timed besides the built-in launch (merged into it; duplicates of it are dropped)
SWEEP = [dict(block_n=64, split_k=1), dict(block_n=128, split_k=1), dict(block_n=64, split_k=2),
         dict(block_n=64, split_k=4), dict(block_n=128, split_k=2), dict(block_k=64), dict(block_k=256, block_n=64),
         dict(block_k=128), dict(num_warps=8), dict(num_stages=4), dict(num_stages=1)]
GRAPH_MS = [24, 32]      # the captured graph sizes a decode batch of 17-32 runs at (the kernel's 32-row tile)
QUICK_MS = [1, 4, 5, 8, 12, 16, *GRAPH_MS]
SMOKE_MS = [1, 5, 16, *GRAPH_MS]
BANDS = [(5, 16), (17, forge_tuned.MMA_MAX_TOKENS)]   # the summary's per-layer sections: 16-row tile, 32-row tile


class CpuTimer:
    """--smoke's stand-in for bench_gemv.Timer: wall time of a few calls (no graphs, no device)."""

    def launches(self, est_us: float, ncopies: int) -> int:
        return 2

    def per_call_us(self, fn, n_launch: int) -> float:
        fn(0)
        t = time.perf_counter()
        for i in range(n_launch):
            fn(i)
        return (time.perf_counter() - t) * 1e6 / n_launch


def cpu_copy_rate(torch) -> dict:
    src = torch.empty(1 << 23, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    t = time.perf_counter()
    dst.copy_(src)
    us = (time.perf_counter() - t) * 1e6
    return {"best": "tensor.copy_ on the CPU (--smoke)", "tbps_read_write": round(2 * src.numel() * 4 / us / 1e6, 4)}


def launches(SK, M, N, K, cus, fused, hip, sweep):
    """[(label, launch dict)]: the built-in launch first, then the sweep's distinct launches."""
    base = SK.launch_config(M, N, K, cus, fused=fused, is_hip=hip)._asdict()
    out, seen = [("mma", dict(base))], {tuple(base.values())}
    for over in (SWEEP if sweep else []):
        cfg = {**base, **over}
        if hip and cfg["block_n"] * cfg["block_k"] * (2 if fused else 1) > 128 * 128:
            continue                                  # past gfx9's 64 KiB of LDS (skinny_gemm's docstring)
        if K // cfg["block_k"] < cfg["split_k"] or tuple(cfg.values()) in seen:
            continue
        seen.add(tuple(cfg.values()))
        out.append(("mma " + "/".join(f"{cfg[k]}" for k in base), cfg))
    return out


def load_gemv(gpu: bool, no_gemv: bool):
    """(the CUDA-core GEMV extension or None, its build seconds, a note for the provenance)."""
    if not gpu or no_gemv:
        return None, 0.0, "not timed (--no-gemv)" if no_gemv else "not timed (no device)"
    try:
        import gemv_ext  # beside this file; builds a torch extension (nvcc / hipcc): only on a GPU machine
        ext, build_s = gemv_ext.load()
        return ext, build_s, f"built/loaded in {build_s:.1f} s"
    except Exception as e:  # noqa: BLE001 - the GEMV is a comparison, its build may fail on a platform
        return None, 0.0, f"not built: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def err(torch, y, r) -> float:
    if torch.isnan(y).any():
        return math.inf
    floor = 1e-2 * r.pow(2).mean().sqrt().item()
    return ((y.double() - r).abs() / r.abs().clamp_min(floor)).max().item()


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help=f"folder for {OUT_NAME}.json and {OUT_NAME}.md")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel degrees whose per-rank shapes are timed (default 1,2)")
    ap.add_argument("--ms", default="1-16,24,32",
                    help=f"token counts, 1-{forge_tuned.MMA_MAX_TOKENS} (default 1-16,24,32; the GEMV only at "
                         f"1-{forge_tuned.GEMV_MAX_TOKENS})")
    ap.add_argument("--quick", action="store_true", help=f"M = {QUICK_MS}, no sweep, fewer repetitions")
    ap.add_argument("--no-sweep", action="store_true", help="time only the built-in launch of the new kernel")
    ap.add_argument("--no-gemv", action="store_true", help="do not build or time the CUDA-core GEMV extension")
    ap.add_argument("--smoke", action="store_true", help="CPU: Triton's interpreter at tiny shapes (plumbing only)")
    ap.add_argument("--config", default=str(BS.CONFIG), help="the model's config.json (default: configs/models/qwen3.5-27b)")
    ap.add_argument("--force", action="store_true", help=f"overwrite an existing {OUT_NAME}.json in --out")
    args = ap.parse_args(argv)
    try:
        args.tps = sorted({int(t) for t in args.tp.split(",")})
    except ValueError:
        ap.error(f"--tp {args.tp!r}: expected degrees such as 1,2")
    try:
        args.ms = SMOKE_MS if args.smoke else QUICK_MS if args.quick else BS.parse_ms(args.ms, forge_tuned.MMA_MAX_TOKENS)
    except SystemExit as e:                       # bench_skinny's one-line message, with this tool's exit code
        ap.error(str(e).replace("bench_skinny: ", ""))
    if (Path(args.out) / f"{OUT_NAME}.json").exists() and not args.force:
        ap.error(f"--out {args.out}: {OUT_NAME}.json exists there; pick another folder or pass --force")
    if args.smoke:
        args.cases = [(0, *s) for s in SMOKE_SHAPES]
    else:
        try:
            config = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--config {args.config}: cannot read it as JSON ({e})")
        args.cases = [(tp, *s) for tp in args.tps for s in BS.shapes(config, tp)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"      # must be set before triton is first imported
    import torch  # heavy; imported once the arguments are known good
    import torch.nn.functional as F
    from forge_triton import skinny_gemm as SK  # imports triton: after TRITON_INTERPRET is decided

    gpu = torch.cuda.is_available() and not args.smoke
    if not gpu and not args.smoke:
        print(f"{OUT_NAME}: no CUDA/ROCm device visible; run this on a GPU machine (or --smoke on a CPU)",
              file=sys.stderr)
        return 2
    dev = "cuda" if gpu else "cpu"
    hip = getattr(torch.version, "hip", None) is not None
    t_start = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ext, build_s, ext_note = load_gemv(gpu, args.no_gemv)
    print(f"{OUT_NAME}: GEMV extension {ext_note}", flush=True)
    if gpu:
        timer = BG.Timer(torch, reps=5 if args.quick else 9, target_ms=1.0 if args.quick else 2.0)
        prov = BG.provenance(torch, build_s)
        copy = BG.copy_bandwidth(torch, timer)
        cus = SK.num_compute_units()
    else:
        timer = CpuTimer()
        shim = types.SimpleNamespace(__version__=torch.__version__, version=torch.version,
                                     cuda=types.SimpleNamespace(get_device_name=lambda: "cpu (Triton interpreter)"))
        prov, copy, cus = BG.provenance(shim, 0.0), cpu_copy_rate(torch), SK.num_compute_units()
    bw = copy["tbps_read_write"]
    act, act_label = BG.silu_and_mul_fn(torch, F) if gpu else (
        lambda gu, o: torch.mul(F.silu(gu[:, :o.shape[1]]), gu[:, o.shape[1]:], out=o), "silu*mul (torch)")
    print(f"copy reference: {bw:.3f} TB/s ({copy['best']}); {cus} SMs/CUs", flush=True)
    result = {"provenance": {**prov, "config": args.config, "smoke": args.smoke, "compute_units": cus,
                             "gemv_extension": ext_note},
              "convention": "tbps = (W + x read + y written) / time; frac_copy = tbps / copy.tbps_read_write; "
                            "floor_us = those bytes at the copy rate; launch = [block_n, block_k, split_k, "
                            "num_warps, num_stages]", "tp": args.tps, "ms": args.ms, "copy": copy}
    g = torch.Generator(device=dev).manual_seed(2468)
    rows, checks, failed = [], [], 0
    for tp, name, N, K in args.cases:
        wbytes = N * K * 2
        ncopies = max(2, min(math.ceil(3 * BS.L2_BYTES / wbytes), BS.MEM_CAP // wbytes)) if gpu else 2
        w0 = (torch.randn(N, K, device=dev, generator=g) * K ** -0.5).bfloat16()
        ws = [w0] + [w0.clone() for _ in range(ncopies - 1)]
        xall = torch.randn(max(args.ms), K, device=dev, generator=g).bfloat16()
        ref_all = torch.cat([xall.double() @ w0[i:i + 32768].double().T for i in range(0, N, 32768)], dim=1)
        kinds = ["plain"] + (["fused"] if name == "gate_up" else [])
        for kind in kinds:
            fused = kind == "fused"
            n_out = N // 2 if fused else N
            ref = F.silu(ref_all[:, :n_out]) * ref_all[:, n_out:] if fused else ref_all
            for M in args.ms:
                x = xall[:M].clone()
                y = torch.full((M, n_out), float("nan"), device=dev, dtype=torch.bfloat16)
                nbytes = wbytes + M * K * 2 + M * n_out * 2
                n_launch = timer.launches(nbytes / (bw * 1e6) * 1.2, ncopies)

                def rec(impl, fn, launch=None, check=True):
                    nonlocal failed
                    c = {"tp": tp, "shape": name, "kind": kind, "M": M, "impl": impl, "launch": launch}
                    if check:
                        y.fill_(float("nan"))
                        try:
                            res = fn(0)           # F.linear returns its output; the others write y
                        except Exception as e:  # noqa: BLE001 - a launch that does not compile is recorded
                            c.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                            checks.append(c)
                            failed += impl == "mma"
                            return
                        got = res if isinstance(res, torch.Tensor) and res.shape == y.shape else y
                        c["max_rel_err"] = err(torch, got, ref[:M])
                        c["tol"] = TOL_ROUNDED if impl.startswith("F.linear +") else TOL
                        c["ok"] = c["max_rel_err"] <= c["tol"]
                        checks.append(c)
                        if not c["ok"]:
                            failed += 1
                            print(f"  WRONG: {c}", flush=True)
                            return
                    us = timer.per_call_us(fn, n_launch)
                    rows.append({"tp": tp, "shape": name, "N": N, "K": K, "M": M, "kind": kind, "impl": impl,
                                 "launch": launch, "us": round(us, 2), "tbps": round(nbytes / us / 1e6, 4),
                                 "frac_copy": round(nbytes / us / 1e6 / bw, 3),
                                 "floor_us": round(nbytes / (bw * 1e6), 2), "bytes": nbytes})

                if fused:
                    rec(f"F.linear + {act_label}", lambda i: act(F.linear(x, ws[i % ncopies]), y))
                else:
                    rec("F.linear", lambda i: F.linear(x, ws[i % ncopies]))
                if ext is not None and M <= forge_tuned.GEMV_MAX_TOKENS:     # its launches stop at 16 rows
                    gemv = ext.forge_gemv_silu_mul if fused else ext.forge_gemv
                    rec("gemv", lambda i: gemv(y, x, ws[i % ncopies]))
                for label, cfg in launches(SK, M, N, K, cus, fused, hip, sweep=not (args.quick or args.no_sweep)):
                    part = torch.empty(max(1, SK.workspace_numel(M, N, cfg["split_k"])), device=dev,
                                       dtype=torch.float32)
                    call = SK.skinny_gemm_silu_mul if fused else SK.skinny_gemm
                    rec(label, lambda i, cfg=cfg, part=part: call(x, ws[i % ncopies], y, workspace=part, **cfg),
                        launch=list(cfg.values()))
        print(f"  TP{tp} {name} {N}x{K}: done ({time.time() - t_start:.0f} s)", flush=True)
        ws = w0 = None
        if gpu:
            torch.cuda.empty_cache()
    result.update(correctness=checks, rows=rows, failed=failed, wall_s=round(time.time() - t_start, 1))
    result.update(summarize(rows, args.cases))
    lines = render(result)
    (out_dir / f"{OUT_NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{OUT_NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if failed:
        print(f"{OUT_NAME}: {failed} launch(es) differ from the float64 reference (see 'correctness')", file=sys.stderr)
    return 1 if failed else 0


def summarize(rows: list[dict], cases) -> dict:
    """Per (tp, shape, kind, M): F.linear, GEMV, the built-in and the fastest launch of the new kernel; the
    pairs where that fastest launch beat F.linear (`tuned_skinny_mma`, keyed "NxK" then M)."""
    summary, tuned = [], {"plain": {}, "fused": {}}
    keys = sorted({(r["tp"], r["shape"], r["kind"], r["M"]) for r in rows},
                  key=lambda k: ([c[:2] for c in cases].index(k[:2]), k[2], k[3]))
    for tp, name, kind, M in keys:
        rs = [r for r in rows if (r["tp"], r["shape"], r["kind"], r["M"]) == (tp, name, kind, M)]
        base = next((r for r in rs if r["impl"].startswith("F.linear")), None)
        mma = [r for r in rs if r["impl"].startswith("mma")]
        if base is None or not mma:
            continue
        gemv = next((r for r in rs if r["impl"] == "gemv"), None)
        dflt = next((r for r in mma if r["impl"] == "mma"), None)
        best = min(mma, key=lambda r: r["us"])
        summary.append({"tp": tp, "shape": name, "kind": kind, "N": best["N"], "K": best["K"], "M": M,
                        "floor_us": best["floor_us"], "linear_us": base["us"], "linear_frac_copy": base["frac_copy"],
                        "gemv_us": gemv and gemv["us"], "gemv_frac_copy": gemv and gemv["frac_copy"],
                        "builtin_us": dflt and dflt["us"], "builtin_frac_copy": dflt and dflt["frac_copy"],
                        "best_impl": best["impl"], "best_launch": best["launch"], "best_us": best["us"],
                        "best_frac_copy": best["frac_copy"], "best_vs_linear": round(best["us"] / base["us"], 3)})
        if best["us"] < base["us"]:
            tuned[kind].setdefault(f"{best['N']}x{best['K']}", {})[str(M)] = best["launch"]
    return {"summary": summary, "tuned_skinny_mma": tuned}


def span(ss: list[dict], key: str, scale: float = 100, fmt: str = "{:.0f}") -> str:
    vals = [scale * s[key] for s in ss if s[key] is not None]
    return "-" if not vals else f"{fmt.format(min(vals))}-{fmt.format(max(vals))}"


def render(result: dict) -> list[str]:
    p, copy = result["provenance"], result["copy"]

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}"

    def us(v):
        return "-" if v is None else f"{v:.1f}"

    lines = [f"# Skinny GEMM on the matrix units ({p['device']})", "",
             f"{p['date']}, commit `{(p['git_commit'] or '?')[:12]}`{' (dirty)' if p['git_dirty'] else ''}, "
             f"torch {p['torch']}, Triton {p['triton']}, " + (f"HIP {p['hip']}" if p['hip'] else f"CUDA {p['cuda']}")
             + f", {p['compute_units']} SMs/CUs, command `{p['command']}`", "",
             f"Copy reference {copy['tbps_read_write']:.3f} TB/s (read + write, {copy['best']}). µs per call; "
             "% = (W + x + y bytes) / time / copy rate; floor = those bytes at the copy rate. mma = the built-in "
             "launch of kernels/forge_triton/skinny_gemm.py, best = its fastest timed launch "
             "[block_n, block_k, split_k, warps, stages]. GEMV extension: " + p["gemv_extension"]
             + f" (timed at 1-{forge_tuned.GEMV_MAX_TOKENS} rows, where its launches stop: '-' above).", "",
             "| TP | layer | kind | N x K | M | floor µs | F.linear µs | % | GEMV µs | % | mma µs | % | best µs | % "
             "| best / F.linear | best launch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(f"| {s['tp']} | {s['shape']} | {s['kind']} | {s['N']}x{s['K']} | {s['M']} | {s['floor_us']:.1f} | "
                     f"{s['linear_us']:.1f} | {pct(s['linear_frac_copy'])} | {us(s['gemv_us'])} | "
                     f"{pct(s['gemv_frac_copy'])} | {us(s['builtin_us'])} | {pct(s['builtin_frac_copy'])} | "
                     f"{s['best_us']:.1f} | {pct(s['best_frac_copy'])} | {s['best_vs_linear']:.3f} | {s['best_launch']} |")
    for lo, hi in BANDS:
        groups: dict = {}
        for s in result["summary"]:
            if lo <= s["M"] <= hi:
                groups.setdefault((s["tp"], s["shape"], s["kind"], f"{s['N']}x{s['K']}"), []).append(s)
        if not groups:
            continue
        ms = sorted({s["M"] for ss in groups.values() for s in ss})
        lines += ["", f"## Per layer at M = {lo}-{hi} (measured: {', '.join(map(str, ms))}): % of copy bandwidth "
                  "(min-max)", "", "| TP | layer | kind | N x K | F.linear | mma built-in | mma best | best / F.linear |",
                  "|---|---|---|---|---|---|---|---|"]
        for (tp, name, kind, nk), ss in groups.items():
            lines.append(f"| {tp} | {name} | {kind} | {nk} | {span(ss, 'linear_frac_copy')} | "
                         f"{span(ss, 'builtin_frac_copy')} | {span(ss, 'best_frac_copy')} | "
                         f"{span(ss, 'best_vs_linear', 1, '{:.2f}')} |")
    tuned = result["tuned_skinny_mma"]
    npairs = sum(len(v) for d in tuned.values() for v in d.values())
    lines += ["", f"## Where the new kernel beat F.linear ({npairs} (shape, M) pairs; launch = its fastest)", "",
              "```json", json.dumps(tuned, sort_keys=True), "```", "",
              f"Wall time {result['wall_s']} s; {result['failed']} launch(es) wrong against float64."]
    return lines


if __name__ == "__main__":
    sys.exit(main())
