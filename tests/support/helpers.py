"""Shared by the contest-loop tests: the forge CLI as a subprocess, the fake server on a free
loopback port, the tiny model, and the fixture runs in tests/data/runs/."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
DATA = ROOT / "tests" / "data"
FIXTURE_RUNS = DATA / "runs"
REHEARSAL_PY = ROOT / "build" / "rehearsal" / "venv" / "bin" / "python"
H200_E2E_ARCHIVE = DATA / "h200-e2e.tgz"   # copies of recorded H200 run files (tests/data/README.md)

sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(SUPPORT))


# Test servers listen below Linux's ephemeral range (32768-60999 by default): a port the kernel handed out
# by bind(0) is one it may give the next outgoing connection of any test running beside this one, before
# the server started on it binds it (a server then refused "port in use", a flaky test).
TEST_PORTS = (20000, 32700)
_ports = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port() -> int:
    for _ in range(200):
        p = _ports.randrange(*TEST_PORTS)
        if port_free(p):
            return p
    raise RuntimeError(f"no free port in {TEST_PORTS[0]}-{TEST_PORTS[1]}")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_pair() -> int:
    """A port p with p and p+1 both free (servers of one e2e run take consecutive ports)."""
    for _ in range(100):
        p = free_port()
        if port_free(p + 1):
            return p
    raise RuntimeError("no two consecutive free ports")


def forge_env(tmp: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT / "scripts"), "FORGE_RUNS_DIR": str(tmp / "runs"),
                "FORGE_BUILD_DIR": str(tmp / "build"), "NO_PROXY": "127.0.0.1,localhost"})
    # a test's `make` runs as a user's does, not as a sub-make of the `make test` that started pytest
    for k in ("DATA_DIR", "MODEL", "MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"):
        env.pop(k, None)
    env.update(extra)
    return env


def forge(tmp: Path, *args: str, timeout: float = 120, env: dict | None = None, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forge", *args], cwd=ROOT, env=env or forge_env(tmp, **extra),
                          capture_output=True, text=True, timeout=timeout)


def health(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def fake_server(model: Path, port: int | None = None, **env: str):
    """The fake server on a free loopback port; yields (port, process)."""
    port = port or free_port()
    penv = dict(os.environ)
    penv.update({k: str(v) for k, v in env.items()})
    p = subprocess.Popen([sys.executable, str(SUPPORT / "fakeserver.py"), "serve", str(model), "--port", str(port),
                          "--served-model-name", "Qwen3.5-27B"], env=penv,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):  # bounded: 20 s
            if health(port) or p.poll() is not None:
                break
            time.sleep(0.1)
        yield port, p
    finally:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def args_with(base: list[str], extra) -> list[str]:
    """`base` (a verb, options with their values, flags) without the options that `extra` gives again, then
    `extra`: a one-value option given twice is refused by every verb, so a test's own value replaces the
    default its helper gives."""
    given = {t.split("=", 1)[0] for t in extra if t.startswith("--")}
    out, i = [], 0
    while i < len(base):
        group = base[i:i + 2] if base[i].startswith("--") and i + 1 < len(base) and \
            not base[i + 1].startswith("--") else base[i:i + 1]
        if group[0].split("=", 1)[0] not in given:
            out += group
        i += len(group)
    return [*out, *extra]


def e2e_fake(tmp: Path, *extra: str, env_extra: dict | None = None, timeout: float = 300,
             port: int | None = None) -> tuple[subprocess.CompletedProcess, int, Path]:
    """`forge e2e-gpu` against two fake servers (tests/support/fakeserver.py) with the replay client:
    the first profile's server replays tests/data/runs/fast, the others .../base; every client call is
    logged to tmp/replay.log. Profiles fast-int8 and upstream unless `extra` names --profiles; one
    prompt per tier unless it gives --num-prompts. Returns (result, first port, results folder)."""
    port = port or free_port_pair()
    env = forge_env(tmp, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp / "replay.log"),
                    **{f"REPLAY_FROM_{port}": str(FIXTURE_RUNS / "fast")}, **(env_extra or {}))
    from forge.lab import gpu_bundle
    model = tmp / "model"
    if not model.is_dir():
        gpu_bundle.write_model_dir({"model": {"config": "configs/models/qwen3.5-27b/config.json",
                                              "vocab_size": 248320, "eos_token_id": 248044}}, model)
    cmd = [sys.executable, "-m", "forge", *args_with([
        "e2e-gpu", "--bundle", "", "--model", str(model), "--vllm", f"{sys.executable} {SUPPORT / 'fakeserver.py'}",
        "--client", f"{sys.executable} {SUPPORT / 'replayclient.py'}", "--first-port", str(port), "--out",
        str(tmp / "out"), "--pack", str(tmp / "pack" / "e2e.tgz"), "--num-prompts", "1",
        # a fake server starts in about a second, not a GPU server's minutes
        "--start-guess-s", "0", "--profiles", "fast-int8,upstream"], extra)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return r, port, tmp / "out"


def tiny_model(dest: Path) -> Path:
    import tinymodel
    return tinymodel.build(dest)


def tier_files(dest: Path, lines: int = 100) -> Path:
    """Official-format tier files (`<tier>_throughput.jsonl`, more lines than the finals send) in `dest`."""
    import json
    dest.mkdir(parents=True, exist_ok=True)
    for t in ("4-8K", "8-16K", "16-32K"):
        (dest / f"{t}_throughput.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}", "output_tokens": 8}) + "\n"
                                                            for i in range(lines)))
    return dest


def probe_bundle(tmp: Path) -> Path:
    """A GPU bundle of one small wheel (`forgeprobe`, importable as a check) and an empty model folder, with
    its manifest: what `forge e2e-gpu --install-only` installs. Made once per `tmp`."""
    import json
    import zipfile

    from forge.hashing import sha256_file
    b = tmp / "bundle"
    if (b / "manifest.json").is_file():
        return b
    (b / "wheels").mkdir(parents=True)
    whl = b / "wheels" / "forgeprobe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("forgeprobe/__init__.py", "SITE = True\n")
        z.writestr("forgeprobe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: forgeprobe\nVersion: 1.0\n")
        z.writestr("forgeprobe-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                     "Tag: py3-none-any\n")
        z.writestr("forgeprobe-1.0.dist-info/RECORD", "")
    (b / "model").mkdir()
    files = {f"wheels/{whl.name}": {"sha256": sha256_file(whl), "bytes": whl.stat().st_size}}
    (b / "manifest.json").write_text(json.dumps({"vllm_wheel": whl.name, "version": "0.18.1+test", "python": "3",
                                                 "files": files}))
    return b


_h200_dir: Path | None = None
_bench_modules: dict = {}


def bench_module(name: str):
    """kernels/bench/<name>.py as a module (the benchmark scripts sit beside each other, not in a package),
    loaded once per test process."""
    if name not in _bench_modules:
        import importlib.util
        spec = importlib.util.spec_from_file_location(f"kernels_bench_{name}", ROOT / "kernels" / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _bench_modules[name] = mod
    return _bench_modules[name]


def h200_e2e() -> Path:
    """The recorded H200 run files of tests/data/h200-e2e.tgz, extracted once per test process into a
    temporary folder (removed at exit); tests copy what they change."""
    global _h200_dir
    if _h200_dir is None:
        import atexit
        import shutil
        import tarfile
        import tempfile

        from forge import tarsafe
        d = Path(tempfile.mkdtemp(prefix="forge-h200-e2e-"))
        atexit.register(shutil.rmtree, d, True)
        with tarfile.open(H200_E2E_ARCHIVE, "r:gz") as tf:
            tarsafe.extract_tar(tf, d)
        _h200_dir = d / "h200-e2e"
    return _h200_dir

