"""Every test session: the git work tree is the same at the end as at the start (tests/support/clean_tree.py),
and Ctrl-C reaches the processes the tests start.

A shell that starts a job in the background without job control (`cmd &` in a script, `nohup`) starts it
with SIGINT ignored, and every process below inherits that: the tool's processes would then never see the
Ctrl-C the interrupt tests send them and would run on to exit 0. A handler of our own (Python's usual one)
is reset to the default in each child at exec, so the tests see what a user's terminal gives."""

import signal
import sys
from pathlib import Path

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from clean_tree import pytest_sessionfinish, pytest_sessionstart  # noqa: E402,F401
