"""What the platform's `python setup.py bdist_wheel` would build from a tree, found on any machine:
setup.py runs in a copy of the tree with `setuptools.setup` replaced by a recorder, so nothing is
compiled. For a HIP build, torch is faked as a ROCm build (a `torch` package holding only what
setup.py reads: torch.version.hip, torch.__version__ 2.10.0, CUDA_HOME/ROCM_HOME) and ROCM_PATH
points at a folder holding `.info/rocm_version` ("26.04", as DTK 26.04 writes it); HOME and git's
global configuration are temporary, so a setup.py that writes into them (the vendor's adds a git
safe.directory entry) leaves the machine as it was.

Every run is offline: a sitecustomize on the child's path makes a socket connection to anything
but the loopback raise (and records it), proxies point at loopback port 9 (a connection there is refused
and recorded as well), git may use the
file protocol only and pip no index. Records: version, ext_modules names, install_requires, and
the `__hcu_version__` setup.py wrote into vllm/version.py.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .. import proc
from ..errors import ForgeError

DTK_RELEASE = "26.04"
FAKE_TORCH_VERSION = "2.10.0"
FAKE_HIP_VERSION = "6.3.25264"

NETWORK_GUARD = r'''
import os, socket
_LOG = os.environ.get("FORGE_NET_LOG")
_LOOPBACK = ("127.", "::1", "localhost", "0.0.0.0")

def _refuse(what, target):
    host = target[0] if isinstance(target, tuple) and target else target
    proxied = isinstance(target, tuple) and len(target) >= 2 and target[1] == 9    # the proxies' dead port
    if isinstance(host, str) and host.startswith(_LOOPBACK) and not proxied:
        return
    if isinstance(host, (str, bytes)) or isinstance(target, tuple):
        if _LOG:
            with open(_LOG, "a") as f:
                f.write(f"{what} {target!r} pid {os.getpid()}\n")
        raise OSError(f"network access blocked (offline build check): {what} {target!r}")

_connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _refuse("connect", address)
    return _connect(self, address)

def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _refuse("connect", address)
    return _connect_ex(self, address)

def getaddrinfo(host, *a, **kw):
    if host is not None:
        _refuse("resolve", host if isinstance(host, str) else str(host))
    return _getaddrinfo(host, *a, **kw)

socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
'''

FAKE_TORCH = {
    "__init__.py": f"__version__ = {FAKE_TORCH_VERSION!r}\nfrom . import version, utils  # noqa\n",
    "version.py": f"hip = {FAKE_HIP_VERSION!r}\ncuda = None\n__version__ = {FAKE_TORCH_VERSION!r}\n",
    "utils/__init__.py": "",
    "utils/cpp_extension.py": "import os\nCUDA_HOME = None\nROCM_HOME = os.environ.get('ROCM_PATH')\n",
}

RECORDER = r'''
import json, os, runpy, sys
for var in os.environ.pop("_FORGE_UNSET", "").split(","):
    os.environ.pop(var, None)
import setuptools
seen = {}
def setup(**kw):
    seen["version"] = kw.get("version")
    seen["ext_modules"] = [e.name for e in kw.get("ext_modules") or []]
    seen["install_requires"] = list(kw.get("install_requires") or [])
    seen["cmdclass"] = sorted(kw.get("cmdclass") or {})
setuptools.setup = setup
sys.argv = ["setup.py", "bdist_wheel"]
runpy.run_path("setup.py", run_name="__main__")
print("FORGE_SETUP_PROBE " + json.dumps(seen))
'''


def offline_env(work: Path) -> dict[str, str]:
    """Environment for a child process that must not reach the network (see the module's doc)."""
    guard = work / "netguard"
    guard.mkdir(parents=True, exist_ok=True)
    (guard / "sitecustomize.py").write_text(NETWORK_GUARD)
    home = work / "home"
    home.mkdir(exist_ok=True)
    dead = "http://127.0.0.1:9"
    return {"FORGE_NET_LOG": str(work / "network.log"), "HOME": str(home),
            "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_ALLOW_PROTOCOL": "file", "GIT_TERMINAL_PROMPT": "0",
            "http_proxy": dead, "https_proxy": dead, "HTTP_PROXY": dead, "HTTPS_PROXY": dead,
            "ALL_PROXY": dead, "all_proxy": dead, "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1",
            "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PYTHONDONTWRITEBYTECODE": "1",
            "_FORGE_GUARD_PATH": str(guard)}


def network_attempts(work: Path) -> list[str]:
    log = work / "network.log"
    return log.read_text().splitlines() if log.is_file() else []


def _with_path(env: dict, *first: Path) -> dict:
    parts = [str(p) for p in first] + [env["_FORGE_GUARD_PATH"]]
    return {**env, "PYTHONPATH": os.pathsep.join(parts)}


def copy_tree(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".git", "build", "dist", "__pycache__"))


