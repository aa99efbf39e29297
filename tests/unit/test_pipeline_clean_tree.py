"""Documented commands leave the tracked tree as they found it: run in a copy of this working tree
(tracked and not-ignored files, committed there), each must leave `git status --porcelain` empty.
Generated files are either tracked and regenerated identically (`make report`) or ignored (the
rehearsals' records, build/, dist/, .cache/)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SDIST = Path(os.environ.get("VLLM_SRC") or ROOT / ".cache" / "forge" / "src" / "vllm-0.18.1.tar.gz")


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    dst = tmp_path_factory.mktemp("clone") / "repo"
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "-co", "--exclude-standard"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file() or src.is_symlink():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f, follow_symlinks=False)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "copy"]):
        subprocess.run(["git", "-C", dst, *cmd], check=True, env=env, capture_output=True)
    return dst


def _env(clone):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_", "VLLM_SRC", "MAKE"))}
    env["FORGE_CACHE_DIR"] = str(clone.parent / "cache")
    if SDIST.is_file():
        env["VLLM_SRC"] = str(SDIST)
    return env


def _status(clone) -> str:
    return subprocess.run(["git", "-C", clone, "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, check=True).stdout


def _make(clone, *targets, timeout=600):
    r = subprocess.run(["make", "-C", str(clone), f"PY={sys.executable}", *targets], env=_env(clone),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"make {' '.join(targets)}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
    return r


@pytest.mark.parametrize("targets", [["help"], ["report"],
                                     ["patches-lint"], ["score", "TOK_S=15.97,14.44,11.04"]])
def test_cheap_commands_leave_the_tree_clean(clone, targets):
    _make(clone, *targets)
    st = _status(clone)
    subprocess.run(["git", "-C", clone, "checkout", "-q", "--", "."], check=True)   # next case starts clean
    assert st == "", f"`make {' '.join(targets)}` changed the tracked tree:\n{st}"


@pytest.mark.skipif(not SDIST.is_file(), reason="needs the vLLM sdist (make fetch, or the rehearsal)")
def test_tree_and_patches_check_leave_the_tree_clean(clone):
    _make(clone, "tree")
    _make(clone, "patches-check")
    assert _status(clone) == ""


def test_rehearsal_records_are_not_tracked(clone):
    """What `make rehearsal` and `make image-rehearsal` record about their run (times, machine,
    commit) goes to ignored files: a rerun cannot leave the tree dirty or the record stale."""
    code = (
        "from forge.builder import imagerehearsal, rehearsal\n"
        "rehearsal.write_report({'started': 'x', 'ok': False, 'stages': [{'stage': 's', 'ok': False, "
        "'seconds': 1, 'error': 'e'}]}, rehearsal.REPORTS)\n"
        "imagerehearsal._write_image_report({'started': 'x', 'ok': False, 'forge': {}, 'seconds': 1})\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**_env(clone), "PYTHONPATH": str(clone / "scripts")})
    assert (clone / "reports" / "rehearsal.md").is_file() and (clone / "reports" / "image-rehearsal.json").is_file()
    assert _status(clone) == ""
    assert json.loads((clone / "reports" / "rehearsal.json").read_text())["ok"] is False
