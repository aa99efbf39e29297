"""The one reader of a calibration's documents (the output folder of `forge calibrate`): each family's
<family>.json (its records; kernels/calibrate/common.py describes a record) and calibration.json (the
selection, the table, provenance). Every field the tools read is checked on the way in (types, finite
positive times, decision names and points from the families' known set, one device per folder)
before anything is selected, priced or written: a damaged document is an error naming its file and
key, never a crash or a wrong number."""

from __future__ import annotations

import math
import re
from pathlib import Path

from .. import paths
from ..errors import ForgeError
from . import runs

FAMILIES = ("gemv", "prefill", "decode", "write", "gemm")
KINDS = ("ours", "upstream", "builtin", "vendor")
# the decisions and points each family's code (kernels/calibrate/) writes (the write family's checks
# were one decision, "write", in the first recorded calibrations); the GEMV family's token counts: 1-16 and
# the captured graph sizes 24 and 32 (kernels/calibrate/gemv.py GRAPH_TOKENS), where only the platform GEMM
# and the skinny GEMM ("mma") are measured
GEMV_TOKENS = r"([1-9]|1[0-6]|24|32)"
GEMV_MAX_TOKENS = 16      # our GEMV's launches ([block, rows]) stop here (kernels/forge_tuned GEMV_MAX_TOKENS)
DECISION = {"gemv": r"gemv\.(plain|fused)\.[1-9]\d*x[1-9]\d*\." + GEMV_TOKENS, "prefill": r"prefill\.(16bit|int8)",
            "decode": r"decode\.[1-9]\d*\.(16bit|int8|qk)", "write": r"write(\.b[1-9]\d*\.t[1-9]\d*)?",
            "gemm": r"gemm\.[1-9]\d*x[1-9]\d*"}
POINT = {"gemv": "M=" + GEMV_TOKENS, "prefill": r"P=\d+ C=[1-9]\d*", "decode": r"(n=[1-9]\d* )?ctx=[1-9]\d*",
         "write": r"block=[1-9]\d* tokens=[1-9]\d*", "gemm": r"M=[1-9]\d*"}
SHOWN = {"gemv": ("gemv.plain|fused.NxK.M", "M=1 to M=16, M=24 or M=32"), "prefill": ("prefill.16bit|int8", "P=PREFIX C=CHUNK"),
         "decode": ("decode.BATCH.16bit|int8|qk", "ctx=TOKENS, or n=REQUESTS ctx=TOKENS where a graph pads them"), "write": ("write.bBLOCK.tTOKENS", "block=B tokens=T"),
         "gemm": ("gemm.NxK", "M=ROWS")}
EVERY_POINT = "(every point)"        # the one record of a candidate that killed its process
IDENTITY = ("device_name", "arch", "compute_units", "toolkit", "torch", "triton")


def redo_hint(family: str = "FAMILY") -> str:
    return (f"the file is damaged: measure the family again (forge calibrate --out FOLDER --force --redo {family}), "
            "or restore the folder from its copy")


# --- values ----------------------------------------------------------------------------------------

def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def positive(v) -> bool:
    """A finite number > 0 (not a bool)."""
    return _number(v) and v > 0


def _nonneg(v) -> bool:
    return _number(v) and v >= 0


