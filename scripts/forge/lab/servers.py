"""The profiles' servers side by side on one GPU: started through `run.serve.start_server` (the
profile's checked command plus the harness's arguments), waited for, warmed, and stopped; a failing
server is recorded against its name and the run goes on with the others. A server an earlier
invocation of the folder left up (--keep-servers) is reused when it runs exactly the command this
invocation would start and answers /health; any other server recorded in the folder is stopped."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import paths, proc, ui
from ..errors import ForgeError
from ..run import runs, serve, synth
from . import final_round, profiler, stacks
from .client import complete
from .serverlog import log_facts

if TYPE_CHECKING:
    from .session import Run

WARM_PROMPT_TOKENS = 9000                          # one full 8192-token prefill chunk and a ragged one


def start_all(run: Run, model: Path, names: list[str]) -> list[str]:
    """Start the servers side by side; returns the profiles whose server came up. With a fixed
    KV-cache size (no memory profiling) they all start at once and warm up together; otherwise the
    first starts alone (its memory profile must not see another process allocating) and the others
    start while it compiles its kernels on its first request."""
    if run.h["side_by_side"].get("kv_cache_memory_bytes") or run.servers:
        return start_all_at_once(run, model, names)
    live: list[str] = []
    waited: set[str] = set()
    warm_thread = None
    for name in names:
        st = _launch(run, model, name)
        if st is None:
            continue
        if warm_thread is None:           # no server is up yet: this one starts alone
            waited.add(name)
            if guarded(run, name, wait_ready, run, name):
                live.append(name)
                warm_thread = threading.Thread(target=guarded, args=(run, name, warm, run, name, model), daemon=True)
                warm_thread.start()
    for name in names:
        if name in run.servers and name not in waited:
            waited.add(name)
            if guarded(run, name, wait_ready, run, name):
                live.append(name)
    if warm_thread is not None:
        warm_thread.join()
    for name in live[1:]:
        guarded(run, name, warm, run, name, model)
    return [n for n in names if n in live]


def port_of(run: Run, name: str) -> int:
    """A profile's port: its place in the run's profiles after --first-port, the same in every
    invocation of the folder (a kept server is found where it was started)."""
    return run.args.first_port + run.names.index(name)


def _launch_parts(run: Run, name: str) -> tuple[list[str], dict[str, str]]:
    extra_env = {"VLLM_LOGGING_LEVEL": "INFO"}
    if run.triton_cache:
        extra_env["TRITON_CACHE_DIR"] = run.triton_cache
    hargs = run.hargs + final_round.capacity_args(run.capacity, name)
    if run.args.profile_prefill:          # not part of the tiers' identity: the profiler idles until asked
        hargs = hargs + profiler.server_args(run.out, name)
    if run.args.stack_every:
        extra_env.update(stacks.server_env(run.out, name, run.args.stack_every))
    return hargs, extra_env


def plan(run: Run, model: Path, name: str) -> dict:
    """What this invocation would start for `name`, in the terms a server's state file keeps: a server
    left up is reused only when it matches this exactly."""
    hargs, extra_env = _launch_parts(run, name)
    port = port_of(run, name)
    rendered = serve.render(run.profiles[name], model, run.contest, run.rnd, run.serve_tier, cards=False)
    launch = serve.launch_command(rendered, image=None, vllm_cmd=run.vllm_cmd, port=port, container="",
                                  shm_size="") + hargs
    return {"profile": name, "port": port, "launch": launch, "env": {**rendered["env"], **extra_env},
            "process_env": dict(run.child_env), "bundle_wheel_sha256": run.identity.get("bundle_wheel_sha256")}


def check_cards(run: Run, model: Path, name: str) -> None:
    """A --finals-servers server's cards (one per rank of its topology), visible to it: checked as its
    start checks them, so a machine short of cards is refused before the results folder is made."""
    if run.rnd is not None:
        _, extra_env = _launch_parts(run, name)
        serve.render(run.profiles[name], model, run.contest, run.rnd, run.serve_tier,
                     env={**run.child_env, **extra_env})


def _launch(run: Run, model: Path, name: str) -> dict | None:
    hargs, extra_env = _launch_parts(run, name)
    if "FORGE_STACK_DIR" in extra_env:
        stacks.fresh_folder(Path(extra_env["FORGE_STACK_DIR"]))
    prof = run.profiles[name]
    state_file = state_path(run.out, name)
    st = guarded(run, name, functools.partial(
        serve.start_server, prof, model, contest=run.contest, port=port_of(run, name), run_id=name,
        vllm_cmd=run.vllm_cmd, wait=False, run_dir=run.run_dir(name), process_env=run.child_env,
        state_file=state_file, harness_args=hargs, extra_env=extra_env, rnd=run.rnd, tier=run.serve_tier))
    if st is not None:
        st["t_start"] = time.monotonic()
        # the state file also says what the server runs, for an invocation that may reuse it
        runs.write_json(state_file, {**{k: v for k, v in st.items() if k != "popen"},
                                     "reuse": plan(run, model, name)})
        run.servers[name] = st
    return st


def adopt_or_stop(run: Run, model: Path) -> list[str]:
    """Servers an earlier invocation of this folder left running (--keep-servers, or a run killed
    before it could stop them: they run in their own sessions): reuse each that runs exactly what
    this invocation would start and answers /health; stop the others (they would hold the GPU and
    the ports). Returns the profiles reused."""
    adopted = []
    for sf, st, why in _left_up(run, model):
        if st is None:
            sf.unlink(missing_ok=True)        # unreadable, or that server has exited
            continue
        name = st.get("profile")
        if why is None:
            # the paths this run reads and packs are its own, never ones the record names
            st.update(popen=None, reused=True, ready_s="up already", warm_s="—", state_file=str(sf),
                      log=str(run.run_dir(name, create=False) / "server.log"))
            run.servers[name] = st
            adopted.append(name)
            run.step(f"server {name} reused: left up by an earlier invocation (pid {st['pid']}, port {st['port']})")
            continue
        ui.warn(f"stopping the {name} server an earlier invocation left running (pid {st['pid']}): {why}")
        serve.stop_server(st, quiet=True, state_file=sf)
        sf.unlink(missing_ok=True)
    return adopted


def _left_up(run: Run, model: Path) -> list[tuple[Path, dict | None, str | None]]:
    """The servers recorded in the folder, read without changing anything: (state file, its record or None
    where it is unreadable or that server has exited, None where it is reused or why it is not)."""
    out = []
    for sf in sorted((run.out / "state").glob("*.json")):
        try:
            st = runs.read_json(sf)
        except ForgeError:
            out.append((sf, None, None))
            continue
        if not isinstance(st, dict) or not isinstance(st.get("pid"), int) or not st.get("start_time") or \
                proc.process_start_time(st["pid"]) != st["start_time"]:
            out.append((sf, None, None))
            continue
        name = st.get("profile")
        url = f"http://{st.get('host')}:{st.get('port')}{st.get('health')}"
        want = plan(run, model, name) if name in run.names else None
        why = ("not one of this run's profiles" if want is None else
               "it runs another command than this invocation's" if st.get("reuse") != want else
               None if serve.health_ok(url) else "it does not answer /health")
        out.append((sf, st, why))
    return out


def reusable(run: Run, model: Path) -> tuple[list[str], set[int]]:
    """The profiles whose server adopt_or_stop would reuse, found before anything is written or stopped
    (the checks before the servers start count them as up), and the ports of every server recorded as up
    (reused, or stopped before the others start: their ports are not another process's)."""
    left = [(st, why) for _, st, why in _left_up(run, model) if st is not None]
    return ([st["profile"] for st, why in left if why is None],
            {st["port"] for st, _ in left if isinstance(st.get("port"), int)})


def stop_left_servers(out: Path) -> int:
    """Stop the servers recorded in `out`/state (left up by --keep-servers); returns how many were up."""
    n = 0
    for sf in sorted((out / "state").glob("*.json")):
        try:
            st = runs.read_json(sf)
        except ForgeError:
            sf.unlink()
            continue
        if isinstance(st, dict) and isinstance(st.get("pid"), int) and st.get("start_time") and \
                proc.process_start_time(st["pid"]) == st["start_time"]:
            ui.info(f"stopping the {st.get('profile')} server (pid {st['pid']}, port {st.get('port')})")
            serve.stop_server(st, quiet=True, state_file=sf)
            n += 1
        sf.unlink(missing_ok=True)
    return n


def start_all_at_once(run: Run, model: Path, names: list[str]) -> list[str]:
    for name in names:
        _launch(run, model, name)
    live = [n for n in names if n in run.servers and guarded(run, n, wait_ready, run, n)]
    threads = [threading.Thread(target=guarded, args=(run, n, warm, run, n, model), daemon=True) for n in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return live


def last_error(run: Run, name: str) -> str:
    """The first line of the last error recorded against server `name` (guarded), cut for one error line."""
    err = ((run.summary.get("server_errors") or {}).get(name) or ["no error recorded"])[-1]
    return (err.splitlines() or [""])[0][:300]


def not_up_error(run: Run, names: list[str]) -> ForgeError:
    """The run's failure (exit 1: it ran, and failed) where the servers of `names` never came up: each one's
    last error and its log, and what the run could not measure for it."""
    def one(n: str) -> str:
        log = run.servers.get(n, {}).get("log")
        return f"{n}: {last_error(run, n)}; " + (f"its log: {paths.rel(Path(log))}" if log else
                                                 "it did not start, so it wrote no log")
    live = [n for n in run.servers if n not in names]
    who = f"the {names[0]} server" if len(names) == 1 else f"the servers of {', '.join(names)}"
    it = "it" if len(names) == 1 else "them"
    what = ("nothing was measured" if not live else
            f"nothing was measured on {it}, so no profile is scored against the reference ({run.ref})"
            if run.ref in names else f"nothing was measured on {it}, so {' and '.join(names)} got no score")
    return ForgeError(f"{who} did not come up ({'; '.join(one(n) for n in names)}): {what}",
                      hint=f"read the log, fix the cause and run the same --out again ({paths.rel(run.out)}): the tiers "
                           "measured are kept; summary.json server_errors has each error whole", exit_code=1)


def guarded(run: Run, name: str, fn, *a):
    """Run one step for server `name`; a failure is recorded against that server (its log is kept)
    and the run goes on with the others."""
    try:
        return fn(*a)
    except Exception as e:            # recorded against the server; KeyboardInterrupt still ends the run
        msg = e.message if isinstance(e, ForgeError) else f"{type(e).__name__}: {e}"
        with run.lock:
            run.summary.setdefault("server_errors", {}).setdefault(name, []).append(msg[-3000:])
            what = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "step")
            run.step(f"server {name}: {what} failed", error=msg[-500:])
        return None


def wait_ready(run: Run, name: str) -> bool:
    st = run.servers[name]
    if st.get("reused"):
        return True
    serve.wait_healthy(st["popen"], st, timeout=max(5.0, run.left()))
    st["ready_s"] = round(time.monotonic() - st["t_start"], 1)
    run.step(f"server {name} ready", seconds=st["ready_s"], port=st["port"], **log_facts(Path(st["log"])))
    return True


def warm(run: Run, name: str, model: Path) -> None:
    st = run.servers[name]
    if st.get("reused"):
        return                            # warmed by the invocation that started it
    t = time.monotonic()
    prompt = synth.synthetic_prompt(model, WARM_PROMPT_TOKENS, "warm")
    complete(st, prompt, 16, timeout=max(5.0, run.left()))
    st["warm_s"] = round(time.monotonic() - t, 1)
    run.step(f"server {name} warmed (first request: Triton compile and autotune)", seconds=st["warm_s"])


def state_path(out: Path, name: str) -> Path:
    """The record of server `name` of the run writing into `out` (derived here, never read from a record)."""
    return out / "state" / f"{paths.plain_name(name, 'a server name')}.json"


def stop_all(servers: dict, out: Path) -> None:
    """Stop the servers at once (each gets a short grace), so the end of a run stays short."""
    ts = [threading.Thread(target=serve.stop_server, args=(st, True, 5.0, state_path(out, name)))
          for name, st in servers.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
