"""Tree tests run against the patched vLLM that `make rehearsal` installs (pure-Python build, CPU torch)
into build/rehearsal/venv. `forge test` runs the rehearsal before these tests, so in CI they never skip."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("FORGE_BUILD_DIR", ROOT / "build"))     # as scripts/forge/paths.py
REHEARSAL_PY = BUILD / "rehearsal" / "venv" / "bin" / "python"
TREE = BUILD / "vllm"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The interpreter of the rehearsal venv, which has the patched vLLM installed."""
    if not REHEARSAL_PY.exists():
        pytest.skip(f"{REHEARSAL_PY} is missing: run `make rehearsal` first")
    return REHEARSAL_PY


class SnippetServer:
    """tests/tree/helpers/snippet_server.py in the rehearsal venv: each snippet runs in a child forked
    from a process that has already imported the third-party packages (torch, transformers, ...),
    so a snippet costs its own work and vLLM's import, not torch's. One per test worker, started on
    first use, restarted if it dies. FORGE_TREE_SNIPPETS=fresh runs every snippet in a new
    interpreter instead (the reference behaviour, for a snippet suspected of depending on it)."""

    def __init__(self, python: Path, tmp: Path):
        self.python, self.tmp, self.proc, self.n = python, tmp, None, 0

    def _start(self) -> None:
        if self.proc is not None:             # a server that died: its reply pipe goes with it
            self.replies.close()
        r, w = os.pipe()
        log = open(self.tmp / "snippet-server.log", "ab")
        self.proc = subprocess.Popen([str(self.python), str(HERE / "helpers" / "snippet_server.py"), str(w)],
                                     stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(w,), cwd=ROOT,
                                     env=snippet_env(None), text=True)
        os.close(w)
        log.close()
        self.replies = os.fdopen(r, "r")
        if not self.replies.readline():
            raise AssertionError(f"the snippet server did not start: {(self.tmp / 'snippet-server.log').read_text()[-3000:]}")

    def run(self, code: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.n += 1
        out, err = self.tmp / f"{self.n}.out", self.tmp / f"{self.n}.err"
        req = {"code": code, "env": env, "cwd": str(ROOT), "timeout": timeout, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.replies.readline()
        if not line:
            raise AssertionError(f"the snippet server died: {(self.tmp / 'snippet-server.log').read_text()[-3000:]}")
        reply = json.loads(line)
        res = subprocess.CompletedProcess([str(self.python), "-c", code], reply["rc"],
                                          out.read_text(errors="replace"), err.read_text(errors="replace"))
        out.unlink()
        err.unlink()
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(res.args, timeout, res.stdout, res.stderr)
        return res

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.replies.close()


def snippet_env(env: dict | None) -> dict:
    full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
    full_env.pop("PYTHONPATH", None)
    if "TRITON_INTERPRET" not in (env or {}):
        # tests/kernels turns the interpreter on for the whole pytest process; a snippet
        # asks for it explicitly (ahead-of-time compiles must not run interpreted)
        full_env.pop("TRITON_INTERPRET", None)
    return full_env


def _checked(res: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and res.returncode != 0:
        raise AssertionError(f"snippet failed (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    return res


@pytest.fixture(scope="session")
def run_in_fresh_vllm(vllm_python):
    """run_in_vllm's reference: every snippet in a new interpreter of the rehearsal venv."""

    def run(code: str, *, env: dict | None = None, timeout: float = 600, check: bool = True):
        return _checked(subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True,
                                       env=snippet_env(env), timeout=timeout, cwd=ROOT,
                                       stdin=subprocess.DEVNULL), check)

    return run


@pytest.fixture(scope="session")
def run_in_vllm(vllm_python, run_in_fresh_vllm, tmp_path_factory):
    """Run a Python snippet in the rehearsal venv as `python -c` would (its environment: ours, with
    `env` on top, PYTHONPATH and TRITON_INTERPRET dropped unless `env` sets them; stdin empty);
    returns a CompletedProcess (text). Raises on a non-zero exit when `check`."""
    if os.environ.get("FORGE_TREE_SNIPPETS") == "fresh":
        yield run_in_fresh_vllm
        return
    server = SnippetServer(vllm_python, tmp_path_factory.mktemp("snippets"))

    def run(code: str, *, env: dict | None = None, timeout: float = 600, check: bool = True):
        return _checked(server.run(code, snippet_env(env), timeout), check)

    yield run
    server.close()


@pytest.fixture(scope="session")
def patched_tree() -> Path:
    if not (TREE / ".git").is_dir():
        pytest.skip(f"{TREE} is missing: run `make tree` first")
    return TREE
