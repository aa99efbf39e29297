"""Kernel verbs. `kernels-check`: compile-only checks that need no GPU — kernels/csrc with nvcc
(sm_90) and hipcc (gfx90a, HIP_PLATFORM=amd) standalone, and as part of vLLM's `_C`: nvcc with torch's
headers, and hipcc the way vLLM's CMake builds a `_C` source for ROCm (builder.hipcompile: hipify,
vLLM's HIP flags, torch's headers in the ROCm layout); our torch glue checked against vLLM's own
kernels' idiom; the Triton kernels ahead of time for the AMD stand-in targets and sm_90 with the LDS
(≤ 64 KiB) and register-spill check. Writes reports/kernels/compile-check.{json,md}. `bench-kernels`:
the GPU benchmark (on a GPU machine)."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import json
import re
import shutil
import sys
from pathlib import Path

from .. import config, options, proc, records, ui
from ..errors import ForgeError
from ..paths import BUILD, KERNELS, REPORTS, rel
from ..recipe import provenance
from . import fetch, hipcompile

CSRC = KERNELS / "csrc"


def _resource_lines(text: str) -> list[str]:
    # whole words: "LDS" inside "bit-fields" of a header's warning is not a resource line
    keep = re.compile(r"\b(registers|spill|VGPRs|SGPRs|ScratchSize|LDS|Occupancy|stack frame)\b", re.I)
    return [l.strip() for l in text.splitlines() if keep.search(l)][:40]


IN_C_CUDA = "sm_90 (in vLLM's _C, torch headers)"
IN_C_HIP = "gfx90a (in vLLM's _C: hipified, vLLM's HIP flags, torch headers in ROCm layout)"


def _in_c_compilers(out_dir: Path, sources: list[Path], strict: bool) -> tuple[list, list[str]]:
    """The two in-`_C` modes (builder.hipcompile) and the problems of our glue against vLLM's idiom. The
    HIP mode and the glue check need the pinned vLLM source (its cmake/hipify.py, flags, reference
    kernels); a mode that cannot run here is given with the reason instead of its command."""
    try:
        vllm, no_source = fetch.ensure_source(), None
    except ForgeError as e:
        if strict:
            raise
        vllm, no_source = None, f"the pinned vLLM source is not available ({e.message})"
    glue = hipcompile.glue_problems(sources, vllm) if vllm else []
    try:
        cuda_inc = hipcompile.cuda_torch_include_args(out_dir)
    except ImportError:
        return [("nvcc", IN_C_CUDA, "torch is not importable here", {}),
                ("hipcc", IN_C_HIP, "torch is not importable here", {})], glue
    compilers = [("nvcc", IN_C_CUDA, lambda src, obj: ["nvcc", "-arch=sm_90", "-std=c++17", "-O3", "-c", "-DFORGE_IN_VLLM",
                                                        "-DTORCH_EXTENSION_NAME=_C", *cuda_inc, "-o", obj, src], {})]
    if vllm is None or not shutil.which("hipcc"):
        compilers.append(("hipcc", IN_C_HIP, no_source or "hipcc not installed", {}))
        return compilers, glue
    flags = hipcompile.vllm_hip_flags(vllm)
    build_csrc, hipified = hipcompile.hipify_like_vllm(vllm, sources, out_dir / "hipify")
    inc = [*hipcompile.rocm_torch_include_args(out_dir), f"-I{build_csrc}"]
    compilers.append(("hipcc", IN_C_HIP, lambda src, obj: [
        "hipcc", "--offload-arch=gfx90a", *flags, "-Rpass-analysis=kernel-resource-usage", *inc, "-c",
        "-o", obj, hipified[src]], {"HIP_PLATFORM": "amd"}))
    return compilers, glue


def compile_csrc(out_dir: Path, strict: bool) -> tuple[list[dict], list[str]]:
    """Every source of kernels/csrc in every mode; returns the records and the glue's problems."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    sources = sorted(CSRC.glob("*.cu"))
    compilers = [
        ("nvcc", "sm_90", lambda src, obj: ["nvcc", "-arch=sm_90", "-O3", "-c", "-DFORGE_STANDALONE",
                                           "-Xptxas", "-v", "-o", obj, src], {}),
        ("hipcc", "gfx90a", lambda src, obj: ["hipcc", "--offload-arch=gfx90a", "-O3", "-c", "-DFORGE_STANDALONE",
                                             "-Rpass-analysis=kernel-resource-usage", "-o", obj, src],
         {"HIP_PLATFORM": "amd"}),
    ]
    in_c, glue = _in_c_compilers(out_dir, sources, strict)
    jobs = []
    for src in sources:
        for tool, arch, argv, env in [*compilers, *in_c]:
            rec = {"source": src.relative_to(KERNELS.parent).as_posix(), "compiler": tool, "arch": arch}
            skipped = argv if isinstance(argv, str) else None if shutil.which(tool) else f"{tool} not installed"
            if skipped:
                if strict:
                    raise ForgeError(f"{tool} {arch}: {skipped}", hint="apt-get install -y hipcc" if tool == "hipcc"
                                     else "install the CUDA toolkit")
                ui.warn(f"skipping {rec['source']} for {tool} {arch}: {skipped}")
                results.append({**rec, "ok": None, "skipped": skipped})
                continue
            obj = out_dir / f"{src.stem}.{arch.split()[0]}.{len(results) + len(jobs)}.o"
            jobs.append((rec, argv(src, obj), env, tool, arch))

    def one(job) -> dict:
        rec, cmd, env, tool, arch = job
        res = proc.run(cmd, env=env, capture=True, check=False, what=f"{tool} {arch}")
        text = (res.stdout or "") + (res.stderr or "")
        spills = [l for l in _resource_lines(text) if re.search(r"spill", l, re.I) and
                  not re.search(r"\b0 bytes spill stores, 0 bytes spill loads|Spill: 0|SpillCount: 0", l)]
        spills = [l for l in spills if re.search(r"[1-9]\d* bytes spill|Spill\w*: [1-9]", l)]
        ok = res.returncode == 0 and not spills
        ui.info(f"{tool} {arch} {rec['source']}: {'ok' if ok else 'FAILED'}")
        return {**rec, "ok": ok, "resources": _resource_lines(text),
                "error": None if res.returncode == 0 else text[-3000:], "spills": spills}

    # each compile is its own process: as many at once as this machine has cores, results in order
    with concurrent.futures.ThreadPoolExecutor(max_workers=options.usable_cores()) as pool:
        results += list(pool.map(one, jobs))
    return results, glue


