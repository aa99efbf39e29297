"""What a build was made from: upstream, overlay, patches, kernels, toolchain, our commit."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

from . import config, proc
from .hashing import combine, sha256_file
from .paths import KERNELS, PATCHES, ROOT


def _version_of(module: str) -> str | None:
    try:
        m = __import__(module)
        return getattr(m, "__version__", "?")
    except Exception:
        return None


def _tool_version(cmd: list[str]) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        text = (out.stdout or out.stderr).strip().splitlines()
        return next((l for l in text if l.strip()), None)
    except (OSError, subprocess.SubprocessError):
        return None


def toolchain() -> dict:
    tv: dict = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch
        tv.update(torch=torch.__version__, torch_hip=torch.version.hip, torch_cuda=torch.version.cuda)
    except Exception:
        tv["torch"] = None
    for mod in ("triton", "setuptools", "setuptools_scm"):
        tv[mod] = _version_of(mod)
    tv["hipcc"] = _tool_version(["hipcc", "--version"])
    tv["nvcc"] = _tool_version(["nvcc", "--version"])
    tv["git"] = _tool_version(["git", "--version"])
    return tv


def forge_commit() -> dict:
    try:
        sha = proc.output(["git", "-C", ROOT, "rev-parse", "HEAD"], what="git rev-parse")
        dirty = bool(proc.output(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"]))
    except Exception:
        return {"commit": None, "dirty": None}
    return {"commit": sha, "dirty": dirty}


def kernel_hashes() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): sha256_file(p)
            for p in sorted(KERNELS.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
            and p.suffix in (".py", ".cu", ".cuh", ".h", ".hip", ".yaml")}


def series_hash(state: dict) -> str:
    """One hash for 'upstream + overlay + patches', as applied in the tree state."""
    return combine(state["upstream"], state["overlay"], *(f"{n}:{d}" for n, d, _ in state["patches"]))


def record(state: dict, *, version: str, device: str, rocm_arch: list[str] | None = None) -> dict:
    up = config.upstream()
    return {
        "version": version,
        "device": device,
        "rocm_arch": rocm_arch,
        "upstream": {"name": up["name"], "version": up["version"], "sdist_sha256": up["sdist"]["sha256"],
                     "tree_sha256": up["sdist"]["tree_sha256"], "git_commit": up["git"]["commit"]},
        "series_hash": series_hash(state),
        "tree_head": state["head"],
        "overlay_hash": state["overlay"],
        "patches": [{"name": n, "sha256": d} for n, d, _ in state["patches"]],
        "kernels": kernel_hashes(),
        "toolchain": toolchain(),
        "forge": forge_commit(),
        "python_executable": sys.executable,
    }
