"""Every source in kernels/csrc compiles without a GPU in every mode we ship it in: standalone for nvcc (sm_90) and
hipcc (gfx90a), and as part of vLLM's _C (torch headers, FORGE_IN_VLLM) — via `forge kernels-check`,
whose report is checked here (written under the test's temporary folder: the tracked
reports/kernels/compile-check.* stay as `make kernels-check` recorded them)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc is not installed")
def test_kernels_check_compiles_every_mode(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"))
    res = subprocess.run([sys.executable, "-m", "forge", "kernels-check", "--report-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    report = json.loads((tmp_path / "compile-check.json").read_text())
    sources = {r["source"] for r in report["csrc"]}
    assert {"kernels/csrc/int8_kv_write.cu", "kernels/csrc/forge_gemv.cu"} <= sources
    for src in sources:
        modes = {(r["compiler"], r["arch"]): r for r in report["csrc"] if r["source"] == src}
        assert modes[("nvcc", "sm_90")]["ok"] is True, src
        assert modes[("nvcc", "sm_90 (in vLLM's _C, torch headers)")]["ok"] is True, src
        hip = modes[("hipcc", "gfx90a")]
        if shutil.which("hipcc"):
            assert hip["ok"] is True, src
    assert report["triton_aot_ok"] is True
