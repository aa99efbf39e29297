# SPDX-License-Identifier: Apache-2.0
"""Per-device launch and route table of the dcu-forge kernels: what `forge calibrate` measured on a
device, read by the patched vLLM at start-up.

Self-contained (json, os, logging, torch), so the same file runs in the tool (kernels/ on the import
path) and inside vLLM, where the kernel overlay places it as ``vllm/forge_tuned/__init__.py`` and the
committed tables (``configs/kernels/tuned/*.json``) beside it.

A table (JSON, ``schema`` = SCHEMA):
    validators  what the measurements depend on; a table is used only on a device and software stack
                where every key of MATCH is equal (device name, arch, compute units, toolkit, torch,
                triton). A mismatch is refused with a one-line reason, never used silently.
    provenance  where it came from (project commit, patch series, kernel-source hash, driver, date,
                command, report): recorded, not matched, because the submission's vLLM is built from
                the vendor tree with a version string of its own, and a commit that leaves the
                kernels alone does not change what is fast. `forge calibrate --check` compares the
                kernel-source hash with a checkout.
    gemv        {"plain"|"fused": {"NxK": {"M": [block, rows]}}}: the (shape, token count) pairs at
                which our decode GEMV beat the platform's GEMM (and the launch that won; [0, 0] is
                the kernel's built-in choice); a pair not listed keeps the platform's GEMM.
    prefill     {"16bit"|"int8": [BLOCK_M, TILE_N, num_warps, num_stages]}: the chunked-prefill
                kernel's launch; absent: the kernel's built-in LAUNCH table.
    decode      {"segments": {"<batch>": S}, "launch": {"16bit"|"int8": [TILE_N, warps, stages]}}:
                split-KV decode; absent: the built-in heuristic.

Which table: ``VLLM_FORGE_TUNED`` = a file (used if its validators match, refused with the reason
otherwise), ``0``/``off`` (built-in defaults), or unset: the first table in this package's folder
whose validators match the running device, else the built-in defaults. Every outcome is logged once.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os

SCHEMA = "forge-tuned/1"
MATCH = ("device_name", "arch", "compute_units", "toolkit", "torch", "triton")
ENV = "VLLM_FORGE_TUNED"
HERE = os.path.dirname(os.path.abspath(__file__))

logger = logging.getLogger("vllm.forge_tuned")


class TableError(ValueError):
    """A table file that cannot be used: unreadable, malformed, or made for another device."""


def _major_minor(version: str | None) -> str | None:
    if not version:
        return None
    parts = str(version).split("+")[0].split(".")
    return ".".join(parts[:2])


def device_identity(device_index: int = 0) -> dict:
    """The MATCH keys of the running device and software, plus the driver (recorded only)."""
    import torch

    ident: dict = {"torch": _major_minor(torch.__version__)}
    try:
        import triton
        ident["triton"] = _major_minor(triton.__version__)
    except ImportError:
        ident["triton"] = None
    if not torch.cuda.is_available():
        ident.update(device_name="cpu", arch="cpu", compute_units=0, toolkit=None, driver=None)
        return ident
    props = torch.cuda.get_device_properties(device_index)
    hip = getattr(torch.version, "hip", None)
    if hip:
        arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0] or None
        toolkit = f"hip {_major_minor(hip)}"
    else:
        arch = f"sm_{props.major}{props.minor}"
        toolkit = f"cuda {_major_minor(torch.version.cuda)}"
    try:
        driver = int(torch._C._cuda_getDriverVersion())
    except Exception:  # noqa: BLE001 - recorded when the build exposes it
        driver = None
    ident.update(device_name=torch.cuda.get_device_name(device_index), arch=arch,
                 compute_units=int(props.multi_processor_count), toolkit=toolkit, driver=driver)
    return ident


def mismatch(table: dict, ident: dict) -> str | None:
    """Why `table` does not fit the device `ident` (one line), or None when it does."""
    val = table.get("validators")
    if not isinstance(val, dict):
        return "it has no validators"
    diffs = [f"{k} {val.get(k)!r} != {ident.get(k)!r}" for k in MATCH if val.get(k) != ident.get(k)]
    return "made for another device or stack: " + ", ".join(diffs) if diffs else None


def _check_launch(where: str, v, n: int) -> None:
    if not (isinstance(v, list) and len(v) == n and all(isinstance(x, int) and x >= 0 for x in v)):
        raise TableError(f"{where}: must be a list of {n} non-negative integers, got {v!r}")


def validate(table) -> dict:
    """Check a table's structure; return it. Raises TableError naming the key."""
    if not isinstance(table, dict):
        raise TableError("the table is not a JSON object")
    if table.get("schema") != SCHEMA:
        raise TableError(f"key 'schema': {table.get('schema')!r}, expected {SCHEMA!r}")
    val = table.get("validators")
    if not isinstance(val, dict) or any(k not in val for k in MATCH):
        raise TableError(f"key 'validators': must hold {', '.join(MATCH)}")
    for kind, shapes in (table.get("gemv") or {}).items():
        if kind not in ("plain", "fused") or not isinstance(shapes, dict):
            raise TableError(f"key 'gemv.{kind}': expected 'plain' or 'fused' mapping shapes")
        for shape, rows in shapes.items():
            nk = shape.lower().split("x")
            if len(nk) != 2 or not all(p.isdigit() for p in nk) or not isinstance(rows, dict):
                raise TableError(f"key 'gemv.{kind}.{shape}': expected 'NxK': {{'M': [block, rows]}}")
            for m, launch in rows.items():
                if m not in ("1", "2", "3", "4"):
                    raise TableError(f"key 'gemv.{kind}.{shape}.{m}': token count must be 1-4")
                _check_launch(f"key 'gemv.{kind}.{shape}.{m}'", launch, 2)
    for kv, launch in (table.get("prefill") or {}).items():
        if kv not in ("16bit", "int8"):
            raise TableError(f"key 'prefill.{kv}': expected '16bit' or 'int8'")
        _check_launch(f"key 'prefill.{kv}'", launch, 4)
    dec = table.get("decode") or {}
    for b, s in (dec.get("segments") or {}).items():
        if not (str(b).isdigit() and isinstance(s, int) and s >= 1 and s & (s - 1) == 0):
            raise TableError(f"key 'decode.segments.{b}': segments must be a power of two >= 1, got {s!r}")
    for kv, launch in (dec.get("launch") or {}).items():
        if kv not in ("16bit", "int8"):
            raise TableError(f"key 'decode.launch.{kv}': expected '16bit' or 'int8'")
        _check_launch(f"key 'decode.launch.{kv}'", launch, 3)
    return table


