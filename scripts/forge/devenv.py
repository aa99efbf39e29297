"""Housekeeping verbs: the project venv, `make help`, `make clean`.

This module imports only the standard library: `forge venv` runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
from pathlib import Path

from . import options, proc
from .builder import tree as tree_mod
from .errors import ForgeError
from .paths import BUILD, DIST, ROOT, TREE, rel
from .run import server_record


def cmd_venv(args) -> int:
    venv = (ROOT / args.path) if not Path(args.path).is_absolute() else Path(args.path)
    req = ROOT / "requirements" / "dev.txt"
    want = hashlib.sha256(req.read_bytes()).hexdigest()
    marker = venv / ".forge-requirements"
    py = venv / "bin" / "python"
    if py.exists() and marker.is_file() and marker.read_text().strip() == want:
        return 0
    print(f"[forge] setting up {rel(venv)} from {rel(req)} (first run: a few minutes)", file=sys.stderr, flush=True)
    if not py.exists():
        if proc.run([sys.executable, "-m", "venv", str(venv)], check=False).returncode != 0:
            raise ForgeError(f"could not create {rel(venv)}", hint="install python3-venv (apt-get install python3-venv)")
    rc = proc.run([str(py), "-m", "pip", "install", "-q", "-r", str(req)], check=False).returncode
    if rc != 0:
        raise ForgeError(f"pip could not install {rel(req)} into {rel(venv)}",
                         hint="check pip's configured index (pip config list) and the messages above")
    marker.write_text(want + "\n")
    return 0


def cmd_help_make(args) -> int:
    """Print the Makefile's targets with their `## ` descriptions."""
    text = Path(args.makefile).read_text()
    rows = re.findall(r"^([a-zA-Z][\w-]*):[^\n#]*## (.*)$", text, re.M)
    width = max(len(t) for t, _ in rows)
    print("dcu-forge targets (make <target>):")
    for t, d in rows:
        print(f"  {t.ljust(width)}  {d}")
    return 0


def _work_clean_would_lose() -> None:
    """Refuse (ForgeError) when build/ holds what `make clean` would lose for good: a running server's
    record (it would keep running with nothing to stop it by) or work in build/vllm not in patches/."""
    st = server_record.running_server()
    if st:
        raise ForgeError(f"a server started by forge is running (pid {st['pid']}, run {st['run_id']}); clean "
                         f"would remove its record ({rel(server_record.STATE)}) and leave it running",
                         hint="stop it first with `make stop`, or remove build/ anyway with `make clean FORCE=1`")
    if not (TREE / ".git").is_dir():
        return
    keep = "remove build/ anyway with `make clean FORCE=1`"
    state = tree_mod.read_state(TREE)
    if not state:
        raise ForgeError(f"{rel(TREE)} has no record of how it was built (.git/{tree_mod.STATE}): what is in it "
                         "cannot be told from patches/", hint=f"move it away to keep it, or {keep}")
    new = tree_mod.git_out(TREE, "ls-files", "--others", "--exclude-standard")
    if new:
        raise ForgeError(f"{rel(TREE)} has files git does not track (new work?):\n{new[:800]}\nclean would delete them",
                         hint=f"commit them in build/vllm and run `make patches-refresh`, or {keep}")
    if not state.get("pending"):
        try:
            tree_mod.check_clean(TREE, state)
        except ForgeError as e:
            raise ForgeError(e.message + "\nclean would delete it",
                             hint=f"export it with `make patches-refresh` (commit in build/vllm first), or {keep}"
                             ) from None


def cmd_clean(args) -> int:
    if not options.forced(args.force):
        _work_clean_would_lose()
    for d in (BUILD, DIST):
        if d.exists():
            print(f"[forge] removing {rel(d)}", file=sys.stderr)
            shutil.rmtree(d)
    return 0


def register(sub) -> None:
    p = sub.add_parser("venv", help="create/update the project venv (.venv) from requirements/dev.txt")
    p.add_argument("--path", default=".venv")
    p.set_defaults(func=cmd_venv)
    p = sub.add_parser("help-make", help="list the Makefile targets")
    p.add_argument("makefile", nargs="?", default=str(ROOT / "Makefile"))
    p.set_defaults(func=cmd_help_make)
    p = sub.add_parser("clean", help="remove build/ and dist/ (keeps the verified source cache); refuses while a "
                                     "server started by forge runs or build/vllm holds work not in patches/")
    p.add_argument("--force", action="store_true", help="remove them anyway (also FORCE=1)")
    p.set_defaults(func=cmd_clean)
