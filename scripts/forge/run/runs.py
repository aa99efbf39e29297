"""Run folders: reports/runs/<run-id>/ holds one server start and/or one benchmark run — the server
log, one result file per tier (`vllm bench serve`'s own JSON), and manifest.json with provenance."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path
from shutil import which
from typing import Any

from .. import paths, proc, records
from ..errors import ForgeError
from ..recipe import provenance

RUNS = paths.REPORTS / "runs"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def runs_root() -> Path:
    return Path(os.environ.get("FORGE_RUNS_DIR", RUNS))


def new_run_id(profile: str | None, suffix: str = "", root: Path | None = None) -> str:
    """<time>-<profile><suffix>, whose folder under `root` (default: the runs) does not exist yet (-2, -3,
    ... within the same second): a new run (or sweep) never lands in an earlier one."""
    base = f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{profile or 'run'}{suffix}"
    run_id, k = base, 1
    while ((root or runs_root()) / run_id).exists():
        k += 1
        run_id = f"{base}-{k}"
    return run_id


def check_run_id(run_id: str) -> str:
    """A run id: a plain name (paths.plain_name) that starts with a letter or digit, then letters, digits,
    '.', '_' and '-'; a path is refused,
    never shortened to its last part."""
    paths.plain_name(run_id, "run id")
    if not _ID.match(run_id):
        raise ForgeError(f"run id {run_id!r} is not a plain name",
                         hint="start with a letter or digit, then use letters, digits, '.', '_' and '-' "
                              "(e.g. 20260101-120000-contest)")
    return run_id


def run_dir(run_id: str, create: bool = True, root: Path | None = None) -> Path:
    """reports/runs/<run_id> (or <root>/<run_id>), created unless `create` is false."""
    d = Path(root or runs_root()) / check_run_id(run_id)
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def resolve_run(arg: str) -> Path:
    """A run given as a folder path or as a run id under the runs folder (runs_root)."""
    p = Path(arg)
    if p.is_dir():
        return p
    root = runs_root()
    q = root / arg
    if q.is_dir():
        return q
    listing = f"ls {shlex.quote(paths.rel(root) + '/')}"
    if p.is_file():
        raise ForgeError(f"{arg} is a file, not a run folder",
                         hint=f"give the folder that holds the tier results (<tier>.json), e.g. {p.parent}, "
                              f"or a run id under {paths.rel(root)}/ ({listing})")
    for x in dict.fromkeys((p, q)):         # a link that leads back to itself is no missing run
        paths.resolved(x, "run")
    raise ForgeError(f"run {arg!r} not found (neither a folder nor {paths.rel(q)})",
                     hint=f"list runs with: {listing}")


def write_json(path: Path, data: Any) -> None:
    """Write atomically: an interrupted write never leaves half a file that looks finished."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


# the one bounded reader of a JSON record (forge.records): every record a run folder holds is read by it
read_json = records.read_json


# --- tier results and their records in the manifest --------------------------------------------

def failed_result(contest: dict, tier: str, n: int, reason: str) -> dict:
    """A tier the server could not serve at all: every request failed. Same keys as a
    `vllm bench serve` result, so scoring treats it like any other run of all-failed requests."""
    return {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat", "num_prompts": n,
            "duration": 0.0, "completed": 0, "failed": n, "total_input_tokens": 0,
            "total_output_tokens": 0, "request_throughput": 0.0, "output_throughput": 0.0,
            "total_token_throughput": 0.0, "input_lens": [0] * n, "output_lens": [0] * n,
            "ttfts": [0.0] * n, "itls": [[] for _ in range(n)], "start_times": [0.0] * n,
            "generated_texts": [""] * n, "errors": [reason] * n,
            "forge_synthesized": f"server unreachable; all {n} requests recorded as failed"}


def result_path(rdir: Path, tier: str) -> Path:
    return rdir / f"{tier}.json"


def tier_done(rdir: Path, tier: str, keep_failed: bool = False) -> bool:
    """A finished result for `tier`: one where every request completed, or with keep_failed any
    result (failed requests included)."""
    p = result_path(rdir, tier)
    if not p.is_file():
        return False
    try:
        d = read_json(p)
    except ForgeError:
        return False
    if not (isinstance(d, dict) and "completed" in d):
        return False
    return keep_failed or (not d.get("failed") and bool(d.get("completed")))


def set_aside_failed(rdir: Path, tier: str) -> Path | None:
    """Move a tier's result with failed requests to failed/<tier>.<n>.json before it is rerun."""
    p = result_path(rdir, tier)
    if not p.is_file():
        return None
    dest_dir = rdir / "failed"
    dest_dir.mkdir(exist_ok=True)
    n = 1
    while (dest_dir / f"{tier}.{n}.json").exists():
        n += 1
    dest = dest_dir / f"{tier}.{n}.json"
    os.replace(p, dest)
    return dest


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def tier_record(status: str, res: dict, seconds: float | None) -> dict:
    """The manifest's record of a tier's result file."""
    return {"status": status, "seconds": seconds, "finished": now_iso(), "completed": res.get("completed"),
            "failed": res.get("failed"), "output_throughput": res.get("output_throughput")}