def _whole(v, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


MMA = "mma"     # the one launch that is a word: the GEMV family's skinny GEMM (kernels/forge_tuned)
LAUNCH_FORM = {"gemv": f"a list of whole numbers, {MMA!r} or null"}


def _launch(v, family: str | None) -> bool:
    return v is None or isinstance(v, list) and all(_whole(x) for x in v) or family == "gemv" and v == MMA


def launch_form(family: str | None) -> str:
    return LAUNCH_FORM.get(family, "a list of whole numbers or null")


def _text(v) -> bool:
    return isinstance(v, str) and bool(v.strip())


class Doc:
    """Where a check is (the file) and what to do about a failure (the hint)."""

    def __init__(self, file: str, hint: str):
        self.file, self.hint = file, hint

    def bad(self, key: str, v, want: str) -> ForgeError:
        return ForgeError(f"{self.file}: key '{key}' is {repr(v)[:60]}, expected {want}", hint=self.hint)

    def need(self, ok: bool, key: str, v, want: str) -> None:
        if not ok:
            raise self.bad(key, v, want)


def family_of(decision: str) -> str | None:
    """The family a decision name belongs to, or None when it is none of the known ones."""
    fam = decision.split(".")[0] if isinstance(decision, str) else None
    return fam if fam in DECISION and re.fullmatch(DECISION[fam], decision) else None


def check_device(dev, d: Doc, key: str = "device") -> dict:
    d.need(isinstance(dev, dict), key, dev, "an object: the device's identity")
    d.need(_text(dev.get("device_name")), f"{key}.device_name", dev.get("device_name"), "the device's name")
    d.need(_text(dev.get("arch")), f"{key}.arch", dev.get("arch"), "the device's architecture")
    d.need(_whole(dev.get("compute_units")), f"{key}.compute_units", dev.get("compute_units"),
           "a whole number >= 0")
    for k in ("toolkit", "torch", "triton"):
        d.need(dev.get(k) is None or isinstance(dev.get(k), str), f"{key}.{k}", dev.get(k), "a version or null")
    d.need(dev.get("driver") is None or isinstance(dev.get("driver"), (int, str)) and
           not isinstance(dev.get("driver"), bool), f"{key}.driver", dev.get("driver"), "a version or null")
    return dev


def identity(dev: dict) -> dict:
    """What a table's validators match (the device and its stack)."""
    return {k: dev.get(k) for k in IDENTITY}


def check_record(r, d: Doc, family: str, key: str) -> None:
    d.need(isinstance(r, dict), key, r, "an object: one candidate at one point")
    dec = r.get("decision")
    d.need(isinstance(dec, str) and family_of(dec) == family, f"{key}.decision", dec,
           f"a decision of the {family} family ({SHOWN[family][0]})")
    d.need(_text(r.get("candidate")), f"{key}.candidate", r.get("candidate"), "the candidate's name")
    d.need(r.get("kind") in KINDS, f"{key}.kind", r.get("kind"), "one of " + ", ".join(KINDS))
    d.need(_launch(r.get("launch"), family), f"{key}.launch", r.get("launch"), launch_form(family))
    if family == "gemv" and isinstance(r.get("launch"), list):
        m = int(dec.rsplit(".", 1)[1])
        d.need(m <= GEMV_MAX_TOKENS, f"{key}.launch", r.get("launch"),
               f"{MMA!r} or null at {m} tokens (the GEMV's [block, rows] launches stop at {GEMV_MAX_TOKENS})")
    d.need(isinstance(r.get("selectable", True), bool), f"{key}.selectable", r.get("selectable"), "true or false")
    d.need(isinstance(r.get("ok"), bool), f"{key}.ok", r.get("ok"), "true or false")
    d.need(positive(r.get("weight")), f"{key}.weight", r.get("weight"), "a finite number > 0")
    point = r.get("point")
    d.need(isinstance(point, str) and (re.fullmatch(POINT[family], point) is not None or
                                       point == EVERY_POINT and not r.get("ok") and r.get("us") is None),
           f"{key}.point", point, f"a point of the {family} family ({SHOWN[family][1]})")
    err, tol = r.get("err"), r.get("tol")
    d.need(err is None or isinstance(err, (int, float)) and not isinstance(err, bool) and not math.isnan(err)
           and err >= 0, f"{key}.err", err, "an error >= 0 (inf: the output was not written) or null")
    d.need(not r.get("ok") or _nonneg(err), f"{key}.err", err, "a finite error >= 0 for a correct candidate")
    d.need(tol is None or _nonneg(tol), f"{key}.tol", tol, "a finite tolerance >= 0 or null")
    d.need(r.get("error") is None or isinstance(r.get("error"), str), f"{key}.error", r.get("error"),
           "a message or null")
    skipped = r.get("not_timed")
    d.need(skipped is None or _text(skipped) and not r.get("ok") and r.get("us") is None and r.get("error") is None,
           f"{key}.not_timed", skipped, "absent, or why the candidate was not run (then ok false, no time, no error)")
    us = r.get("us")
    if us is None:
        return
    d.need(isinstance(us, dict), f"{key}.us", us, "the timing: median, p10, p90 (microseconds) and n")
    for k in ("median", "p10", "p90"):
        d.need(positive(us.get(k)), f"{key}.us.{k}", us.get(k), "a finite time > 0 (microseconds)")
    d.need(us["p10"] <= us["median"] <= us["p90"], f"{key}.us", us, "p10 <= median <= p90")
    d.need(_whole(us.get("n"), 1), f"{key}.us.n", us.get("n"), "a whole number >= 1 (samples)")


def check_family(doc, file: str, family: str) -> dict:
    """A family's document (<family>.json), checked; returns it."""
    d = Doc(file, redo_hint(family))
    if not isinstance(doc, dict):
        raise ForgeError(f"{file}: a JSON {type(doc).__name__}, not a calibration family's document",
                         hint=d.hint)
    d.need(doc.get("family") == family, "family", doc.get("family"), f"{family!r} (the file's family)")
    check_device(doc.get("device"), d)
    d.need(isinstance(doc.get("options"), dict), "options", doc.get("options"), "the options it was measured with")
    recs = doc.get("records")
    d.need(isinstance(recs, list), "records", recs, "a list of records")
    for i, r in enumerate(recs):
        check_record(r, d, family, f"records[{i}]")
    d.need(doc.get("notes") is None or isinstance(doc["notes"], list) and all(isinstance(n, str) for n in doc["notes"]),
           "notes", doc.get("notes"), "a list of lines")
    d.need(doc.get("seconds") is None or _nonneg(doc["seconds"]), "seconds", doc.get("seconds"), "a time >= 0")
    return doc


def read_family(path: Path, family: str) -> dict:
    """<family>.json read and checked (check_family)."""
    return check_family(runs.read_json(path), paths.rel(path), family)


def one_device(docs: dict[str, dict]) -> dict | None:
    """The one device the documents {file: doc} were measured on (None for none); a folder whose
    documents name two devices or stacks is refused, naming the file that differs."""
    first = None
    for file, doc in docs.items():
        ident = identity(doc["device"])
        if first is None:
            first = (file, ident)
        elif ident != first[1]:
            diff = ", ".join(f"{k} {ident[k]!r} (there {first[1][k]!r})" for k in IDENTITY if ident[k] != first[1][k])
            raise ForgeError(f"{file}: key 'device' differs from {first[0]}: {diff}; one calibration folder holds "
                             "one device's measurements",
                             hint="give each device its own --out (the default is build/calibration/<device>), or "
                                  "measure the family again on this device (--force --redo FAMILY)")
    return first[1] if first else None


# --- calibration.json ----------------------------------------------------------------------------

def _check_entry(s, d: Doc, key: str, family: str | None = None) -> None:
    d.need(isinstance(s, dict), key, s, "an object: the decision's selection")
    cands = s.get("candidates")
    d.need(isinstance(cands, dict), f"{key}.candidates", cands, "an object of candidates")
    for name, c in cands.items():
        k = f"{key}.candidates.{name}"
        d.need(isinstance(c, dict), k, c, "an object: the candidate's totals")
        d.need(positive(c.get("us")), f"{k}.us", c.get("us"), "a finite time > 0 (microseconds)")
        d.need(_nonneg(c.get("spread_us")), f"{k}.spread_us", c.get("spread_us"), "a finite spread >= 0")
        d.need(_whole(c.get("points"), 1), f"{k}.points", c.get("points"), "a whole number >= 1")
        d.need(c.get("kind") in KINDS, f"{k}.kind", c.get("kind"), "one of " + ", ".join(KINDS))
        d.need(_launch(c.get("launch"), family), f"{k}.launch", c.get("launch"), launch_form(family))
    failed = s.get("failed")
    d.need(isinstance(failed, dict) and all(isinstance(v, str) for v in failed.values()), f"{key}.failed", failed,
           "an object of candidate: why it failed")
    skipped = s.get("not_timed", {})
    d.need(isinstance(skipped, dict) and all(isinstance(v, str) for v in skipped.values()), f"{key}.not_timed",
           skipped, "absent, or an object of candidate: why it was not timed")
    for ref in ("upstream", "builtin", "best_ours", "chosen"):
        v = s.get(ref)
        d.need(v is None or isinstance(v, str) and v in cands, f"{key}.{ref}", v,
               f"null or one of its candidates ({', '.join(cands) or 'none'})")
    if s.get("chosen") is not None:
        d.need(positive(s.get("us")), f"{key}.us", s.get("us"), "a finite time > 0 (microseconds)")
        d.need(s.get("kind") in KINDS, f"{key}.kind", s.get("kind"), "one of " + ", ".join(KINDS))
        d.need(_launch(s.get("launch"), family), f"{key}.launch", s.get("launch"), launch_form(family))
    for k in ("speedup", "vs_builtin"):
        d.need(s.get(k) is None or positive(s[k]), f"{key}.{k}", s.get(k), "a finite ratio > 0 or absent")
    d.need(s.get("noise") is None or _nonneg(s["noise"]), f"{key}.noise", s.get("noise"), "a finite share >= 0")
    d.need(isinstance(s.get("why"), str), f"{key}.why", s.get("why"), "the reason of the choice")


def check_report(doc, file: str) -> dict:
    """calibration.json, checked; returns it."""
    d = Doc(file, "the report is damaged: make it again (forge calibrate --out FOLDER --force keeps the "
                   "families measured with the same options), or restore the folder from its copy")
    if not isinstance(doc, dict) or not isinstance(doc.get("selection"), dict):
        what = "key 'selection' missing" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise ForgeError(f"{file}: {what}: not a calibration report",
                         hint="give the output folder of `forge calibrate` (build/calibration/<device>)")
    d.need(isinstance(doc.get("provenance"), dict), "provenance", doc.get("provenance"),
           "an object: where the calibration came from")
    check_device(doc.get("device"), d)
    fams = doc.get("families")
    d.need(isinstance(fams, dict) and all(f in FAMILIES for f in fams), "families", fams,
           f"an object of families ({', '.join(FAMILIES)})")
    for fam, info in fams.items():
        d.need(isinstance(info, dict), f"families.{fam}", info, "an object")
        d.need(info.get("failed") is None or isinstance(info["failed"], str), f"families.{fam}.failed",
               info.get("failed"), "why the family failed, or null")
    measured = {f for f, info in fams.items() if not info.get("failed")}
    for dec, s in doc["selection"].items():
        d.need(family_of(dec) in measured, f"selection.{dec}", dec,
               f"a decision of a measured family ({', '.join(sorted(measured)) or 'none'})")
        _check_entry(s, d, f"selection.{dec}", family_of(dec))
    d.need(isinstance(doc.get("table"), dict), "table", doc.get("table"), "the per-device table")
    return doc


def report_path(folder: Path) -> Path:
    folder = Path(folder)
    return folder / "calibration.json" if folder.is_dir() else folder


def read_report(folder: Path, option: str = "--calibration") -> tuple[dict, list[dict]]:
    """(calibration.json, every measured family's records) of a calibration folder, each document read
    and checked, the families' files present and of the report's device, and every candidate the
    selection names recorded in its family's file."""
    cal = report_path(folder)
    paths.resolved(cal, option)                     # a symlink loop (the folder's or the file's): said so
    if not cal.is_file():
        raise ForgeError(f"{option} {folder}: no calibration.json there",
                         hint="give the output folder of `forge calibrate` (build/calibration/<device>)")
    file = paths.rel(cal)
    doc = check_report(runs.read_json(cal), file)
    records: list[dict] = []
    docs = {file: doc}
    for fam, info in doc["families"].items():
        if info.get("failed"):
            continue
        p = cal.parent / f"{fam}.json"
        if not p.is_file():
            raise ForgeError(f"{paths.rel(p)}: " + ("a folder, not a file" if p.is_dir() else "not found")
                             + f"; {file} records the {fam} family as measured",
                             hint=f"restore the family's file, or measure it again (forge calibrate --out "
                                  f"{paths.rel(cal.parent)} --force --redo {fam})")
        fd = read_family(p, fam)
        docs[paths.rel(p)] = fd
        records += fd["records"]
    one_device(docs)
    have = {(r["decision"], r["candidate"]) for r in records}
    for dec, s in doc["selection"].items():
        for name in s["candidates"]:
            if (dec, name) not in have:
                raise ForgeError(f"{file}: key 'selection.{dec}.candidates.{name}' has no record in "
                                 f"{family_of(dec)}.json; the report and its family disagree",
                                 hint="make the report again from the families (forge calibrate --out FOLDER --force)")
    return doc, records


def device_slug(ident: dict) -> str:
    """A file name for a device: its name, arch and compute units (e.g. nvidia-h200-sm_90-132cu), made
    from the record's data through the path rule (paths.plain_name): never a path."""
    name = re.sub(r"[^a-z0-9]+", "-", str(ident.get("device_name", "device")).lower()).strip("-") or "device"
    arch = re.sub(r"[^a-z0-9_]+", "", str(ident.get("arch", "")).lower())
    cu = ident.get("compute_units", 0)
    if not (isinstance(cu, int) and not isinstance(cu, bool) and cu >= 0):
        raise ForgeError(f"the device's compute units {cu!r}: not a whole number, so no file name is made of it",
                         hint="the calibration's device record is damaged; measure again")
    return paths.plain_name(f"{name}-{arch}-{cu}cu", "the device's file name")
