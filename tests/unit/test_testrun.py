"""`make test` runs both rehearsals and the container toolchain check, but keeps their reports out of the
tracked reports/ folder."""

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import ROOT  # noqa: E402

from forge import testrun  # noqa: E402
from forge.builder import imagerehearsal, rehearsal, toolchain  # noqa: E402
from forge.paths import REPORTS  # noqa: E402


def test_make_test_writes_the_rehearsal_reports_under_build(monkeypatch, tmp_path):
    calls = {}
    monkeypatch.setattr(testrun, "disk_preflight", lambda with_image, with_toolchain: None)
    monkeypatch.setattr(testrun.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(rehearsal, "rehearse", lambda **kw: calls.setdefault("rehearsal", kw))
    started = []
    default_log = testrun.IMAGE_LOG
    monkeypatch.setattr(testrun, "IMAGE_LOG", tmp_path / "image-rehearsal.out")   # not the checkout's live log
    monkeypatch.setattr(testrun.proc, "start", lambda cmd, **kw: started.append((cmd, kw)) or FakeChild(0))
    monkeypatch.setattr(toolchain, "preflight", lambda **kw: {"python_exe": "python3.10"})
    monkeypatch.setattr(toolchain, "start_venv", lambda pre: calls.setdefault("venv", "child"))
    monkeypatch.setattr(toolchain, "finish", lambda pre, child: calls.setdefault("toolchain", child))
    monkeypatch.setattr(toolchain, "stop_venv", lambda child: calls.setdefault("stopped", child))
    monkeypatch.setattr(testrun, "make_room", lambda with_image: calls.setdefault("room", with_image))
    monkeypatch.setattr(testrun, "lint", lambda: 0)
    args = types.SimpleNamespace(no_rehearsal=False, no_image=False, no_toolchain=False, pytest_args=["--version"],
                                 workers=1)
    assert testrun.cmd_test(args) == 0
    assert calls["toolchain"] == "child", "make test runs the container toolchain check on the venv it started"
    assert calls["room"] is True, "after the check, room is made for the image rehearsal beside the tests"
    out = calls["rehearsal"]["report_dir"]
    assert out == testrun.TEST_REPORTS and REPORTS not in (out, *out.parents)
    # the image rehearsal runs as its own verb beside the tests, its report beside the rehearsal's
    [(cmd, kw)] = started
    assert [str(c) for c in cmd[1:4]] == ["-m", "forge", "image-rehearsal"]
    assert Path(cmd[cmd.index("--report-dir") + 1]) == testrun.TEST_REPORTS
    assert kw["log"] == testrun.IMAGE_LOG
    assert testrun.TEST_REPORTS in default_log.parents, "its output stays out of the tracked reports/ too"


class FakeChild:
    """A background process as testrun sees it: poll, wait, returncode, pid."""

    def __init__(self, rc, running=False):
        self.returncode, self.pid, self._running = (None if running else rc), 4242, running
        self._rc = rc

    def poll(self):
        return self.returncode

    def wait(self):
        self.returncode = self._rc
        return self._rc


def _image_beside_the_tests(monkeypatch, tmp_path, child, pytest_rc=0, raise_in_pytest=None):
    events = []
    monkeypatch.setattr(testrun, "IMAGE_LOG", tmp_path / "image-rehearsal.out")
    monkeypatch.setattr(testrun, "disk_preflight", lambda with_image, with_toolchain: None)
    monkeypatch.setattr(testrun.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(rehearsal, "rehearse", lambda **kw: events.append("rehearsal"))
    monkeypatch.setattr(toolchain, "preflight", lambda **kw: None)
    monkeypatch.setattr(testrun, "lint", lambda: 0)
    monkeypatch.setattr(testrun.proc, "start", lambda cmd, **kw: events.append("image started") or child)
    monkeypatch.setattr(testrun.proc, "stop_group", lambda pid, grace_s: events.append(f"stopped {pid}") or "terminated")

    def fake_pytest(runs, workers):
        events.append("pytest")
        if raise_in_pytest:
            raise raise_in_pytest
        return pytest_rc
    monkeypatch.setattr(testrun, "pytest_runs", fake_pytest)
    args = types.SimpleNamespace(no_rehearsal=False, no_image=False, no_toolchain=True, pytest_args=[], workers=2)
    return events, args


def test_the_image_rehearsal_runs_beside_the_tests_and_its_failure_fails_make_test(monkeypatch, tmp_path, capsys):
    events, args = _image_beside_the_tests(monkeypatch, tmp_path, FakeChild(3, running=True))
    monkeypatch.setattr(testrun.proc, "tail", lambda path, n: "buildah: no space left on device")
    assert testrun.cmd_test(args) == 3, "a failed image rehearsal fails make test even when every test passed"
    assert events == ["rehearsal", "image started", "pytest"]
    assert "image rehearsal FAILED (exit 3)" in capsys.readouterr().err
    events, args = _image_beside_the_tests(monkeypatch, tmp_path, FakeChild(0, running=True), pytest_rc=1)
    assert testrun.cmd_test(args) == 1


def test_an_interrupted_test_run_stops_the_image_rehearsal(monkeypatch, tmp_path):
    events, args = _image_beside_the_tests(monkeypatch, tmp_path, FakeChild(0, running=True),
                                           raise_in_pytest=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        testrun.cmd_test(args)
    assert events == ["rehearsal", "image started", "pytest", "stopped 4242"]


def test_the_image_report_goes_where_it_is_told(tmp_path):
    rec = {"started": "2026-01-01T00:00:00+00:00", "ok": True, "seconds": 1.0, "forge": {"commit": "abc"},
           "stages": [{"stage": "build", "seconds": 1.0}]}
    before = {p: p.stat().st_mtime_ns for p in REPORTS.glob("image-rehearsal.*")}
    imagerehearsal._write_image_report(rec, tmp_path)
    assert (tmp_path / "image-rehearsal.json").is_file()
    assert "PASS" in (tmp_path / "image-rehearsal.md").read_text()
    assert {p: p.stat().st_mtime_ns for p in REPORTS.glob("image-rehearsal.*")} == before
    assert ROOT in REPORTS.parents


def _recording(monkeypatch, rcs: list[int]) -> list:
    """Replace process starts by a recorder: each call returns the next exit code of `rcs`."""
    seen = []

    def fake(cmd, **kw):
        seen.append(cmd)
        return types.SimpleNamespace(returncode=rcs[len(seen) - 1])

    monkeypatch.setattr(testrun.proc, "run", fake)
    return seen


def test_make_test_lints_first_then_runs_the_fault_suite_and_the_rest_once(monkeypatch):
    seen = _recording(monkeypatch, [0, 0, 1])
    args = types.SimpleNamespace(no_rehearsal=True, no_image=True, pytest_args=[], workers=2)
    assert testrun.cmd_test(args) == 1, "a failure in either run fails make test"
    assert seen[0][1:] == ["-m", "ruff", "check", "."]
    runs = [c[c.index("pytest") + 1:] for c in seen[1:]]
    for r in runs:
        assert "--durations=15" in r and r[r.index("-n") + 1] == "2", r
    assert [r[-1:] if r[-1] == "tests/faults" else r[-2:] for r in runs] == \
        [["tests/faults"], ["tests", "--ignore=tests/faults"]]
    assert (ROOT / "tests" / "faults" / "conftest.py").is_file()


def test_a_lint_finding_stops_make_test_before_the_rehearsal(monkeypatch):
    seen = _recording(monkeypatch, [1])
    monkeypatch.setattr(rehearsal, "rehearse", lambda **kw: seen.append("rehearsal"))
    args = types.SimpleNamespace(no_rehearsal=False, no_image=True, pytest_args=[], workers=2)
    assert testrun.cmd_test(args) == 1
    assert len(seen) == 1 and "ruff" in seen[0]


def test_make_check_is_lint_unit_and_faults_on_the_workers(monkeypatch):
    seen = _recording(monkeypatch, [0, 0])
    assert testrun.cmd_check(types.SimpleNamespace(workers=3)) == 0
    assert "ruff" in seen[0]
    run = seen[1][seen[1].index("pytest") + 1:]
    assert run[-2:] == ["tests/unit", "tests/faults"] and run[run.index("-n") + 1] == "3"


def test_one_worker_runs_without_xdist(monkeypatch):
    seen = _recording(monkeypatch, [0, 0])
    assert testrun.cmd_check(types.SimpleNamespace(workers=1)) == 0
    assert "-n" not in seen[1]


def test_no_toolchain_skips_the_container_toolchain_check_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(testrun, "disk_preflight", lambda with_image, with_toolchain: None)
    monkeypatch.setattr(rehearsal, "rehearse", lambda **kw: None)
    for f in ("preflight", "start_venv", "finish"):
        monkeypatch.setattr(toolchain, f, lambda *a, **kw: pytest.fail("ran the skipped check"))
    monkeypatch.setattr(testrun, "lint", lambda: 0)
    _recording(monkeypatch, [0])
    args = types.SimpleNamespace(no_rehearsal=False, no_image=True, no_toolchain=True, pytest_args=["x"], workers=1)
    assert testrun.cmd_test(args) == 0
    assert "toolchain check skipped (--no-toolchain)" in capsys.readouterr().err


def test_the_disk_preflight_counts_the_toolchain_venv_until_it_exists(monkeypatch, tmp_path):
    warned = []
    monkeypatch.setattr(testrun.ui, "warn", warned.append)
    monkeypatch.setattr(testrun, "BUILD", tmp_path)
    monkeypatch.setattr(toolchain, "VENV", tmp_path / "toolchain" / "venv")
    (tmp_path / "rehearsal" / "venv").mkdir(parents=True)
    free = testrun.NEED_GB["toolchain"] - 0.5 + 1.0       # enough for the rest, not for a new toolchain venv
    monkeypatch.setattr(testrun, "free_gb", lambda path: free)
    testrun.disk_preflight(with_image=False, with_toolchain=True)
    assert len(warned) == 1 and "No space left" in warned[0]
    warned.clear()
    testrun.disk_preflight(with_image=False, with_toolchain=False)
    toolchain.VENV.mkdir(parents=True)
    testrun.disk_preflight(with_image=False, with_toolchain=True)
    assert not warned


@pytest.mark.parametrize("free,removed", [(2.5, True), (3.5, False)])
def test_a_short_disk_gives_the_checked_toolchain_venv_back_before_the_tests(monkeypatch, tmp_path, capsys,
                                                                             free, removed):
    monkeypatch.setattr(testrun, "BUILD", tmp_path)
    monkeypatch.setattr(toolchain, "VENV", tmp_path / "toolchain" / "venv")
    (toolchain.VENV / "bin").mkdir(parents=True)
    monkeypatch.setattr(testrun, "free_gb", lambda path: free)
    # the tests' 2 GB and a 1 GB margin; without an image rehearsal in the run
    assert testrun.make_room(with_image=False) is removed
    assert toolchain.VENV.is_dir() is not removed
    if removed:
        err = capsys.readouterr().err
        assert "removed" in err and "venv" in err and "the next `make test` rebuilds it" in err
    assert testrun.make_room(with_image=False) is False, "nothing left to give back"
    toolchain.VENV.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(testrun.buildah, "storage_driver", lambda: "vfs")
    monkeypatch.setattr(testrun, "_containers_root", lambda: str(tmp_path))
    assert testrun.make_room(with_image=True) is True, "the image rehearsal's 12 GB with vfs do not fit"


def test_a_failed_rehearsal_stops_the_background_venv_build(monkeypatch):
    from forge.errors import ForgeError
    seen = []
    monkeypatch.setattr(testrun, "disk_preflight", lambda with_image, with_toolchain: None)
    monkeypatch.setattr(testrun, "lint", lambda: 0)
    monkeypatch.setattr(toolchain, "preflight", lambda **kw: {})
    monkeypatch.setattr(toolchain, "start_venv", lambda pre: "child")
    monkeypatch.setattr(toolchain, "finish", lambda pre, child: pytest.fail("checked after a failed rehearsal"))
    monkeypatch.setattr(toolchain, "stop_venv", seen.append)

    def fail(**kw):
        raise ForgeError("rehearsal broke")
    monkeypatch.setattr(rehearsal, "rehearse", fail)
    args = types.SimpleNamespace(no_rehearsal=False, no_image=True, no_toolchain=False, pytest_args=["x"], workers=1)
    with pytest.raises(ForgeError):
        testrun.cmd_test(args)
    assert seen == ["child"]
