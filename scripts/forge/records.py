"""Records on disk, read and replaced by one rule each: `read_json`, the one reader of every JSON record
the tool reads (bounded: a regular file of at most MAX_JSON_BYTES, no key given twice, no nesting deeper
than MAX_JSON_DEPTH, no integer longer than Python parses; anything else is one error naming the file),
and `guard_recorded`, the one guard every writer passes before it replaces a recorded output (a file git
tracks, a score, a complete calibration, a local edit): refused without --force, nothing written."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import paths
from .errors import ForgeError

MAX_JSON_BYTES = 256 * 2**20     # the largest record the tool writes is a few MiB (a tier's per-token times)
MAX_JSON_DEPTH = 64              # the deepest record the tool writes nests about 8 levels
DAMAGED = "the file is damaged; restore it from a copy of the run, or rerun the step that writes it"


class _Twice(ValueError):
    pass


def _unique(pairs: list) -> dict:
    seen: dict = {}
    for k, v in pairs:
        if k in seen:
            raise _Twice(k)
        seen[k] = v
    return seen


def read_bytes(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file of at most `limit` (default MAX_JSON_BYTES) bytes. A FIFO, a device
    (/dev/zero), a folder or a larger file is refused (a ForgeError naming it) without waiting on it or
    reading it whole."""
    limit = MAX_JSON_BYTES if limit is None else limit
    name = paths.rel(Path(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)      # a FIFO opens at once, never waits for a writer
    except FileNotFoundError:
        raise ForgeError(f"{name}: not found", hint="check the path; if a forge step writes it, run that step first"
                         ) from None
    except IsADirectoryError:
        raise ForgeError(f"{name}: is a folder, not a file", hint="give the file itself") from None
    except OSError as e:
        if e.errno == errno.ELOOP:          # not a permission: a link on the path leads back to itself
            raise ForgeError(f"{name}: a symlink loop", hint=paths.LOOP_HINT) from None
        if e.errno == errno.ENOTDIR:
            raise ForgeError(f"{name}: a part of this path is a file, not a folder",
                             hint="check the path; give the file itself") from None
        raise ForgeError(f"{name}: cannot be read ({e.strerror})", hint="check the file's permissions") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ForgeError(f"{name}: is a folder, not a file", hint="give the file itself")
        if not stat.S_ISREG(st.st_mode):
            raise ForgeError(f"{name}: not a regular file (a FIFO, a device or a socket); a record is a file",
                             hint="give the file the tool wrote, not a pipe or a device")
        if st.st_size > limit:
            raise ForgeError(f"{name}: {st.st_size:,} bytes, more than the {limit:,} a record may hold",
                             hint=DAMAGED)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:                   # grew while read
        raise ForgeError(f"{name}: more than the {limit:,} bytes a record may hold", hint=DAMAGED)
    return data


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests (a scalar: 0), counted without recursion."""
    most, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            most = max(most, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v)
                             if isinstance(x, (dict, list)))
    return most


def parse_json(text: str, name: str, *, cut_hint: str | None = None) -> Any:
    """JSON text of the record `name`, parsed with the reader's bounds (no key twice, nesting at most
    MAX_JSON_DEPTH, integers Python parses); a ForgeError naming `name` otherwise."""
    deep = f"{name}: not a record: JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = json.loads(text, object_pairs_hook=_unique)
    except _Twice as e:
        raise ForgeError(f"{name}: key {str(e.args[0])[:60]!r} is given twice in one object (JSON would keep the "
                         "last silently)", hint="keep one of them; a file the tool wrote never repeats a key") from None
    except json.JSONDecodeError as e:
        if not text.strip() or e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
            raise ForgeError(f"{name}: not valid JSON, cut short ({'empty file' if not text.strip() else e.msg})",
                             hint=cut_hint or "the file was cut short (an interrupted write); rerun the step "
                                              "that writes it") from None
        raise ForgeError(f"{name}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                         "the file is damaged, not cut short", hint=DAMAGED) from None
    except RecursionError:                          # nesting past the parser's stack
        raise ForgeError(deep, hint=DAMAGED) from None
    except ValueError:                              # an integer longer than Python parses
        raise ForgeError(f"{name}: not a record: an integer of more than {sys.get_int_max_str_digits()} digits",
                         hint=DAMAGED) from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise ForgeError(deep, hint=DAMAGED)
    return value


def read_json(path: Path) -> Any:
    """The one reader of a JSON record: its content; a missing file, one that is not a regular file or is
    larger than a record, not UTF-8 text, JSON cut short or other text than JSON, a key given twice,
    nesting deeper than a record's or an integer too long is a ForgeError naming the file."""
    data = read_bytes(path)
    name = paths.rel(Path(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ForgeError(f"{name}: not UTF-8 text (byte {e.start}), so not JSON", hint=DAMAGED) from None
    return parse_json(text, name)


# --- the guard of recorded outputs ----------------------------------------------------------------------

def _differs(path: Path, new: bytes | None) -> bool:
    if new is None or not path.is_file() or path.is_symlink():
        return True
    try:
        return read_bytes(path, limit=max(len(new), 1)) != new
    except ForgeError:
        return True


def tracked_changes(new: Mapping[Path, "bytes | str | None"]) -> list[Path]:
    """The files of `new` (a path -> what a writer would put there; None where not known beforehand) that
    hold a recorded output the write would change: a file that git tracks in this checkout whose content
    differs."""
    out = []
    by_folder: dict[Path, set[str]] = {}
    for p in new:
        p = Path(p)
        if p.exists() or p.is_symlink():
            by_folder.setdefault(p.parent.resolve(), set())
    for folder in by_folder:
        by_folder[folder] = set(paths.tracked_files(folder))
    for p, data in new.items():
        p = Path(p)
        if not (p.exists() or p.is_symlink()):
            continue
        real = p.parent.resolve() / p.name
        try:
            name = str(real.relative_to(paths.ROOT))
        except ValueError:
            continue
        blob = data.encode() if isinstance(data, str) else data
        if name in by_folder[p.parent.resolve()] and _differs(p, blob):
            out.append(p)
    return out


def changed_files(new: Mapping[Path, "bytes | str | None"]) -> list[Path]:
    """The files of `new` that exist with other content than the write would give them (a local edit)."""
    return [Path(p) for p, data in new.items() if (Path(p).exists() or Path(p).is_symlink())
            and _differs(Path(p), data.encode() if isinstance(data, str) else data)]


def listed(files: Iterable[Path], most: int = 3) -> str:
    names = [paths.rel(Path(p)) for p in files]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def guard_recorded(where: str, held: str | None, *, doing: str, force: bool, hint: str = "") -> None:
    """The one guard of recorded outputs, passed by every writer before it writes: `held` says what `where`
    holds that `doing` would replace (files git tracks, a score, a complete calibration, a local edit;
    None or "": nothing recorded). Without `force` (--force, FORCE=1) it is refused: one error naming it
    and how to keep it, nothing written."""
    if not held or force:
        return
    fix = "--force (FORCE=1) replaces it"
    raise ForgeError(f"{where} already holds {held}; {doing} would replace it",
                     hint=f"{hint}, or {fix}" if hint else f"pass {fix}")


def guard_tracked(folder: Path, new: Mapping[Path, "bytes | str | None"], *, doing: str, force: bool,
                  hint: str = "") -> None:
    """guard_recorded for a writer of files into `folder`: the recorded output it would replace is those of
    `new` (path -> content, None where not known beforehand) that git tracks and the write would change."""
    changed = tracked_changes(new)
    held = f"recorded files git tracks that it would change ({listed(changed)})" if changed else None
    guard_recorded(paths.rel(Path(folder)), held, doing=doing, force=force, hint=hint)
