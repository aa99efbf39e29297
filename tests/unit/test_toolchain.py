"""The contest container's toolchain check (forge.builder.toolchain): which Python and which ld.lld it
takes, what it says when one is missing, when its venv is reused, and that its check of the tool under
the container's Python finds what a newer Python accepts and 3.10 does not."""

import os
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import ROOT  # noqa: E402,F401

from forge.builder import toolchain, toolchainfind  # noqa: E402
from forge.errors import ForgeError  # noqa: E402


def _exe(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _fake_python(path: Path, version: str) -> Path:
    """A stand-in that answers the version query as that Python would."""
    return _exe(path, f'echo "{version}"')


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """No python3.10 on PATH, an empty pyenv root, no forced Python."""
    monkeypatch.delenv(toolchain.PYTHON_ENV, raising=False)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    monkeypatch.setattr(toolchainfind.shutil, "which", lambda name: None)
    return tmp_path


def test_a_pyenv_310_is_taken_newest_first_and_a_dead_shim_is_passed_over(bare, monkeypatch):
    shim = _exe(bare / "shims" / "python3.10", "echo 'pyenv: python3.10: command not found' >&2; exit 127")
    monkeypatch.setattr(toolchainfind.shutil, "which", lambda name: str(shim) if name == "python3.10" else None)
    for v in ("3.10.4", "3.10.13", "3.10.9"):
        _fake_python(bare / "pyenv" / "versions" / v / "bin" / "python3.10", v.replace(".", " "))
    exe, version, how = toolchain.find_python()
    assert (version, how) == ((3, 10, 13), "pyenv") and "3.10.13" in exe


def test_without_a_310_the_boxs_python_is_used_and_said_to_be(bare):
    _fake_python(bare / "pyenv" / "versions" / "3.12.1" / "bin" / "python3.12", "3 12 1")
    exe, version, how = toolchain.find_python()
    assert how == "fallback" and version == tuple(sys.version_info[:3])


@pytest.mark.parametrize("body", ["exit 1", 'echo "3 9 18"'])
def test_a_forced_python_that_is_not_310_or_newer_is_refused_by_name(bare, monkeypatch, body):
    monkeypatch.setenv(toolchain.PYTHON_ENV, str(_exe(bare / "py", body)))
    with pytest.raises(ForgeError) as e:
        toolchain.find_python()
    assert toolchain.PYTHON_ENV in e.value.message and e.value.exit_code == 2
    assert toolchain.PYTHON_ENV in e.value.hint


def test_the_newest_versioned_lld_is_found_when_none_is_on_path(monkeypatch, tmp_path):
    monkeypatch.delenv(toolchain.LLD_ENV, raising=False)
    monkeypatch.setattr(toolchainfind.shutil, "which", lambda name: None)
    found = {"/usr/bin/ld.lld-*": [str(_exe(tmp_path / f"ld.lld-{v}", "true")) for v in (9, 15, 14)],
             "/usr/lib/llvm-*/bin/ld.lld": []}
    monkeypatch.setattr(toolchainfind.glob, "glob", lambda pattern: found.get(pattern, []))
    assert toolchain.find_lld() == str(tmp_path / "ld.lld-15")
    found["/usr/bin/ld.lld-*"] = []
    assert toolchain.find_lld() is None


def test_a_bad_lld_path_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv(toolchain.LLD_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ForgeError) as e:
        toolchain.find_lld()
    assert toolchain.LLD_ENV in e.value.message and "lld-15" in e.value.hint


def test_without_lld_the_check_says_what_is_missing_before_building_anything(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "find_lld", lambda: None)
    monkeypatch.setattr(toolchain, "ensure_venv", lambda *a, **k: pytest.fail("built the venv without a linker"))
    with pytest.raises(ForgeError) as e:
        toolchain.run_checks(work=tmp_path / "toolchain")
    assert "ld.lld" in e.value.message and "gfx90a" in e.value.message
    assert "apt-get install lld-15" in e.value.hint and toolchain.LLD_ENV in e.value.hint
    assert not (tmp_path / "toolchain").exists()


def test_the_venv_is_reused_while_its_python_and_requirements_are_unchanged(monkeypatch, tmp_path):
    venv = tmp_path / "venv"
    calls = []
    monkeypatch.setattr(toolchain.proc, "run", lambda cmd, **kw: calls.append([str(c) for c in cmd]))

    def build(version):
        calls.clear()
        toolchain.ensure_venv("/usr/bin/python3.10", version, venv)
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        (venv / "bin" / "python").touch()
        return sorted({tuple(c[1:3]) for c in calls})

    made = [("-m", "pip"), ("-m", "venv")]
    assert build((3, 10, 13)) == made
    assert build((3, 10, 13)) == [], "an unchanged venv is not rebuilt"
    assert build((3, 10, 14)) == made, "another Python rebuilds it"
    req = tmp_path / "req.txt"
    req.write_text(toolchain.REQUIREMENTS.read_text() + "# changed\nextra-small-pkg==1.0\n")
    monkeypatch.setattr(toolchain, "REQUIREMENTS", req)
    assert build((3, 10, 14)) == made, "changed requirements rebuild it"
    pips = [c for c in calls if c[1:3] == ["-m", "pip"]]
    assert all("--no-deps" in c and "--no-cache-dir" in c for c in pips)
    specs = [[x for x in c if "==" in x] for c in pips]
    # every pin installed once; a large wheel (torch, Triton, an NVIDIA library) by a pip of its own, so
    # its download is gone before the next one is fetched
    assert sorted(x for g in specs for x in g) == sorted(f"{n}=={v}" for n, v in toolchain.pinned().items())
    assert "extra-small-pkg==1.0" in specs[-1]
    for g in specs:
        assert len(g) == 1 or not any(x.startswith(("torch==", "triton==", "nvidia-")) for x in g), g


def _python310():
    exe, version, how = toolchain.find_python()
    if version[:2] != (3, 10):
        pytest.skip("no Python 3.10 on this box (python3.10 on PATH, pyenv)")
    return exe


def test_the_tool_check_finds_newer_syntax_and_standard_library_under_310(tmp_path):
    py = _python310()
    pkg = tmp_path / "scripts" / "forge"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fine.py").write_text("import json\nX: int | None = None\n")
    (pkg / "newer.py").write_text("import tomllib\n")                               # 3.11's standard library
    (tmp_path / "groups.py").write_text("try:\n    pass\nexcept* ValueError:\n    pass\n")  # 3.11 syntax
    (tmp_path / "late.py").write_text("import json\n\ndef f():\n    from datetime import UTC, date\n")  # 3.11's
    files = ["groups.py", "late.py", "scripts/forge/__init__.py", "scripts/forge/fine.py", "scripts/forge/newer.py"]
    with pytest.raises(ForgeError) as e:
        toolchain.check_tool(Path(py), tmp_path / "out.json", root=tmp_path, files=files)
    msg = e.value.message
    assert "4 problem(s) under Python 3.10" in msg, msg
    assert "groups.py:3: SyntaxError" in msg and "late.py:4: ImportError: cannot import name 'UTC'" in msg
    assert "scripts/forge/newer.py:1: ImportError" in msg and "forge.newer" in msg and "tomllib" in msg
    assert "fine" not in msg and "date'" not in msg


def test_the_projects_own_code_passes_the_tool_check_under_310(tmp_path):
    res = toolchain.check_tool(Path(_python310()), tmp_path / "out.json")
    assert res["files"] > 100 and res["modules"] > 50 and not res["problems"]
    assert os.path.isfile(tmp_path / "out.json")


def test_a_current_venv_starts_no_background_build(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "venv_current", lambda version, venv: True)
    monkeypatch.setattr(toolchain.proc, "start", lambda *a, **k: pytest.fail("started a build"))
    assert toolchain.start_venv({"version": (3, 10, 13), "python_exe": "python3.10"}) is None


def test_a_failed_background_build_is_reported_with_its_log(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "WORK", tmp_path)
    (tmp_path / "venv-build.log").write_text("ERROR: No matching distribution found for torch==2.10.0\n")
    monkeypatch.setattr(toolchain, "run_checks", lambda *a: pytest.fail("checked without a venv"))
    child = type("Child", (), {"wait": lambda self: 1})()
    with pytest.raises(ForgeError) as e:
        toolchain.finish({}, child)
    assert "exit 1" in e.value.message and "No matching distribution" in e.value.message
    assert "venv-build.log" in e.value.hint
