"""`make test` on a fresh box that has only what the README's two commands bring: no ld.lld (the
contest container's Triton links its AMD kernels with one), no buildah and no Docker. The stages that
need them are skipped, each said in one line when it is skipped and again in the run's last lines, and
the run still passes; everything else runs. `forge toolchain-check` alone still refuses to run without
the linker."""

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import ROOT  # noqa: E402,F401

from forge import testrun  # noqa: E402
from forge.builder import rehearsal, toolchain  # noqa: E402
from forge.errors import ForgeError  # noqa: E402


@pytest.fixture
def fresh_box(monkeypatch, tmp_path):
    """No ld.lld, no buildah, no docker; a Python 3.10 found; the stages' work replaced by recorders."""
    seen = {"warn": [], "checked": []}
    monkeypatch.setattr(toolchain, "find_lld", lambda: None)
    monkeypatch.setattr(toolchain, "find_python", lambda: ("/usr/bin/python3.10", (3, 10, 12), "PATH"))
    monkeypatch.setattr(testrun.shutil, "which", lambda name: None)
    monkeypatch.setattr(testrun, "disk_preflight", lambda with_image, with_toolchain: None)
    monkeypatch.setattr(testrun, "lint", lambda: 0)
    monkeypatch.setattr(rehearsal, "rehearse", lambda **kw: seen["checked"].append("rehearsal"))
    monkeypatch.setattr(toolchain, "start_venv", lambda pre: None)
    monkeypatch.setattr(toolchain, "stop_venv", lambda child: None)
    monkeypatch.setattr(toolchain, "finish", lambda pre, child: seen["checked"].append(("toolchain", pre["ld_lld"])))
    monkeypatch.setattr(testrun, "make_room", lambda with_image: None)
    monkeypatch.setattr(testrun, "pytest_runs", lambda runs, workers: seen["checked"].append("pytest") or 0)
    monkeypatch.setattr(testrun.ui, "warn", seen["warn"].append)
    monkeypatch.setattr(toolchain.ui, "warn", seen["warn"].append)
    monkeypatch.setattr(testrun.ui, "info", lambda *a, **k: None)
    return seen


def test_make_test_without_lld_or_an_image_builder_skips_those_stages_and_passes(fresh_box):
    args = types.SimpleNamespace(no_rehearsal=False, no_image=False, no_toolchain=False, pytest_args=[], workers=2)
    assert testrun.cmd_test(args) == 0
    assert fresh_box["checked"] == ["rehearsal", ("toolchain", None), "pytest"], \
        "the rehearsal, the toolchain's other checks and the tests still run"
    warns = fresh_box["warn"]
    assert any("ld.lld" in w and "skipped" in w and "lld-15" in w for w in warns[:-2]), warns   # said when skipped
    last = warns[-2:]                                                                          # and at the end
    assert any("ld.lld" in w and "ahead-of-time compile" in w for w in last), last
    assert any("image rehearsal" in w and "buildah" in w for w in last), last


def test_the_toolchain_check_leaves_out_only_the_compile_without_a_linker(monkeypatch, tmp_path, fresh_box):
    pins = toolchain.pinned()
    monkeypatch.setattr(toolchain, "ensure_venv", lambda exe, version, venv: "py")
    monkeypatch.setattr(toolchain, "versions", lambda py: {**pins, "python": "3.10.12"})
    monkeypatch.setattr(toolchain, "check_tool", lambda py, out: {"files": 1, "modules": 1, "python": "3.10.12"})
    ran = []

    def tool(argv, out, what, env=None):
        ran.append(Path(str(argv[1])).name)
        return {"ok": True, "checks": [1]}
    monkeypatch.setattr(toolchain, "run_json_tool", tool)
    res = toolchain.run_checks(tmp_path, toolchain.preflight(need_lld=False))
    assert ran == ["selftest.py"] and res["aot"]["linker"] is None and "ld.lld" in res["aot"]["skipped"]


def test_toolchain_check_alone_still_needs_the_linker(fresh_box):
    with pytest.raises(ForgeError) as e:
        toolchain.preflight()
    assert "no ld.lld" in e.value.message


def test_the_toolchain_venv_builds_in_the_background_without_a_linker(monkeypatch, fresh_box):
    """`make test` starts `forge toolchain-check --venv-only` as a child while the rehearsal runs: on a box
    without ld.lld that child must build the venv (it links nothing), not stop the run."""
    built = []
    monkeypatch.setattr(toolchain, "ensure_venv", lambda exe, version, *a, **k: built.append((exe, version)))
    assert toolchain.cmd_toolchain_check(types.SimpleNamespace(venv_only=True)) == 0
    assert built == [("/usr/bin/python3.10", (3, 10, 12))]