def probe_hip(tree: Path, python: str | None = None, keep: Path | None = None) -> dict:
    """Run `tree`'s setup.py for a ROCm/DTK build with the recorder. Returns {version, ext_modules,
    install_requires, hcu_version, network} (network: blocked connection attempts)."""
    with tempfile.TemporaryDirectory(prefix="forge-setup-probe-") as t:
        work = Path(keep or t)
        src = work / "src"
        copy_tree(Path(tree), src)
        fake = work / "faketorch"
        for name, text in FAKE_TORCH.items():
            (fake / "torch" / name).parent.mkdir(parents=True, exist_ok=True)
            (fake / "torch" / name).write_text(text)
        rocm = work / "dtk"
        (rocm / ".info").mkdir(parents=True)
        (rocm / ".info" / "rocm_version").write_text(DTK_RELEASE)
        env = _with_path(offline_env(work), fake)
        env.update(ROCM_PATH=str(rocm), ROCM_HOME=str(rocm))
        # what the platform's shell does not set (a developer's own may be set here)
        env["_FORGE_UNSET"] = "VLLM_TARGET_DEVICE,VLLM_VERSION_OVERRIDE,SETUPTOOLS_SCM_PRETEND_VERSION,VLLM_USE_PRECOMPILED"
        res = proc.run([python or sys.executable, "-c", RECORDER], cwd=src, env=env, capture=True,
                       check=False, what="setup.py (recorder)", timeout=300)
        out = _parse(res, "HIP")
        vp = src / "vllm" / "version.py"
        text = vp.read_text(errors="replace") if vp.is_file() else ""
        hcu = written_hcu_version(text) if "__hcu_version__" in text else None
        out.update(hcu_version=hcu, network=network_attempts(work))
        return out


def written_hcu_version(text: str) -> str | None:
    """The `__hcu_version__` a build wrote into vllm/version.py (a plain or placeholder-free f-string),
    or a sentence saying why the file cannot give it."""
    try:
        mod = ast.parse(text)
    except SyntaxError as e:
        return f"(vllm/version.py does not parse: {e})"
    for node in ast.walk(mod):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__hcu_version__"
                                                for t in node.targets):
            v = node.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                return v.value
            if isinstance(v, ast.JoinedStr) and all(isinstance(x, ast.Constant) for x in v.values):
                return "".join(x.value for x in v.values)
            return "(vllm/version.py computes __hcu_version__)"
    return None


def _parse(res, what: str) -> dict:
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("FORGE_SETUP_PROBE ")), None)
    if res.returncode != 0 or line is None:
        detail = ((res.stderr or "") + (res.stdout or "")).strip()[-3000:]
        raise ForgeError(f"setup.py did not get to setup() for a {what} build (exit {res.returncode}):\n{detail}",
                         hint="this is what the platform's `python setup.py bdist_wheel` would stop on")
    return json.loads(line.split(" ", 1)[1])


def build_empty_metadata(tree: Path, out: Path, python: str | None = None) -> dict:
    """`setup.py dist_info` for the empty target (pure Python, no compiler) in a copy of `tree`,
    offline. Returns {metadata (the METADATA text), network}."""
    with tempfile.TemporaryDirectory(prefix="forge-empty-meta-") as t:
        work = Path(t)
        src = work / "src"
        copy_tree(Path(tree), src)
        env = _with_path(offline_env(work))
        env.update(VLLM_TARGET_DEVICE="empty")
        out.mkdir(parents=True, exist_ok=True)
        res = proc.run([python or sys.executable, "setup.py", "-q", "dist_info", "--output-dir", out], cwd=src,
                       env=env, capture=True, check=False, what="setup.py dist_info (empty target)", timeout=600)
        net = network_attempts(work)
        meta = next(out.glob("*.dist-info/METADATA"), None)
        if res.returncode != 0 or meta is None:
            raise ForgeError(f"setup.py dist_info for the empty target failed (exit {res.returncode}):\n"
                             + ((res.stderr or "") + (res.stdout or "")).strip()[-3000:]
                             + (f"\nblocked network access: {net}" if net else ""))
        return {"metadata": meta.read_text(), "network": net}
