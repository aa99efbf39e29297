"""Pinned source: a tampered or partial sdist is never used."""

import os

import pytest

from forge import fetch
from forge.errors import ForgeError
from forge.hashing import sha256_file

from pipeline_fixtures import make_sdist, upstream_cfg


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
    assert (d / fetch.MARKER).read_text().strip() == th


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
