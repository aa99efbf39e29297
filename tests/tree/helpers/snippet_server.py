"""Runs the tree tests' snippets in the rehearsal venv, one forked child per snippet, so that the
third-party imports every snippet needs (torch, transformers, triton, ...: about 90 % of a vLLM
import's time) are paid once per test worker instead of once per snippet.

Only third-party packages are loaded before the fork; vLLM and our kernels are imported by each
snippet in its own child, so whatever they read from the environment at import time (VLLM_*,
TRITON_INTERPRET, CUDA_VISIBLE_DEVICES) is the snippet's environment, exactly as in a fresh
`python -c`. The child gets the snippet's whole environment, `sys.argv == ['-c']`, the working
folder, stdin from /dev/null, and its own stdout/stderr files; its exit code is what `python -c`
would return (1 after an uncaught exception, with the traceback on stderr).

Protocol (one request at a time): the client writes one JSON line per snippet on stdin
({"code", "env", "cwd", "timeout", "stdout", "stderr"}) and reads one JSON line ({"rc"}) from the
file descriptor named by argv[1] ({"rc", "timed_out"}). Run by tests/tree/conftest.py; standard library only."""

import atexit
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback

# third-party modules only: nothing here reads a VLLM_* variable at import time. Not triton (nor
# torchvision, which imports it): triton.language builds its helpers as interpreted or compiled
# functions at import time, by TRITON_INTERPRET, which differs from snippet to snippet.
PRELOAD = ("torch", "numpy", "sympy", "networkx", "transformers", "pydantic", "aiohttp", "huggingface_hub",
           "yaml", "jinja2")
MUST_NOT_LOAD = ("triton", "vllm")


def _child(req: dict) -> None:
    try:
        os.setpgid(0, 0)                      # a timeout kills the snippet and whatever it started
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["-c"]
        sys.path[0] = ""                      # as `python -c`: the working folder first
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        rc = 0
        try:
            exec(compile(req["code"], "<string>", "exec"), main.__dict__)
        except SystemExit as e:
            if e.code is None:
                rc = 0
            elif isinstance(e.code, int):
                rc = e.code
            else:
                print(e.code, file=sys.stderr)
                rc = 1
        except BaseException:
            traceback.print_exc()
            rc = 1
        # what an interpreter does on its way out: wait for the snippet's non-daemon threads, run
        # the exit handlers (logging's flush among them)
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
        rc = 1
    os._exit(rc)


def _wait(pid: int, timeout: float) -> tuple[int, bool]:
    """(exit code as subprocess gives it, whether the snippet was killed for its time)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return -signal.SIGKILL, True
        time.sleep(0.01)


def main() -> None:
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)             # a program a snippet starts does not hold the protocol open
    reply = os.fdopen(fd, "w", buffering=1)
    os.dup2(2, 1)                             # stray output of a preload goes to the log, not the protocol
    loaded = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception:                     # a package the venv lacks is simply imported by nobody
            pass
    early = [m for m in MUST_NOT_LOAD if m in sys.modules]
    if early:
        sys.exit(f"snippet server: a preload imported {early}; their import-time state must be the snippet's")
    reply.write(json.dumps({"ready": loaded}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        try:
            os.setpgid(pid, pid)              # also here: the timeout may come before the child's own call
        except OSError:
            pass
        rc, timed_out = _wait(pid, float(req["timeout"]))
        reply.write(json.dumps({"rc": rc, "timed_out": timed_out}) + "\n")


if __name__ == "__main__":
    main()
