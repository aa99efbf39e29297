"""The tree tests' snippets run in children of tests/tree/helpers/snippet_server.py; each of these
behaviours is what a fresh `python -c` in the rehearsal venv gives, checked side by side with one."""

import signal
import subprocess

import pytest

CASES = {
    "environment, argv, path, folder, stdin": (
        "import os, sys; print(os.environ.get('FORGE_SNIPPET_PROBE'), os.environ.get('PYTHONPATH'), sys.argv, "
        "repr(sys.path[0]), os.getcwd(), repr(sys.stdin.read()))"),
    "the snippet's own triton and vllm (nothing of theirs loaded before it)": (
        "import sys; print('triton' in sys.modules, any(m.startswith('vllm') for m in sys.modules)); "
        "import os; print(os.environ.get('TRITON_INTERPRET'))"),
    "an uncaught exception": "raise ValueError('the message')",
    "sys.exit with a number": "import sys; print('before'); sys.exit(3)",
    "sys.exit with a message": "import sys; sys.exit('a message')",
    "exit handlers and threads finish": (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('exit handler'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_snippet_behaves_as_in_a_fresh_interpreter(run_in_vllm, run_in_fresh_vllm, case):
    code = CASES[case]
    env = {"FORGE_SNIPPET_PROBE": "seen", "TRITON_INTERPRET": "1"} if "triton" in case else \
        {"FORGE_SNIPPET_PROBE": "seen"}
    got = run_in_vllm(code, env=env, check=False, timeout=60)
    want = run_in_fresh_vllm(code, env=env, check=False, timeout=60)
    assert got.returncode == want.returncode, (got.stderr, want.stderr)
    assert got.stdout == want.stdout
    # the last line of stderr (the exception or the exit message) is the same; the frames above it
    # differ by the server's own frame
    assert got.stderr.strip().splitlines()[-1:] == want.stderr.strip().splitlines()[-1:]


def test_a_snippet_past_its_time_is_killed_and_the_next_one_runs(run_in_vllm):
    with pytest.raises(subprocess.TimeoutExpired):
        run_in_vllm("import time; time.sleep(30)", timeout=1)
    assert run_in_vllm("print('next')").stdout == "next\n"


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGKILL"])
def test_a_snippet_that_kills_its_process_costs_only_itself(run_in_vllm, sig):
    """A crash is the snippet's exit code, never a timeout (a SIGKILL from outside included)."""
    r = run_in_vllm(f"import os, signal; os.kill(os.getpid(), signal.{sig})", check=False, timeout=60)
    assert r.returncode == -getattr(signal, sig)
    assert run_in_vllm("print('next')").stdout == "next\n"
