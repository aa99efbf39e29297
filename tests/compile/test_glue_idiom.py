"""Our kernels' torch glue is vLLM's own: every include of torch's CUDA headers and every at::cuda / c10::cuda
name (and device_of) in kernels/csrc is one that vLLM's csrc/cache_kernels.cu or csrc/activation_kernels.cu use,
so the hipify step of the vendor's ROCm build meets nothing it does not already map for vLLM's kernels. The
reference files are read from the pinned source in the patched tree (upstream files our patches leave alone)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREE = Path(os.environ.get("FORGE_BUILD_DIR", ROOT / "build")) / "vllm"
sys.path.insert(0, str(ROOT / "scripts"))

from forge.builder import hipcompile  # noqa: E402

pytestmark = pytest.mark.skipif(not (TREE / ".git").is_dir(), reason=f"{TREE} is missing: run `make tree` first")


def test_our_glue_uses_only_what_vllms_kernels_use():
    assert hipcompile.glue_problems(sorted((ROOT / "kernels" / "csrc").glob("*.cu")), TREE) == []


def test_a_name_outside_vllms_idiom_is_named_with_its_line(tmp_path):
    """Only what vLLM's _C build compiles is held to the idiom: the branch of a torch extension of its own
    (FORGE_IN_VLLM undefined) is not; a branch on anything else (the compiler) is; comments are not code."""
    src = tmp_path / "k.cu"
    src.write_text("#include <c10/cuda/CUDAStream.h>\n"
                   "#if defined(FORGE_IN_VLLM)\n"
                   "#include <ATen/cuda/CUDAContext.h>\n"
                   "#else\n"
                   "#include <c10/cuda/CUDAFunctions.h>\n"
                   "#endif\n"
                   "#ifdef __HIPCC__\n"
                   "#include <c10/cuda/CUDAMathCompat.h>\n"
                   "#endif\n"
                   "void f(T& x) {\n"
                   "  const at::cuda::OptionalCUDAGuard device_guard(device_of(x));  // not c10::cuda::current_device\n"
                   "  launch(c10::cuda::getCurrentCUDAStream());\n"
                   "}\n")
    refs = " or ".join(hipcompile.REFERENCE_SOURCES)
    assert hipcompile.glue_problems([src], TREE) == [
        f"k.cu:1: c10/cuda/CUDAStream.h is not used by vLLM's {refs}",
        f"k.cu:8: c10/cuda/CUDAMathCompat.h is not used by vLLM's {refs}",
        f"k.cu:12: c10::cuda::getCurrentCUDAStream is not used by vLLM's {refs}"]