def read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise TableError(f"cannot read it: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TableError(f"not valid JSON: {e}") from None
    return validate(data)


def committed_tables(folder: str = HERE) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.json")))


def choose(ident: dict, env: str | None, folder: str = HERE) -> tuple[dict | None, str]:
    """(table or None, one line saying which and why). Pure: no logging, no device query."""
    if env is not None and env.strip().lower() in ("0", "off", "none"):
        return None, f"{ENV}={env}: built-in defaults"
    if env:
        try:
            table = read(env)
        except TableError as e:
            return None, f"{ENV}={env} refused: {e}; built-in defaults"
        why = mismatch(table, ident)
        if why:
            return None, f"{ENV}={env} refused: {why}; built-in defaults"
        return table, f"table {env} (validators match {ident.get('device_name')} {ident.get('arch')})"
    seen = []
    for path in committed_tables(folder):
        name = os.path.basename(path)
        try:
            table = read(path)
        except TableError as e:
            seen.append(f"{name}: {e}")
            continue
        why = mismatch(table, ident)
        if why is None:
            return table, f"table {name} (validators match {ident.get('device_name')} {ident.get('arch')})"
        seen.append(f"{name}: {why}")
    where = "; ".join(seen) if seen else "no table is installed"
    return None, (f"no table for {ident.get('device_name')} {ident.get('arch')} "
                  f"{ident.get('compute_units')} CUs ({where}); built-in defaults")


@functools.cache
def active() -> dict | None:
    """The table this process uses (chosen and logged once)."""
    try:
        ident = device_identity()
    except Exception as e:  # noqa: BLE001 - no device query: defaults
        logger.warning("dcu-forge tuned table: no device identity (%s); built-in defaults", e)
        return None
    table, line = choose(ident, os.environ.get(ENV))
    (logger.info if table is not None or os.environ.get(ENV) is None else logger.warning)(
        "dcu-forge tuned table: %s", line)
    if table is not None:
        for text in describe(table):
            logger.info("dcu-forge tuned table: %s", text)
    return table


def describe(table: dict) -> list[str]:
    """One line per route the table sets, for the server log."""
    lines = []
    for kind, shapes in sorted((table.get("gemv") or {}).items()):
        for shape, rows in sorted(shapes.items()):
            picks = ", ".join(f"M={m} {'built-in' if l == [0, 0] else f'block {l[0]} rows {l[1]}'}"
                              for m, l in sorted(rows.items()))
            lines.append(f"gemv {kind} {shape}: forge GEMV at {picks}; other token counts: platform GEMM")
    for kv, launch in sorted((table.get("prefill") or {}).items()):
        lines.append(f"prefill {kv}: BLOCK_M {launch[0]}, TILE_N {launch[1]}, warps {launch[2]}, stages {launch[3]}")
    dec = table.get("decode") or {}
    for b, s in sorted((dec.get("segments") or {}).items()):
        lines.append(f"decode batch {b}: {s} segments")
    for kv, launch in sorted((dec.get("launch") or {}).items()):
        lines.append(f"decode {kv}: TILE_N {launch[0]}, warps {launch[1]}, stages {launch[2]}")
    return lines


def gemv_route(fused: bool = False) -> dict[tuple[int, int], dict[int, tuple[int, int]]] | None:
    """(N, K) -> {token count: (block, rows)} from the active table; None: no table."""
    table = active()
    if table is None or "gemv" not in table:
        return None
    shapes = (table["gemv"] or {}).get("fused" if fused else "plain") or {}
    out: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    for shape, rows in shapes.items():
        n, k = (int(p) for p in shape.lower().split("x"))
        out[(n, k)] = {int(m): (int(l[0]), int(l[1])) for m, l in rows.items()}
    return out


def prefill_launch(kv_int8: bool) -> tuple[int, int, int, int] | None:
    table = active()
    launch = ((table or {}).get("prefill") or {}).get("int8" if kv_int8 else "16bit")
    return tuple(launch) if launch else None


def decode_segments(num_seqs: int) -> int | None:
    table = active()
    segs = (((table or {}).get("decode") or {}).get("segments") or {}).get(str(num_seqs))
    return int(segs) if segs else None


def decode_launch(kv_int8: bool) -> tuple[int, int, int] | None:
    table = active()
    launch = (((table or {}).get("decode") or {}).get("launch") or {}).get("int8" if kv_int8 else "16bit")
    return tuple(launch) if launch else None