def cmd_kernels_check(args) -> int:
    b = config.build()
    out = BUILD / "kernels-check"
    results = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "command": "make kernels-check", "forge": provenance.forge_commit(),
               "toolchain": provenance.toolchain()}
    results["csrc"], results["glue_problems"] = compile_csrc(out, args.strict)
    targets = [x for t in [*b["aot_targets"], "cuda:90"] for x in ("--target", t)]
    aot_json = out / "aot.json"
    res = proc.run([sys.executable, KERNELS / "aot.py", *targets, "--json", aot_json], check=False,
                   capture=True, what="Triton ahead-of-time compile")
    results["triton_aot"] = records.read_json(aot_json) if aot_json.is_file() else None
    results["triton_aot_ok"] = res.returncode == 0
    report_dir = Path(args.report_dir) if getattr(args, "report_dir", None) else REPORTS / "kernels"
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "compile-check.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["<!-- generated by `make kernels-check` (scripts/forge/builder/kernels.py); do not edit -->",
             "# Kernel compile check (no GPU)", "", f"{results['date']}, forge commit "
             f"`{(results['forge'].get('commit') or '?')[:12]}`", "",
             "| source | compiler | arch | result | resources |", "|---|---|---|---|---|"]
    for r in results["csrc"]:
        state = "skipped: " + r["skipped"] if r.get("skipped") else ("ok" if r["ok"] else "FAILED")
        lines.append(f"| {r['source']} | {r['compiler']} | {r['arch']} | {state} | "
                     f"{'<br>'.join(r.get('resources', [])[:4])} |")
    glue = results["glue_problems"]
    lines += ["", f"Torch glue against vLLM's idiom ({' and '.join(hipcompile.REFERENCE_SOURCES)} of the pinned "
              "source: every torch include and at::/c10:: CUDA name of ours is one they use): "
              + ("ok" if not glue else "FAILED<br>" + "<br>".join(glue)),
              "", f"Triton AOT ({', '.join(t for t in targets if t != '--target')}): "
              f"{'ok' if results['triton_aot_ok'] else 'FAILED'} — details in compile-check.json",
              "", "The HIP in-_C mode follows vLLM's CMake for a `_C` source under ROCm (hipify, VLLM_GPU_FLAGS, "
              "torch's headers in the ROCm layout); not verified here:", "",
              *(f"- {u}" for u in hipcompile.UNVERIFIED)]
    (report_dir / "compile-check.md").write_text("\n".join(lines) + "\n")
    failed = [r for r in results["csrc"] if r["ok"] is False]
    if failed or glue or not results["triton_aot_ok"]:
        detail = "\n".join([*(f"{r['source']} [{r['compiler']} {r['arch']}]: " +
                              (r["error"] or "; ".join(r["spills"]))[:1500] for r in failed), *glue])
        if not results["triton_aot_ok"]:
            detail += "\n" + ((res.stdout or "") + (res.stderr or ""))[-2000:]
        raise ForgeError("kernel compile check failed:\n" + detail, hint=f"see {rel(report_dir / 'compile-check.md')}")
    print(f"kernels-check: OK ({rel(report_dir / 'compile-check.md')})")
    return 0


