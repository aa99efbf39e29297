"""Content hashes used for pinning and provenance, and the manifest of an extracted source tree."""

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


def file_entry(p: Path) -> list:
    """[kind, size, sha256] of one file: kind 'l' (symlink: its target text is hashed), 'x'
    (executable) or 'f'."""
    if p.is_symlink():
        target = os.readlink(p).encode()
        return ["l", len(target), sha256_bytes(target)]
    return ["x" if os.access(p, os.X_OK) else "f", p.stat().st_size, sha256_file(p)]


def tree_manifest(root: Path, exclude: Iterable[str] = (".git",)) -> dict[str, list]:
    """{relative posix path: [kind, size, sha256]} of every file below root; names in `exclude`
    (files or folders, at any depth) are left out."""
    root = Path(root)
    skip = set(exclude)
    out: dict[str, list] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        # a symlink to a folder is listed by os.walk as a folder; it is a file of the tree
        for d in [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            dirnames.remove(d)
            filenames.append(d)
        for name in filenames:
            if name in skip:
                continue
            p = Path(dirpath) / name
            out[p.relative_to(root).as_posix()] = file_entry(p)
    return out


def manifest_hash(manifest: dict[str, list]) -> str:
    """The tree hash of a manifest: sha256 over sorted 'path\\0kind\\0sha256' lines (sizes are
    implied by the content hashes). Equal to tree_sha256 of the tree the manifest describes."""
    h = hashlib.sha256()
    for line in sorted(f"{p}\0{e[0]}\0{e[2]}\n" for p, e in manifest.items()):
        h.update(line.encode())
    return h.hexdigest()


def tree_sha256(root: Path, exclude: Iterable[str] = (".git",)) -> str:
    """Hash of a directory's files (see manifest_hash). Independent of mtimes, owners and the order
    the filesystem lists entries in."""
    return manifest_hash(tree_manifest(root, exclude))


def manifest_diff(expected: dict[str, list], got: dict[str, list], what: str = "the sdist") -> list[str]:
    """What differs between two manifests, one line per file: changed, added, missing. `what` names
    the expected side in the lines."""
    out = []
    for p in sorted(set(expected) | set(got)):
        e, g = expected.get(p), got.get(p)
        if e is None:
            out.append(f"{p}: added (not in {what})")
        elif g is None:
            out.append(f"{p}: missing")
        elif e != g:
            how = "size" if e[1] != g[1] else "type" if e[0] != g[0] else "content"
            out.append(f"{p}: changed ({how}: {e[1]} bytes sha256 {e[2][:12]}… in {what}, "
                       f"{g[1]} bytes sha256 {g[2][:12]}… here)")
    return out


def combine(*parts: str) -> str:
    """A stable hash over several hashes/strings, order-sensitive."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\n")
    return h.hexdigest()
