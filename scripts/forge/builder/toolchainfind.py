"""The Python and the ld.lld the contest container's toolchain check (builder/toolchain.py) takes on this box.

The Python: FORGE_TOOLCHAIN_PYTHON when set (a 3.10 or newer that runs), else `python3.10` on PATH, else
pyenv's newest 3.10.x, else the Python the tool runs on (the caller says so). The linker Triton 3.4's AMD
backend calls: TRITON_HIP_LLD_PATH, else ld.lld on PATH, else the newest versioned one (/usr/bin/ld.lld-*,
/usr/lib/llvm-*/bin/ld.lld).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys
from pathlib import Path

from .. import proc
from ..errors import ForgeError

CONTAINER_PYTHON = (3, 10)
PYTHON_ENV = "FORGE_TOOLCHAIN_PYTHON"        # a Python to use instead of the search below
LLD_ENV = "TRITON_HIP_LLD_PATH"               # Triton's own variable for its AMD linker
LLD_FIX = ("install Debian's lld-15 (apt-get install lld-15; .ci/run does), or set "
           f"{LLD_ENV} to an ld.lld")

_VERSION = "import sys; print(*sys.version_info[:3])"


def python_version(exe: str) -> tuple[int, ...] | None:
    """(major, minor, micro) of a Python executable, None when it does not run as one (a pyenv shim
    whose version is not selected, a broken link)."""
    try:
        res = proc.run([exe, "-c", _VERSION], capture=True, check=False, timeout=60)
    except ForgeError:
        return None
    parts = res.stdout.split()
    if res.returncode != 0 or len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _pyenv_pythons(major_minor: tuple[int, int]) -> list[str]:
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    want = "%d.%d" % major_minor
    found = glob.glob(os.path.join(root, "versions", f"{want}.*", "bin", f"python{want}"))

    def key(path: str) -> tuple[int, ...]:
        tail = Path(path).parents[1].name[len(want) + 1:]
        return tuple(int(x) for x in re.findall(r"\d+", tail)) or (0,)
    return sorted(found, key=key, reverse=True)


def find_python() -> tuple[str, tuple[int, ...], str]:
    """(executable, version, how it was found): the container's Python 3.10 where this box has
    one, else the Python the tool runs on (the caller says so)."""
    forced = os.environ.get(PYTHON_ENV)
    if forced is not None:
        v = python_version(forced)
        if v is None or v[:2] < (3, 10):
            raise ForgeError(f"{PYTHON_ENV}={forced!r} is not a Python 3.10 or newer that runs here",
                             hint=f"point {PYTHON_ENV} at a python3.10 executable, or unset it to let the "
                                  "tool search PATH and pyenv")
        return forced, v, PYTHON_ENV
    want = "%d.%d" % CONTAINER_PYTHON
    for exe, how in [(shutil.which(f"python{want}"), "PATH"),
                     *((p, "pyenv") for p in _pyenv_pythons(CONTAINER_PYTHON))]:
        if exe:
            v = python_version(exe)
            if v and v[:2] == CONTAINER_PYTHON:
                return exe, v, how
    exe = getattr(sys, "_base_executable", None) or sys.executable
    return exe, tuple(sys.version_info[:3]), "fallback"


def _lld_version(path: str) -> tuple[int, ...]:
    m = re.search(r"(\d+)(?:/bin/ld\.lld$|$)", path)
    return (int(m.group(1)),) if m else (0,)


def find_lld() -> str | None:
    """The ld.lld Triton 3.4's AMD backend will link with, or None."""
    forced = os.environ.get(LLD_ENV)
    if forced:
        if not (os.path.isfile(forced) and os.access(forced, os.X_OK)):
            raise ForgeError(f"{LLD_ENV}={forced!r} is not an executable file", hint=LLD_FIX)
        return forced
    if shutil.which("ld.lld"):
        return shutil.which("ld.lld")
    versioned = [p for p in glob.glob("/usr/bin/ld.lld-*") + glob.glob("/usr/lib/llvm-*/bin/ld.lld")
                 if os.access(p, os.X_OK)]
    return max(versioned, key=_lld_version) if versioned else None
