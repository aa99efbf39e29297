"""Every source in kernels/csrc compiles without a GPU in every mode we ship it in: standalone for nvcc (sm_90) and
hipcc (gfx90a), and as part of vLLM's _C — with nvcc against torch's headers, and with hipcc the way vLLM's CMake
builds a _C source for ROCm (vLLM's hipify step, vLLM's HIP flags, torch's headers in the ROCm layout) — and our
torch glue uses only what vLLM's own kernels use; via `forge kernels-check`, whose report is checked here
(written under the test's temporary folder: the tracked reports/kernels/compile-check.* stay as
`make kernels-check` recorded them)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge.builder import kernels  # noqa: E402


@pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc is not installed")
def test_kernels_check_compiles_every_mode(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"))
    res = subprocess.run([sys.executable, "-m", "forge", "kernels-check", "--report-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    report = json.loads((tmp_path / "compile-check.json").read_text())
    sources = {r["source"] for r in report["csrc"]}
    assert {"kernels/csrc/int8_kv_write.cu", "kernels/csrc/forge_gemv.cu"} <= sources
    for src in sources:
        modes = {(r["compiler"], r["arch"]): r for r in report["csrc"] if r["source"] == src}
        assert modes[("nvcc", "sm_90")]["ok"] is True, src
        assert modes[("nvcc", kernels.IN_C_CUDA)]["ok"] is True, src
        for arch in ("gfx90a", kernels.IN_C_HIP):
            if shutil.which("hipcc"):
                assert modes[("hipcc", arch)]["ok"] is True, (src, arch)
    assert report["glue_problems"] == []
    assert report["triton_aot_ok"] is True
    md = (tmp_path / "compile-check.md").read_text()
    assert kernels.IN_C_HIP in md and "not verified here" in md and "gfx936" in md
