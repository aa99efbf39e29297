"""What a build was made from: upstream, overlay, patches, kernels, toolchain, our commit."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import sys
from importlib import metadata
from pathlib import Path

from .. import config, proc, records
from ..errors import ForgeError
from ..hashing import combine, sha256_file
from ..paths import KERNELS, ROOT

NOT_INSTALLED = "not installed"
TORCH_PROBE = "import torch; print(torch.version.hip or ''); print(torch.version.cuda or '')"

# How each tool prints its version: the pattern's first group is recorded, never the banner.
TOOL_VERSION = {
    "nvcc": r"release [\d.]+, V([\d.]+)",          # "Cuda compilation tools, release 13.0, V13.0.88"
    "hipcc": r"HIP version: ([\w.\-]+)",            # "HIP version: 6.2.41133-dd7f95766"
    "git": r"git version ([\w.\-]+)",
}


def _version_of(dist: str) -> str:
    """The installed version of a Python distribution (from its metadata: nothing is imported),
    or "not installed"."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _tool_version(cmd: list[str], pattern: str) -> str:
    """The version a command-line tool reports, "not installed" when it is not on PATH, or
    "unknown (<first line>)" when its output has no version where expected."""
    if not shutil.which(cmd[0]):
        return NOT_INSTALLED
    try:
        out = proc.run(cmd, capture=True, check=False, timeout=30, what=cmd[0])
    except ForgeError as e:
        return f"unknown ({cmd[0]} did not run: {e.message})"
    text = (out.stdout or "") + (out.stderr or "")
    m = re.search(pattern, text)
    if m:
        return m.group(1)
    first = next((l.strip() for l in text.splitlines() if l.strip()), "no output")
    return f"unknown ({first[:80]})"


def toolchain() -> dict:
    tv: dict = {"python": platform.python_version(), "platform": platform.platform()}
    tv["torch"] = _version_of("torch")
    tv["torch_hip"] = tv["torch_cuda"] = NOT_INSTALLED
    if tv["torch"] != NOT_INSTALLED:
        # its HIP and CUDA versions, read by a fresh interpreter of this Python: an import in this process depends
        # on what the process imported before (a torch import that failed once here fails again as "cannot load
        # module more than once per process", whatever the installation)
        try:
            out = proc.run([sys.executable, "-c", TORCH_PROBE], capture=True, check=False, timeout=300,
                           what="torch's build versions")
        except ForgeError as e:
            out = None
            why = e.message
        if out is not None and out.returncode == 0 and len(out.stdout.splitlines()) == 2:
            hip, cuda = out.stdout.splitlines()
            tv.update(torch_hip=hip or "none (not a ROCm build)", torch_cuda=cuda or "none (not a CUDA build)")
        else:                           # installed but broken: say so rather than guess
            if out is not None:
                why = next((x.strip() for x in reversed(out.stderr.splitlines()) if x.strip()), "no output")
            tv["torch"] += f" (import failed: {why})"[:200]
    for mod in ("triton", "setuptools", "setuptools_scm", "wheel"):
        tv[mod] = _version_of(mod.replace("_", "-"))
    tv["hipcc"] = _tool_version(["hipcc", "--version"], TOOL_VERSION["hipcc"])
    tv["nvcc"] = _tool_version(["nvcc", "--version"], TOOL_VERSION["nvcc"])
    tv["git"] = _tool_version(["git", "--version"], TOOL_VERSION["git"])
    return tv


# A copy of the project without its git folder (a GPU machine's copy of the checkout) can still name the
# commit it holds: `source_manifest()` here lists HEAD and the git blob id of every file HEAD tracks; there,
# FORGE_SOURCE_MANIFEST=<that file> makes forge_commit() compare the copy's files with it.
SOURCE_MANIFEST_ENV = "FORGE_SOURCE_MANIFEST"


