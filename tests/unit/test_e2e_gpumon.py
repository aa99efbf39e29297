"""`forge e2e-gpu` samples the GPU beside the run (logs/gpu-monitor.log): with a card's tool on PATH (a fake
nvidia-smi here, answering each query as the real one does) every sample holds the clocks line and the
processes on the card, the summary names the log and its samples; without one the summary says the GPU
was not sampled. A query that hangs is written as such and the run goes on."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from helpers import e2e_fake

FAKE_SMI = """#!/bin/sh
case "$*" in
  *memory.total*) echo 143771 ;;
  *--query-gpu=name*) echo "NVIDIA H200" ;;
  *query-compute-apps*) echo "GPU-0, 4242, python3, 52000 MiB" ;;
  *clocks.sm*) if [ -n "$SMI_HANG" ]; then exec sleep 30; fi; echo "0, 1980 MHz, 3201 MHz, 250.00 W, 41, 75 %, 109719 MiB" ;;
  *) echo "NVIDIA H200" ;;
esac
"""


def fake_path(tmp_path: Path) -> str:
    d = tmp_path / "fakebin"
    d.mkdir(exist_ok=True)
    smi = d / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    return f"{d}{os.pathsep}{os.environ.get('PATH', '')}"


def test_the_gpu_is_sampled_beside_the_run(tmp_path):
    r, _, out = e2e_fake(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K",
                         env_extra={"PATH": fake_path(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (out / "logs" / "gpu-monitor.log").read_text()
    assert log.startswith("# nvidia-smi, every 5 s")
    samples = re.split(r"\n(?=\d{4}-\d\d-\d\dT)", log)[1:]
    assert samples and all("1980 MHz" in b and "4242, python3" in b for b in samples), log[:2000]
    s = json.loads((out / "summary.json").read_text())
    mon = s["gpu_monitor"]
    assert mon["tool"] == "nvidia-smi" and mon["log"] == "logs/gpu-monitor.log" and mon["samples"] == len(samples)
    assert f"`logs/gpu-monitor.log`, {len(samples)} samples" in (out / "summary.md").read_text()


def test_without_a_card_tool_the_summary_says_the_gpu_was_not_sampled(tmp_path):
    r, _, out = e2e_fake(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K")
    if (out / "logs" / "gpu-monitor.log").exists():
        import pytest
        pytest.skip("a card's management tool is on this machine's PATH")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["gpu_monitor"]["tool"] is None
    assert "The GPU beside the run: not sampled (no nvidia-smi" in (out / "summary.md").read_text()


def test_a_query_that_hangs_is_written_and_the_monitor_stops(tmp_path, monkeypatch):
    """The monitor on its own: a hanging query is cut at its timeout and written as such; stop() returns."""
    from forge.lab import gpumon
    monkeypatch.setenv("PATH", fake_path(tmp_path))
    monkeypatch.setenv("SMI_HANG", "1")
    monkeypatch.setattr(gpumon, "QUERY_TIMEOUT_S", 0.5)
    m = gpumon.Monitor(tmp_path / "logs" / "gpu-monitor.log", interval_s=0.2)
    assert m.tool == "nvidia-smi"
    m.start()
    t = time.monotonic()
    while m.samples < 2 and time.monotonic() - t < 20:
        time.sleep(0.1)
    t = time.monotonic()
    m.stop()
    assert time.monotonic() - t < 3 and not m._thread.is_alive()   # not held up by the query in flight
    text = (tmp_path / "logs" / "gpu-monitor.log").read_text()
    assert m.samples >= 2 and "(no answer in 0.5 s)" in text, text
    assert "4242, python3" in text
