"""Every subprocess the tool starts goes through here: one place to log, check and explain failures."""

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from .errors import ForgeError


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP where the tool ends as on Ctrl-C (signals_as_interrupt): the same clean-up runs,
    and the command exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_as_interrupt(signums=(signal.SIGTERM, signal.SIGHUP)):
    """Within the block, SIGTERM and SIGHUP raise Terminated, so what a Ctrl-C stops (a server started and
    not yet answering) is stopped by them too; outside the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, frame):
        raise Terminated(signum)
    old = {s: signal.signal(s, on_signal) for s in signums}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def merged_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """os.environ with `env` on top (values as strings): what every child process gets."""
    full = dict(os.environ)
    full.update({k: str(v) for k, v in (env or {}).items()})
    return full


def split_command(text: str, what: str) -> list[str]:
    """A command given as one string (an option's value or an environment variable), split as a shell
    would; an unbalanced quote or an empty command is a ForgeError naming `what`."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        example = "'python3 -m module --name \"a b\"'"
        raise ForgeError(f"{what} {text!r}: {e} (an unbalanced quote)",
                         hint=f"quote the command as a shell would, e.g. {what}" + (" " if what.startswith("-") else "=")
                              + example) from None
    if not argv:
        raise ForgeError(f"{what} {text!r}: an empty command", hint="give the command, or leave the option out")
    return argv


def fmt(cmd: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(c)) for c in cmd)


