"""Archives of an end-to-end run: the results pack rewritten after every step, and the Triton kernel
cache cut into parts small enough to come back from a machine, then seeded on the next one."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path

from .. import tarsafe, ui
from ..errors import ForgeError
from ..hashing import sha256_file
from ..run import runs
from .serverlog import trim_log

TRITON_PART_MIB = 15      # the parts of a packed Triton cache (what comes back from a machine per file)
TRITON_PARTS = "triton-cache.tgz"
TRITON_MANIFEST = "triton-cache.json"


def _write_tgz(dest: Path, files: list[tuple[Path, str]], level: int = 9) -> None:
    """A .tar.gz of (file, name in the archive) pairs, written to a temporary name and renamed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=level) as tf:
            for path, arcname in files:
                tf.add(path, arcname=arcname)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def pack(out: Path, dest: Path, servers: dict) -> None:
    """A .tar.gz of the results folder (server logs trimmed; datasets, profiler traces, the raw stack samples
    (stacks.json digests them) and the live servers' state files left out), written atomically."""
    (out / "logs").mkdir(exist_ok=True)
    for name, st in servers.items():
        trim_log(Path(st["log"]), out / "logs" / f"server-{name}.log")
    _write_tgz(dest, [(p, str(Path(out.name) / p.relative_to(out))) for p in sorted(out.rglob("*"))
                      if p.is_file() and p.relative_to(out).parts[0] not in ("datasets", "traces", "state", "stacks")
                      and p.name != "server.log"])


class _JoinedParts(io.RawIOBase):
    """Files read one after the other as one stream (a cut archive without a joined copy on disk)."""

    def __init__(self, files: list[Path]):
        super().__init__()
        self.files, self.cur = list(files), None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while True:
            if self.cur is None:
                if not self.files:
                    return 0
                self.cur = open(self.files.pop(0), "rb")
            n = self.cur.readinto(b)
            if n:
                return n
            self.cur.close()
            self.cur = None

    def close(self) -> None:
        if self.cur is not None:
            self.cur.close()
            self.cur = None
        super().close()


def check_triton_source(src: Path) -> Path:
    """The manifest of a folder --triton-cache-from names; a folder without one is a wrong path."""
    man_path = src / TRITON_MANIFEST
    if not man_path.is_file():
        raise ForgeError(f"--triton-cache-from {src}: no {TRITON_MANIFEST} there",
                         hint="give the folder an earlier run's --triton-cache-pack wrote (its parts and "
                              f"{TRITON_MANIFEST}), or leave the option out")
    return man_path


def seed_triton_cache(src: Path, cache: Path) -> dict:
    """Unpack the parts `pack_triton_cache` wrote (checked against their manifest) into the cache
    directory. Kernels are keyed by source, options and device, so a cache from another machine of the
    same kind is reused and anything else is compiled again. A damaged or incomplete set is skipped with
    a warning (the cache only saves time); a folder without parts is an error (a wrong path)."""
    man = runs.read_json(check_triton_source(src))
    parts = [src / x["name"] for x in man.get("parts", [])]
    bad = [p.name for p, x in zip(parts, man.get("parts", []))
           if not p.is_file() or p.stat().st_size != x.get("bytes") or sha256_file(p) != x.get("sha256")]
    if bad or not parts:
        ui.warn(f"Triton cache parts in {src} do not match {TRITON_MANIFEST} ({', '.join(bad) or 'no parts'}); "
                "starting with an empty cache")
        return {"from": str(src), "skipped": f"parts missing or changed: {', '.join(bad) or 'none listed'}"}
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".seed-", dir=cache))
    n = 0
    try:
        with _JoinedParts(parts) as raw, tarfile.open(fileobj=io.BufferedReader(raw), mode="r|gz") as tf:
            for m in tf:
                if not (m.isfile() or m.isdir()) or tarsafe.leaves_folder(m.name):
                    continue                   # only plain files and folders inside the cache
                tarsafe.extract_tar(tf, tmp, m)
                n += m.isfile()
        for entry in tmp.iterdir():            # complete: move into place (what is there already stays)
            if not (cache / entry.name).exists():
                os.replace(entry, cache / entry.name)
    except (tarfile.TarError, EOFError, OSError, zlib.error, ForgeError) as e:
        ui.warn(f"Triton cache parts in {src} could not be unpacked ({type(e).__name__}: {e}); "
                "starting with an empty cache")
        return {"from": str(src), "skipped": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"from": str(src), "parts": len(parts), "files": n}


def pack_triton_cache(cache: Path, dest: Path, part_mib: float = TRITON_PART_MIB) -> dict:
    """The cache directory as a .tar.gz cut into parts of at most part_mib MiB (DIR/triton-cache.tgz.000,
    .001, ...) plus DIR/triton-cache.json (the parts, their sizes and sha256). The archive is complete
    before any earlier pack in DIR is replaced."""
    dest.mkdir(parents=True, exist_ok=True)
    whole = dest / f".{TRITON_PARTS}.whole"
    _write_tgz(whole, [(p, str(p.relative_to(cache))) for p in sorted(cache.rglob("*")) if p.is_file()], level=6)
    step = max(1, int(part_mib * 1024 * 1024))
    made = []
    try:
        with open(whole, "rb") as f:
            while chunk := f.read(step):
                tmp = dest / f".{TRITON_PARTS}.{len(made):03d}.part"
                tmp.write_bytes(chunk)
                made.append(tmp)
        size = whole.stat().st_size
        for old in dest.glob(f"{TRITON_PARTS}.*"):
            old.unlink()
        parts = []
        for i, tmp in enumerate(made):
            final = dest / f"{TRITON_PARTS}.{i:03d}"
            os.replace(tmp, final)
            parts.append({"name": final.name, "bytes": final.stat().st_size, "sha256": sha256_file(final)})
        runs.write_json(dest / TRITON_MANIFEST, {"parts": parts, "bytes": size, "from": str(cache)})
    finally:
        whole.unlink(missing_ok=True)
        for tmp in made:
            tmp.unlink(missing_ok=True)
    return {"to": str(dest), "parts": len(parts), "mib": round(size / 2**20, 1)}
