"""forge offline-check: the CMake paths a HIP build takes, and every download on them, named by
file:line. Small CMake trees written here pin the evaluation rules; the pinned sdist (when the cache
holds it) is the case the check exists for: its triton_kernels.cmake clones Triton for HIP."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge.builder import offline  # noqa: E402
from forge.builder.cmakelang import parse_cmake  # noqa: E402
from forge.errors import ForgeError  # noqa: E402

CACHE = Path(os.environ.get("FORGE_CACHE_DIR", ROOT / ".cache" / "forge"))
SDIST = CACHE / "src" / "vllm-0.18.1"
GIT = "GIT_REPOSITORY https://example.invalid/x.git"


def tree(tmp_path: Path, top: str, files: dict[str, str] | None = None) -> Path:
    (tmp_path / "CMakeLists.txt").write_text(top)
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def lines(w) -> list[tuple[str, int]]:
    return [(f.file, f.line) for f in w.findings]


def test_the_reader_keeps_lines_arguments_and_skips_comments():
    cmds = parse_cmake('# c\n#[[ block\n FetchContent_Declare(x URL y)\n]]\nset(A "a b" [=[c)d]=] e)\n'
                       'if (X\n  AND Y) # t\nendif()\n')
    assert [(c.name, c.line) for c in cmds] == [("set", 5), ("if", 6), ("endif", 8)]
    assert cmds[0].args == [("A", False), ("a b", True), ("c)d", True), ("e", False)]


def test_only_the_hip_branches_are_followed(tmp_path):
    t = tree(tmp_path, f'''
if(VLLM_GPU_LANG STREQUAL "CUDA")
  FetchContent_Declare(cutlass {GIT})
elseif(VLLM_GPU_LANG STREQUAL "HIP")
  include(cmake/hip.cmake)
else()
  file(DOWNLOAD https://example.invalid/a a)
endif()
if (NOT VLLM_TARGET_DEVICE STREQUAL "cuda" AND NOT VLLM_TARGET_DEVICE STREQUAL "rocm")
  include(cmake/cpu.cmake)
  return()
endif()
include(${{CMAKE_CURRENT_LIST_DIR}}/cmake/utils.cmake)
''', {"cmake/hip.cmake": "\n\nExternalProject_Add(p URL https://example.invalid/p.tgz)\n",
      "cmake/cpu.cmake": f"FetchContent_Declare(onednn {GIT})\n", "cmake/utils.cmake": "set(X 1)\n"})
    w = offline.check_tree(t)
    assert lines(w) == [("cmake/hip.cmake", 3)]
    assert "CMakeLists.txt:5 include(cmake/hip.cmake)" in str(w.findings[0])
    assert w.files == ["CMakeLists.txt", "cmake/hip.cmake", "cmake/utils.cmake"]


def test_a_condition_it_cannot_evaluate_counts_as_reachable_and_is_named(tmp_path):
    t = tree(tmp_path, f'''
if(NVCC_THREADS AND VLLM_GPU_LANG STREQUAL "CUDA")
  FetchContent_Declare(a {GIT})
endif()
if(SOME_CACHE_OPTION)
  FetchContent_Declare(b {GIT})
endif()
if (DEFINED ENV{{B_SRC_DIR}})
  FetchContent_Declare(c SOURCE_DIR $ENV{{B_SRC_DIR}})
else()
  FetchContent_Declare(c {GIT})
endif()
''')
    w = offline.check_tree(t)
    assert lines(w) == [("CMakeLists.txt", 6), ("CMakeLists.txt", 11)]     # unknown AND false is false
    assert "not evaluated" in str(w.findings[0]) and "SOME_CACHE_OPTION" in str(w.findings[0])
    assert w.findings[1].alternative == "environment variable B_SRC_DIR"
    assert "local-path alternative: environment variable B_SRC_DIR" in str(w.findings[1])


def test_a_local_copy_shipped_in_the_tree_guards_a_download(tmp_path):
    body = f'''
if(EXISTS "${{CMAKE_CURRENT_SOURCE_DIR}}/third_party/tk")
  FetchContent_Declare(tk SOURCE_DIR ${{CMAKE_CURRENT_SOURCE_DIR}}/third_party/tk)
else()
  FetchContent_Declare(tk {GIT})
endif()
'''
    t = tree(tmp_path, body)
    assert lines(offline.check_tree(t)) == [("CMakeLists.txt", 5)]
    (tmp_path / "third_party" / "tk").mkdir(parents=True)
    assert offline.check_tree(t).findings == []


def test_a_network_command_and_a_function_body_are_reported(tmp_path):
    t = tree(tmp_path, '''
function(fetch_it)
  execute_process(COMMAND git clone https://example.invalid/r.git)
endfunction()
file(DOWNLOAD "https://example.invalid/f" "${CMAKE_BINARY_DIR}/f")
''')
    assert lines(offline.check_tree(t)) == [("CMakeLists.txt", 3), ("CMakeLists.txt", 5)]


def test_require_offline_names_file_and_line(tmp_path):
    t = tree(tmp_path, f"FetchContent_Declare(x {GIT})\n")
    with pytest.raises(ForgeError, match=r"CMakeLists.txt:1: fetchcontent_declare\(x GIT_REPOSITORY"):
        offline.require_offline(t)


@pytest.mark.skipif(not SDIST.is_dir(), reason="needs the verified sdist in the cache (make fetch)")
def test_the_pristine_sdist_fails_on_the_triton_clone(tmp_path):
    w = offline.check_tree(SDIST)
    assert lines(w) == [("cmake/external_projects/triton_kernels.cmake", 17)]
    text = str(w.findings[0])
    assert "github.com/triton-lang/triton.git" in text and "CMakeLists.txt:1189 include(" in text
    assert "TRITON_KERNELS_SRC_DIR" in text
    # the CUDA-only downloads (cutlass, flash-attention, FlashMLA, qutlass) are not on the HIP path
    assert not any("cutlass" in str(f) or "flash" in str(f).lower() for f in w.findings)
    r = subprocess.run([sys.executable, "-m", "forge", "offline-check", "--tree", str(SDIST)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "scripts")}, timeout=120)
    assert r.returncode == 2 and "triton_kernels.cmake:17" in r.stderr and "Traceback" not in r.stderr
