"""The patched CMakeLists.txt never lets one of our kernels break vLLM's `_C`: a source of csrc/forge/ that
does not compile the way `_C` compiles it is left out with a warning and its ops are not registered; an intact
one is built in and registered.

What runs, and what that proves at its size: the checked-sources block is cut verbatim from the patched
tree's CMakeLists.txt (between its `dcu-forge: checked sources` markers) and included by a small CMake
project set up as vLLM's CMakeLists.txt sets up a HIP build up to that point: the pinned cmake/utils.cmake,
torch found through its own CMake config (the CPU wheel's; its headers completed to a ROCm torch's by the
hipified ATen/hip and c10/hip folders and library stubs of builder.hipcompile, given as toolchain flags),
CMake's HIP language (this hipcc's clang, C++17 as newer clangs such as DTK's default to), VLLM_GPU_FLAGS
from utils.cmake's own get_torch_gpu_compiler_flags, vLLM's extra HIP flag and one target architecture
(gfx90a: this hipcc does not know gfx936). The block then does for real what it does in vLLM's build: the
pinned cmake/hipify.py over the patched tree's csrc/ and its probe project compiling each source, here with
forge_gemv.cu broken on purpose (a CUDA 12 launch attribute HIP does not have) and int8_kv_write.cu intact.
Then a stand-in `_C` target is built from what the block kept that the host compiler builds (the real
patched torch_bindings.cpp) with `_C`'s definitions line copied from the patched CMakeLists.txt; its object
shows which forge ops `_C` would register. Not covered here: compiling the kept .cu into the stand-in
target (the probe compiled it already, the same way), linking `_C`, DTK's compiler and gfx936 itself."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREE = Path(os.environ.get("FORGE_BUILD_DIR", ROOT / "build")) / "vllm"
sys.path.insert(0, str(ROOT / "scripts"))

from forge.builder import hipcompile  # noqa: E402

BEGIN, END = "# >>> dcu-forge: checked sources", "# <<< dcu-forge: checked sources"
DEFS_LINE = "target_compile_definitions(_C PRIVATE FORGE_IN_VLLM=1 ${FORGE_EXT_DEFS})"
BREAK = "static const int forge_pdl = cudaLaunchAttributeProgrammaticStreamSerialization;\n"

pytestmark = [
    pytest.mark.skipif(not (TREE / ".git").is_dir(), reason=f"{TREE} is missing: run `make tree` first"),
    pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("hipcc") and shutil.which("nm")),
                       reason="needs cmake, hipcc (apt-get install -y hipcc cmake) and nm"),
]


def hip_toolchain(tmp: Path, extra_flags: list[str]) -> tuple[list[str], dict]:
    """CMake arguments and environment for CMake's HIP language with the installed hipcc's clang. A
    ROCm install has lib/cmake/hip-lang under its root; Debian keeps it under lib/<multiarch>/cmake, so
    a root of links is made for it."""
    r = subprocess.run(["hipcc", "--offload-arch=gfx90a", "-c", "-x", "hip", os.devnull, "-o", os.devnull],
                       env=dict(os.environ, HIP_PLATFORM="amd", HIPCC_VERBOSE="1"), capture_output=True, text=True)
    cmd = next(line for line in (r.stdout + r.stderr).splitlines() if line.startswith("hipcc-cmd:")).split()
    clang = os.path.realpath(cmd[1])
    rocm = next(a.split("=", 1)[1] for a in cmd if a.startswith("--rocm-path="))
    flags = [a.replace('"', "") for a in cmd if a.startswith(("--rocm-path=", "--hip-device-lib-path="))]
    env = dict(os.environ, HIP_PLATFORM="amd")
    root = Path(rocm)
    if not (root / "lib" / "cmake" / "hip-lang" / "hip-lang-config.cmake").is_file():
        found = sorted(Path(rocm, "lib").glob("*/cmake/hip-lang/hip-lang-config.cmake"))
        assert found, f"no hip-lang CMake package under {rocm}/lib"
        cmake_dir = found[0].parent.parent
        root = tmp / "rocm-root"
        (root / "lib" / "cmake").mkdir(parents=True)
        for pkg in cmake_dir.iterdir():
            (root / "lib" / "cmake" / pkg.name).symlink_to(pkg)
        env["CMAKE_PREFIX_PATH"] = str(cmake_dir)
    # C++17: the default of newer clangs such as DTK's; this clang 15 defaults to C++14
    return [f"-DCMAKE_HIP_COMPILER={clang}", f"-DCMAKE_HIP_COMPILER_ROCM_ROOT={root}", "-DCMAKE_HIP_STANDARD=17",
            f"-DCMAKE_HIP_FLAGS={' '.join([*flags, *extra_flags])}"], env


PROJECT = """cmake_minimum_required(VERSION 3.21)
project(forge_checked_sources LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 17)
# what the block reads from vLLM's CMake for a HIP build, set up as vLLM's CMakeLists.txt does
set(VLLM_GPU_LANG HIP)
set(Python_EXECUTABLE "{python}")
include(cmake/utils.cmake)
append_cmake_prefix_path("torch" "torch.utils.cmake_prefix_path")
find_package(Torch REQUIRED)
enable_language(HIP)
get_torch_gpu_compiler_flags(VLLM_GPU_FLAGS HIP)
set(CMAKE_HIP_FLAGS "${{CMAKE_HIP_FLAGS}} -Wno-unused-result")
set(VLLM_GPU_ARCHES gfx90a)
set(VLLM_EXT_SRC "csrc/torch_bindings.cpp")
include(forge_block.cmake)
file(WRITE "${{CMAKE_BINARY_DIR}}/kept.txt" "${{VLLM_EXT_SRC}}\\n${{FORGE_EXT_DEFS}}\\n")
# the stand-in _C: what the block kept that the host compiler builds, with _C's definitions
list(FILTER VLLM_EXT_SRC INCLUDE REGEX "\\\\.cpp$")
add_library(_C OBJECT ${{VLLM_EXT_SRC}})
target_include_directories(_C PRIVATE csrc "{python_include}")
target_link_libraries(_C PRIVATE torch)
target_compile_definitions(_C PRIVATE TORCH_EXTENSION_NAME=_C)
{defs_line}
"""


def test_a_broken_source_is_left_out_and_an_intact_one_built_in(tmp_path):
    lists = (TREE / "CMakeLists.txt").read_text()
    assert BEGIN in lists and END in lists, "the patched CMakeLists.txt has no checked-sources block"
    assert DEFS_LINE in lists, "the patched CMakeLists.txt gives _C the definitions of the sources it kept"
    project = tmp_path / "project"
    shutil.copytree(TREE / "csrc", project / "csrc")
    (project / "cmake").mkdir()
    for f in ("hipify.py", "utils.cmake"):
        shutil.copyfile(TREE / "cmake" / f, project / "cmake" / f)
    (project / "forge_block.cmake").write_text(lists[lists.index(BEGIN):lists.index(END) + len(END)] + "\n")
    gemv = project / "csrc" / "forge" / "forge_gemv.cu"
    text = gemv.read_text()
    gemv.write_text(text.replace("namespace fgemv {", BREAK + "namespace fgemv {", 1))
    (project / "CMakeLists.txt").write_text(PROJECT.format(
        python=sys.executable, python_include=sysconfig.get_paths()["include"], defs_line=DEFS_LINE))
    # torch's CUDA headers in the ROCm layout and the library stubs, beside the CPU wheel's headers that the
    # torch target brings: given to the compiler as a toolchain's flags
    overlay = hipcompile.rocm_header_overlay(tmp_path / "torch")
    args, env = hip_toolchain(tmp_path, [f"-isystem {d}" for d in overlay])
    build = tmp_path / "build"
    conf = subprocess.run(["cmake", "-S", project, "-B", build, "-DCMAKE_BUILD_TYPE=RelWithDebInfo", *args],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert conf.returncode == 0, conf.stdout[-3000:] + conf.stderr[-5000:]
    warning = re.sub(r"\s+", " ", conf.stderr)
    assert ("dcu-forge: csrc/forge/forge_gemv.cu does not compile with _C's flags for gfx90a; it is left out of _C "
            "and its ops are not registered (FORGE_HAS_GEMV is not defined)") in warning, conf.stderr[-4000:]
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in warning, "the warning shows the compiler's error"
    assert "dcu-forge: csrc/forge/int8_kv_write.cu compiles with _C's flags for gfx90a" in conf.stdout
    kept, defs = (build / "kept.txt").read_text().splitlines()
    assert "csrc/forge/int8_kv_write.cu" in kept.split(";") and "csrc/forge/forge_gemv.cu" not in kept
    assert defs.split(";") == ["FORGE_HAS_INT8_KV_WRITE=1"]

    built = subprocess.run(["cmake", "--build", build, "--target", "_C"], env=env, capture_output=True, text=True,
                           timeout=1200)
    assert built.returncode == 0, built.stdout[-5000:]
    obj = next(build.rglob("torch_bindings.cpp.o"))
    symbols = subprocess.run(["nm", "-C", obj], capture_output=True, text=True, check=True).stdout
    registered = set(re.findall(r"\bU (forge_\w+)\(", symbols))
    assert registered == {"forge_int8_kv_write"}, registered
