"""forge pack-run / unpack-run: a recorded run folder keeps its documents as files and every file in
one deterministic raw.tgz; checked with tarfile/gzip directly on random folders."""

import gzip
import io
import os
import shutil
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import forge  # noqa: E402

# the folder's files, and which of them stay as documents (written out here, not taken from the code)
DOCS = ["summary.md", "decode.md", "README.md"]
RAW = ["summary.json", "decode.json", "runs/a/score.md", "runs/a/score.json", "runs/a/score.png",
       "predict/a/predict.md", "predict/a/predict.png", "runs/a/README.md",
       "e2e.log", "logs/server-a.log", "logs/bench-worker.log", "runs/a/4-8K.json", "runs/a/manifest.json",
       "runs/a/serve.json", "runs/a/rounds/r1/4-8K.json", "runs/a/rounds/r1/4-8K.client.log",
       "runs/fault-a/16-32K.json", "datasets/4-8K.jsonl"]


def _folder(root: Path, seed: int) -> dict:
    rng = __import__("random").Random(seed)
    files = {}
    for i, rel in enumerate(DOCS + RAW):
        body = os.urandom(rng.randrange(0, 3000)) if i % 3 else b""      # some empty files too
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body)
        t = rng.randrange(10**9, 2 * 10**9)
        os.utime(p, (t, t))
        files[rel] = body
    return files


def test_pack_keeps_the_documents_and_archives_the_whole_folder(tmp_path):
    run = tmp_path / "run"
    files = _folder(run, 1)
    r = forge(tmp_path, "pack-run", str(run))
    assert r.returncode == 0, r.stderr
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert left == sorted(DOCS + ["raw.tgz"])
    assert not (run / "logs").exists() and not (run / "runs" / "fault-a").exists()   # emptied folders go
    raw = (run / "raw.tgz").read_bytes()
    assert raw[:2] == b"\x1f\x8b" and raw[4:8] == b"\0\0\0\0"        # gzip header without a time
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(raw))) as tf:
        members = tf.getmembers()
        assert [m.name for m in members] == sorted(files)
        for m in members:
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
            assert tf.extractfile(m).read() == files[m.name]
    # the same files with other times and another folder name give the same bytes
    other = tmp_path / "other"
    _folder(other, 2)
    for rel, body in files.items():
        (other / rel).write_bytes(body)
    assert forge(tmp_path, "pack-run", str(other)).returncode == 0
    assert (other / "raw.tgz").read_bytes() == raw