def record_kept_tier(manifest: dict, name: str, res: dict) -> bool:
    """Make the manifest's record of a kept tier agree with its result file: a run stopped between
    moving the result into place and updating the manifest has a result with no record (or the
    record of an earlier attempt). Returns whether the record changed."""
    rec = manifest.setdefault("tiers", {}).get(name)
    keys = ("completed", "failed", "output_throughput")
    if rec and all(rec.get(k) == res.get(k) for k in keys):
        return False
    errors = " ".join(str(e) for e in res.get("errors") or [] if e)
    status = ("done" if not res.get("forge_synthesized")
              else "server-died" if "server died" in errors else "server-down")
    manifest["tiers"][name] = {**tier_record(status, res, None), "recorded_on_resume": True}
    return True


# --- what a run folder already holds ---------------------------------------------------------

def measured_with(rdir: Path) -> dict | None:
    """{"profile", "tiers"}: the profile manifest.json records for the tiers measured in run folder
    `rdir` (a result file, or the record of one), or None while no tier was measured there."""
    mpath = Path(rdir) / "manifest.json"
    try:
        m = read_json(mpath) if mpath.is_file() else None
    except ForgeError:
        return None
    if not isinstance(m, dict):
        return None
    recorded = m.get("tiers") or {}
    names = set(recorded) | set(m.get("datasets") or {})
    measured = sorted(n for n in names if n in recorded or (Path(rdir) / f"{n}.json").is_file())
    return {"profile": m.get("profile"), "tiers": measured} if measured else None


def profile_label(profile: str | None) -> str:
    return f"profile {profile}" if profile else "no profile label (a server not started by forge serve)"


def refuse_other_profile(rdir: Path, profile: str | None, now: str, hint: str) -> None:
    """Refuse to add a server or results of `profile` to a run folder whose tiers were measured with
    another profile: the run would label two profiles' measurements as one. `now` says what would
    be added ("the server answering now runs"); `hint` is the fix, where {prior} is the recorded
    profile."""
    prior = measured_with(rdir)
    if prior is None or prior["profile"] == profile:
        return
    raise ForgeError(f"run {Path(rdir).name} was measured with {profile_label(prior['profile'])} "
                     f"(tier(s) {', '.join(prior['tiers'])}); {now} {profile_label(profile)}",
                     hint=hint.format(prior=prior["profile"] or "PROFILE"))


def prune_empty(d: Path) -> None:
    """Remove folder `d` and the folders under it that hold no file; whatever holds a file stays."""
    for sub, _dirs, _files in os.walk(d, topdown=False):
        try:
            os.rmdir(sub)
        except OSError:
            pass


# --- provenance ----------------------------------------------------------------------------------

def git_commit() -> dict:
    """The project commit a record was made from (provenance.forge_commit: also on a copy of the checkout
    without its git folder, through a source manifest)."""
    return provenance.forge_commit()


def vllm_provenance(python: str | None = None, env: dict[str, str] | None = None) -> dict:
    """vLLM's version and our wheel's provenance record (vllm/_forge_provenance.py: PROVENANCE),
    read from `python` (default: this interpreter; `env` added to its environment) without importing
    vLLM's heavy modules."""
    code = ("import json, importlib.metadata as m\n"
            "out = {}\n"
            "try: out['version'] = m.version('vllm')\n"
            "except Exception as e: out['version'] = None\n"
            "try:\n"
            "    import importlib.util, runpy\n"
            "    spec = importlib.util.find_spec('vllm')\n"
            "    import os\n"
            "    f = os.path.join(os.path.dirname(spec.origin), '_forge_provenance.py') if spec else None\n"
            "    out['provenance'] = runpy.run_path(f)['PROVENANCE'] if f and os.path.exists(f) else None\n"
            "except Exception as e: out['provenance_error'] = str(e)\n"
            "print(json.dumps(out, default=str))\n")
    try:
        text = proc.output([python or sys.executable, "-c", code], what="vllm provenance", timeout=60, env=env)
        return json.loads(text.splitlines()[-1])
    except (ForgeError, json.JSONDecodeError, IndexError):
        return {"version": None, "provenance": None}


def device_info() -> dict:
    info: dict[str, Any] = {"host": platform.node(), "machine": platform.machine(), "os": platform.platform()}
    for tool, args in (("rocm-smi", ["--showproductname"]), ("hy-smi", ["--showproductname"]),
                       ("nvidia-smi", ["--query-gpu=name,driver_version", "--format=csv,noheader"])):
        if which(tool):
            try:
                info[tool] = proc.output([tool, *args], what=tool, timeout=20)[-2000:]
            except ForgeError:
                pass
    return info


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
