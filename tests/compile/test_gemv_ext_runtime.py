"""kernels/bench/gemv_ext.own_cxx_runtime: an extension that carries its own C++ runtime (linked
statically, as the GPU machine's default compiler does) is recognised, so the GEMV refusal tests skip
with the reason instead of crashing; a normally linked one is not flagged. Two tiny shared objects that
throw, built here with g++."""

import shutil
import subprocess

import pytest
from helpers import bench_module

pytestmark = pytest.mark.skipif(not (shutil.which("g++") and shutil.which("readelf")), reason="needs g++ and readelf")


def _so(tmp_path, name, *flags):
    src = tmp_path / "t.cpp"
    src.write_text('#include <stdexcept>\nextern "C" void refuse(int a) { if (a) throw std::runtime_error("no"); }\n')
    out = tmp_path / name
    r = subprocess.run(["g++", "-shared", "-fPIC", "-O1", *flags, "-o", str(out), str(src)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"g++ cannot build this variant here: {r.stderr[-300:]}")
    return out


def test_a_statically_linked_cxx_runtime_is_named(tmp_path):
    mod = bench_module("gemv_ext")
    normal = _so(tmp_path, "normal.so")
    assert mod.own_cxx_runtime(normal) is None
    static = _so(tmp_path, "forge_gemv_ext.so", "-static-libstdc++", "-static-libgcc")
    note = mod.own_cxx_runtime(static)
    assert note and "own C++ runtime" in note and "CXX=/usr/bin/g++" in note and "forge_gemv_ext.so" in note
    assert mod.own_cxx_runtime(tmp_path / "missing.so") is None