def cmd_bench_kernels(args) -> int:
    try:
        import torch  # heavy and optional: only the benchmark, on a GPU machine
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    payload = BUILD / "gpu-payload"
    if args.prepare or not has_gpu:
        src = fetch.ensure_source()
        proc.run([sys.executable, KERNELS / "bench" / "prepare_payload.py", "--vllm-src", src, "--out", payload],
                 what="benchmark payload (vLLM's reference kernels from the pinned source)")
        if not has_gpu:
            print(f"no GPU here: prepared {rel(payload)}; on a GPU machine run `make bench-kernels` "
                  "with that folder present")
            return 0
    out = Path(args.out)
    if args.decode_batched:
        # batched decode at the final round's load, per rank's heads (kernels/bench/bench_decode_batched.py)
        proc.run([sys.executable, KERNELS / "bench" / "bench_decode_batched.py", "--payload", payload,
                  "--out", out / "decode-batched"], what="batched decode benchmark")
        return 0
    proc.run([sys.executable, KERNELS / "bench" / "bench_kernels.py", "--payload", payload, "--out", out],
             what="kernel benchmark")
    return 0


def register(sub) -> None:
    p = sub.add_parser("kernels-check", help="compile-check kernels/csrc (hipcc gfx90a, nvcc sm_90; standalone and "
                       "as in vLLM's _C) and Triton AOT targets")
    p.add_argument("--strict", action="store_true",
                   help="fail when nvcc, hipcc or the pinned vLLM source (for the HIP in-_C compile) is missing")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where compile-check.{md,json} go (default reports/kernels; the tests write elsewhere)")
    p.set_defaults(func=cmd_kernels_check)
    p = sub.add_parser("bench-kernels", help="kernel benchmarks on a GPU machine (writes reports/kernels/)")
    p.add_argument("--out", default=str(REPORTS / "kernels"))
    p.add_argument("--prepare", action="store_true", help="(re)build build/gpu-payload from the pinned source")
    p.add_argument("--decode-batched", action="store_true",
                   help="instead: decode attention at batch 1, 4, 10, 16, the tiers' contexts and 32K, 24/4 and 12/2 "
                        "heads, against vLLM's unified kernel and the KV bytes at copy bandwidth (OUT/decode-batched/)")
    p.set_defaults(func=cmd_bench_kernels)
