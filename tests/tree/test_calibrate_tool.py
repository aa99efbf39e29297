"""`forge calibrate` end to end on a CPU (`--smoke`: tiny shapes under Triton's interpreter, against the
patched vLLM the rehearsal installed): the prefill family's candidates are checked against float64 and
timed against vLLM's unified kernel; a candidate that kills its process is recorded as failed and its
family goes on with the others; a family whose process dies outside any candidate is recorded as failed
while the other families go on; the table and the report are written, and a rerun keeps what was measured. What it proves at
this size is the tool (isolation, selection, resume, documents), not any number: the timings of the
interpreter mean nothing. About a minute on two cores."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def calibrate(out: Path, python: Path, *extra, fault: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FORGE_CALIBRATE_FAULT")}
    env["PYTHONPATH"] = str(ROOT / "scripts")
    if fault:
        env["FORGE_CALIBRATE_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "forge", "calibrate", "--smoke", "--families", "prefill,write,gemm",
                           "--kernels", "installed", "--python", str(python), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)


def test_calibrate_isolates_a_dying_family_selects_and_resumes(tmp_path, vllm_python):
    # a Python that dies of a segmentation fault in the gemm family's process, as a GPU fault would
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncase \"$*\" in *' gemm '*) kill -SEGV $$;; esac\nexec {vllm_python} \"$@\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "cal"
    # and a prefill candidate that kills its process (a GPU fault in one launch): the family goes on
    killer = "BLOCK_M 64 TILE_N 32 warps 8 stages 2"
    r = calibrate(out, fake, fault=f"prefill.16bit|{killer}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"prefill.16bit / {killer}: the process was killed by signal 11" in r.stderr
    assert "gemm: FAILED: the process was killed by signal 11" in r.stderr
    doc = json.loads((out / "calibration.json").read_text())
    assert doc["families"]["gemm"]["failed"].startswith("the process was killed by signal 11")
    s = doc["selection"]["prefill.16bit"]
    # every other candidate ran and was checked; the upstream path is the unified kernel
    assert s["upstream"] == "vLLM unified (16-row tiles)"
    assert list(s["failed"]) == [killer] and "killed the calibration process" in s["failed"][killer]
    assert s["chosen"] in s["candidates"] and killer not in s["candidates"] and len(s["candidates"]) >= 2
    assert not list(out.glob("prefill.json.*")), "the family's partial files are gone once it finished"
    table = json.loads((out / "table.json").read_text())
    assert table["prefill"]["16bit"] == s["candidates"][s["best_ours"]]["launch"]
    assert table["validators"]["device_name"] == "cpu"
    md = (out / "calibration.md").read_text()
    assert "**FAILED**: the process was killed by signal 11" in md and "| prefill.16bit |" in md
    writes = json.loads((out / "write.json").read_text())["records"]
    assert writes and all(w["ok"] for w in writes)
    # a rerun keeps the measured families and measures only the one that failed
    r2 = calibrate(out, vllm_python)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "prefill: kept from" in r2.stderr and "write: kept from" in r2.stderr
    assert "gemm: measuring" in r2.stderr


def test_calibrate_refuses_an_unknown_family():
    r = subprocess.run([sys.executable, "-m", "forge", "calibrate", "--families", "gemv,nope"], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT / "scripts")), timeout=120)
    assert r.returncode == 2 and "unknown nope" in r.stderr


def test_the_decode_family_measures_each_batch_padded_to_its_cuda_graph(tmp_path, vllm_python):
    """The decode family on the patched vLLM (smoke: 1 and 3 requests): 3 requests run as the server runs
    them, in the graph of 4 with one padding row, so the decision and the table's segments are keyed by 4,
    the size the backend plans for; every candidate, vLLM's kernel included, is checked on the real rows."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FORGE_CALIBRATE_FAULT")}
    env["PYTHONPATH"] = str(ROOT / "scripts")
    out = tmp_path / "cal"
    r = subprocess.run([sys.executable, "-m", "forge", "calibrate", "--smoke", "--families", "decode",
                        "--kernels", "installed", "--python", str(vllm_python), "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    fam = json.loads((out / "decode.json").read_text())
    assert "batch 4: 3 requests padded to 4" in " ".join(fam["notes"])
    assert {r["point"] for r in fam["records"] if r["decision"].startswith("decode.4.")} == {"n=3 ctx=97"}
    doc = json.loads((out / "calibration.json").read_text())
    assert {d for d in doc["selection"] if d.startswith("decode.")} == {
        f"decode.{b}.{kv}" for b in (1, 4) for kv in ("16bit", "int8", "qk")}
    assert all(r["ok"] for r in fam["records"]), [r for r in fam["records"] if not r["ok"]]
    # the int8 cache's two Q.K paths, each at the batch's built-in launch, on every point of the batch
    qk = {(r["decision"], r["kind"], r["point"]) for r in fam["records"] if r["decision"].endswith(".qk")}
    assert qk == {(f"decode.{b}.qk", k, p) for b, p in ((1, "ctx=97"), (4, "n=3 ctx=97")) for k in ("builtin", "ours")}
    table = json.loads((out / "table.json").read_text())
    assert set(next(iter(table["decode"]["segments"].values()))) == {"1", "4"}
    assert isinstance(table["decode"]["qk_int8"], bool)     # both paths measured at every batch: a choice
