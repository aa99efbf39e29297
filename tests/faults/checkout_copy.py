"""A throwaway checkout for the fault cases that need one of their own: this repository's tool, configs
and kernels (and any paths a case names) copied into a git repository of its own and committed, so its
tracked files are recorded outputs a case may try to replace, and its configs a case may damage, without
touching this checkout. Copying and committing takes well under a second."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def make_checkout(root: Path, extra: tuple[str, ...] = ()) -> Path:
    """scripts/, configs/, kernels/ and `extra` (paths of this repository) under `root`, committed."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("scripts", "configs", "kernels", *extra):
        src, dst = REPO / part, root / part
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, ignore=ignore) if src.is_dir() else shutil.copyfile(src, dst)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "the checkout")
    return root


def commit(root: Path, files: dict[str, str | bytes]) -> None:
    """Write `files` (path under root -> content) and commit them: recorded outputs of the checkout."""
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "recorded")


def status(root: Path) -> str:
    return git(root, "status", "--porcelain", "--untracked-files=all")


def forge_in(root: Path, tmp: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """`forge ARGS` run from the checkout at `root` (its own scripts, configs and git), runs and build
    under `tmp`."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_", "VLLM_")) and k not in ("FORCE", "DATA_DIR")}
    e.update({"PYTHONPATH": str(root / "scripts"), "FORGE_RUNS_DIR": str(tmp / "runs"),
              "FORGE_BUILD_DIR": str(tmp / "build"), "PYTHONDONTWRITEBYTECODE": "1", **env})
    return subprocess.run([sys.executable, "-m", "forge", *args], cwd=root, env=e, capture_output=True, text=True,
                          timeout=timeout)
