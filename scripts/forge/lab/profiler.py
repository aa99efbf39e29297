"""vLLM's torch profiler on the harness servers: the server arguments that arm it (idle until
/start_profile), the folder its traces go to, and the trace a /stop_profile wrote. Used by the
profiles of `e2e-gpu --profile-prefill` (forge.lab.prefill_profile, forge.lab.batch_profile)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import ForgeError

TRACES = "traces"                              # full traces stay on the machine (left out of the pack)


def trace_dir(out: Path, name: str) -> Path:
    return out / TRACES / name


def server_args(out: Path, name: str) -> list[str]:
    cfg = {"profiler": "torch", "torch_profiler_dir": str(trace_dir(out, name).resolve()), "ignore_frontend": True,
           "torch_profiler_dump_cuda_time_total": False, "torch_profiler_use_gzip": True}
    return ["--profiler-config", json.dumps(cfg)]


def traces_now(tdir: Path) -> dict[Path, int]:
    """The traces in `tdir` and their modification times, before a /start_profile."""
    return {p: p.stat().st_mtime_ns for p in tdir.rglob("*.json*")}


def new_trace(tdir: Path, before: dict[Path, int], wait_s: int = 120) -> Path:
    """The largest trace written or rewritten in `tdir` since `before` (the worker writes it after
    answering /stop_profile)."""
    new: list[Path] = []
    for _ in range(wait_s):
        new = [p for p in tdir.rglob("*.json*") if before.get(p) != p.stat().st_mtime_ns]
        if new:
            time.sleep(2)                     # let a writer still at it finish
            break
        time.sleep(1)
    if not new:
        raise ForgeError(f"{tdir}: no trace written after /stop_profile", hint="see the server log")
    return max(new, key=lambda p: p.stat().st_size)
