"""Where things live. Everything is relative to the repository root unless overridden by env."""

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from . import proc
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
    except (ValueError, OSError, RuntimeError):     # a symlink loop: as given, the message is not lost
        return str(path)


LOOP_HINT = "a link on the path leads back to itself: remove or repoint it (ls -l shows where it leads)"


def resolved(path: Path, what: str = "") -> Path:
    """Path(path).resolve(), or a ForgeError naming `path` (and the option `what`) where a symbolic link on
    it leads back to itself: stat says ELOOP on every Python (resolve raises RuntimeError on some)."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ForgeError(f"{what + ' ' if what else ''}{path}: a symlink loop", hint=LOOP_HINT) from None
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        raise ForgeError(f"{what + ' ' if what else ''}{path}: a symlink loop", hint=LOOP_HINT) from None


def inside(path: Path, folder: Path, *, or_equal: bool = False) -> bool:
    """Whether `path` lies below `folder` (or is it, with `or_equal`), both resolved (symbolic links followed)."""
    p, f = resolved(Path(path)), resolved(Path(folder))
    return f in p.parents or (or_equal and p == f)


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


# --- names and folders given on the command line ------------------------------------------------

def plain_name(value: str, what: str) -> str:
    """A name that becomes one component of a path under the tool's own folders (a label, a run id, a
    profile's subfolder): refused, naming `what`, when it is empty or would be a path (a '/', '.' or
    '..', an absolute path), so it never lands elsewhere or silently becomes another name."""
    if value is None or not str(value).strip():
        raise ForgeError(f"{what} {value!r}: empty", hint=f"give a name for {what}, or leave the option out")
    value = str(value)
    if name_problem(value):
        raise ForgeError(f"{what} {value!r}: {name_problem(value)}", hint=NAME_HINT)
    return value


NAME_HINT = "use letters, digits, '.', '_' and '-', without '/'"


def name_problem(value) -> str | None:
    """Why `value` may not become one component of a path (None: it may): the rule of plain_name, for
    a name read from data (a config's tier name, a record's key) as much as one given on the command line."""
    if not isinstance(value, str) or not value.strip():
        return f"{value!r} is not a name (empty or not text)"
    if value in (".", "..") or any(c in value for c in "/\\\0") or value.startswith("~"):
        return "not a plain name (a path would put it outside its folder)"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "not a plain name (it holds a control character, such as a line break)"
    return None


def tracked_files(folder: Path) -> list[str]:
    """The files under `folder` that git tracks in this checkout (none where it lies outside the
    checkout, or git cannot say): a recorded result that only `--force` may replace."""
    real = resolved(folder)
    if real != ROOT and ROOT not in real.parents:
        return []
    try:
        out = proc.output(["git", "-C", str(ROOT), "ls-files", "-z", "--", str(real)], what="git ls-files")
    except ForgeError:
        return []
    return [x for x in out.split("\0") if x]


def target_folder(value: str, what: str, *, outside_checkout: bool = False, hint: str | None = None) -> Path:
    """A folder given as a path that the tool writes into (--to, --into, --out): refused, naming
    `what`, when it is empty, an existing file or a link to nothing; with `outside_checkout`, also when it is this checkout or lies inside it
    (the tool would overwrite its own tracked files)."""
    if value is None or not str(value).strip():
        raise ForgeError(f"{what} {value!r}: empty", hint=f"give a folder for {what}, or leave the option out")
    p = Path(value).expanduser()
    real = resolved(p, what)                   # a symlink loop: refused, not a traceback
    if p.exists() and not p.is_dir() or p.is_symlink() and not p.exists():    # found once the verb's work was done
        raise ForgeError(f"{what} {value}: " + ("a file, not a folder" if p.exists() else f"a link to {os.readlink(p)}, "
                         "which is not there (make that folder first)"), hint=f"give a folder for {what}")
    above = next((a for a in p.parents if a.exists() or a.is_symlink()), None)
    if above is not None and not above.is_dir():    # the folder cannot be made below a file
        raise ForgeError(f"{what} {value}: {above} is a file, not a folder, so no folder can be made below it",
                         hint=f"give a folder for {what} whose parents are folders")
    if outside_checkout:
        if real == ROOT or ROOT in real.parents:
            raise ForgeError(f"{what} {value}: inside this checkout ({ROOT}); writing there would overwrite "
                             "the tool's own files", hint=hint or "give a folder outside the checkout, e.g. a "
                                                                 "checkout of your scoring repository")
    return p


def results_folder(value: str, what: str = "--out") -> Path:
    """A folder the tool writes its results into (--out): a folder path (`target_folder`) outside the tool's
    own files (`outside_sources`)."""
    out = target_folder(value, what)
    outside_sources(value, what)
    return out


def outside_sources(value: str, what: str) -> Path:
    """A path the tool writes its results to (--out, --pack): refused, naming `what`, when it lies inside
    this checkout but outside build/ and reports/ (the results would land among the tool's own files)."""
    p = Path(value).expanduser()
    real = resolved(p, what)
    if (real == ROOT or ROOT in real.parents) and not any(
            real == ROOT / d or ROOT / d in real.parents for d in ("build", "reports")):
        raise ForgeError(f"{what} {value}: inside this checkout, outside build/ and reports/; the results would "
                         "land among the tool's own files", hint=f"give {what} a path under reports/ or build/, "
                                                                 "or outside the checkout")
    return p


@contextlib.contextmanager
def staged_folder(dest: Path):
    """A temporary folder to fill for `dest`, beside it: when the block ends without an error its
    contents move into `dest` (a new `dest` appears whole, an existing one receives them file by file);
    on an error it is removed, and so is every parent folder that was made for it, so a failure leaves
    the disk as it was."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ForgeError(f"{dest}: is a file, not a folder", hint="give a folder (a new or an existing one)")
    made = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    anchor = dest if dest.is_dir() else dest.parent
    anchor.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.part-", dir=anchor))
    try:
        yield tmp
        if dest.is_dir():
            _move_into(tmp, dest)
            tmp.rmdir()
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:                      # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM held off for a step that must finish once begun (the renames that put the
    files of one result in place): a signal that arrives meanwhile is recorded and acted on when the
    step ends, so Ctrl-C leaves the old result or the new one, never a mix. (Python runs signal handlers
    in the main thread whichever thread the signal reaches, native library threads included, so the
    handlers are swapped rather than the signal mask; outside the main thread the step runs as it is.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(got):
            handler = old[s]
            if callable(handler):
                handler(s, None)             # Python's own SIGINT handler raises KeyboardInterrupt here
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), s)      # the default: end as the signal would have


def _stage_dir(parent: Path, name: str) -> Path:
    """A new hidden folder in `parent` for staging `name` (made with this process's umask)."""
    tmp = parent / f".{name}.part-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    return tmp


def refuse_recorded(folder: Path, stem: str, what: str) -> None:
    """`what` recorded in `folder` as <stem>.json or <stem>.md (either file is the record: the .md alone was
    replaced without --force): refused naming the file; a caller given --force does not ask."""
    held = [folder / f"{stem}{ext}" for ext in (".json", ".md") if (folder / f"{stem}{ext}").is_file()]
    if held:
        raise ForgeError(f"{rel(held[0])}: {what} is recorded there",
                         hint="--force replaces it (FORCE=1), or give another --out")


def write_files(folder: Path, files: "dict[str, str | bytes]") -> None:
    """Write the files of one result into `folder` all or nothing: each is written in full (and flushed
    to disk) in a staging folder beside them, then all are renamed into place together with interrupts
    held off (signals_held). A failure or an interrupt before the renames leaves `folder` as it was."""
    folder = Path(folder)
    taken = [n for n in files if (folder / n).is_dir() and not (folder / n).is_symlink()]
    if taken:                                   # found at the renames, it left the files renamed before it
        raise ForgeError(f"{rel(folder / taken[0])}: a folder, not a file; nothing was written",
                         hint="move or remove the folder, or write the result to another folder")
    folder.mkdir(parents=True, exist_ok=True)
    stage = _stage_dir(folder, "files")
    try:
        for name, data in files.items():
            with open(stage / name, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        with signals_held():
            for name in files:
                os.replace(stage / name, folder / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def staged_result(dest: Path, replace: bool = False):
    """A folder to fill for the result folder `dest`, beside it: when the block ends without an error it
    is renamed to `dest`, so `dest` appears whole or not at all. An existing `dest` that holds anything
    is replaced whole only with `replace` (the caller asked: --force), the swap held off from interrupts;
    without it the caller has refused beforehand. On an error or an interrupt the staged folder and the
    parent folders made for it go, and `dest` is as it was."""
    dest = Path(dest)
    made = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        tmp = _stage_dir(dest.parent, dest.name)
        yield tmp
        old = None
        with signals_held():
            if dest.is_symlink() or dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
                if not replace:
                    raise FileExistsError(errno.EEXIST, "already exists", str(dest))
                old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
                os.rename(dest, old)
            try:
                os.rename(tmp, dest)     # a new or empty `dest`: this one rename
            except BaseException:
                if old is not None:
                    os.rename(old, dest)
                raise
            tmp = None
        if old is not None:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for p in made:                      # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def _move_into(src: Path, dest: Path) -> None:
    for entry in sorted(src.iterdir()):
        target = dest / entry.name
        if entry.is_dir() and not entry.is_symlink():
            target.mkdir(exist_ok=True)
            _move_into(entry, target)
            entry.rmdir()
        else:
            os.replace(entry, target)
