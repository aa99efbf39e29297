"""Tar archives extracted without writing outside their folder: every member checked before the first is
written (a name that climbs out, a special file, a link out or through a link of the archive, two members
that cannot both be on disk), on every Python."""

from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath

from .errors import ForgeError
from .paths import rel


def leaves_folder(name: str) -> bool:
    """A tar member name (or link target) that would land outside the folder it is extracted into."""
    return name.startswith("/") or ".." in PurePosixPath(name).parts


def _member_problem(m: tarfile.TarInfo, links: set[str]) -> str | None:
    """Why member `m` may not be extracted (None: it may): a name that is absolute, empty or climbs out
    (`..`), a kind other than a file, folder or link, a link whose target leaves the folder, or a path
    through a symbolic link of the archive (whose target decides where it lands)."""
    name = m.name
    parts = PurePosixPath(name).parts
    if not name or name.startswith("/") or ".." in parts or "\0" in name:
        return "leaves the folder it is extracted into" if name else "has an empty name"
    if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
        return "is not a file, folder or link (a device, FIFO or other special file)"
    if any(str(PurePosixPath(*parts[:i])) in links for i in range(1, len(parts))):
        return "lies under a link of the archive"
    if m.issym() or m.islnk():
        target = m.linkname
        if not target or target.startswith("/"):
            return f"is a link to {target!r}, outside the folder"
        base = list(parts[:-1]) if m.issym() else []
        for part in PurePosixPath(target).parts:
            if part == "..":
                if not base:
                    return f"is a link to {target!r}, outside the folder"
                base.pop()
            elif part != ".":
                base.append(part)
                if str(PurePosixPath(*base)) in links:
                    return f"is a link to {target!r}, through another link of the archive"
    return None


def check_members(members: list[tarfile.TarInfo], where: str) -> None:
    """Refuse (a ForgeError naming the archive and the member) an archive any member of which could
    write outside the folder it is extracted into, make a special file or clash with another member (a
    path both a folder and a file); the whole list is checked, so nothing is written when one member is
    bad. The same rule on every Python."""
    links: set[str] = set()
    folder: dict[str, bool] = {}        # each path the archive makes: a folder (its own or a member's parent) or not
    for m in members:
        why = _member_problem(m, links) or _clash(m, folder)
        if why:
            raise ForgeError(f"{where}: member {m.name!r} {why}; nothing was extracted",
                             hint="the archive is damaged or not one of ours; take it again")
        if m.issym():
            links.add(str(PurePosixPath(m.name)))


def _clash(m: tarfile.TarInfo, folder: dict[str, bool]) -> str | None:
    """Why member `m` cannot be on disk beside the members before it (None: it can), recording the paths it
    makes in `folder`: a path that is a folder and a file (or link) of the archive, or a member under a file
    of it (extracted, the second would fail midway with an error naming the extraction's temporary folder),
    or a file (or link) the archive holds twice (the last copy would replace the first unseen)."""
    parts = PurePosixPath(m.name).parts
    for i in range(1, len(parts)):
        above = str(PurePosixPath(*parts[:i]))
        if folder.setdefault(above, True) is False:
            return f"lies under {above!r}, a file of the archive"
    name = str(PurePosixPath(*parts))
    if not m.isdir() and folder.get(name) is False:
        return "is in the archive twice (extracted, the last copy would silently replace the first)"
    if folder.setdefault(name, m.isdir()) != m.isdir():
        return "is a folder and a file of the archive"
    return None


def extract_tar(tf: tarfile.TarFile, dest: Path, member: "tarfile.TarInfo | None" = None) -> None:
    """Extract an open archive (or one `member` of it) into dest without writing outside it: every member
    is checked first (check_members), so a bad one is refused before anything is written, on every
    Python; Python's "data" filter, where this Python has one, is applied on top."""
    where = rel(Path(tf.name)) if tf.name else "archive"
    check_members([member] if member is not None else tf.getmembers(), where)
    kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    try:
        if member is None:
            tf.extractall(dest, **kw)
        else:
            tf.extract(member, dest, **kw)
    except getattr(tarfile, "FilterError", ()) as e:      # the data filter's refusal
        raise ForgeError(f"{where}: {e}", hint="the archive is damaged or not one of ours; take it again") from None
