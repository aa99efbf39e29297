"""Stack samples of the servers' Python processes during a run (`forge e2e-gpu --stack-every SECONDS`):
where each process's main thread was, sample by sample. harness/gpu/stacks/sitecustomize.py, put on the
servers' PYTHONPATH, makes each process write its threads' stacks every SECONDS (a sampler thread, with the
GIL; each sample says how late it came, so a process held in one C call shows as a late sample) to
<out>/stacks/<profile>/stacks-<pid>.txt; after the run they are read into <out>/stacks.json (per process: its
role, the samples, the main thread's innermost frames by count and sample by sample, the late samples) once the
servers are down, and a section of summary.md. The raw files stay out of the packed archive (their size); the
digest goes in. A run killed before its end leaves the raw files in <out>/stacks/ and no digest."""

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
SAMPLE = re.compile(r"^Sample at ([0-9.]+) late (-?[0-9.]+)")
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
                        f"where each process's main thread was, and how long it could not run Python (a late "
                        f"sample), in {FOLDER}.json and summary.md. A diagnostic: a sampler thread in each process "
                        "takes the GIL for each sample; compare tok/s only between runs without it")


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


def _samples(lines: Iterable[str]) -> tuple[dict, list[list[Frame]], list[float]]:
    """(header, [the main thread's frames, innermost first, per sample], [how late each sample came, s]) of one
    process's lines. A sample late by more than the period means the process could not run Python for about that
    long before it (its GIL held in one C call). The main thread is the one the header names (the thread that
    armed the sampler, or that forked the process); a sample without it is an empty list."""
    head: dict = {}
    out: list[list[Frame]] = []
    late: list[float] = []
    threads: list[tuple[str, list[Frame]]] = []
    cur: list[Frame] | None = None

    def close() -> None:
        if len(out) < len(late):                     # the open sample, once
            main = int(head.get("main", "-1"), 16)
            out.append(next((fr for ident, fr in threads if int(ident, 16) == main), []))

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
        elif SAMPLE.match(line):
            close()
            threads, cur = [], None
            late.append(float(SAMPLE.match(line).group(2)))
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
    return head, out, late


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


def _next_number(folder: Path, prefix: str, suffix: str) -> int:
    """One more than the highest <prefix><n><suffix> in folder (not the count: after a user removed one, a count
    would name a kept file again and the rename would replace it)."""
    nums = (p.name[len(prefix):len(p.name) - len(suffix)] for p in folder.glob(f"{prefix}*{suffix}"))
    return 1 + max((int(n) for n in nums if n.isdigit()), default=0)


def fresh_folder(folder: Path) -> None:
    """A server's sample folder before a new start of it: the files an earlier start left there (its digest, if
    any, is in that run's stacks.json) go to earlier/<n>/ inside it, so the new start's digest holds only its own
    processes and nothing is deleted."""
    folder.mkdir(parents=True, exist_ok=True)
    old = sorted(folder.glob("stacks-*.txt"))
    if old:
        dest = folder / "earlier" / str(_next_number(folder / "earlier", "", ""))
        dest.mkdir(parents=True)
        for f in old:
            f.rename(dest / f.name)


def settle(out: Path, every: float | None) -> dict:
    """At a run's end: with --stack-every the digest (collect); without it, a digest an earlier sampled run left
    in <out> moves into <out>/stacks/ (earlier-<n>.json, out of the archive and of summary.md), so the folder does
    not show samples this run did not take."""
    if every:
        return collect(out)
    stale = out / f"{FOLDER}.json"
    if stale.is_file():
        (out / FOLDER).mkdir(exist_ok=True)
        stale.rename(out / FOLDER / f"earlier-{_next_number(out / FOLDER, 'earlier-', '.json')}.json")
    return {}


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
                head, samples, late = _samples(fh)
            inner = [_name(s[0]) if s else "(no main thread)" for s in samples]
            code = [next((_name(fr) for fr in s if not fr[2]), "(only the standard library)") if s
                    else "(no main thread)" for s in samples]
            every = head.get("every_s") or 0.0
            held = sorted(([round(x, 3), inner[i], code[i]] for i, x in enumerate(late) if x > every),
                          key=lambda h: -h[0])
            procs.append({**head, "role": _role(samples), "samples": len(samples),
                          "top": Counter(inner).most_common(TOP), "timeline": inner,
                          "top_code": Counter(code).most_common(TOP), "timeline_code": code,
                          "late_s": [round(x, 3) for x in late], "held": held[:TOP], "held_count": len(held)})
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
    frames, its innermost frames outside the standard library, by share of the samples, and the samples that
    came more than a period late (the process held that long; where its main thread was when it let go)."""
    rows = []
    for name, procs in digest.items():
        for p in procs:
            if p.get("samples", 0) < 5:
                continue
            cells = ["; ".join(f"`{frame}` {100 * n / p['samples']:.0f} %" for frame, n in p.get(k) or [])
                     .replace("|", "/") for k in ("top", "top_code")]
            held = "; ".join(f"{h[0]:.1f} s, then at `{h[2]}`" for h in p.get("held") or [])
            if p.get("held_count", 0) > len(p.get("held") or []):
                held += f" (of {p['held_count']})"
            rows.append(f"| {name} | {p['role']} | {p.get('pid', '?')} | {p['samples']} | {cells[0]} | {cells[1]} | "
                        f"{held.replace('|', '/') or '—'} |")
    if not rows:
        return []
    return ["", f"## Where the servers' processes were ({FOLDER}.json: the main thread's innermost frame per sample)",
            "", "| profile | process | pid | samples | innermost frames, share of samples | innermost outside the "
            "standard library | samples late by more than a period (held), then where |", "|---|---|---|---|---|---|---|",
            *rows]
