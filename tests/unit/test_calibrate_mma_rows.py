"""`forge calibrate --kernels installed` against a wheel built before the skinny GEMM's 32-row tile: that copy of
the kernel (vllm/model_executor/layers/forge_skinny_gemm.py) takes 1-16 rows (MAX_M 16), so at the graphs' 24 and
32 tokens its candidate ("mma") is recorded as not timed, with the kernel's row limit and the fix (rebuild the
wheel, or --kernels checkout), never as failed (a failed candidate reads as a wrong result). The limit is read
from the kernel module's MAX_M, no GPU: the family's own loop runs on a CPU
with stand-ins (test_calibrate_gemv_graph_tokens), then the selection, the documents' reader, the report and the
tool's counts take the records."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.nn.functional as F
from test_calibrate_gemv_graph_tokens import MMA, _silu_mul, run_family

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "kernels"))
from calibrate import common as C  # noqa: E402
from calibrate import gemv as G  # noqa: E402

from forge.errors import ForgeError  # noqa: E402
from forge.run import calibration as sel  # noqa: E402
from forge.run import calibration_docs as cd  # noqa: E402

H200 = {"device_name": "NVIDIA H200", "arch": "sm_90", "compute_units": 132, "toolkit": "cuda 13.0",
        "torch": "2.11", "triton": "3.6", "driver": 13000}
MMA_NAMES = ("forge mma", "forge fused mma")


def _old_launch_config(M, N, K, cus, fused=False):
    if not 1 <= M <= 16:            # what a copy of the kernel from before its 32-row tile says
        raise ValueError(f"skinny_gemm: M={M} rows; the kernel takes 1-16")
    return SimpleNamespace(split_k=1)


def _old_mma(x, w, out, workspace=None):
    _old_launch_config(x.shape[0], w.shape[0], w.shape[1], 8)
    return out.copy_(F.linear(x.float(), w.float()))


def _old_mma_fused(x, w, out, workspace=None):
    _old_launch_config(x.shape[0], w.shape[0], w.shape[1], 8, fused=True)
    return _silu_mul(F.linear(x.float(), w.float()), out)


OLD = SimpleNamespace(MAX_M=16, num_compute_units=lambda: 8, workspace_numel=lambda M, N, s, f=False: 0,
                      launch_config=_old_launch_config, skinny_gemm=_old_mma, skinny_gemm_silu_mul=_old_mma_fused)


def _tokens(r) -> int:
    return int(r["point"][2:])


@pytest.mark.parametrize("hip", [False, True], ids=["nvidia", "amd"])
def test_an_older_installed_skinny_gemm_is_not_timed_above_its_rows_and_never_failed(tmp_path, monkeypatch, hip):
    doc = run_family(tmp_path, monkeypatch, hip, mma=OLD, kernels="installed")
    recs = doc["records"]
    failed = [r for r in recs if not r["ok"] and not r.get("not_timed")]
    assert not failed and not [r for r in recs if C.failed(r)], failed[:2]
    skipped = [r for r in recs if r.get("not_timed")]
    assert {(r["decision"], r["candidate"]) for r in skipped} == {
        (f"gemv.{kind}.{shape}.{m}", name) for m in (24, 32)
        for kind, shape, name in (("plain", "64x128", "forge mma"), ("plain", "96x128", "forge mma"),
                                  ("fused", "96x128", "forge fused mma"))}
    for r in skipped:
        assert r["ok"] is False and r["us"] is None and r["error"] is None and r["launch"] == G.MMA
        why = r["not_timed"]
        assert why.startswith("not timed above 16 tokens") and "takes 1-16 rows (its MAX_M 16)" in why
        assert "installed vLLM" in why and "make wheel" in why and "--kernels checkout" in why
    assert all(r["ok"] and r["us"] for r in recs if not r.get("not_timed"))
    assert {_tokens(r) for r in recs if r["candidate"] in MMA_NAMES and r["us"]} == set(range(1, 17))
    assert {r["not_timed"] for r in skipped} == {skipped[0]["not_timed"]}     # one reason for 24 and 32 alike
    assert [n for n in doc["notes"] if n.startswith("not timed")] == [skipped[0]["not_timed"]]   # said once

    s = sel.select(recs)
    for dec in {r["decision"] for r in skipped}:
        name = "forge fused mma" if ".fused." in dec else "forge mma"
        assert s[dec]["failed"] == {} and set(s[dec]["not_timed"]) == {name}, s[dec]
        assert s[dec]["kind"] == "upstream" and f"({name} not timed)" in s[dec]["why"]
        cd._check_entry(s[dec], cd.Doc("calibration.json", "hint"), f"selection.{dec}", "gemv")
    assert all(not d["failed"] and "not_timed" not in d for dec, d in s.items() if int(dec.rsplit(".", 1)[1]) <= 16)


def test_the_row_limit_is_read_from_the_kernel_module():
    for m in G.token_counts():
        assert G.mma_not_timed(MMA, m, "installed") is None                  # a copy with the 32-row tile
        assert (G.mma_not_timed(OLD, m, "installed") is None) is (m <= 16)
    sk, _ = G.load_mma("checkout")                                           # this checkout's kernel: every count
    assert sk.MAX_M >= max(G.token_counts())
    assert all(G.mma_not_timed(sk, m, "checkout") is None for m in G.token_counts())


def test_the_reader_takes_a_not_timed_record_only_without_a_result():
    r = C.record("gemv.plain.64x128.24", "forge mma", "ours", point="M=24", launch=G.MMA, tol=0.02, weight=64,
                 not_timed="not timed above 16 tokens: why")
    d = cd.Doc("gemv.json", "hint")
    cd.check_record(r, d, "gemv", "records[0]")
    for bad in ({"ok": True, "err": 0.0, "us": {"median": 1.0, "p10": 1.0, "p90": 1.0, "n": 1}},
                {"error": "RuntimeError: x"}, {"not_timed": ""}, {"not_timed": 3}):
        with pytest.raises(ForgeError, match=r"gemv.json: key 'records\[0\].not_timed'"):
            cd.check_record({**r, **bad}, d, "gemv", "records[0]")


def test_calibrate_counts_and_reports_not_timed_apart_from_failed(tmp_path, monkeypatch):
    (tmp_path / "measure").mkdir()
    doc = run_family(tmp_path / "measure", monkeypatch, False, mma=OLD, kernels="installed")
    out = tmp_path / "cal"
    out.mkdir()
    doc.update(family="gemv", device=H200, seconds=1.0,
               options={"kernels": "installed", "ops": "vllm", "quick": False, "smoke": False, "seed": 1234})
    (out / "gemv.json").write_text(json.dumps(doc))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FORGE_CALIBRATE_FAULT")}
    r = subprocess.run([sys.executable, "-m", "forge", "calibrate", "--families", "gemv", "--kernels", "installed",
                        "--ops", "vllm", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(env, PYTHONPATH=str(ROOT / "scripts")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "0 failing candidate(s) left out, 6 not timed" in r.stderr
    cal = cd.check_report(json.loads((out / "calibration.json").read_text()), "calibration.json")
    assert cal["selection"]["gemv.fused.96x128.32"]["not_timed"].keys() == {"forge fused mma"}
    md = (out / "calibration.md").read_text()
    assert "| decision | candidate | point | error |" not in md           # no failure table: nothing failed
    assert "Not timed: 6 candidate-point(s), neither passed nor failed:" in md
    assert "- not timed above 16 tokens: the installed vLLM's skinny GEMM" in md and "(6: gemv.plain.64x128.24 forge mma" in md
    assert md.count("- not timed above 16 tokens") == 2          # once in the family's notes, once over its points
