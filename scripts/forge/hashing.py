"""Content hashes used for pinning and provenance."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_sha256(root: Path, exclude: Iterable[str] = (".git",)) -> str:
    """Hash of a directory's regular files: sorted 'path\\0exec\\0sha256' lines. Symlinks hash their target
    text. Independent of mtimes, owners and the order the filesystem lists entries in."""
    root = Path(root)
    skip = set(exclude)
    lines = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in filenames:
            p = Path(dirpath) / name
            relp = p.relative_to(root).as_posix()
            if p.is_symlink():
                digest, mode = sha256_bytes(os.readlink(p).encode()), "l"
            else:
                digest, mode = sha256_file(p), "x" if os.access(p, os.X_OK) else "f"
            lines.append(f"{relp}\0{mode}\0{digest}\n")
    h = hashlib.sha256()
    for line in sorted(lines):
        h.update(line.encode())
    return h.hexdigest()


def combine(*parts: str) -> str:
    """A stable hash over several hashes/strings, order-sensitive."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\n")
    return h.hexdigest()
