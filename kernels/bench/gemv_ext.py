"""Build kernels/csrc/forge_gemv.cu as a standalone torch extension (torch.utils.cpp_extension.load) on a
GPU machine: the tests and the benchmark use it; inside vLLM the same source is part of `_C`.

The build is cached in FORGE_GEMV_BUILD_DIR (default: build/forge-gemv-ext under the repository) and
compiled for the visible device only (TORCH_CUDA_ARCH_LIST is set from it when unset)."""

from __future__ import annotations

import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "kernels" / "csrc" / "forge_gemv.cu"


def build_dir() -> Path:
    return Path(os.environ.get("FORGE_GEMV_BUILD_DIR") or REPO / "build" / "forge-gemv-ext")


def load(verbose: bool = False):
    """Returns (module, seconds spent). The module has forge_gemv(out, x, w, block=0, rows=0) and
    forge_gemv_silu_mul(out, x, w, block=0, rows=0)."""
    import torch
    import torch.utils.cpp_extension as ce

    if not torch.cuda.is_available():
        raise RuntimeError("forge_gemv needs a CUDA/ROCm device")
    if torch.version.cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    mod = ce.load(name="forge_gemv_ext", sources=[str(SOURCE)], build_directory=str(out),
                  extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], verbose=verbose)
    return mod, time.time() - t0
