"""Stack samples of the servers' Python processes during a run (`forge e2e-gpu --stack-every SECONDS`):
where each process's main thread was, sample by sample. harness/gpu/stacks/sitecustomize.py, put on the
servers' PYTHONPATH, makes each process write its threads' stacks every SECONDS (faulthandler's watchdog, which
samples a process held in a long call too) to <out>/stacks/<profile>/stacks-<pid>.txt; after the run they are
read into <out>/stacks.json (per process: its role, the samples, the main thread's innermost frames by count and
sample by sample) once the servers are down, and a section of summary.md. The raw files stay out of the packed
archive (their size); the digest goes in. A run killed before its end leaves the raw files in <out>/stacks/ and no
digest."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterable

from .. import options, paths

SITE = paths.ROOT / "harness" / "gpu" / "stacks"
FOLDER = "stacks"
MOST_S, LEAST_S = 60.0, 0.1
TOP = 6                              # frames per process in summary.md
HEADER = re.compile(r"^# forge stacks pid (\d+) ppid (\d+) every ([0-9.]+) s(?: from \S+ main (0x[0-9a-f]+))?")
THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
FRAME = re.compile(r'^\s+File (?:"(.*)"|(\?\?\?)), line (\d+|\?\?\?) in (.*)$')
# functions on a process's main-thread stack that say what it is, in this order: a forked process keeps its
# parent's outer frames (a worker the engine core's, an engine core the API server's command line)
ROLES = (("worker", ("worker_main",)), ("engine core", ("run_engine_core", "run_busy_loop")),
         ("API server", ("run_server", "serve_http", "run_server_worker", "cmd", "main")))
API_PATHS = ("entrypoints/cli/", "entrypoints/openai/")


def register_options(p) -> None:
    p.add_argument("--stack-every", type=options.number_in(LEAST_S, MOST_S, "seconds", "2"), metavar="SECONDS",
                   help="sample the Python stacks of every server process each SECONDS "
                        f"({LEAST_S:g}-{MOST_S:g}; harness/gpu/stacks/sitecustomize.py on the servers' PYTHONPATH): "
                        f"where each process's main thread was, in {FOLDER}.json and summary.md. A diagnostic: "
                        "the sampler reads threads' frames without the GIL (CPython has crash and hang reports "
                        "around it); compare tok/s only between runs without it")


def server_env(out: Path, name: str, every: float | None) -> dict[str, str]:
    """What a server's command records for stack samples (nothing without --stack-every): the period and the
    folder, which the server's start makes (the samples are written only where it exists)."""
    if not every:
        return {}
    return {"FORGE_STACK_EVERY": f"{every:g}", "FORGE_STACK_DIR": str(out / FOLDER / name)}


def process_env(child_env: dict[str, str], every: float | None) -> dict[str, str]:
    """The children's process environment (the bundle's site folder on PYTHONPATH, never recorded in a run) with
    the sampler's folder first on the path, where --stack-every asks for it; the site stays next. Only a process
    whose environment also has server_env's variables (the servers) is sampled."""
    if not every:
        return child_env
    base = child_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return {**child_env, "PYTHONPATH": str(SITE) + (os.pathsep + base if base else "")}


Frame = tuple[str, str, bool]           # (file:line, function, in Python's standard library)