def test_unpack_restores_the_folder_and_a_packed_folder_is_left_alone(tmp_path):
    run = tmp_path / "run"
    files = _folder(run, 3)
    assert forge(tmp_path, "pack-run", str(run)).returncode == 0
    r = forge(tmp_path, "unpack-run", str(run), "--to", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert {str(p.relative_to(tmp_path / "out")): p.read_bytes()
            for p in (tmp_path / "out").rglob("*") if p.is_file()} == files
    before = (run / "raw.tgz").read_bytes()
    r = forge(tmp_path, "pack-run", str(run))
    assert r.returncode == 0 and "already packed" in r.stderr + r.stdout
    assert (run / "raw.tgz").read_bytes() == before
    # unpacked in place: packed again, the same bytes for the same files
    assert forge(tmp_path, "unpack-run", str(run)).returncode == 0
    r = forge(tmp_path, "pack-run", str(run))
    assert r.returncode == 0, r.stderr
    assert (run / "raw.tgz").read_bytes() == before and not (run / "e2e.log").exists()
    # raw files beside an archive whose members are not all in the folder: refused, nothing lost
    assert forge(tmp_path, "unpack-run", str(run)).returncode == 0
    (run / "e2e.log").unlink()
    r = forge(tmp_path, "pack-run", str(run))
    assert r.returncode == 2 and "lacks members of the archive (e2e.log)" in r.stderr and "unpack-run" in r.stderr
    assert "Traceback" not in r.stderr and (run / "raw.tgz").read_bytes() == before


def test_user_mistakes_are_named(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "summary.md").write_text("x")
    r = forge(tmp_path, "pack-run", str(docs))
    assert r.returncode == 2 and "no raw files" in r.stderr and not (docs / "raw.tgz").exists()
    r = forge(tmp_path, "unpack-run", str(docs))
    assert r.returncode == 2 and "raw.tgz not found" in r.stderr and "Traceback" not in r.stderr
    shutil.rmtree(docs)
    r = forge(tmp_path, "pack-run", str(docs))
    assert r.returncode == 2 and "not a folder" in r.stderr


def test_the_recorded_run_folders_hold_documents_and_one_archive():
    """The repository's own layout (file names only): each recorded e2e run folder tracks its
    documents and raw.tgz, no raw file."""
    import subprocess
    root = Path(__file__).resolve().parents[2]
    ls = subprocess.run(["git", "-C", str(root), "ls-files", "reports/e2e"], capture_output=True, text=True)
    if ls.returncode != 0:
        import pytest
        pytest.skip("not a git work tree")
    folders: dict[str, list[str]] = {}
    for f in ls.stdout.splitlines():
        parts = f.split("/")
        if len(parts) > 3:
            folders.setdefault(parts[2], []).append("/".join(parts[3:]))
    assert len(folders) >= 11, sorted(folders)
    doc_names = {Path(d).name for d in DOCS}
    for name, files in folders.items():
        assert "raw.tgz" in files, name
        stray = [f for f in files if f != "raw.tgz" and f not in doc_names]
        assert not stray, (name, stray)


def test_tools_on_a_packed_record_say_how_to_read_it(tmp_path):
    """e2e-decode on a packed run folder names unpack-run in its hint; predict --e2e and prefill-profile
    read it (predict names the profiles the archive holds)."""
    run = tmp_path / "run"
    _folder(run, 4)
    assert forge(tmp_path, "pack-run", str(run)).returncode == 0
    r = forge(tmp_path, "e2e-decode", str(run))
    assert r.returncode == 2, r.stderr
    assert "packed record" in r.stderr and f"unpack-run {run}" in r.stderr.replace("\n", " "), r.stderr
    r = forge(tmp_path, "predict", "--e2e", str(run), "--out", str(tmp_path / "p"))
    assert r.returncode == 2 and "no runs/upstream/" in r.stderr and "its profiles: a" in r.stderr, r.stderr
    assert not (tmp_path / "p").exists()
    # prefill-profile reads a packed record itself: it says the archive holds no prefill profile
    before = sorted(p.name for p in run.iterdir())
    r = forge(tmp_path, "prefill-profile", str(run), "--out", str(tmp_path / "pp"))
    assert r.returncode == 2 and f"{run}: no prefill-profile/*.json here (nor in its raw.tgz)" in r.stderr, r.stderr
    assert sorted(p.name for p in run.iterdir()) == before
    # not packed: the tools' own hints
    plain = tmp_path / "plain"
    plain.mkdir()
    r = forge(tmp_path, "e2e-decode", str(plain))
    assert r.returncode == 2 and "packed record" not in r.stderr and "--reference" in r.stderr


def _evil_tgz(path: Path, members: list) -> None:
    """A gzip'd tar with the given (TarInfo, bytes) members."""
    with tarfile.open(path, "w:gz") as tf:
        for info, body in members:
            tf.addfile(info, io.BytesIO(body) if body is not None else None)


def _file(name: str, body: bytes = b"x") -> tuple:
    info = tarfile.TarInfo(name)
    info.size = len(body)
    return info, body


def _link(name: str, target: str) -> tuple:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


def test_unpack_refuses_members_that_leave_the_folder(tmp_path):
    run = tmp_path / "home" / "run"
    run.mkdir(parents=True)
    for member in [_file("../escaped.txt"), _link("evil", "../../outside")]:
        _evil_tgz(run / "raw.tgz", [_file("fine.txt"), member])
        r = forge(tmp_path, "unpack-run", str(run))
        assert r.returncode == 2, (member[0].name, r.stdout, r.stderr)
        assert "raw.tgz" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "home" / "escaped.txt").exists() and not (tmp_path / "outside").exists()
    # an absolute name is refused on every Python (the data filter would rewrite it under the folder)
    absolute = Path(f"/tmp/forge-abs-escape-{os.getpid()}.txt")
    _evil_tgz(run / "raw.tgz", [_file("fine.txt"), _file(str(absolute))])
    r = forge(tmp_path, "unpack-run", str(run))
    assert not absolute.exists() and not (run / "fine.txt").exists() and not (run / "tmp").exists()
    assert r.returncode == 2 and "leaves the folder" in r.stderr, r.stderr


def test_extract_without_the_data_filter_checks_names_first(tmp_path, monkeypatch):
    """On a Python without tarfile's extraction filters (before 3.10.12) the names and link targets are
    checked before anything is written; a clean archive extracts as it is."""
    from forge import tarsafe
    from forge.errors import ForgeError
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    for bad in ([_file("ok.txt"), _file("a/../../up.txt")], [_file("ok.txt"), _link("l", "/etc/passwd")],
                [_file("ok.txt"), _link("l", "../x")]):
        src = tmp_path / "bad.tgz"
        _evil_tgz(src, bad)
        dest = tmp_path / "dest"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        with tarfile.open(src) as tf:
            try:
                tarsafe.extract_tar(tf, dest)
            except ForgeError as e:
                assert bad[1][0].name in str(e) and "bad.tgz" in str(e)
            else:
                raise AssertionError(f"{bad[1][0].name} was extracted")
        assert list(dest.iterdir()) == [], "nothing is written before the check"
        assert not (tmp_path / "up.txt").exists()
    good = tmp_path / "good.tgz"
    _evil_tgz(good, [_file("a/b.txt", b"hello"), _link("a/l", "b.txt")])
    with tarfile.open(good) as tf:
        tarsafe.extract_tar(tf, tmp_path / "g")
    assert (tmp_path / "g" / "a" / "b.txt").read_bytes() == b"hello"
    assert os.readlink(tmp_path / "g" / "a" / "l") == "b.txt"
