"""What `forge e2e-gpu` starts its servers and its client with, checked before anything is written or
started (forge.lab.preflight): each command's program there (--vllm; --client or $FORGE_BENCH_CLIENT; split as
a shell splits them), the ports the servers take free on this machine (a server an earlier invocation of the
folder left up is reused or stopped first, so its port is not counted), and where the command is vLLM's own
CLI: vLLM importable by the Python that runs it (where no bundle installs one) and, for the servers, a GPU
they can see. Each was found only after the results folder was written, as a server that never came up or
a client that failed every tier. A stand-in server or client (any other command) is checked for its
program alone: what it needs is not known here."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from .. import proc
from ..errors import ForgeError
from ..run import bench, serve
from .servers import port_of

if TYPE_CHECKING:
    from .session import Run

VLLM_MODULES = ("vllm.entrypoints.cli.main", "vllm")
# what the Python behind a vLLM command is asked: vLLM findable, and (with an argument) the cards torch sees
PROBE = ("import importlib.util, json, sys\nout = {'vllm': importlib.util.find_spec('vllm') is not None}\n"
         "if len(sys.argv) > 1:\n    try:\n        import torch\n        out['cards'] = torch.cuda.device_count()\n"
         "    except Exception as e:\n        out['cards'] = None\n        out['why'] = f'{type(e).__name__}: {e}'\n"
         "print(json.dumps(out))")


def vllm_python(launcher: list[str]) -> list[str] | None:
    """The interpreter (with what precedes `-m`) a command runs vLLM's CLI with; None where the command is
    not vLLM's CLI (a stand-in, a wrapper script) or its interpreter cannot be told."""
    for i, a in enumerate(launcher[:-1]):
        if a == "-m" and launcher[i + 1] in VLLM_MODULES:
            return launcher[:i] or None
    if len(launcher) == 1 and Path(launcher[0]).name == "vllm":
        py = bench.python_of(launcher)
        return [py] if py else None
    return None


def _program(argv: list[str], what: str, hint: str) -> None:
    if not shutil.which(argv[0]):
        raise ForgeError(f"{what}: '{argv[0]}' is not installed, not on PATH or not executable", hint=hint)


def _probe(py: list[str], env: dict[str, str], cards: bool, what: str) -> dict:
    r = proc.run([*py, "-c", PROBE, *(["cards"] if cards else [])], capture=True, check=False, env=env,
                 timeout=300, what=f"the Python of {what}")
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ForgeError(f"{what}: its Python ({proc.fmt(py)}) did not answer whether it imports vLLM "
                         f"(exit {r.returncode}): {(r.stderr.strip().splitlines() or [''])[-1][:300]}",
                         hint="give a command whose Python runs (e.g. --vllm 'python3 -m vllm.entrypoints.cli.main')") \
            from None


def check_ports(run: Run, to_start: list[str], left_up: set[int]) -> None:
    """Each port a server starts on (--first-port, then one per profile) free to bind on every interface (as
    vLLM binds it: the command sets no --host), but for those of servers the folder's record says are up (`left_up`:
    reused, or stopped before the starts)."""
    for name in to_start:
        port = port_of(run, name)
        if port in left_up:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
                continue
            except OSError as e:
                why = ("below 1024, where only root may listen" if e.errno == errno.EACCES else
                       "in use by another process" if e.errno == errno.EADDRINUSE else
                       f"not free to listen on ({e.strerror})")
        raise ForgeError(f"--first-port {run.args.first_port}: port {port}, the {name} server's, is {why}",
                         hint=f"stop what holds it (`ss -ltnp | grep :{port}`), or give another --first-port")


def _who(option: str, value: str | None, env_var: str | None, default: str) -> str:
    if value is not None:
        return f"{option} {value!r}"
    if env_var and os.environ.get(env_var):
        return f"${env_var} {os.environ[env_var]!r}"
    return default


def check_commands(run: Run, to_start: list[str], client: bool, memory: tuple[list[int], str] | None) -> dict:
    """The servers' command (where any starts) and the client's (`client`: where any tier runs); returns
    what was found of the GPU where no card tool answered (`memory` None), for the run's record."""
    args, env = run.args, run.child_env
    if client:
        argv = bench.client_launcher(args.client)
        what = _who("--client", args.client, bench.CLIENT_ENV, "the client's vLLM")
        _program(argv, what, "give the command that runs vLLM's CLI for `bench serve`, e.g. --client "
                             "'python3 -m vllm.entrypoints.cli.main'")
        py = vllm_python(argv)
        if py and not args.bundle and not _probe(py, env, False, what)["vllm"]:
            raise ForgeError(f"{what}: vLLM is not installed for {proc.fmt(py)}, and --bundle '' installs none; the "
                             "tiers run its `vllm bench serve`", hint="give --bundle (the one `make gpu-bundle` "
                                                                     "built), or a --client whose Python has vLLM")
    if not to_start:
        return {}
    argv = serve.native_launcher(run.vllm_cmd)         # this Python's vLLM where --vllm is not given
    what = _who("--vllm", args.vllm, None, "the servers' vLLM")
    _program(argv, what, "give the command that runs vLLM's CLI, e.g. --vllm 'python3 -m vllm.entrypoints.cli.main'")
    py = vllm_python(argv)
    if not py:
        return {}
    if memory is not None and not memory[0]:
        raise ForgeError(f"{what}: no GPU visible to the servers ({memory[1]} leaves none)",
                         hint="make a card visible (CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES)")
    if memory is not None and args.bundle:
        return {}
    ans = _probe(py, env, memory is None, what)
    if not args.bundle and not ans["vllm"]:
        raise ForgeError(f"{what}: vLLM is not installed for {proc.fmt(py)}, and --bundle '' installs none",
                         hint="give --bundle (the one `make gpu-bundle` built), or --vllm with a command that runs "
                              "an installed vLLM")
    if memory is not None:
        return {}
    if not ans.get("cards"):
        seen = (f"torch does not import in {proc.fmt(py)} ({ans.get('why', '')[:200]})" if ans.get("cards") is None
                else f"torch.cuda.device_count() is 0 in {proc.fmt(py)}")
        raise ForgeError(f"{what}: no GPU for the servers: none of nvidia-smi, hy-smi or rocm-smi answered, and "
                         f"{seen}", hint="run e2e-gpu on a GPU machine, its cards visible (CUDA_VISIBLE_DEVICES "
                                         "or HIP_VISIBLE_DEVICES)")
    return {"cards": ans["cards"], "source": f"torch.cuda.device_count() in {proc.fmt(py)}"}
