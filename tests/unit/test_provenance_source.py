"""What a record says it was made from: a copy of the checkout without its git folder (a GPU machine's)
names its commit through a source manifest and is clean only when every tracked file matches; a record
shows no path of the machine it was made on."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from forge.recipe import provenance

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"], "HOME": "/nonexistent"}


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "k.py").write_text("x = 1\n")
    (root / "README.md").write_text("readme\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", "-C", str(root), *cmd], check=True, env=GIT_ENV, capture_output=True)
    monkeypatch.setattr(provenance, "ROOT", root)
    monkeypatch.delenv(provenance.SOURCE_MANIFEST_ENV, raising=False)
    return root


def test_a_copy_without_git_names_its_commit_and_is_clean_when_its_files_match(checkout, tmp_path, monkeypatch):
    man = provenance.source_manifest()
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert man["commit"] == head.strip() and set(man["files"]) == {"kernels/k.py", "README.md"}
    copy = tmp_path / "copy"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    mf = tmp_path / "source.json"
    mf.write_text(json.dumps(man))
    monkeypatch.setattr(provenance, "ROOT", copy)
    monkeypatch.setenv(provenance.SOURCE_MANIFEST_ENV, str(mf))
    got = provenance.forge_commit()
    assert got["commit"] == man["commit"] and got["dirty"] is False
    (copy / "kernels" / "k.py").write_text("x = 2\n")
    got = provenance.forge_commit()
    assert got["dirty"] is True and got["differ"] == ["kernels/k.py"] and len(got["diff_sha256"]) == 64
    other = provenance.forge_commit()["diff_sha256"]
    (copy / "kernels" / "k.py").write_text("x = 3\n")
    assert provenance.forge_commit()["diff_sha256"] != other        # the hash names what the copy holds


def test_a_dirty_checkout_has_a_diff_hash_that_follows_its_change(checkout):
    assert provenance.forge_commit()["dirty"] is False
    (checkout / "README.md").write_text("changed\n")
    a = provenance.forge_diff_hash()
    assert provenance.forge_commit()["dirty"] is True and len(a) == 64
    (checkout / "README.md").write_text("changed again\n")
    assert provenance.forge_diff_hash() != a


def test_a_bad_manifest_is_refused_naming_the_variable(checkout, tmp_path, monkeypatch):
    bad = tmp_path / "m.json"
    bad.write_text("[1]")
    monkeypatch.setenv(provenance.SOURCE_MANIFEST_ENV, str(bad))
    with pytest.raises(provenance.ForgeError, match=provenance.SOURCE_MANIFEST_ENV):
        provenance.forge_commit()


def test_a_record_shows_no_machine_path(checkout):
    assert provenance.shown_path(checkout / "reports" / "x") == "reports/x"
    assert provenance.shown_path(Path("/tmp/pipe/cal")) == ".../cal"
    assert provenance.shown_command(["calibrate", "--out", "/tmp/pipe/cal", "--python=/usr/bin/python3",
                                     "--kernels", "installed"]) == \
        "calibrate --out .../cal --python=.../python3 --kernels installed"


def test_a_copy_without_git_or_manifest_is_warned_of_before_the_work(checkout, tmp_path, monkeypatch):
    assert provenance.unnamed_commit_warning("the records") is None          # a git checkout names its commit
    copy = tmp_path / "bare"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setattr(provenance, "ROOT", copy)
    why = provenance.unnamed_commit_warning("the records")
    assert why and "the records will name no commit" in why and provenance.SOURCE_MANIFEST_ENV in why
    mf = tmp_path / "source.json"
    monkeypatch.setattr(provenance, "ROOT", checkout)
    mf.write_text(json.dumps(provenance.source_manifest()))
    monkeypatch.setattr(provenance, "ROOT", copy)
    monkeypatch.setenv(provenance.SOURCE_MANIFEST_ENV, str(mf))
    assert provenance.unnamed_commit_warning("the records") is None          # the bundle's manifest names it
