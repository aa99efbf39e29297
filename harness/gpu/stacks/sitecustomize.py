"""Stack samples of a server's Python processes (`forge e2e-gpu --stack-every SECONDS`).

Put first on a server's PYTHONPATH by the harness with FORGE_STACK_EVERY (seconds between samples) and
FORGE_STACK_DIR (where each process writes `stacks-<pid>.txt`). Every process the server starts from it
(the API server, the engine core, workers; forked ones re-arm here) writes, every FORGE_STACK_EVERY seconds,
the Python stack of each of its threads: faulthandler's watchdog thread does it without the GIL, so a process
held in a long call is sampled where it is held. The header names the process's main thread, so the digest
(`forge e2e-gpu` reads the files into the run's stacks.json) never takes another thread for it.
Without FORGE_STACK_EVERY this file does nothing but run the next sitecustomize on the path, if any.
A diagnostic: the watchdog reads other threads' frames without the GIL, and CPython has reports of crashes and
hangs around it; compare tok/s only between runs without it. Standard library only.
"""

import _thread
import faulthandler
import os
import sys
import time

_state = {"file": None, "pid": None, "every": None}


def _arm(forked: bool = False) -> None:
    _state["file"] = _state["pid"] = None        # never the parent's file, whatever happens below
    try:
        every = float(os.environ.get("FORGE_STACK_EVERY", ""))
        folder = os.environ["FORGE_STACK_DIR"]
    except (ValueError, KeyError):
        return
    if not (0 < every <= 3600) or not os.path.isdir(folder):
        return
    try:
        f = open(os.path.join(folder, f"stacks-{os.getpid()}.txt"), "a", buffering=1)
    except OSError:
        return
    f.write(f"# forge stacks pid {os.getpid()} ppid {os.getppid()} every {every:g} s from {time.time():.3f} "
            f"main 0x{_thread.get_ident():016x}\n"
            + (f"# forked from {os.getppid()}\n" if forked else f"# argv {' '.join(sys.argv)[:400]}\n"))
    f.flush()
    faulthandler.dump_traceback_later(every, repeat=True, file=f)
    _state.update(file=f, pid=os.getpid(), every=every)


def _stop() -> None:
    # before a fork, in the process that armed the timer: a child cannot cancel a watchdog thread it did not
    # inherit (the call waits for ever), so the timer is stopped here and each side arms its own after the fork
    if _state["file"] is not None and _state["pid"] == os.getpid():
        faulthandler.cancel_dump_traceback_later()


def _rearm_parent() -> None:
    if _state["file"] is not None and _state["pid"] == os.getpid():
        faulthandler.dump_traceback_later(_state["every"], repeat=True, file=_state["file"])


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
    os.register_at_fork(before=_stop, after_in_parent=_rearm_parent, after_in_child=lambda: _arm(forked=True))
_next_sitecustomize()
