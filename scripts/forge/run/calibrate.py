"""`forge calibrate` (`make calibrate`): on the card, every kernel family checked against float64 and timed
against the upstream path and the vendor libraries, at the model's shapes and the work the organizers'
server schedules (4096-token prefill chunks of each tier's prompts, decode contexts 4K-32K at the batches
the rounds' servers plan decode at, CUDA-graph padding included, 1-16 rows for linear layers and the 24 and
32 rows vLLM pads a decode batch of 17-32 to); then the selection (the fastest correct candidate; a failing
one never; ties to upstream), the per-device table the patched vLLM reads at start-up, and one report.

Runs in the competition container or the image with our wheel installed (`--kernels installed --ops
vllm`, the default when the installed vLLM carries our kernels), or from a checkout on any GPU
machine (`--kernels checkout --ops build`: our kernels from kernels/, the GEMV compiled from
kernels/csrc; vLLM's own kernels from the installed vLLM). Each family runs in a child process, and a
candidate that faults the GPU or crashes the process is recorded as failed while its family starts again
with the candidates it has not measured (at most 5 times); the other families go on regardless.
Families already measured in the output folder with the same options are kept (rerun after an
interrupt, or after a family failed, to resume). A folder that holds a complete calibration (or one
git tracks) is not written into again unless asked (--force; --redo FAMILY then measures one again).
Every family document kept is read and checked first (a damaged one, or one measured on another
device, is refused naming its file and key), and the results (table.json, calibration.json,
calibration.md, the charts) are written together: an interrupt leaves the previous set or the new one.

Writes OUT/ (default build/calibration/<device>): <family>.json (the records), calibration.json (the
selection, the table, provenance), calibration.md, one chart per family, table.json. --install copies
the table to configs/kernels/tuned/<device>.json, where `make tree` puts it into the vLLM tree (and
so into the wheel and the submission); a calibration of some families (--families) keeps the installed
table's sections of the others when that table is of the same stack and rank geometry (else refused;
--force replaces it whole); --install-vllm copies it beside the installed vLLM's loader,
for a server started right away on this machine. --tp N measures one rank's shapes and heads at that
tensor-parallel degree (run.rank_geometry); the table (<device>-tpN.json) is taken only at that degree."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from .. import options as opts
from .. import paths, proc, tunedtable, ui
from ..errors import ForgeError
from ..hashing import combine, sha256_file
from ..recipe import patchfile, provenance
from ..records import guard_recorded, read_json, tracked_changes
from . import calibrate_options, calibrate_report, rank_geometry, table_merge
from . import calibration as sel
from . import calibration_docs as cd
from .calibration_docs import device_slug

FAMILIES = cd.FAMILIES
SEED_MAX = calibrate_options.SEED_MAX
# decode: 4 batches x 4 contexts x 52 candidates (int8 launches too), about 0.2-0.45 s each on an H200
FAMILY_TIMEOUT_S = {"gemv": 600, "prefill": 600, "decode": 900, "write": 120, "gemm": 300}
MAX_RESTARTS = 5          # candidates that may kill a family's process before the family is given up
TUNED = paths.CONFIGS / "kernels" / "tuned"


def kernels_hash() -> str:
    """sha256 of the kernel sources a table's launches were measured with (recorded in provenance)."""
    files = sorted([*paths.KERNELS.glob("forge_triton/*.py"), *paths.KERNELS.glob("csrc/*.cu")])
    return combine(*(f"{f.relative_to(paths.ROOT)}:{sha256_file(f)}" for f in files))


def worker_cmd(family: str, out: Path, args) -> list[str]:
    cmd = [args.python or sys.executable, "-m", "calibrate", family, "--out", str(out), "--kernels", args.kernels,
           "--ops", args.ops, "--seed", str(args.seed)]
    return cmd + (["--quick"] if args.quick else []) + (["--smoke"] if args.smoke else []) + rank_geometry.worker_args(args.tp)


def options(args) -> dict:
    return {"kernels": args.kernels, "ops": args.ops, "quick": args.quick, "smoke": args.smoke, "seed": args.seed, **rank_geometry.options(args.tp)}


