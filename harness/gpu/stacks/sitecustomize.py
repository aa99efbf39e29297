"""Stack samples of a server's Python processes (`forge e2e-gpu --stack-every SECONDS`).

Put first on a server's PYTHONPATH by the harness with FORGE_STACK_EVERY (seconds between samples) and
FORGE_STACK_DIR (where each process writes `stacks-<pid>.txt`). Every process the server starts from it
(the API server, the engine core, workers; forked ones start their own sampler here) writes, every
FORGE_STACK_EVERY seconds, the Python stack of each of its threads. A daemon thread takes the samples with the
GIL (sys._current_frames), so it never reads a frame that is being changed. A process whose GIL is held in one
C call is sampled when the call returns: each sample records how late it came (`late`), which is how long the
process could not run Python. The header names the process's main thread, so the digest (`forge e2e-gpu` reads
the files into the run's stacks.json) never takes another thread for it.
Without FORGE_STACK_EVERY this file does nothing but run the next sitecustomize on the path, if any.
(faulthandler's watchdog, which samples without the GIL, crashed vLLM's API server with SIGSEGV while it
imported modules: it is not used.) A diagnostic; compare tok/s only between runs without it. Standard library only.
"""

import _thread
import os
import sys
import threading
import time

MAX_FRAMES = 100                    # per thread, innermost first
_state = {"file": None, "pid": None, "every": None, "stop": None}
_write = threading.Lock()           # held while a sample is written and across a fork: never a half-written file


def _stack_lines(frame) -> list:
    lines = []
    while frame is not None and len(lines) < MAX_FRAMES:
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
        frame = frame.f_back
    return lines


def _sampler(f, every: float, stop: threading.Event) -> None:
    me = threading.get_ident()
    due = time.monotonic() + every
    while not stop.wait(max(0.0, due - time.monotonic())):
        late = time.monotonic() - due
        out = [f"Sample at {time.time():.3f} late {late:.3f}"]
        frames = sys._current_frames()
        for ident in frames:
            if ident != me:
                out.append(f"Thread 0x{ident:016x} (most recent call first):")
                out += _stack_lines(frames[ident])
        frames = None                                # no frame (nor its locals) kept alive until the next sample
        with _write:
            if _state["stop"] is not stop:          # stopped (or re-armed after a fork) meanwhile
                return
            try:
                f.write("\n".join(out) + "\n")
                f.flush()
            except (OSError, ValueError):           # the file gone or closed: the sampler ends, the server runs on
                return
        due += every
        if due < time.monotonic():                  # held past one or more periods: the next is a period from now
            due = time.monotonic() + every


def _arm(forked: bool = False) -> None:
    _state.update(file=None, pid=None, stop=None)    # never the parent's file, whatever happens below
    try:
        every = float(os.environ.get("FORGE_STACK_EVERY", ""))
        folder = os.environ["FORGE_STACK_DIR"]
    except (ValueError, KeyError):
        return
    if not (0 < every <= 3600) or not os.path.isdir(folder):
        return
    try:
        f = open(os.path.join(folder, f"stacks-{os.getpid()}.txt"), "a", buffering=1)
        f.write(f"# forge stacks pid {os.getpid()} ppid {os.getppid()} every {every:g} s from {time.time():.3f} "
                f"main 0x{_thread.get_ident():016x}\n"
                + (f"# forked from {os.getppid()}\n" if forked else f"# argv {' '.join(sys.argv)[:400]}\n"))
        f.flush()
    except OSError:
        return
    stop = threading.Event()
    _state.update(file=f, pid=os.getpid(), every=every, stop=stop)
    threading.Thread(target=_sampler, args=(f, every, stop), name="forge-stacks", daemon=True).start()


def _before_fork() -> None:
    _write.acquire()                                 # no sample is being written while the process forks


def _after_fork_in_parent() -> None:
    _write.release()


def _after_fork_in_child() -> None:
    _write.release()                                 # the child's copy of the lock, held by the forking thread
    _arm(forked=True)                                # the parent's sampler thread does not exist here


def _next_sitecustomize() -> None:
    """Python imports only the first sitecustomize on the path: run the one this file shadows, if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in sys.path:
        if not d or os.path.abspath(d) == here:
            continue
        cand = os.path.join(d, "sitecustomize.py")
        if os.path.isfile(cand):
            try:
                with open(cand) as fh:
                    exec(compile(fh.read(), cand, "exec"), {"__name__": "sitecustomize", "__file__": cand})
            except Exception as e:          # as Python itself treats a failing sitecustomize: said, not fatal
                print(f"Error in sitecustomize {cand}: {type(e).__name__}: {e}", file=sys.stderr)
            return


_arm()
if hasattr(os, "register_at_fork") and _state["file"] is not None:
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
_next_sitecustomize()
