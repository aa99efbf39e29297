"""A small stand-in project for the fault-injection tests: this repository's tool (scripts/forge)
and configs, with a fake vLLM 0.18.1 sdist (a setup.py and a few hundred modules), a kernel overlay
and a patch series, served by a file:// package index. Every stage runs for real on it, in a
second or two, as the `forge` command line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
sys.path.insert(0, str(REPO / "scripts"))

from pipeline_fixtures import REVIEW, make_patch, make_sdist  # noqa: E402

SETUP_PY = """import os
from setuptools import setup, find_namespace_packages
setup(name="vllm", version=os.environ["VLLM_VERSION_OVERRIDE"],
      packages=find_namespace_packages(include=["vllm", "vllm.*"]))
"""


def upstream_files(n_modules: int = 400) -> dict[str, str]:
    files = {"setup.py": SETUP_PY, "vllm/__init__.py": "__version__ = '0.18.1'\n",
             "vllm/config.py": "".join(f"LINE_{i} = {i}\n" for i in range(60)),
             "vllm/attention.py": "".join(f"ATT_{i} = {i}\n" for i in range(60)),
             "README.md": "fake upstream for the fault tests\n"}
    for i in range(n_modules):
        files[f"vllm/filler/m{i // 50}/mod{i}.py"] = "".join(f"V_{i}_{j} = {j}\n" for j in range(200))
    return files


def make_project(root: Path, n_modules: int = 400, n_patches: int = 4) -> dict:
    """Lay out the project under root; returns {"root", "sdist", "index", "sdist_sha256", "tree_sha256"}."""
    root.mkdir(parents=True)
    shutil.copytree(REPO / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "configs", root / "configs")
    # the fake sdist
    files = upstream_files(n_modules)
    work = root.parent / "upstream-src"
    work.mkdir(parents=True)
    tb, sha, th = make_sdist(work, files)
    pristine = work / "ex" / "vllm-0.18.1"
    up = yaml.safe_load((REPO / "configs" / "upstream.yaml").read_text())
    up["sdist"].update(sha256=sha, tree_sha256=th)
    (root / "configs" / "upstream.yaml").write_text(yaml.safe_dump(up))
    # a file:// simple index serving it
    index = work / "simple"
    (index / "vllm").mkdir(parents=True)
    (index / "vllm" / "index.html").write_text(
        f'<html><a href="{tb.as_uri()}#sha256={sha}">vllm-0.18.1.tar.gz</a></html>')
    # kernel overlay
    (root / "kernels").mkdir()
    (root / "kernels" / "k.py").write_text("def kernel():\n    return 42\n")
    shutil.copy(REPO / "kernels" / "forge_switches.py", root / "kernels")      # the switches' validator (profiles)
    (root / "kernels" / "overlay.yaml").write_text("files:\n  - src: kernels/k.py\n    dst: vllm/ops/k.py\n")
    # a patch series, authored on a scratch git copy
    author = work / "author"
    shutil.copytree(pristine, author)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"]}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", "-C", author, *cmd], check=True, env=env, capture_output=True)
    pdir = root / "patches"
    pdir.mkdir()
    names = []
    for i in range(n_patches):
        f = "vllm/config.py" if i % 2 == 0 else "vllm/attention.py"
        var = "LINE" if i % 2 == 0 else "ATT"
        text = make_patch(author, f, f"{var}_{10 * i + 5} = {10 * i + 5}\n", f"{var}_{10 * i + 5} = -{i}\n",
                          f"vllm: change {i}", REVIEW)
        names.append(f"change_{i}.patch")
        (pdir / names[-1]).write_text(text)
    (pdir / "series").write_text("".join(n + "\n" for n in names))
    return {"root": root, "sdist": tb, "index": index, "sdist_sha256": sha, "tree_sha256": th}


def forge_env(proj: dict, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FORGE_", "VLLM_", "PIP_", "SOURCE_DATE_EPOCH"))}
    env.update(PYTHONPATH=str(proj["root"] / "scripts"), PIP_INDEX_URL=proj["index"].as_uri(),
               PIP_CONFIG_FILE=os.devnull, PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def forge_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "forge", *args]


def run(proj: dict, *args, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(forge_cmd(*args), cwd=proj["root"], env=forge_env(proj, **env), capture_output=True,
                          text=True, timeout=timeout)


def interrupt(proj: dict, args: list[str], after_s: float, sig: int, **env) -> int | None:
    """Start `forge args`, send `sig` to its whole process group (as Ctrl-C or a kill of the session
    does) after `after_s` seconds; returns its exit code (None if it finished before the signal)."""
    return signal_after(forge_cmd(*args), proj["root"], forge_env(proj, **env), after_s, sig)


def signal_after(cmd: list[str], cwd: Path, env: dict, after_s: float, sig: int) -> int | None:
    """Start `cmd` in its own process group and send `sig` to the group after `after_s` seconds;
    returns its exit code (None if it finished first). What is left of the group is then killed."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        p.wait(timeout=after_s)
        return None
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    try:
        rc = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait()
    # what the signal left running in the group (a git child after SIGINT) is ended too
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(0.05)
    return rc