def _samples(lines: Iterable[str]) -> tuple[dict, list[list[Frame]]]:
    """(header, [the main thread's frames, innermost first, per sample]) of one process's lines. The main
    thread is the one the header names (the thread that armed the sampler, or that forked the process); in a
    file without that, the last thread listed whose outermost frame is not threading's _bootstrap (faulthandler
    lists the newest thread first). A sample without the main thread (past the 100 threads a dump holds) is
    an empty list."""
    head: dict = {}
    out: list[list[Frame]] = []
    threads: list[tuple[str, list[Frame]]] = []
    cur: list[Frame] | None = None

    def close() -> None:
        if not threads:
            return
        main = head.get("main")
        if main:
            out.append(next((fr for ident, fr in threads if int(ident, 16) == int(main, 16)), []))
        else:
            found = [fr for _, fr in threads if fr and fr[-1][1] != "_bootstrap"]
            out.append(found[-1] if found else [])

    for line in lines:
        line = line.rstrip("\n")
        m = HEADER.match(line)
        if m:
            head = {"pid": int(m.group(1)), "ppid": int(m.group(2)), "every_s": float(m.group(3)),
                    **({"main": m.group(4)} if m.group(4) else {})}
        elif line.startswith("# argv "):
            head["argv"] = line[7:]
        elif line.startswith("# forked from "):
            head["argv"] = f"(forked from {line[14:]})"
        elif line.startswith("Timeout ("):
            close()
            threads, cur = [], None
        elif THREAD.match(line):
            cur = []
            threads.append((THREAD.match(line).group(1), cur))
        else:
            f = FRAME.match(line)
            if f and cur is not None:
                path = f.group(1) or "???"
                stdlib = path.startswith("<frozen") or ("/lib/python" in path and "-packages/" not in path)
                cur.append((f"{_short(path)}:{f.group(3)}", f.group(4), stdlib))
    close()
    return head, out


def _short(path: str) -> str:
    for mark in ("site-packages/", "/forge-e2e-site/", "/lib/python"):
        if mark in path:
            return path.split(mark, 1)[1]
    return path


def _role(samples: list[list[Frame]]) -> str:
    """A process's role from the functions on its main thread's stack (the API server's only where they are
    vLLM's entry points: "main" and "cmd" are common names)."""
    funcs = {func for s in samples for _, func, _ in s}
    api = {func for s in samples for where, func, _ in s if any(p in where for p in API_PATHS)}
    for role, marks in ROLES:
        if any(m in (api if role == "API server" else funcs) for m in marks):
            return role
    return "other"


def collect(out: Path) -> dict:
    """{profile: [per process: pid, ppid, role, argv, every_s, samples, top [[frame, count]], timeline, and
    top_code / timeline_code: the same of the innermost frame outside Python's standard library (where in vLLM,
    or the program, a thread waiting in selectors or asyncio was)]} from <out>/stacks/, written to
    <out>/stacks.json; {} where there are none."""
    res: dict = {}
    for folder in sorted(p for p in (out / FOLDER).glob("*") if p.is_dir()):
        procs = []
        for f in sorted(folder.glob("stacks-*.txt")):
            with open(f, errors="replace") as fh:        # line by line: a long run's file is large
                head, samples = _samples(fh)
            inner = [_name(s[0]) if s else "(no main thread)" for s in samples]
            code = [next((_name(fr) for fr in s if not fr[2]), "(only the standard library)") if s
                    else "(no main thread)" for s in samples]
            procs.append({**head, "role": _role(samples), "samples": len(samples),
                          "top": Counter(inner).most_common(TOP), "timeline": inner,
                          "top_code": Counter(code).most_common(TOP), "timeline_code": code})
        if procs:
            res[folder.name] = procs
    if res:
        (out / f"{FOLDER}.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def _name(fr: Frame) -> str:
    return f"{fr[1]} ({fr[0]})"


def read(out: Path) -> dict:
    """The digest collect() wrote to <out>/stacks.json; {} before (or without) one."""
    try:
        return json.loads((out / f"{FOLDER}.json").read_text())
    except (OSError, ValueError):
        return {}


def summary_lines(digest: dict) -> list[str]:
    """summary.md's section: per profile and process (with 5 samples or more), the main thread's innermost
    frames, and its innermost frames outside the standard library, by share of the samples."""
    rows = []
    for name, procs in digest.items():
        for p in procs:
            if p.get("samples", 0) < 5:
                continue
            cells = ["; ".join(f"`{frame}` {100 * n / p['samples']:.0f} %" for frame, n in p.get(k) or [])
                     .replace("|", "/") for k in ("top", "top_code")]
            rows.append(f"| {name} | {p['role']} | {p.get('pid', '?')} | {p['samples']} | {cells[0]} | {cells[1]} |")
    if not rows:
        return []
    return ["", f"## Where the servers' processes were ({FOLDER}.json: the main thread's innermost frame per sample)",
            "", "| profile | process | pid | samples | innermost frames, share of samples | innermost outside the "
            "standard library |", "|---|---|---|---|---|---|", *rows]
