"""A test run leaves the git work tree as it found it: `git status --porcelain` (tracked files changed,
added or deleted; new files .gitignore does not cover) and the content of every file it lists are the
same at the end of the session as at its start, or the session fails and names the files.

Loaded by tests/conftest.py. Outside a git work tree (an exported source tree, no git) there is nothing
to compare and the check is off; a tree already dirty at the start is compared file by file, so only
what the tests themselves changed counts. FORGE_TREE_CHECK=0 turns it off."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path


def snapshot(where: Path) -> dict[str, str] | None:
    """{path: "<status> <content sha256 or 'gone'>"} for every entry `git status --porcelain` lists;
    None when `where` is not inside a git work tree."""
    try:
        top = subprocess.run(["git", "-C", str(where), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=60)
        if top.returncode != 0:
            return None
        root = Path(top.stdout.strip())
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain=v1", "-z", "--untracked-files=all"],
                            capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if st.returncode != 0:
        return None
    out: dict[str, str] = {}
    fields = st.stdout.decode("utf-8", "surrogateescape").split("\0")
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        status, path = entry[:2], entry[3:]
        if "R" in status or "C" in status:      # a rename or copy: the next field is the source path
            i += 1
        p = root / path
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "gone"
        out[path] = f"{status} {digest}"
    return out


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Paths whose status or content differs between the two snapshots (clean again counts as changed)."""
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


def _enabled() -> bool:
    return os.environ.get("FORGE_TREE_CHECK", "1") != "0"


def pytest_sessionstart(session) -> None:
    session.config._forge_tree = snapshot(Path(session.config.rootpath)) if _enabled() else None


def pytest_sessionfinish(session, exitstatus) -> None:
    before = getattr(session.config, "_forge_tree", None)
    if before is None:
        return
    after = snapshot(Path(session.config.rootpath))
    diff = changed(before, after or {})
    if not diff:
        return
    lines = [f"  {p}: {before.get(p, 'clean')} -> {(after or {}).get(p, 'clean')}" for p in diff[:20]]
    more = [f"  ... and {len(diff) - 20} more"] if len(diff) > 20 else []
    msg = "\n".join(["the tests changed the git work tree (a test must write under tmp_path or build/):",
                     *lines, *more])
    rep = session.config.pluginmanager.get_plugin("terminalreporter")
    if rep is not None:
        rep.write_sep("=", "work tree changed by the tests", red=True)
        rep.write_line(msg)
    else:
        print(msg)
    session.exitstatus = 1
