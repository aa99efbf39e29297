"""`forge calibrate --install` of a calibration that measured some families only (`--families gemv`): the
table it makes holds those families' sections alone, and installing it whole would drop the installed
table's other sections (the prefill and decode launches measured before) without a word. Instead the
installed table's sections of the families not measured now are kept, when that table was measured on the
same device, stack and rank geometry (its validators); each kept section's provenance goes into the new
table's `provenance.sections`. A table for another stack is not merged: the install is refused, naming
the key that differs (`--force` replaces it whole)."""

from __future__ import annotations

import copy

from .. import tunedtable
from ..errors import ForgeError

# the table section each calibration family writes (write and gemm write none)
SECTIONS = {"gemv": "gemv", "prefill": "prefill", "decode": "decode"}


def _geometry_free(validators: dict) -> dict:
    return {k: v for k, v in validators.items() if k not in ("tp", "heads")}


def _decode_as_read(installed: dict) -> dict:
    """The installed table's decode section in the current schema (a forge-tuned/1 table's segments keyed
    by batch alone are written as the loader reads them: its measured KV heads and context)."""
    T = tunedtable.loader()
    dec = copy.deepcopy(installed["decode"])
    if installed.get("schema") == T.OLD_SCHEMA and "segments" in dec:
        dec["segments"] = {str(kv): {str(b): {str(c): s for c, s in ctxs.items()} for b, ctxs in batches.items()}
                           for kv, batches in T.decode_segment_table(installed).items()}
    return dec


def merge(new: dict, installed: dict, measured: list[str], where: str, force: bool) -> tuple[dict, list[str]]:
    """(the table to install, the sections kept from `installed`). `new` is the calibration's table of the
    `measured` families; `installed` the valid table at the destination `where`."""
    kept = [sec for fam, sec in SECTIONS.items() if fam not in measured and sec in installed]
    if not kept:
        return new, []
    T = tunedtable.loader()
    differ = sorted(k for k in set(_geometry_free(new["validators"])) | set(_geometry_free(installed["validators"]))
                    if new["validators"].get(k) != installed["validators"].get(k))
    if T.geometry(new) != T.geometry(installed):
        differ.append("tp/heads")
    if differ:
        if force:
            return new, []
        key = differ[0]
        raise ForgeError(f"--install: {where} holds the {', '.join(kept)} section(s) of a calibration on another stack "
                         f"(validators.{key}: {installed['validators'].get(key)!r} there, "
                         f"{new['validators'].get(key)!r} now); this calibration measured {', '.join(measured)} only, "
                         "so its table would drop them",
                         hint="calibrate every family on this stack (leave out --families), or replace the table "
                              "whole with --force")
    out = copy.deepcopy(new)
    old_prov = {k: v for k, v in (installed.get("provenance") or {}).items() if k not in ("sections", "note")}
    old_sections = (installed.get("provenance") or {}).get("sections") or {}
    sections = {}
    for sec in kept:
        out[sec] = _decode_as_read(installed) if sec == "decode" else copy.deepcopy(installed[sec])
        sections[sec] = old_sections.get(sec) or old_prov
    out["provenance"] = {**out["provenance"], "sections": sections}
    T.validate(out)
    return out, kept
