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

from .. import options, paths

SITE = paths.ROOT / "harness" / "gpu" / "stacks"
FOLDER = "stacks"
MOST_S, LEAST_S = 60.0, 0.1
TOP = 6                              # frames per process in summary.md
HEADER = re.compile(r"^# forge stacks pid (\d+) ppid (\d+) every ([0-9.]+) s")
FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
ROLES = (("engine core", ("v1/engine/core.py",)), ("API server", ("entrypoints/openai", "entrypoints/cli", "uvicorn")),
         ("worker", ("v1/worker", "v1/executor")))


def register_options(p) -> None:
    p.add_argument("--stack-every", type=options.number_in(LEAST_S, MOST_S, "seconds", "2"), metavar="SECONDS",
                   help="sample the Python stacks of every server process each SECONDS "
                        f"({LEAST_S:g}-{MOST_S:g}; harness/gpu/stacks/sitecustomize.py on the servers' PYTHONPATH): "
                        f"where each process's main thread was, in {FOLDER}.json and summary.md")


def server_env(out: Path, name: str, every: float | None, base_pythonpath: str) -> dict[str, str]:
    """The environment a server gets for stack samples (nothing without --stack-every); the server's start
    makes FORGE_STACK_DIR (the samples are written only where it exists)."""
    if not every:
        return {}
    folder = out / FOLDER / name
    return {"FORGE_STACK_EVERY": f"{every:g}", "FORGE_STACK_DIR": str(folder),
            "PYTHONPATH": str(SITE) + (os.pathsep + base_pythonpath if base_pythonpath else "")}


Frame = tuple[str, str, bool]           # (file:line, function, in Python's standard library)


def _samples(text: str) -> tuple[dict, list[list[Frame]]]:
    """(header, [the main thread's frames, innermost first, per sample]) of one process's file. The main
    thread is the one whose outermost frame is not threading's _bootstrap (every thread threading starts ends
    there; the main one in a module's code or in runpy's, for `python -m`)."""
    head: dict = {}
    out: list[list[Frame]] = []
    threads: list[list[Frame]] = []
    cur: list[Frame] | None = None

    def close() -> None:
        main = [t for t in threads if t and t[-1][1] != "_bootstrap"]
        if threads:
            out.append(main[0] if main else [])

    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            head = {"pid": int(m.group(1)), "ppid": int(m.group(2)), "every_s": float(m.group(3))}
        elif line.startswith("# argv "):
            head["argv"] = line[7:]
        elif line.startswith("Timeout ("):
            close()
            threads, cur = [], None
        elif line.startswith(("Thread 0x", "Current thread 0x")):
            cur = []
            threads.append(cur)
        else:
            f = FRAME.match(line)
            if f and cur is not None:
                path = f.group(1)
                stdlib = path.startswith("<frozen") or ("/lib/python" in path and "-packages/" not in path)
                cur.append((f"{_short(path)}:{f.group(2)}", f.group(3), stdlib))
    close()
    return head, out


def _short(path: str) -> str:
    for mark in ("site-packages/", "/forge-e2e-site/", "/lib/python"):
        if mark in path:
            return path.split(mark, 1)[1]
    return path


def _role(samples: list[list[Frame]]) -> str:
    seen = {where for s in samples for where, _, _ in s}
    for role, marks in ROLES:
        if any(m in w for w in seen for m in marks):
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
            head, samples = _samples(f.read_text(errors="replace"))
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
            cells = ["; ".join(f"{frame} {100 * n / p['samples']:.0f} %" for frame, n in p.get(k) or [])
                     .replace("|", "/") for k in ("top", "top_code")]
            rows.append(f"| {name} | {p['role']} | {p.get('pid', '?')} | {p['samples']} | {cells[0]} | {cells[1]} |")
    if not rows:
        return []
    return ["", f"## Where the servers' processes were ({FOLDER}.json: the main thread's innermost frame per sample)",
            "", "| profile | process | pid | samples | innermost frames, share of samples | innermost outside the "
            "standard library |", "|---|---|---|---|---|---|", *rows]
