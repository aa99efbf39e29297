"""The profiles' servers side by side on one GPU: started through `run.serve.start_server` (the
profile's checked command plus the harness's arguments), waited for, warmed, and stopped; a failing
server is recorded against its name and the run goes on with the others."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import proc, ui
from ..errors import ForgeError
from ..run import runs, serve, synth
from . import prefill_profile
from .client import complete
from .serverlog import log_facts

if TYPE_CHECKING:
    from .session import Run

WARM_PROMPT_TOKENS = 9000                          # one full 8192-token prefill chunk and a ragged one


def start_all(run: Run, model: Path, names: list[str], site: Path | None) -> list[str]:
    """Start the servers side by side; returns the profiles whose server came up. With a fixed
    KV-cache size (no memory profiling) they all start at once and warm up together; otherwise the
    first starts alone (its memory profile must not see another process allocating) and the others
    start while it compiles its kernels on its first request."""
    if run.h.get("kv_cache_memory_bytes"):
        return start_all_at_once(run, model, names)
    live: list[str] = []
    waited: set[str] = set()
    warm_thread = None
    for i, name in enumerate(names):
        st = _launch(run, model, name, i)
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


def _launch(run: Run, model: Path, name: str, i: int) -> dict | None:
    args = run.args
    extra_env = {"VLLM_LOGGING_LEVEL": "INFO"}
    if run.triton_cache:
        extra_env["TRITON_CACHE_DIR"] = run.triton_cache
    hargs = run.hargs
    if run.args.profile_prefill:          # not part of the rounds' identity: the profiler idles until asked
        hargs = hargs + prefill_profile.server_args(run.out, name)
    run.summary["harness"] = {"server_args": hargs, "env": extra_env}
    prof = run.profiles[name]
    st = guarded(run, name, functools.partial(
        serve.start_server, prof, model, contest=run.contest, port=args.first_port + i, run_id=name,
        vllm_cmd=run.vllm_cmd, wait=False, run_dir=run.run_dir(name), process_env=run.child_env, state_file=run.out / "state" / f"{name}.json",
        harness_args=hargs, extra_env=extra_env))
    if st is not None:
        st["t_start"] = time.monotonic()
        run.servers[name] = st
    return st


def start_all_at_once(run: Run, model: Path, names: list[str]) -> list[str]:
    for i, name in enumerate(names):
        _launch(run, model, name, i)
    live = [n for n in names if n in run.servers and guarded(run, n, wait_ready, run, n)]
    threads = [threading.Thread(target=guarded, args=(run, n, warm, run, n, model), daemon=True) for n in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return live


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
    serve.wait_healthy(st["popen"], st, timeout=max(5.0, run.left()))
    st["ready_s"] = round(time.monotonic() - st["t_start"], 1)
    run.step(f"server {name} ready", seconds=st["ready_s"], port=st["port"], **log_facts(Path(st["log"])))
    return True


def warm(run: Run, name: str, model: Path) -> None:
    st = run.servers[name]
    t = time.monotonic()
    prompt = synth.synthetic_prompt(model, WARM_PROMPT_TOKENS, "warm")
    complete(st, prompt, 16, timeout=max(5.0, run.left()))
    st["warm_s"] = round(time.monotonic() - t, 1)
    run.step(f"server {name} warmed (first request: Triton compile and autotune)", seconds=st["warm_s"])


def stop_stale_servers(out: Path) -> None:
    """Servers an interrupted invocation of this folder left running (a killed run cannot stop
    them: they run in their own sessions) would hold the GPU and the ports."""
    for sf in sorted((out / "state").glob("*.json")):
        try:
            st = runs.read_json(sf)
        except ForgeError:
            sf.unlink()
            continue
        if proc.process_start_time(st["pid"]) == st["start_time"]:
            ui.warn(f"stopping the {st.get('profile')} server an earlier invocation left running (pid {st['pid']})")
            serve.stop_server(st, quiet=True)
        sf.unlink(missing_ok=True)


def stop_all(servers: dict) -> None:
    """Stop the servers at once (each gets a short grace), so the end of a run stays short."""
    ts = [threading.Thread(target=serve.stop_server, args=(st, True, 5.0)) for st in servers.values()]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