def child_env(args) -> dict:
    """What a family's process (and the device probe) runs with: kernels/ importable; with --smoke,
    Triton's interpreter on the CPU (vLLM keeps Triton enabled when no GPU driver is visible)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(paths.KERNELS), os.environ.get("PYTHONPATH")]))}
    if args.smoke:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def recorded(out_dir: Path) -> str | None:
    """What `out_dir` holds that a calibration would replace: a folder git tracks, or a complete
    calibration (calibration.json with no failed family); None for a new folder, or an interrupted or
    partly failed calibration, which a rerun resumes."""
    tracked = paths.tracked_files(out_dir)
    if tracked:
        return f"a recorded calibration ({len(tracked)} files tracked by git)"
    cal = out_dir / "calibration.json"
    if not cal.is_file():
        return None
    try:
        fams = read_json(cal)["families"]
        if any(info.get("failed") for info in fams.values()):
            return None
    except (ForgeError, KeyError, TypeError, AttributeError):
        pass                             # unreadable: a calibration all the same, kept unless asked
    return "a complete calibration"


def kept_families(out_dir: Path, families: list[str], args) -> dict:
    """The family documents `out_dir` holds with this run's options, read and checked before anything is
    measured: a damaged one, or families of two devices, are refused naming the file and key."""
    kept = {}
    for fam in families:
        path = out_dir / f"{fam}.json"
        if not path.is_file() or fam in (args.redo or []):
            continue
        doc = cd.read_family(path, fam)
        if doc["options"] == options(args):
            kept[fam] = doc
        else:
            ui.info(f"{fam}: {paths.rel(path)} was measured with other options; measuring again")
    cd.one_device({paths.rel(out_dir / f"{f}.json"): d for f, d in kept.items()})
    return kept


def run_family(family: str, out_dir: Path, args) -> dict:
    """The family's document, measured now in a child process and checked; a child that fails (or
    writes a damaged document, set aside) leaves {"failed": why}."""
    path = out_dir / f"{family}.json"
    log = out_dir / f"{family}.log"
    log.unlink(missing_ok=True)
    env = child_env(args)
    budget = FAMILY_TIMEOUT_S[family] * (3 if args.smoke else 1)
    ui.info(f"{family}: measuring (log: {paths.rel(log)}; at most {budget} s)")
    t0 = time.monotonic()
    inflight, killers = Path(f"{path}.inflight"), Path(f"{path}.killers.jsonl")
    for attempt in range(MAX_RESTARTS + 1):
        left = budget - (time.monotonic() - t0)
        try:
            res = proc.run(worker_cmd(family, path, args) + (["--resume"] if attempt else []), env=env, check=False,
                           log=log, cwd=paths.ROOT, timeout=max(left, 1), what=f"calibrate {family}")
            code = res.returncode
        except ForgeError as e:          # timed out
            code, why = None, str(e).splitlines()[0]
            break
        if code == 0 and path.is_file():
            try:
                doc = cd.read_family(path, family)
            except ForgeError as e:
                why = f"it wrote a damaged document ({e.message}), set aside as {paths.set_aside(path).name}"
                break
            bad, skipped = (sum(1 for r in doc["records"] if not r["ok"] and bool(r.get("not_timed")) is nt) for nt in (False, True))
            ui.info(f"{family}: {len(doc['records'])} records, {bad} failed, {skipped} not timed, {time.monotonic() - t0:.0f} s")
            return doc
        why = (f"the process was killed by signal {-code} (a GPU fault or a crash)" if code < 0
               else f"the process exited {code}")
        try:
            who = read_json(inflight)
        except ForgeError:
            break                        # it died outside a candidate: the family as a whole failed
        if not isinstance(who, dict):
            break
        who["why"] = why
        with open(killers, "a", encoding="utf-8") as f:
            f.write(json.dumps(who) + "\n")
        inflight.unlink(missing_ok=True)
        ui.warn(f"{family}: {who['decision']} / {who['candidate']}: {why}; recorded as failed, "
                f"the family goes on with the other candidates")
    tail = proc.tail(log, 6) if log.is_file() else ""
    ui.warn(f"{family}: FAILED: {why}; the calibration goes on without it\n{tail}")
    return {"family": family, "failed": why, "log_tail": tail, "records": [], "options": options(args)}


def _device(docs: dict, out_dir: Path) -> dict:
    """The device every measured family ran on (one device per folder; cd.one_device)."""
    measured = {paths.rel(out_dir / f"{f}.json"): d for f, d in docs.items() if not d.get("failed")}
    if not measured:
        raise ForgeError("no family ran, so the device is unknown; nothing to select",
                         hint="see the families' logs in the output folder")
    cd.one_device(measured)
    return next(iter(measured.values()))["device"]


def measured_provenance(out_dir: Path, args) -> dict | None:
    """The provenance calibration.json in `out_dir` records for its measurement (None: none readable, or
    one measured with other options than this run's)."""
    cal = out_dir / "calibration.json"
    try:
        prov = read_json(cal).get("provenance") if cal.is_file() else None
    except (ForgeError, AttributeError):
        return None
    return prov if isinstance(prov, dict) and prov.get("options") == options(args) else None


def calibrate(args, force: bool = False) -> dict:
    ident = None
    if args.out:
        out_dir = Path(args.out)
    else:
        ident = probe_device(args)
        out_dir = paths.BUILD / "calibration" / (device_slug(ident) + rank_geometry.suffix(args.tp))
    guard_recorded(paths.rel(out_dir), recorded(out_dir), doing="calibrating into it", force=force,
                   hint="give a new --out (the default is build/calibration/<device>); with --force the families "
                        "measured with the same options are kept, --redo FAMILY measures one again")
    measured_before = measured_provenance(out_dir, args)
    families = [f for f in FAMILIES if f in args.families]
    kept = kept_families(out_dir, families, args)
    if kept and len(kept) < len(families):
        # the families measured now must run on the device of those kept: ask the device before measuring
        ident = ident or probe_device(args)
        cd.one_device({**{paths.rel(out_dir / f"{f}.json"): d for f, d in kept.items()},
                       "the device calibrating now": {"device": ident}})
    now = [f for f in families if f not in kept]          # the families measured now
    # the device is asked before a family runs, --smoke too: a Python without torch is refused before --out is written
    if now or (getattr(args, "install", False) and not force):
        ident = ident or (probe_device(args) if now else next(iter(kept.values()))["device"])
        calibrate_options.before_measuring(args, ident, now, force,
                                           TUNED / f"{device_slug(ident)}{rank_geometry.suffix(args.tp)}.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    docs = {}
    for i, fam in enumerate(families, 1):
        ui.info(f"[{i}/{len(families)}] family {fam}")
        if fam in kept:
            docs[fam] = kept[fam]
            ui.info(f"{fam}: kept from {paths.rel(out_dir / f'{fam}.json')} ({len(kept[fam]['records'])} records)")
        else:
            docs[fam] = run_family(fam, out_dir, args)
    records = [r for d in docs.values() for r in d.get("records", [])]
    dev = _device(docs, out_dir)
    validators = {**cd.identity(dev), **rank_geometry.validators(args.tp)}   # taken only at this degree
    selection = sel.select(records)
    head = provenance.forge_commit()
    commit = f"{(head.get('commit') or '?')[:12]}{' (dirty)' if head.get('dirty') else ''}"
    # a shipped table names no path of the machine that made it, and what a dirty tree held (kernels/
    # forge_tuned shipping_problems)
    prov = {"commit": commit, "series": series_hash(), "kernels": kernels_hash(),
            "driver": dev.get("driver"), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "forge " + provenance.shown_command(sys.argv[1:]), "report": provenance.shown_path(out_dir),
            "options": options(args)}
    if head.get("dirty"):
        prov["diff_sha256"] = head.get("diff_sha256") or provenance.forge_diff_hash()
    if measured_before is not None and len(kept) == len(families):
        # nothing was measured now: the table is made again from what was measured then, and says so
        # (its commit, kernels, series, driver and date are those of the measurement, not of this checkout)
        prov = measured_before
    table = sel.build_table(selection, validators, prov)
    ft = tunedtable.loader()      # the table's loader: its validator before anything is written
    try:
        ft.validate(table)
    except ft.TableError as e:
        raise ForgeError(f"the table made from {paths.rel(out_dir)} is not one the loader takes: {e}; nothing written",
                         hint="the family documents hold launches the table cannot carry: measure them again "
                              "(--force --redo FAMILY)") from None
    doc = {"provenance": prov, "device": dev, "families": {f: {k: d.get(k) for k in ("seconds", "notes", "failed")}
                                                             for f, d in docs.items()},
           "selection": selection, "table": table, "wall_s": round(time.monotonic() - t0, 1)}
    # the results as one set: an interrupt leaves the previous set or this one, never a mix
    paths.write_files(out_dir, {"table.json": json.dumps(table, indent=1, sort_keys=True) + "\n",
                                "calibration.json": json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n",
                                **calibrate_report.files(doc, records)})
    return {"out": out_dir, "doc": doc, "remade": prov is measured_before}


def series_hash() -> str | None:
    try:
        return combine(*(f"{n}:{sha256_file(paths.PATCHES / n)}" for n in patchfile.read_series(paths.PATCHES)))
    except (ForgeError, OSError):
        return None


def probe_device(args) -> dict:
    """The device's identity from a child process (this process stays off the GPU)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import forge_tuned; "
            "print(json.dumps(forge_tuned.device_identity()))")
    hint = "calibrate needs torch where it runs (the DCU container, the image or a GPU machine)"
    python = args.python or sys.executable
    res = proc.run([python, "-c", code, str(paths.KERNELS)], what="device query", hint=hint, env=child_env(args),
                   capture=True, check=False)
    if res.returncode != 0:          # one line: the child's error, never its traceback
        raise ForgeError(f"{'--python' if args.python else 'this Python,'} {python}: the device query failed (exit "
                         f"{res.returncode}): {proc.last_line(res)}; nothing was measured",
                         hint=hint + "; --python names a Python that has it")
    out = res.stdout.strip()
    try:
        ident = json.loads(out.splitlines()[-1])
    except (ValueError, IndexError):
        raise ForgeError(f"device query: printed {out[-200:]!r}, not the device's identity", hint=hint) from None
    return cd.check_device(ident, cd.Doc("the device query", hint))


def default_kernels() -> tuple[str, str]:
    """(kernels, ops): the installed vLLM's when it carries our kernels, else this checkout's."""
    try:
        if importlib.util.find_spec("vllm") and importlib.util.find_spec("vllm.forge_tuned"):
            return "installed", "vllm"
    except (ImportError, ValueError):
        pass
    return "checkout", "build"


def _vllm_tables() -> Path:
    """The folder of the installed vLLM's tuned tables (--install-vllm)."""
    try:
        spec = importlib.util.find_spec("vllm.forge_tuned")
    except ImportError:             # no vllm package at all (find_spec imports the parent first)
        raise ForgeError(f"--install-vllm: no vLLM is installed for {sys.executable}, so there is no installed "
                         "loader to copy the table beside",
                         hint="install our wheel into this Python (make wheel, then pip install dist/vllm-*.whl), "
                              "or leave out --install-vllm (--install puts the table into the checkout)") from None
    if spec is None or not spec.submodule_search_locations:
        raise ForgeError("--install-vllm: the installed vLLM has no forge_tuned package",
                         hint="install a wheel built from the patch series (make wheel)")
    return Path(list(spec.submodule_search_locations)[0])


def _merged_text(doc: dict, dest: Path, force: bool) -> str:
    """The table to install at `dest`: the calibration's, plus the sections of the families it did not
    measure from a valid table already there (table_merge)."""
    table = doc["table"]
    try:
        installed = tunedtable.loader().read(str(dest)) if dest.is_file() else None
    except ValueError:                          # TableError: not a valid table; replaced whole (guarded)
        installed = None
    if installed is not None:
        table, kept = table_merge.merge(table, installed, list(doc.get("families", {})), paths.rel(dest), force)
        if kept:
            ui.info(f"kept the {', '.join(kept)} section(s) of the table at {paths.rel(dest)} (not measured now; "
                    "their provenance in provenance.sections)")
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def cmd_calibrate(args) -> int:
    calibrate_options.check_options(args)
    if args.out is not None:
        args.out = str(paths.target_folder(args.out, "--out"))
    args.python = calibrate_options.python(args.python)
    force = opts.forced(args.force)
    rank_geometry.rank_heads(args.tp)            # a degree the model cannot run: refused before anything runs
    vllm_tables = _vllm_tables() if args.install_vllm else None
    dk, do = default_kernels()
    args.kernels = args.kernels or dk
    args.ops = args.ops or do
    why = None if args.smoke else provenance.unnamed_commit_warning("the calibration's records (and `--install` "
                                                                     "refuses a table without a commit)")
    if why:
        ui.warn(why)
    res = calibrate(args, force)
    doc, out = res["doc"], res["out"]
    calibrate_options.check_install(args, doc, paths.rel(out))
    sel_ = doc["selection"]
    failed, skipped = (sum(len(d.get(k) or {}) for d in sel_.values()) for k in ("failed", "not_timed"))
    ui.info(f"calibration: {len(sel_)} decisions, {failed} failing candidate(s) left out, {skipped} not timed; "
            f"report {paths.rel(out / 'calibration.md')}; table {paths.rel(out / 'table.json')}")
    slug = device_slug(doc["device"]) + rank_geometry.suffix(args.tp)
    text = json.dumps(doc["table"], indent=1, sort_keys=True) + "\n"      # validated before it was written
    if args.install:
        text = _merged_text(doc, TUNED / f"{slug}.json", force)
        # a table that is shipped names no machine path and a clean or hashed commit
        tunedtable.check_text(text, paths.rel(out / "table.json"), shipped=True,
                              fix="calibrate from a committed checkout (or a dirty one: its diff's hash is recorded)"
                                  + ("; this calibration measured nothing now, so its table keeps the provenance "
                                     "of its measurement" if res.get("remade") else ""))
        dest = TUNED / f"{slug}.json"
        changed = tracked_changes({dest: text})
        guard_recorded(paths.rel(dest), "a committed table" if changed else None, doing="--install",
                       force=force, hint=f"the calibration is in {paths.rel(out)}; commit or move the table first")
        paths.write_atomic(dest, text)
        ui.info(f"installed the table as {paths.rel(dest)} (commit it; `make tree` puts it into the vLLM tree)")
    if vllm_tables is not None:
        dest = vllm_tables / f"{slug}.json"
        paths.write_atomic(dest, _merged_text(doc, dest, force))
        ui.info(f"installed the table beside the installed vLLM's loader: {dest}")
    print(out / "calibration.md")
    return 0


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="check and time every kernel candidate on this device; write its table",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output folder (default build/calibration/<device>)")
    p.add_argument("--families", type=calibrate_options.families, default=list(FAMILIES),
                   help=f"comma-separated subset of {','.join(FAMILIES)} (default all)")
    p.add_argument("--redo", action="append", metavar="FAMILY", help="measure this family again (repeatable)")
    p.add_argument("--force", action="store_true",
                   help="calibrate into a folder that holds a complete or tracked calibration (also FORCE=1)")
    p.add_argument("--kernels", choices=("installed", "checkout"),
                   help="our Triton kernels from the installed vLLM or from kernels/ (default: installed when "
                        "the installed vLLM carries them)")
    p.add_argument("--ops", choices=("vllm", "build"),
                   help="the GEMV from the installed vLLM's _C or built from kernels/csrc (default as --kernels)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and candidates: a first look, minutes")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes under Triton's interpreter on a CPU: checks the tool, measures nothing real")
    p.add_argument("--seed", type=calibrate_options.seed, default=1234,
                   help=f"seed of the random inputs, 0 to {SEED_MAX} (default 1234)")
    rank_geometry.add_option(p)
    p.add_argument("--python", help="the Python that runs the families: a path, or a name on PATH (default: this one)")
    p.add_argument("--install", action="store_true", help="copy the table to configs/kernels/tuned/<device>.json "
                   "(keeping its sections of families not measured now)")
    p.add_argument("--install-vllm", action="store_true",
                   help="copy the table beside the installed vLLM's loader (vllm/forge_tuned/)")
    p.set_defaults(func=cmd_calibrate)
