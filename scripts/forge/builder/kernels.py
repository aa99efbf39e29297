"""Kernel verbs. `kernels-check`: compile-only checks that need no GPU — kernels/csrc with nvcc
(sm_90) and hipcc (gfx90a, HIP_PLATFORM=amd), and the Triton kernels ahead of time for the AMD
stand-in targets and sm_90 with the LDS (≤ 64 KiB) and register-spill check; writes
reports/kernels/compile-check.{json,md}. `bench-kernels`: the GPU benchmark (on a GPU machine)."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import sys
from pathlib import Path

from .. import config, proc, ui
from ..errors import ForgeError
from ..paths import BUILD, KERNELS, REPORTS, rel
from ..recipe import provenance
from . import fetch

CSRC = KERNELS / "csrc"


def _resource_lines(text: str) -> list[str]:
    keep = re.compile(r"(registers|spill|VGPRs|SGPRs|ScratchSize|LDS|Occupancy|stack frame)", re.I)
    return [l.strip() for l in text.splitlines() if keep.search(l)][:40]


def torch_include_args(stub_dir: Path) -> list[str]:
    """Include flags for compiling kernels/csrc the way vLLM's _C build does (FORGE_IN_VLLM), against
    the project venv's torch headers. CPU torch wheels ship the CUDA headers but not the generated
    c10/cuda/impl/cuda_cmake_macros.h, so an empty one is provided."""
    import torch.utils.cpp_extension as ce  # heavy and optional: only the compile check needs torch's headers
    stub = stub_dir / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text("#pragma once\n")
    return [f"-I{p}" for p in ce.include_paths()] + [f"-I{stub_dir}"]


def compile_csrc(out_dir: Path, strict: bool) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    compilers = [
        ("nvcc", "sm_90", lambda src, obj: ["nvcc", "-arch=sm_90", "-O3", "-c", "-DFORGE_STANDALONE",
                                           "-Xptxas", "-v", "-o", obj, src], {}),
        ("hipcc", "gfx90a", lambda src, obj: ["hipcc", "--offload-arch=gfx90a", "-O3", "-c", "-DFORGE_STANDALONE",
                                             "-Rpass-analysis=kernel-resource-usage", "-o", obj, src],
         {"HIP_PLATFORM": "amd"}),
    ]
    try:
        inc = torch_include_args(out_dir / "stub-include")
        compilers.append(("nvcc", "sm_90 (in vLLM's _C, torch headers)",
                          lambda src, obj: ["nvcc", "-arch=sm_90", "-std=c++17", "-O3", "-c", "-DFORGE_IN_VLLM",
                                            "-DTORCH_EXTENSION_NAME=_C", *inc, "-o", obj, src], {}))
    except ImportError:
        ui.warn("torch is not importable here: skipping the torch-extension compile of kernels/csrc")
    for src in sorted(CSRC.glob("*.cu")):
        for tool, arch, argv, env in compilers:
            rec = {"source": src.relative_to(KERNELS.parent).as_posix(), "compiler": tool, "arch": arch}
            if not shutil.which(tool):
                if strict:
                    raise ForgeError(f"{tool} is not installed", hint="apt-get install -y hipcc" if tool == "hipcc"
                                     else "install the CUDA toolkit")
                ui.warn(f"{tool} not installed: skipping {rec['source']} for {arch}")
                results.append({**rec, "ok": None, "skipped": f"{tool} not installed"})
                continue
            obj = out_dir / f"{src.stem}.{arch.split()[0]}.{len(results)}.o"
            res = proc.run(argv(src, obj), env=env, capture=True, check=False, what=f"{tool} {arch}")
            text = (res.stdout or "") + (res.stderr or "")
            spills = [l for l in _resource_lines(text) if re.search(r"spill", l, re.I) and
                      not re.search(r"\b0 bytes spill stores, 0 bytes spill loads|Spill: 0|SpillCount: 0", l)]
            spills = [l for l in spills if re.search(r"[1-9]\d* bytes spill|Spill\w*: [1-9]", l)]
            ok = res.returncode == 0 and not spills
            results.append({**rec, "ok": ok, "resources": _resource_lines(text),
                            "error": None if res.returncode == 0 else text[-3000:], "spills": spills})
            ui.info(f"{tool} {arch} {rec['source']}: {'ok' if ok else 'FAILED'}")
    return results


def cmd_kernels_check(args) -> int:
    b = config.build()
    out = BUILD / "kernels-check"
    results = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "command": "make kernels-check", "forge": provenance.forge_commit(),
               "toolchain": provenance.toolchain()}
    results["csrc"] = compile_csrc(out, args.strict)
    targets = [x for t in [*b["aot_targets"], "cuda:90"] for x in ("--target", t)]
    aot_json = out / "aot.json"
    res = proc.run([sys.executable, KERNELS / "aot.py", *targets, "--json", aot_json], check=False,
                   capture=True, what="Triton ahead-of-time compile")
    results["triton_aot"] = json.loads(aot_json.read_text()) if aot_json.is_file() else None
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
    lines += ["", f"Triton AOT ({', '.join(t for t in targets if t != '--target')}): "
              f"{'ok' if results['triton_aot_ok'] else 'FAILED'} — details in compile-check.json"]
    (report_dir / "compile-check.md").write_text("\n".join(lines) + "\n")
    failed = [r for r in results["csrc"] if r["ok"] is False]
    if failed or not results["triton_aot_ok"]:
        detail = "\n".join(f"{r['source']} [{r['compiler']} {r['arch']}]: " +
                           (r["error"] or "; ".join(r["spills"]))[:1500] for r in failed)
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
    proc.run([sys.executable, KERNELS / "bench" / "bench_kernels.py", "--payload", payload, "--out", out],
             what="kernel benchmark")
    return 0


def register(sub) -> None:
    p = sub.add_parser("kernels-check", help="compile-check kernels/csrc (hipcc gfx90a, nvcc sm_90) and Triton AOT targets")
    p.add_argument("--strict", action="store_true", help="fail when nvcc or hipcc is missing")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where compile-check.{md,json} go (default reports/kernels; the tests write elsewhere)")
    p.set_defaults(func=cmd_kernels_check)
    p = sub.add_parser("bench-kernels", help="kernel benchmarks on a GPU machine (writes reports/kernels/)")
    p.add_argument("--out", default=str(REPORTS / "kernels"))
    p.add_argument("--prepare", action="store_true", help="(re)build build/gpu-payload from the pinned source")
    p.set_defaults(func=cmd_bench_kernels)
