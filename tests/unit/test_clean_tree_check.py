"""The session check of tests/conftest.py (tests/support/clean_tree.py), run by a real pytest session on
a throw-away git repository: it fails a session whose tests change a tracked file or leave a new
unignored file, and lets one pass that writes only ignored outputs, or runs outside a git work tree."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parents[1] / "support"

CONFTEST = f"""
import sys
sys.path.insert(0, {str(SUPPORT)!r})
from clean_tree import pytest_sessionfinish, pytest_sessionstart  # noqa
"""

TEST = """
import os
from pathlib import Path
ROOT = Path(__file__).resolve().parent

def test_writes():
    what = os.environ["WRITE"]
    if what == "tracked":
        (ROOT / "a.txt").write_text("changed by a test\\n")
    elif what == "deleted":
        (ROOT / "a.txt").unlink()
    elif what == "ignored":
        (ROOT / "build").mkdir(exist_ok=True)
        (ROOT / "build" / "out.json").write_text("{}")
    elif what == "untracked":
        (ROOT / "new.txt").write_text("x")
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
                   check=True, capture_output=True)


def _project(tmp_path: Path, git: bool = True) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    (repo / "a.txt").write_text("as committed\n")
    (repo / ".gitignore").write_text("/build/\n__pycache__/\n")
    (repo / "conftest.py").write_text(CONFTEST)
    (repo / "test_it.py").write_text(TEST)
    if git:
        _git(repo, "init", "-q")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", "start")
    return repo


def _session(repo: Path, write: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "FORGE_TREE_CHECK"}
    e.update(WRITE=write, PYTHONDONTWRITEBYTECODE="1", **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_it.py"],
                          cwd=repo, env=e, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("write", ["tracked", "deleted", "untracked"])
def test_a_session_that_changes_the_tree_fails_and_names_the_file(tmp_path, write):
    repo = _project(tmp_path)
    r = _session(repo, write)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed" in r.stdout                 # the test itself passed: the session check failed it
    assert "work tree changed by the tests" in r.stdout
    assert ("new.txt" if write == "untracked" else "a.txt") in r.stdout


def test_ignored_outputs_and_an_already_dirty_tree_pass(tmp_path):
    repo = _project(tmp_path)
    (repo / "a.txt").write_text("edited before the session\n")     # a developer's edit, left alone
    (repo / "notes.txt").write_text("untracked before the session\n")
    r = _session(repo, "ignored")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (repo / "build" / "out.json").is_file()
    # the same dirty file changed by a test does count
    r = _session(repo, "tracked")
    assert r.returncode == 1 and "a.txt" in r.stdout, r.stdout


def test_outside_a_git_work_tree_or_switched_off_nothing_is_checked(tmp_path):
    plain = _project(tmp_path / "plain", git=False)
    r = _session(plain, "tracked", GIT_CEILING_DIRECTORIES=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    repo = _project(tmp_path / "git")
    r = _session(repo, "tracked", FORGE_TREE_CHECK="0")
    assert r.returncode == 0, r.stdout + r.stderr
