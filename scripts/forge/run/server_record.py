"""The record of the server `forge serve` started (build/serve/server.json): reading it, refused
whole when it does not hold (`read_state`), and telling whether the process it names is still that
server (`still_ours`: this boot, its start time, its command line, the process group it leads), so
that `forge stop` and the verbs that find the running server act on that server and no other."""

from __future__ import annotations

from pathlib import Path

from .. import paths, proc
from ..errors import ForgeError
from . import runs
from .serverlog import SCORED_PORT

STATE = paths.BUILD / "serve" / "server.json"


def _state_hint(state_file: Path) -> str:
    return (f"a server forge started may still run: find it (ps -ef | grep 'vllm serve'; ss -ltnp | grep :{SCORED_PORT})"
            f" and stop it, then remove {paths.rel(state_file)}")


_whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0  # noqa: E731
_words = lambda v: isinstance(v, list) and bool(v) and all(isinstance(a, str) for a in v)  # noqa: E731
RECORD_KEYS = (("pid", _whole, "a process id"), ("pgid", _whole, "a process group id"),
               ("start_time", lambda v: isinstance(v, str) and v.isdigit(), "the process's start time (clock ticks)"),
               ("cmdline", _words, "the process's command line"), ("server_args", _words, "the server's arguments"),
               ("boot_id", lambda v: v is None or isinstance(v, str), "the machine's boot id or null"),
               ("run_id", lambda v: isinstance(v, str), "a run id"))


def read_state() -> dict | None:
    """The record of the server `forge serve` started (None: none recorded). A record that cannot be
    read is an error, never "none": the server it describes may still run (a FIFO or a device in its
    place too: the bounded reader refuses it without waiting on it)."""
    if not (STATE.exists() or STATE.is_symlink()):
        return None
    hint = _state_hint(STATE)
    try:
        st = runs.read_json(STATE)
    except ForgeError as e:
        raise ForgeError(f"{e.message}; it is the record of the server forge started", hint=hint) from None
    if not isinstance(st, dict):
        raise ForgeError(f"{paths.rel(STATE)}: a JSON {type(st).__name__}, not the record of a server", hint=hint)
    for key, ok, want in RECORD_KEYS:
        if not ok(st.get(key)):
            raise ForgeError(f"{paths.rel(STATE)}: key '{key}' is {repr(st.get(key))[:40]}, expected {want}; "
                             "not the record of a server", hint=hint)
    return st


def still_ours(st: dict, state_file: Path = STATE) -> bool:
    """Whether the server record `st` names is still running: True only when process `pid` is the one
    recorded (this boot, its start time, a command line ending with the server's arguments) and leads
    its process group `pgid`; False when that process is gone (exited, or its pid now names a later
    process). A live process that answers to the record without being the one recorded is refused
    (a ForgeError naming `state_file`, the record's own path, never a path the record names): nothing is
    signalled on a record that does not hold."""
    pid = st["pid"]
    why = proc.recorded_process(pid, st["pgid"], st["start_time"], st.get("boot_id"), list(st.get("server_args") or []))
    if why == proc.GONE:
        return False                 # exited, its pid now names a later process, or the machine restarted
    if why:
        raise ForgeError(f"{paths.rel(state_file)}: pid {pid} is not the server forge started ({why}); "
                         "nothing was signalled", hint=_state_hint(state_file))
    return True


def running_server() -> dict | None:
    """The state of the server `forge serve` started, when it is still that process."""
    st = read_state()
    if st and still_ours(st):
        return st
    return None
