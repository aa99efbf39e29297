"""Pinned source: a tampered or partial sdist is never used."""

import hashlib
import json
import os

import pytest
from pipeline_fixtures import UPSTREAM_FILES, make_sdist, upstream_cfg

from forge.builder import fetch
from forge.errors import ForgeError
from forge.hashing import sha256_file, tree_sha256


@pytest.fixture
def fake(tmp_path, monkeypatch):
    tb, sha, th = make_sdist(tmp_path)
    monkeypatch.setattr(fetch.config, "upstream", lambda: upstream_cfg(sha, th))
    monkeypatch.setattr(fetch, "CACHE", tmp_path / "cache")
    monkeypatch.delenv("VLLM_SRC", raising=False)
    return tb, sha, th


def test_vllm_src_tarball_verified_and_extracted(fake, monkeypatch):
    tb, sha, th = fake
    monkeypatch.setenv("VLLM_SRC", str(tb))
    d = fetch.ensure_source()
    assert (d / "pkg" / "config.py").is_file()
    # the manifest lists the tarball's members as extracted, and its tree hash is the pinned one
    man = json.loads((d / fetch.MARKER).read_text())
    assert sorted(man["files"]) == ["README", "pkg/config.py", "pkg/sched/scheduler.py"]
    assert man["files"]["pkg/config.py"] == ["f", len(UPSTREAM_FILES["pkg/config.py"]),
                                             hashlib.sha256(UPSTREAM_FILES["pkg/config.py"].encode()).hexdigest()]
    assert tree_sha256(d, exclude=fetch.INTERNAL) == th


