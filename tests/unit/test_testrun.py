"""`make test` runs both rehearsals but keeps their reports out of the tracked reports/ folder."""

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import ROOT  # noqa: E402

from forge import testrun  # noqa: E402
from forge.builder import image, rehearsal  # noqa: E402
from forge.paths import REPORTS  # noqa: E402


def test_make_test_writes_the_rehearsal_reports_under_build(monkeypatch, tmp_path):
    calls = {}
    monkeypatch.setattr(testrun, "disk_preflight", lambda with_image: None)
    monkeypatch.setattr(testrun.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(rehearsal, "rehearse", lambda **kw: calls.setdefault("rehearsal", kw))
    monkeypatch.setattr(image, "image_rehearsal", lambda **kw: calls.setdefault("image", kw))
    args = types.SimpleNamespace(no_rehearsal=False, no_image=False, pytest_args=["--version"])
    assert testrun.cmd_test(args) == 0
    for stage in ("rehearsal", "image"):
        out = calls[stage]["report_dir"]
        assert out == testrun.TEST_REPORTS and REPORTS not in (out, *out.parents), stage


def test_the_image_report_goes_where_it_is_told(tmp_path):
    rec = {"started": "2026-01-01T00:00:00+00:00", "ok": True, "seconds": 1.0, "forge": {"commit": "abc"},
           "stages": [{"stage": "build", "seconds": 1.0}]}
    before = {p: p.stat().st_mtime_ns for p in REPORTS.glob("image-rehearsal.*")}
    image._write_image_report(rec, tmp_path)
    assert (tmp_path / "image-rehearsal.json").is_file()
    assert "PASS" in (tmp_path / "image-rehearsal.md").read_text()
    assert {p: p.stat().st_mtime_ns for p in REPORTS.glob("image-rehearsal.*")} == before
    assert ROOT in REPORTS.parents


def test_make_test_runs_the_fault_suite_first_and_the_rest_once(monkeypatch):
    seen = []
    monkeypatch.setattr(testrun.proc, "run", lambda cmd, **kw: seen.append(cmd[cmd.index("-rs") + 1:])
                        or types.SimpleNamespace(returncode=len(seen) - 1))
    args = types.SimpleNamespace(no_rehearsal=True, no_image=True, pytest_args=[])
    assert testrun.cmd_test(args) == 1, "a failure in either run fails make test"
    assert seen == [["tests/faults"], ["tests", "--ignore=tests/faults"]]
    assert (ROOT / "tests" / "faults" / "conftest.py").is_file()
