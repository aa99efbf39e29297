"""Build kernels/csrc/forge_gemv.cu as a standalone torch extension (torch.utils.cpp_extension.load) on a
GPU machine: the tests, the benchmark and the GPU harness's stand-in `_C` use it; inside vLLM the same
source is part of `_C`.

The build is cached in FORGE_GEMV_BUILD_DIR (default: build/forge-gemv-ext under the repository) and
compiled for the visible device only (TORCH_CUDA_ARCH_LIST is set from it when unset)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "kernels" / "csrc" / "forge_gemv.cu"
NAME = "forge_gemv_ext"   # torch.ops namespace (TORCH_LIBRARY in the source)


def build_dir() -> Path:
    return Path(os.environ.get("FORGE_GEMV_BUILD_DIR") or REPO / "build" / "forge-gemv-ext")


def own_cxx_runtime(so: Path) -> str | None:
    """Why a refusal (a C++ exception) from this built extension would crash the process, or None.
    Seen on a GPU machine whose default compiler (CXX unset: /opt/gcc's g++) links the C++ runtime into
    the extension statically: the .so then defines __cxa_throw itself and needs no libstdc++.so, and an
    exception torch throws through it kills the process (SIGSEGV). Built with the system g++
    (CXX=/usr/bin/g++) the same source refuses with a RuntimeError. Needs binutils' readelf."""
    if not shutil.which("readelf") or not so.is_file():
        return None
    try:
        dyn = subprocess.run(["readelf", "-dW", str(so)], capture_output=True, text=True, timeout=60).stdout
        syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(so)], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    needs_libstdcxx = "libstdc++.so" in dyn
    defines_throw = any(len(t) >= 8 and t[6] != "UND" and t[7].split("@")[0] == "__cxa_throw"
                        for t in (l.split() for l in syms.splitlines()))
    if defines_throw and not needs_libstdcxx:
        return (f"{so.name} carries its own C++ runtime (linked statically by the compiler "
                f"{os.environ.get('CXX') or 'c++ on PATH'}): a refusal would crash the process; rebuild with a "
                "compiler that links libstdc++ dynamically, e.g. CXX=/usr/bin/g++ and a fresh FORGE_GEMV_BUILD_DIR")
    return None


class Ops:
    """The extension's ops, called through torch's dispatcher as vLLM calls _C.forge_gemv: forge_gemv(out,
    x, w, block=0, rows=0) and forge_gemv_silu_mul(out, x, w, block=0, rows=0). A refused configuration
    raises RuntimeError ("... is not built ..."), unless `unsafe_refusals` says why it would crash."""

    def __init__(self, namespace, unsafe_refusals: str | None = None):
        self._ns = namespace
        self.unsafe_refusals = unsafe_refusals

    def forge_gemv(self, out, x, w, block: int = 0, rows: int = 0) -> None:
        self._ns.forge_gemv(out, x, w, block, rows)

    def forge_gemv_silu_mul(self, out, x, w, block: int = 0, rows: int = 0) -> None:
        self._ns.forge_gemv_silu_mul(out, x, w, block, rows)


def load(verbose: bool = False, defines: tuple[str, ...] = (), source: Path | None = None,
         arch_list: str | None = None):
    """Returns (Ops, seconds spent). The source registers its ops with TORCH_LIBRARY under the
    extension's name (torch.ops.forge_gemv_ext), the same schemas as vLLM's _C. `defines` (macro names,
    for an A/B of a variant the source guards with a macro) build a separate extension, named and cached
    apart (forge_gemv_ext_<macros>), so both can be loaded in one process. `arch_list` (e.g. "9.0") sets
    TORCH_CUDA_ARCH_LIST when it is unset, instead of asking the device (a caller that must not touch
    CUDA yet, such as the GPU harness's stand-in _C, passes it); `source` is the .cu file to build (default:
    FORGE_GEMV_SOURCE when set, as the GPU harness reads it, else kernels/csrc/forge_gemv.cu; a source
    other than that one is cached in a folder of its own, so a mutant never shadows the real build)."""
    source = Path(source or os.environ.get("FORGE_GEMV_SOURCE") or SOURCE)
    for d in defines:
        if not d.isidentifier():
            raise ValueError(f"gemv_ext.load: macro name expected, got {d!r}")
    import torch
    import torch.utils.cpp_extension as ce

    if not arch_list and not torch.cuda.is_available():
        raise RuntimeError("forge_gemv needs a CUDA/ROCm device")
    if torch.version.cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        if arch_list:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        else:
            major, minor = torch.cuda.get_device_capability()
            os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    name = "_".join([NAME, *(d.lower() for d in defines)])
    out = build_dir() if not defines else build_dir() / name
    if source.resolve() != SOURCE.resolve():
        out = out / f"src-{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", *(f"-D{d}" for d in defines)]
    t0 = time.time()
    ce.load(name=name, sources=[str(source)], build_directory=str(out), extra_cflags=flags,
            extra_cuda_cflags=flags, is_python_module=False, verbose=verbose)
    note = own_cxx_runtime(out / f"{name}.so")
    if note:
        print(f"warning: {note}", flush=True)
    return Ops(getattr(torch.ops, name), note), time.time() - t0
