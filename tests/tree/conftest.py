"""Tree tests run against the patched vLLM that `make rehearsal` installs (pure-Python build, CPU torch)
into build/rehearsal/venv. `forge test` runs the rehearsal before these tests, so in CI they never skip."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("FORGE_BUILD_DIR", ROOT / "build"))     # as scripts/forge/paths.py
REHEARSAL_PY = BUILD / "rehearsal" / "venv" / "bin" / "python"
TREE = BUILD / "vllm"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The interpreter of the rehearsal venv, which has the patched vLLM installed."""
    if not REHEARSAL_PY.exists():
        pytest.skip(f"{REHEARSAL_PY} is missing: run `make rehearsal` first")
    return REHEARSAL_PY


@pytest.fixture(scope="session")
def run_in_vllm(vllm_python):
    """Run a Python snippet in the rehearsal venv; returns CompletedProcess (text)."""

    def run(code: str, *, env: dict | None = None, timeout: float = 600, check: bool = True):
        full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
        full_env.pop("PYTHONPATH", None)
        if "TRITON_INTERPRET" not in (env or {}):
            # tests/kernels turns the interpreter on for the whole pytest process; a snippet
            # asks for it explicitly (ahead-of-time compiles must not run interpreted)
            full_env.pop("TRITON_INTERPRET", None)
        res = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True,
                             env=full_env, timeout=timeout, cwd=ROOT)
        if check and res.returncode != 0:
            raise AssertionError(f"snippet failed (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
        return res

    return run


@pytest.fixture(scope="session")
def patched_tree() -> Path:
    if not (TREE / ".git").is_dir():
        pytest.skip(f"{TREE} is missing: run `make tree` first")
    return TREE
