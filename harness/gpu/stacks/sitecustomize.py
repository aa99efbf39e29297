"""Stack samples of a server's Python processes (`forge e2e-gpu --stack-every SECONDS`).

Put on a server's PYTHONPATH by the harness with FORGE_STACK_EVERY (seconds between samples) and
FORGE_STACK_DIR (where each process writes `stacks-<pid>.txt`). Every process the server starts from it
(the API server, the engine core, workers; forked ones re-arm here) writes, every FORGE_STACK_EVERY seconds,
the Python stack of each of its threads: faulthandler's watchdog thread does it without the GIL, so a process
held in a long call is sampled where it is held. `forge e2e-gpu` reads the files into the run's stacks.json.
Without FORGE_STACK_EVERY this file does nothing. Standard library only.
"""

import faulthandler
import os
import sys
import time


def _arm(header: bool = True) -> None:
    try:
        every = float(os.environ.get("FORGE_STACK_EVERY", ""))
        folder = os.environ["FORGE_STACK_DIR"]
    except (ValueError, KeyError):
        return
    if not (0 < every <= 3600) or not os.path.isdir(folder):
        return
    f = globals().get("_file")
    if not header and f is not None:          # the parent after a fork: the same file again
        faulthandler.dump_traceback_later(every, repeat=True, file=f)
        return
    try:
        f = open(os.path.join(folder, f"stacks-{os.getpid()}.txt"), "a", buffering=1)
    except OSError:
        return
    f.write(f"# forge stacks pid {os.getpid()} ppid {os.getppid()} every {every:g} s from {time.time():.3f}\n"
            f"# argv {' '.join(sys.argv)[:400]}\n")
    f.flush()
    faulthandler.dump_traceback_later(every, repeat=True, file=f)
    globals()["_file"] = f            # keep it open for the process's life


def _stop() -> None:
    # before a fork, in the parent: a child cannot cancel a watchdog thread it did not inherit (the call waits
    # for it for ever), so the timer is stopped here and each side arms its own after the fork
    if globals().get("_file") is not None:
        faulthandler.cancel_dump_traceback_later()


_arm()
if hasattr(os, "register_at_fork") and globals().get("_file") is not None:
    os.register_at_fork(before=_stop, after_in_parent=lambda: _arm(header=False), after_in_child=_arm)