def _blob_id(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def source_manifest() -> dict:
    """HEAD and {path: blob id} of the files it tracks (as committed, whatever the work tree holds)."""
    sha = proc.output(["git", "-C", ROOT, "rev-parse", "HEAD"], what="git rev-parse")
    listing = proc.output(["git", "-C", ROOT, "ls-tree", "-r", "--full-tree", "HEAD"], what="git ls-tree")
    files = {}
    for line in listing.splitlines():
        meta, _, name = line.partition("\t")
        mode, kind, blob = meta.split()
        if kind == "blob" and mode != "120000":
            files[name] = blob
    return {"commit": sha, "files": files}


def _commit_from_manifest(path: str) -> dict:
    try:
        man = records.read_json(Path(path))
        files, sha = man["files"], man["commit"]
    except (ForgeError, KeyError, TypeError) as e:
        raise ForgeError(f"{SOURCE_MANIFEST_ENV}={path}: not a source manifest ({e})",
                         hint="write one with `forge.recipe.provenance.source_manifest()` in the checkout") from None
    differ = sorted(n for n, blob in files.items() if _blob_id(ROOT / n) != blob)
    if not differ:
        return {"commit": sha, "dirty": False, "from": "source manifest"}
    h = hashlib.sha256()
    for n in differ:
        h.update(f"{n}\0{_blob_id(ROOT / n)}\n".encode())
    return {"commit": sha, "dirty": True, "diff_sha256": h.hexdigest(), "from": "source manifest",
            "differ": differ[:20]}


def forge_commit() -> dict:
    if os.environ.get(SOURCE_MANIFEST_ENV):
        return _commit_from_manifest(os.environ[SOURCE_MANIFEST_ENV])
    try:
        sha = proc.output(["git", "-C", ROOT, "rev-parse", "HEAD"], what="git rev-parse")
        dirty = bool(proc.output(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"]))
    except Exception:
        return {"commit": None, "dirty": None}
    return {"commit": sha, "dirty": dirty}


def unnamed_commit_warning(what: str) -> str | None:
    """Why `what`'s records would name no project commit (a copy of the checkout without its git folder and
    no source manifest), to be said before the work starts; None when the commit is known."""
    if forge_commit().get("commit"):
        return None
    return (f"this copy of the project has no git folder and {SOURCE_MANIFEST_ENV} is not set: {what} will "
            f"name no commit (set {SOURCE_MANIFEST_ENV} to the bundle's build/source-manifest.json, or run from a "
            "git checkout)")


def forge_diff_hash() -> str | None:
    """sha256 of the uncommitted change to tracked files (`git diff HEAD`), for a record made from a dirty
    checkout: what it was made from is then named, not only "dirty"."""
    try:
        diff = proc.run(["git", "-C", ROOT, "diff", "HEAD", "--binary"], capture=True, what="git diff").stdout
    except Exception:
        return None
    return hashlib.sha256(diff.encode("utf-8", "surrogateescape")).hexdigest()


def shown_path(path) -> str:
    """A path as a record shows it: relative to the project when inside it, else only its last part
    (a machine's folders are not part of what was made)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except (ValueError, OSError):
        return f".../{p.name}" if p.name else "..."


def shown_command(argv: list[str]) -> str:
    """A command line as a record shows it: every absolute or home path argument through shown_path."""
    out = []
    for a in argv:
        opt, eq, val = a.partition("=")
        if eq and val.startswith(("/", "~")):
            out.append(f"{opt}={shown_path(Path(val).expanduser())}")
        elif a.startswith(("/", "~")):
            out.append(shown_path(Path(a).expanduser()))
        else:
            out.append(a)
    return " ".join(out)


def kernel_hashes() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): sha256_file(p)
            for p in sorted(KERNELS.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
            and p.suffix in (".py", ".cu", ".cuh", ".h", ".hip", ".yaml")}


def series_hash(state: dict) -> str:
    """One hash for 'upstream + overlay + patches', as applied in the tree state."""
    return combine(state["upstream"], state["overlay"], *(f"{n}:{d}" for n, d, _ in state["patches"]))


DEVICE_MEANING = {"empty": "pure Python, no compiled extensions (VLLM_TARGET_DEVICE=empty)",
                  "rocm": "ROCm build with compiled extensions (VLLM_TARGET_DEVICE=rocm)"}


def record(state: dict, *, version: str, device: str, rocm_arch: list[str] | None = None) -> dict:
    up = config.upstream()
    return {
        "version": version,
        # VLLM_TARGET_DEVICE of the build: "empty" is vLLM's pure-Python build (no compiled
        # extensions: the CPU rehearsal), "rocm" the full build for PYTORCH_ROCM_ARCH
        "device": device,
        "device_meaning": DEVICE_MEANING.get(device, device),
        "rocm_arch": rocm_arch,
        "upstream": {"name": up["name"], "version": up["version"], "sdist_sha256": up["sdist"]["sha256"],
                     "tree_sha256": up["sdist"]["tree_sha256"], "git_commit": up["git"]["commit"]},
        "base": state.get("base", "sdist"),     # sdist, vendor or standin (builder/bases.py)
        "series_hash": series_hash(state),
        "tree_head": state["head"],
        "overlay_hash": state["overlay"],
        "patches": [{"name": n, "sha256": d} for n, d, _ in state["patches"]],
        "kernels": kernel_hashes(),
        "toolchain": toolchain(),
        "forge": forge_commit(),
        "python_executable": sys.executable,
    }