def test_tampered_tarball_refused_with_both_hashes(fake, monkeypatch, tmp_path):
    tb, sha, th = fake
    bad = tmp_path / "bad.tar.gz"
    data = bytearray(tb.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    monkeypatch.setenv("VLLM_SRC", str(bad))
    with pytest.raises(ForgeError) as e:
        fetch.ensure_source()
    msg = str(e.value)
    assert sha in msg and sha256_file(bad) in msg and "mismatch" in msg
    assert not (tmp_path / "cache" / "src" / "vllm-0.18.1.tar.gz").exists()


def test_tampered_cache_refused_and_moved_aside(fake, monkeypatch, tmp_path):
    tb, sha, th = fake
    monkeypatch.setenv("VLLM_SRC", str(tb))
    fetch.ensure_source()
    monkeypatch.delenv("VLLM_SRC")
    cached = tmp_path / "cache" / "src" / "vllm-0.18.1.tar.gz"
    cached.write_bytes(cached.read_bytes() + b"x")
    with pytest.raises(ForgeError, match="tampered"):
        fetch.ensure_source()
    assert not cached.exists() and cached.with_name(cached.name + ".rejected").exists()


def test_modified_source_dir_refused(fake, monkeypatch, tmp_path):
    tb, sha, th = fake
    d = tmp_path / "ex" / "vllm-0.18.1"
    (d / "pkg" / "config.py").write_text("changed\n")
    monkeypatch.setenv("VLLM_SRC", str(d))
    with pytest.raises(ForgeError, match="mismatch"):
        fetch.ensure_source()


def test_partial_or_wrong_download_never_kept(tmp_path):
    src = tmp_path / "served.bin"
    src.write_bytes(b"not the sdist" * 1000)
    dest = tmp_path / "cache" / "vllm-0.18.1.tar.gz"
    with pytest.raises(ForgeError, match="mismatch"):
        fetch.download(src.as_uri(), dest, "0" * 64)
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()
    fetch.download(src.as_uri(), dest, sha256_file(src))
    assert dest.read_bytes() == src.read_bytes()


def test_simple_index_html_lookup(tmp_path):
    page = tmp_path / "simple" / "vllm"
    page.mkdir(parents=True)
    (tmp_path / "f.tar.gz").write_bytes(b"x")
    (page / "index.html").write_text(
        f'<html><a href="../../f.tar.gz#sha256={"a" * 64}">vllm-0.18.1.tar.gz</a></html>')
    url, listed = fetch.find_sdist_url((tmp_path / "simple").as_uri(), "vllm", "vllm-0.18.1.tar.gz")
    assert listed == "a" * 64 and url.endswith("/f.tar.gz")
    assert fetch.find_sdist_url((tmp_path / "simple").as_uri(), "vllm", "other.tar.gz") is None


def _extracted(fake, monkeypatch, tmp_path):
    tb, sha, th = fake
    monkeypatch.setenv("VLLM_SRC", str(tb))
    d = fetch.ensure_source()
    monkeypatch.delenv("VLLM_SRC")
    return d


@pytest.mark.parametrize("tamper,named", [
    (lambda d: (d / "pkg" / "config.py").write_text((d / "pkg" / "config.py").read_text() + "# TAMPERED\n"),
     "pkg/config.py: changed"),
    (lambda d: (d / "pkg" / "extra.py").write_text("import os\n"), "pkg/extra.py: added"),
    (lambda d: (d / "README").unlink(), "README: missing"),
    (lambda d: os.chmod(d / "pkg" / "config.py", 0o755), "pkg/config.py: changed (type"),
])
def test_tampered_extracted_tree_refused_by_name_and_set_aside(fake, monkeypatch, tmp_path, tamper, named):
    d = _extracted(fake, monkeypatch, tmp_path)
    tamper(d)
    with pytest.raises(ForgeError) as e:
        fetch.ensure_source()
    msg = str(e.value)
    assert named in msg and "differs from the pinned sdist" in msg, msg
    aside = d.with_name(d.name + ".rejected")
    assert not d.exists() and aside.is_dir(), "the tampered tree is moved aside, not deleted"
    # the rerun extracts a fresh, verified tree from the verified sdist
    d2 = fetch.ensure_source()
    assert d2 == d and tree_sha256(d2, exclude=fetch.INTERNAL) == fake[2]


def test_forged_manifest_is_not_trusted(fake, monkeypatch, tmp_path):
    """Editing a file and its manifest entry together does not pass: the manifest must carry the
    pinned tree hash of configs/upstream.yaml."""
    d = _extracted(fake, monkeypatch, tmp_path)
    f = d / "pkg" / "config.py"
    f.write_text("EVIL = 1\n")
    man = json.loads((d / fetch.MARKER).read_text())
    man["files"]["pkg/config.py"] = ["f", f.stat().st_size, sha256_file(f)]
    (d / fetch.MARKER).write_text(json.dumps(man))
    with pytest.raises(ForgeError, match="not the pinned one"):
        fetch.ensure_source()
    assert d.with_name(d.name + ".rejected").is_dir()
    assert "EVIL" not in (fetch.ensure_source() / "pkg" / "config.py").read_text()


def test_tree_of_an_earlier_release_is_set_aside_and_extracted_again(fake, monkeypatch, tmp_path):
    d = _extracted(fake, monkeypatch, tmp_path)
    (d / fetch.MARKER).unlink()
    (d / ".forge-verified").write_text(fake[2] + "\n")
    (d / "pkg" / "config.py").write_text("EVIL = 1\n")
    d2 = fetch.ensure_source()
    assert "EVIL" not in (d2 / "pkg" / "config.py").read_text()
    assert (d.with_name(d.name + ".rejected") / "pkg" / "config.py").read_text() == "EVIL = 1\n"


def test_modified_source_dir_names_the_file_when_the_manifest_is_known(fake, monkeypatch, tmp_path):
    _extracted(fake, monkeypatch, tmp_path)
    d = tmp_path / "ex" / "vllm-0.18.1"
    (d / "pkg" / "config.py").write_text("changed\n")
    monkeypatch.setenv("VLLM_SRC", str(d))
    with pytest.raises(ForgeError, match="pkg/config.py: changed"):
        fetch.ensure_source()
    assert d.is_dir(), "a user's own folder is never moved"


def test_a_second_use_verifies_the_tree_without_fetching_or_extracting_again(fake, monkeypatch):
    """Every use re-hashes the tarball and the extracted tree (what that costs on vLLM's 4,297 files shows
    as the fetch stage of `make rehearsal`'s report, seconds), and nothing more: a second use neither
    asks the index nor extracts again, and returns the same tree."""
    tb, _, _ = fake
    monkeypatch.setenv("VLLM_SRC", str(tb))
    first = fetch.ensure_source()
    monkeypatch.delenv("VLLM_SRC")

    def never(*a, **kw):
        raise AssertionError("a verified cached tree was fetched or extracted again")

    monkeypatch.setattr(fetch, "_extract", never)
    monkeypatch.setattr(fetch, "_fetch_from_index", never)
    hashed = []
    real = fetch.verify_extracted
    monkeypatch.setattr(fetch, "verify_extracted", lambda *a: hashed.append(a[0]) or real(*a))
    assert fetch.ensure_source() == first
    assert hashed == [first], "the extracted tree is verified on every use"