def run(cmd: Sequence[str | os.PathLike], *, cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None, check: bool = True, capture: bool = False,
        log: Path | None = None, input: str | None = None, what: str | None = None,
        hint: str | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a command. `env` is merged over os.environ. With `log`, output goes to that file
    (and its tail is shown on failure); with `capture`, output is returned as text."""
    cmd = [str(c) for c in cmd]
    full_env = merged_env(env)
    kwargs = dict(cwd=cwd, env=full_env, input=input, text=True, timeout=timeout)
    try:
        if log is not None:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as fh:
                fh.write(f"$ {fmt(cmd)}\n")
                fh.flush()
                res = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, **kwargs)
        elif capture:
            res = subprocess.run(cmd, capture_output=True, **kwargs)
        else:
            res = subprocess.run(cmd, **kwargs)
    except FileNotFoundError:
        raise ForgeError(f"{what or 'command'}: '{cmd[0]}' is not installed or not on PATH",
                         hint=hint or f"install {cmd[0]} and retry")
    except subprocess.TimeoutExpired:
        raise ForgeError(f"{what or fmt(cmd)}: timed out after {timeout}s", hint=hint)
    if check and res.returncode != 0:
        detail = ""
        if log is not None:
            detail = "\n--- last lines of " + str(log) + " ---\n" + tail(Path(log), 40)
        elif capture:
            detail = "\n" + ((res.stderr or "") + (res.stdout or "")).strip()[-4000:]
        raise ForgeError(f"{what or 'command'} failed (exit {res.returncode}): {fmt(cmd)}{detail}",
                         hint=hint)
    return res


def output(cmd: Sequence[str | os.PathLike], **kw) -> str:
    """stdout of a command that must succeed, stripped."""
    return run(cmd, capture=True, **kw).stdout.strip()


def last_line(res: subprocess.CompletedProcess, most: int = 200) -> str:
    """The last line a captured command printed (a Python's error, after its traceback), for a one-line message."""
    said = [x.strip() for x in ((res.stderr or "") + "\n" + (res.stdout or "")).splitlines() if x.strip()]
    return said[-1][:most] if said else "no output"


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


# --- long-running processes (the server) -------------------------------------------------------

def _terminate_with(parent: int):
    """A preexec function: the child gets SIGTERM when `parent` dies (Linux; elsewhere nothing)."""
    def hook() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
            if os.getppid() != parent:       # the parent died before the call
                os.kill(os.getpid(), signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    return hook


def start(cmd: Sequence[str | os.PathLike], *, log: Path, env: Mapping[str, str] | None = None,
          cwd: str | Path | None = None, what: str | None = None, hint: str | None = None,
          die_with_parent: bool = False) -> subprocess.Popen:
    """Start a long-running command in its own process group (so it can be stopped as a whole),
    output appended to `log`. `env` is merged over os.environ. With `die_with_parent`, the command
    is sent SIGTERM when this process dies, even by SIGKILL (Linux)."""
    cmd = [str(c) for c in cmd]
    full_env = merged_env(env)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as fh:
        fh.write(f"$ {fmt(cmd)}\n")
        fh.flush()
        try:
            return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=cwd, env=full_env, start_new_session=True, text=True,
                                    preexec_fn=_terminate_with(os.getpid()) if die_with_parent else None)
        except FileNotFoundError:
            raise ForgeError(f"{what or 'command'}: '{cmd[0]}' is not installed or not on PATH",
                             hint=hint or f"install {cmd[0]} and retry")


def start_piped(cmd: Sequence[str | os.PathLike], *, stderr_log: Path, env: Mapping[str, str] | None = None,
                what: str | None = None, hint: str | None = None) -> subprocess.Popen:
    """Start a long-running command in its own process group that talks over its stdin/stdout (text,
    line by line); stderr is appended to `stderr_log`. `env` is merged over os.environ."""
    cmd = [str(c) for c in cmd]
    full_env = merged_env(env)
    Path(stderr_log).parent.mkdir(parents=True, exist_ok=True)
    with open(stderr_log, "a") as fh:
        try:
            return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fh, text=True,
                                    env=full_env, start_new_session=True)
        except FileNotFoundError:
            raise ForgeError(f"{what or 'command'}: '{cmd[0]}' is not installed or not on PATH",
                             hint=hint or f"install {cmd[0]} and retry")


def replace_process(cmd: Sequence[str | os.PathLike], *, env: Mapping[str, str] | None = None) -> None:
    """Become `cmd` (exec): the command takes this process's place, e.g. as a container's PID 1.
    `env` is merged over os.environ."""
    cmd = [str(c) for c in cmd]
    full_env = merged_env(env)
    try:
        os.execvpe(cmd[0], cmd, full_env)
    except FileNotFoundError:
        raise ForgeError(f"'{cmd[0]}' is not installed or not on PATH", hint=f"install {cmd[0]} and retry")


def kill_group(pgid: int) -> None:
    """SIGKILL a process group at once (a worker that does not answer)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), to tell a process from a later
    one that reused its pid; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def command_line(pid: int, wait_s: float = 0.0) -> list[str] | None:
    """The arguments process `pid` runs with (/proc/<pid>/cmdline), or None when it is gone. A process
    that has just been started may show none for a moment (its exec is still setting them up): with
    `wait_s`, wait up to that long for them."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        if raw or time.monotonic() >= deadline:
            return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else []
        time.sleep(0.01)


def boot_id() -> str | None:
    """This boot of the machine (a process's start time counts from the boot), or None where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if process_start_time(pid) is None:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


GONE = "gone"


def gone_how(pid: int) -> str:
    """How a recorded process that recorded_process calls GONE is gone, in words: exited, or its pid now
    names another process (a later one, or one of another boot), which is left alone."""
    if alive(pid):
        return (f"no longer runs: pid {pid} now belongs to a different process, which was left alone (nothing was "
                "signalled)")
    return "has already exited"


def recorded_process(pid: int, pgid: int, start_time: str | None, boot: str | None, tail: list[str]) -> str | None:
    """Whether process `pid` is still the one a record names: None when it is (this boot, its start time,
    a command line ending with `tail`, leader of group `pgid`); GONE when that process no longer runs (its
    pid is free or names a later process); else why the live process that answers to the record is not
    it (nothing should be signalled then)."""
    now_boot = boot_id()
    if (boot and now_boot and boot != now_boot) or process_start_time(pid) != start_time or not alive(pid):
        return GONE
    now = command_line(pid, wait_s=1.0) or []
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return GONE
    if not tail or now[-len(tail):] != list(tail):
        return f"its command line is {fmt(now)[:120]!r}, not one ending {fmt(tail)[:80]!r}"
    return f"it leads process group {group}, not the recorded group {pgid}" if group != pgid else None


def stop_group(pgid: int, *, grace_s: float = 30.0) -> str:
    """SIGTERM a process group, then SIGKILL what is left after `grace_s`. Returns how it ended."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return "already gone"
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return "terminated"
        try:
            os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return "terminated"
    return "killed"
