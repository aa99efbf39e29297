"""The real patch series against the real pinned source: it applies, and a corrupted patch is
reported by name, file and hunk (what `make patches-check` does)."""

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge.builder import patches, tree  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.recipe import patchfile  # noqa: E402


def _series():
    names = patchfile.read_series(ROOT / "patches")
    if not names:
        pytest.fail("patches/series is empty: the series must hold at least one real patch")
    return names


def test_every_patch_passes_the_lint():
    assert patches.lint(ROOT / "patches") == 0


def test_corrupted_patch_is_named_with_file_and_hunk(tmp_path):
    names = _series()
    pdir = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", pdir)
    victim = names[-1]
    p = patchfile.parse(pdir / victim)
    f = next(f for f in p.files if f.hunks and not f.created)
    text = (pdir / victim).read_text()
    # change the first context line of the file's first hunk so it no longer matches upstream
    start = text.index(f.hunks[0].header)
    body = text[start + len(f.hunks[0].header) + 1:]
    ctx = next(l for l in body.splitlines() if l.startswith(" ") and l.strip())
    corrupted = text[:start] + text[start:].replace("\n" + ctx + "\n", "\n" + ctx + " # corrupted\n", 1)
    assert corrupted != text
    (pdir / victim).write_text(corrupted)
    with pytest.raises(ForgeError) as e:
        tree.build_tree(tmp_path / "tree", patches_dir=pdir)
    msg = str(e.value)
    assert victim in msg and f.new in msg and re.search(r"hunk #\d+", msg), msg
    # the tree is left at the last good commit: every earlier patch applied, nothing half-done
    log = tree.git_out(tmp_path / "tree", "log", "--format=%s").splitlines()
    assert len(log) == 2 + len(names) - 1
    assert tree.git_out(tmp_path / "tree", "status", "--porcelain", "--untracked-files=no") == ""
