"""Where things live. Everything is relative to the repository root unless overridden by env."""

import os
import tarfile
from pathlib import Path, PurePosixPath

from .errors import ForgeError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
PATCHES = ROOT / "patches"
KERNELS = ROOT / "kernels"
REPORTS = ROOT / "reports"
BUILD = Path(os.environ.get("FORGE_BUILD_DIR", ROOT / "build"))
DIST = Path(os.environ.get("FORGE_DIST_DIR", ROOT / "dist"))
CACHE = Path(os.environ.get("FORGE_CACHE_DIR", ROOT / ".cache" / "forge"))
TREE = BUILD / "vllm"


def rel(path: Path) -> str:
    """Path for messages: relative to the repo root when inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_atomic(path: Path, data: "str | bytes") -> None:
    """Write a file so that a reader (or a rerun after an interrupt) sees the old content or the
    new, never a part: write a temporary file next to it, flush it to disk, rename it over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)          # a failed write leaves `path` as it was and nothing beside it
        raise
    _sweep_dead_writers(path)


def _sweep_dead_writers(path: Path) -> None:
    """Remove the temporary files of earlier writes of `path` whose writer was killed mid-write
    (.<name>.<pid>.tmp with no process <pid>); a live writer's is left alone."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:-4]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def set_aside(path: Path, suffix: str = "rejected") -> Path:
    """Move a file or folder out of the way (never delete it): <name>.<suffix>, or .<suffix>.N when
    that exists. Returns the new path."""
    path = Path(path)
    dest = path.with_name(f"{path.name}.{suffix}")
    n = 1
    while dest.exists() or dest.is_symlink():
        dest = path.with_name(f"{path.name}.{suffix}.{n}")
        n += 1
    os.rename(path, dest)
    return dest


class Lock:
    """An exclusive lock on a file (flock), so two runs never build the same output at once; a
    killed run's lock goes with its process."""

    def __init__(self, path: Path, what: str):
        self.path, self.what, self.fh = Path(path), what, None

    def __enter__(self):
        import fcntl
        import sys
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "a")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[forge] waiting for another run that is building {self.what} ({rel(self.path)})",
                  file=sys.stderr, flush=True)
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.fh.close()
        return False


def leaves_folder(name: str) -> bool:
    """A tar member name (or link target) that would land outside the folder it is extracted into."""
    return name.startswith("/") or ".." in PurePosixPath(name).parts


def extract_tar(tf: tarfile.TarFile, dest: Path, member: "tarfile.TarInfo | None" = None) -> None:
    """Extract an open archive (or one `member` of it) into dest without writing outside it: Python's
    "data" filter where this Python has one (3.10.12+), else a member whose name or link target leaves
    dest is refused (a ForgeError naming the archive and the member) before anything is written."""
    where = rel(Path(tf.name)) if tf.name else "archive"
    hint = "the archive is damaged or not one of ours; take it again"
    filtered = hasattr(tarfile, "data_filter")
    if not filtered:
        for m in [member] if member is not None else tf.getmembers():
            if leaves_folder(m.name) or ((m.issym() or m.islnk()) and leaves_folder(m.linkname)):
                raise ForgeError(f"{where}: member {m.name!r} leaves the folder it is extracted into", hint=hint)
    kw = {"filter": "data"} if filtered else {}
    try:
        if member is None:
            tf.extractall(dest, **kw)
        else:
            tf.extract(member, dest, **kw)
    except getattr(tarfile, "FilterError", ()) as e:      # the data filter's refusal
        raise ForgeError(f"{where}: {e}", hint=hint) from None
