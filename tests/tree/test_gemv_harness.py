"""The GPU harness's stand-in vllm._C builds and registers the product's GEMV when VLLM_FORGE_GEMV=1 asks
for it, or with "auto" (the default: a tuned table may route it) where an NVIDIA GPU is visible, never with
"0", under the schemas of the patched torch_bindings.cpp (so `contest` with and without the GEMV
can be compared on the GPU machine). On a CUDA machine it is built and checked against float64."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "harness" / "gpu" / "overlay" / "vllm" / "_C.py"

LOAD = textwrap.dedent(
    f"""
    import importlib.util, torch
    spec = importlib.util.spec_from_file_location("standin_C", {str(STANDIN)!r})
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    print("HAS", hasattr(torch.ops._C, "forge_gemv"), hasattr(torch.ops._C, "forge_gemv_silu_mul"))
    """
)


def run(code, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_FORGE_GEMV", "FORGE_GEMV"))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**full, **env}, cwd=ROOT)


@pytest.mark.parametrize("mode", [None, "0", "auto"])
def test_not_built_unless_asked(mode):
    """On a machine without an NVIDIA GPU (CI) "auto" builds nothing, and "0" never does."""
    if mode != "0" and shutil.which("nvidia-smi"):
        pytest.skip("an NVIDIA GPU may be visible here: auto builds the GEMV")
    res = run(LOAD, **({"VLLM_FORGE_GEMV": mode} if mode else {}))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "HAS False False" in res.stdout


def test_missing_source_is_named(tmp_path):
    res = run(LOAD, VLLM_FORGE_GEMV="1", FORGE_GEMV_SOURCE=str(tmp_path / "nope.cu"))
    assert res.returncode != 0
    assert "FORGE_GEMV_SOURCE" in res.stderr and "nope.cu" in res.stderr


def test_missing_source_names_the_mode_that_asked_for_it(tmp_path):
    """With no VLLM_FORGE_GEMV set (auto) on a machine where nvidia-smi answers, the error says auto asked
    for the build, not VLLM_FORGE_GEMV=1 (which nobody set), and where the default source is looked for."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 9.0\n")
    smi.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    res = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith(("VLLM_FORGE_GEMV",
                                                                                             "FORGE_GEMV"))},
                              "PATH": path})
    assert res.returncode != 0
    assert "VLLM_FORGE_GEMV=auto (an NVIDIA GPU is visible)" in res.stderr and "VLLM_FORGE_GEMV=1" not in res.stderr
    assert str(tmp_path / "kernels" / "csrc" / "forge_gemv.cu") in res.stderr, res.stderr[-2000:]


def test_a_failing_nvidia_smi_sees_no_gpu(tmp_path):
    """nvidia-smi that answers "NVIDIA-SMI has failed ..." and exits 9 (a driver that does not load): "auto"
    takes its text for no compute capability and builds nothing, where it used to read the words as
    capabilities and fail for a missing GEMV source."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA "
                   "driver.'\nexit 9\n")
    smi.chmod(0o755)
    res = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith(("VLLM_FORGE_GEMV",
                                                                                             "FORGE_GEMV"))},
                              "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert res.returncode == 0 and "HAS False False" in res.stdout, res.stderr[-2000:]


def test_source_outside_a_checkout_is_named(tmp_path):
    """The stand-in builds through the product's builder beside the source (kernels/bench/gemv_ext.py):
    a source without it is refused, naming the builder, before anything is compiled."""
    src = tmp_path / "kernels" / "csrc" / "forge_gemv.cu"
    src.parent.mkdir(parents=True)
    src.write_bytes((ROOT / "kernels" / "csrc" / "forge_gemv.cu").read_bytes())
    res = run(LOAD, VLLM_FORGE_GEMV="1", FORGE_GEMV_SOURCE=str(src))
    assert res.returncode != 0
    assert "gemv_ext.py" in res.stderr and "FORGE_GEMV_SOURCE" in res.stderr


def test_schemas_match_the_patched_bindings(patched_tree):
    binds = (patched_tree / "csrc" / "torch_bindings.cpp").read_text()
    standin = STANDIN.read_text()
    for name in ("forge_gemv", "forge_gemv_silu_mul"):
        m = re.search(r'ops\.def\(\s*((?:"[^"]*"\s*)+)\);\s*ops\.impl\("' + name + '"', binds)
        assert m, name
        schema = "".join(re.findall(r'"([^"]*)"', m.group(1)))
        assert f'"{schema}"' in standin, (name, schema)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device (GPU machine)")
def test_built_and_correct_on_a_gpu(tmp_path):
    code = LOAD + textwrap.dedent(
        """
        import torch.nn.functional as F
        x = torch.randn(2, 5120, device="cuda").bfloat16()
        w = (torch.randn(2 * 512, 5120, device="cuda") * 5120 ** -0.5).bfloat16()
        y = torch.full((2, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
        torch.ops._C.forge_gemv(y, x, w)
        ys = torch.full((2, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        torch.ops._C.forge_gemv_silu_mul(ys, x, w, 256, 2)
        r = x.double() @ w.double().T
        rs = F.silu(r[:, :512]) * r[:, 512:]
        e1 = ((y.double() - r).abs().max() / r.abs().max()).item()
        e2 = ((ys.double() - rs).abs().max() / rs.abs().max()).item()
        print("ERR", e1, e2)
        """
    )
    res = run(code, VLLM_FORGE_GEMV="1", FORGE_GEMV_BUILD_DIR=os.environ.get("FORGE_GEMV_BUILD_DIR",
                                                                          str(ROOT / "build" / "forge-gemv-ext")))
    assert res.returncode == 0, res.stderr[-4000:]
    assert "HAS True True" in res.stdout
    e1, e2 = (float(v) for v in res.stdout.split("ERR")[1].split())
    assert e1 < 1e-2 and e2 < 1e-2, (e1, e2)
