# SPDX-License-Identifier: Apache-2.0
"""Per-device launch and route table of the dcu-forge kernels: what `forge calibrate` measured on a
device, read by the patched vLLM at start-up.

Self-contained (json, os, stat, logging, torch), so the same file runs in the tool (kernels/ on the import
path) and inside vLLM, where the kernel overlay places it as ``vllm/forge_tuned/__init__.py`` and the
committed tables (``configs/kernels/tuned/*.json``) beside it.

A table (JSON, ``schema`` = SCHEMA):
    validators  what the measurements depend on; a table is used only on a device and software stack
                where every key of MATCH is equal (device name, arch, compute units, toolkit, torch,
                triton), and only at its own tensor-parallel degree: ``tp`` (the shapes of one rank
                were measured) with ``heads`` = [q heads, KV heads] of one rank's attention. A
                mismatch is refused with a one-line reason, never used silently.
    provenance  where it came from (project commit, and the hash of its diff when the tree was dirty;
                patch series, kernel-source hash, driver, date, command, report folder): recorded, not
                matched, because the submission's vLLM is built from the vendor tree with a version string
                of its own, and a commit that leaves the kernels alone does not change what is fast. A
                table that is shipped (carried into a tree, a wheel or a submission) names no path of the
                machine that made it (`shipping_problems`).
    gemv        {"plain"|"fused": {"NxK": {"M": [block, rows] | "mma"}}}: the (shape, token count)
                pairs at which one of our kernels beat the platform's GEMM, and which: [block, rows]
                our decode GEMV (forge_gemv.cu) at that launch ([0, 0] its built-in choice); the
                string "mma" the Triton skinny GEMM on the matrix units (forge_triton/skinny_gemm.py:
                plain ``skinny_gemm``, fused ``skinny_gemm_silu_mul``) at its built-in launch, legal
                at 1-32 tokens (the GEMV's launches at 1-16), plain and fused, on every platform. A pair not listed keeps the
                platform's GEMM. `gemv_route` gives {M: (block, rows)} or {M: "mma"} per (N, K).
    prefill     {"16bit"|"int8": [BLOCK_M, TILE_N, num_warps, num_stages]}: the chunked-prefill
                kernel's launch; absent: the kernel's built-in LAUNCH table.
    decode      {"segments": {"<KV heads>": {"<batch>": {"<context>": S}}},
                 "launch": {"16bit"|"int8": [TILE_N, warps, stages]}}: split-KV decode's segments per
                (sequence, KV head) for a batch of that many sequences on a rank with that many KV
                heads (the batch the backend plans: under a FULL CUDA graph, the graph's padded size;
                `forge calibrate` measures it with the round's requests and the padding rows), measured
                over contexts up to <context> tokens (the server plans with its
                max-model-len: the smallest measured context at or above it, else the largest);
                absent: the built-in heuristic (``choose_num_segments``). Optional
                "segments_int8", the same map measured with an int8 KV cache at its own launch:
                an int8 cache takes its count there, else the one of "segments". Optional
                "qk_int8" (true / false): the int8 cache's Q.K path, measured by `forge calibrate`
                at each batch: true keeps the built-in int8 dot (the matrix unit, with its fallback
                where it does not build), false runs the K tiles converted to the query dtype (the
                int8 dot measured slower beyond the noise, or did not build). Absent: the built-in.

Older tables (``forge-tuned/1``: no ``tp`` or ``heads``, decode segments keyed by batch alone) are
read as what they were measured for: TP1, 24 q / 4 KV heads, contexts up to 32768.

Every value is checked against the kernels' own legal launches (`validate`): a table that names a
launch the kernel cannot run, a wrong type, a duplicate key or an unknown key is refused whole.

Which table: ``VLLM_FORGE_TUNED`` = a file (used if it is valid and its validators match, refused with
the reason otherwise), ``0``/``off`` (built-in defaults), or unset: the first valid table in this
package's folder whose validators match the running device, else the built-in defaults. Every outcome
is logged once, each refused malformed file with its reason; no table, however malformed, stops the
server (`active`).
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import stat

SCHEMA = "forge-tuned/2"
OLD_SCHEMA = "forge-tuned/1"          # read as TP1, 24 q / 4 KV heads (what `forge calibrate` measured then)
OLD_GEOMETRY = {"tp": 1, "heads": [24, 4], "context": 32768}
MATCH = ("device_name", "arch", "compute_units", "toolkit", "torch", "triton")
MAX_TP = 64
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


def geometry(table: dict) -> dict:
    """{"tp", "heads": [q, KV] per rank} the table was measured for (an old table: TP1, 24/4)."""
    val = table.get("validators") or {}
    if table.get("schema") == OLD_SCHEMA:
        return {"tp": OLD_GEOMETRY["tp"], "heads": list(OLD_GEOMETRY["heads"])}
    return {"tp": val.get("tp"), "heads": val.get("heads")}


def mismatch(table: dict, ident: dict, tp: int | None = None) -> str | None:
    """Why `table` does not fit the device `ident` (one line), or None when it does. `tp`: the running
    tensor-parallel degree (None: not checked)."""
    val = table.get("validators")
    if not isinstance(val, dict):
        return "it has no validators"
    diffs = [f"{k} {val.get(k)!r} != {ident.get(k)!r}" for k in MATCH if val.get(k) != ident.get(k)]
    if diffs:
        return "made for another device or stack: " + ", ".join(diffs)
    geo = geometry(table)
    if tp is not None and geo["tp"] != tp:
        q, kv = geo["heads"]
        return (f"measured at tensor-parallel degree {geo['tp']} ({q} q / {kv} KV heads per rank), this server "
                f"runs {tp}: per-rank shapes differ")
    return None


# The kernels' own legal launch sets (mirrored here so this file stays self-contained; tests/kernels
# checks each against its kernel). A table may name only these: anything else would fail at the first
# request that takes the route, on the card, in a scored run.
#   forge_gemv.cu: the launch menu `launch()` dispatches (block x rows), and the configurations it
#   builds (`Built`, per partial sums per thread = (2 if fused) x rows x M rounded up to 1/2/4/8/16: at
#   1-4 tokens at most 16 on AMD or in blocks of 640+ threads; at 5-16 tokens at most 16, or 32 on NVIDIA
#   in blocks of up to 256 threads; so the fused kernel stops at 8 tokens on AMD, its built-in launch
#   too; the fused kernel has no 8-row launch). [0, 0] is the kernel's built-in choice.
GEMV_BLOCKS = (64, 128, 256, 512, 640, 768)
GEMV_ROWS = (1, 2, 4, 8)
GEMV_FUSED_ROWS = (1, 2, 4)
GEMV_MAX_TOKENS = 16
#   forge_triton/skinny_gemm.py (MAX_M rows): a pair it serves is named by this string, never a launch
#   (it runs its built-in launch_config); it has no per-platform limit, so fused at 9-32 tokens on AMD too.
GEMV_MMA = "mma"
MMA_MAX_TOKENS = 32
#   forge_prefill_attention.py (BLOCK_M, TILE_N, num_warps, num_stages); BLOCK_M also >= the heads of
#   a KV head, which the kernel checks per model.
PREFILL_LAUNCH = ((16, 32, 64, 128, 256), (16, 32, 64, 128), (1, 2, 4, 8, 16), (1, 2, 3, 4))
#   forge_split_kv_decode.py (TILE_N, num_warps, num_stages) and the segments per (sequence, KV head):
#   any count its merge kernel holds in one tile (MAX_TABLE_SEGMENTS; the tile is the next power of two),
#   not only powers of two: a count that makes the grid a whole number of waves (e.g. 24 at batch 10, 2 KV
#   heads, 132 SMs of two programs each) measured faster than the powers beside it. Per batch size up to
#   MAX_DECODE_BATCH (the 3D-kernel threshold is far below it).
DECODE_LAUNCH = ((16, 32, 64, 128), (1, 2, 4, 8, 16), (1, 2, 3, 4))
MAX_TABLE_SEGMENTS = 256
MAX_DECODE_BATCH = 1024
MAX_CONTEXT = 1 << 24
KEYS = ("schema", "validators", "provenance", "gemv", "prefill", "decode")
KV_KINDS = ("16bit", "int8")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _mapping(where: str, v) -> dict:
    if not isinstance(v, dict):
        raise TableError(f"key '{where}': expected an object, got {type(v).__name__} {v!r:.60}")
    return v


def _launch(where: str, v, legal: tuple) -> tuple:
    names = ("BLOCK_M", "TILE_N", "num_warps", "num_stages") if len(legal) == 4 else \
        ("TILE_N", "num_warps", "num_stages")
    if not (isinstance(v, list) and len(v) == len(legal) and all(_is_int(x) for x in v)):
        raise TableError(f"key '{where}': must be a list of {len(legal)} integers "
                         f"[{', '.join(names)}], got {v!r:.80}")
    for name, x, ok in zip(names, v, legal):
        if x not in ok:
            raise TableError(f"key '{where}': {name} {x} is not one the kernel launches "
                             f"({', '.join(map(str, ok))})")
    return tuple(v)


def _mt(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8 if m <= 8 else 16


def _gemv_built(block: int, rows: int, mt: int, fused: bool, on_amd: bool) -> bool:
    """forge_gemv.cu's `Built` rule."""
    partial = (2 if fused else 1) * rows * mt
    if mt <= 4:
        return (not on_amd and block < 640) or partial <= 16
    return partial <= 16 or (not on_amd and block <= 256 and partial <= 32)


def gemv_launch_problem(block, rows, m: int, fused: bool, on_amd: bool) -> str | None:
    """Why forge_gemv.cu cannot launch (block, rows) for m tokens, or None when it can."""
    if not (_is_int(block) and _is_int(rows)):
        return f"[block, rows] must be integers, got {[block, rows]!r:.60}"
    if not (_is_int(m) and 1 <= m <= GEMV_MAX_TOKENS):
        return f"{m!r:.20} token(s): the kernel handles 1-{GEMV_MAX_TOKENS}"
    if block == 0 and rows == 0:
        if fused and on_amd and m > 8:     # the built-in launch would need 32 partial sums per thread
            return f"the fused kernel is not built for AMD at {m} tokens (it stops at 8)"
        return None                       # the kernel's built-in choice
    menu = GEMV_FUSED_ROWS if fused else GEMV_ROWS
    if block not in GEMV_BLOCKS or rows not in menu:
        return (f"[{block}, {rows}] is not in the kernel's launch menu (block {', '.join(map(str, GEMV_BLOCKS))}; "
                f"rows {', '.join(map(str, menu))}; or [0, 0] for its built-in choice)")
    if not _gemv_built(block, rows, _mt(m), fused, on_amd):
        partial = (2 if fused else 1) * rows * _mt(m)
        return (f"[{block}, {rows}] at {m} token(s) is not built for {'AMD' if on_amd else 'NVIDIA'} "
                f"({partial} partial sums per thread)")
    return None


def gemv_entry_problem(m: str, launch, fused: bool, on_amd: bool) -> str | None:
    """Why a table's entry `gemv.<kind>.NxK.<m>` = `launch` cannot run, or None when it can: [block, rows]
    forge_gemv.cu builds at m tokens, or GEMV_MMA (the skinny GEMM, 1-MMA_MAX_TOKENS tokens)."""
    legal = (f"[block, rows] of our GEMV (1-{GEMV_MAX_TOKENS} tokens) or {GEMV_MMA!r} for the skinny GEMM "
             f"(1-{MMA_MAX_TOKENS} tokens)")
    top = MMA_MAX_TOKENS if launch == GEMV_MMA else GEMV_MAX_TOKENS
    if m not in tuple(str(i) for i in range(1, top + 1)):
        return f"token count must be 1-{top} ({legal}), got {m!r:.20}"
    if isinstance(launch, str):
        return None if launch == GEMV_MMA else f"{launch!r:.40} is not a launch; expected {legal}"
    if not (isinstance(launch, list) and len(launch) == 2):
        return f"must be a list of 2 integers [block, rows] or {GEMV_MMA!r}, got {launch!r:.60}"
    return gemv_launch_problem(launch[0], launch[1], int(m), fused, on_amd)


def _on_amd(val: dict) -> bool:
    return str(val.get("toolkit") or "").startswith("hip") or str(val.get("arch") or "").startswith("gfx")


def validate(table) -> dict:
    """Check a table's structure, types and ranges against the kernels' legal launches; return it.
    Raises TableError naming the key. Never anything else, whatever the input."""
    if not isinstance(table, dict):
        raise TableError("the table is not a JSON object")
    unknown = sorted(k for k in table if k not in KEYS)
    if unknown:
        raise TableError(f"unknown key(s) {', '.join(map(repr, unknown))}; a table holds {', '.join(KEYS)}")
    if table.get("schema") not in (SCHEMA, OLD_SCHEMA):
        raise TableError(f"key 'schema': {table.get('schema')!r:.60}, expected {SCHEMA!r} (or {OLD_SCHEMA!r}, "
                         "read as TP1)")
    old = table["schema"] == OLD_SCHEMA
    val = table.get("validators")
    need = MATCH if old else MATCH + ("tp", "heads")
    if not isinstance(val, dict) or any(k not in val for k in need):
        raise TableError(f"key 'validators': must hold {', '.join(need)}")
    if not old:
        if not (_is_int(val["tp"]) and 1 <= val["tp"] <= MAX_TP):
            raise TableError(f"key 'validators.tp': the tensor-parallel degree 1-{MAX_TP}, got {val['tp']!r:.60}")
        h = val["heads"]
        if not (isinstance(h, list) and len(h) == 2 and all(_is_int(x) and x >= 1 for x in h) and h[0] % h[1] == 0):
            raise TableError(f"key 'validators.heads': [q heads, KV heads] of one rank (q a multiple of KV), "
                             f"got {h!r:.60}")
    for k in MATCH:
        v = val[k]
        if k == "compute_units":
            if not (_is_int(v) and v >= 0):
                raise TableError(f"key 'validators.compute_units': a count >= 0, got {v!r:.60}")
        elif not (v is None or isinstance(v, str)):
            raise TableError(f"key 'validators.{k}': a string or null, got {v!r:.60}")
    if "provenance" in table:
        _mapping("provenance", table["provenance"])
    on_amd = _on_amd(val)
    for kind, shapes in _mapping("gemv", table.get("gemv", {})).items():
        if kind not in ("plain", "fused"):
            raise TableError(f"key 'gemv.{kind}': expected 'plain' or 'fused'")
        for shape, rows in _mapping(f"gemv.{kind}", shapes).items():
            nk = shape.split("x")
            if len(nk) != 2 or not all(_number(p) and int(p) > 0 for p in nk):
                raise TableError(f"key 'gemv.{kind}.{shape}': expected 'NxK' with N, K > 0 (output x input features), "
                                 "each a number without leading zeros, a lower-case x between")
            if kind == "fused" and int(nk[0]) % 2:
                raise TableError(f"key 'gemv.fused.{shape}': the fused weight is [gate; up], N must be even")
            for m, launch in _mapping(f"gemv.{kind}.{shape}", rows).items():
                why = gemv_entry_problem(m, launch, kind == "fused", on_amd)
                if why:
                    raise TableError(f"key 'gemv.{kind}.{shape}.{m}': {why}")
    for kv, launch in _mapping("prefill", table.get("prefill", {})).items():
        if kv not in KV_KINDS:
            raise TableError(f"key 'prefill.{kv}': expected '16bit' or 'int8'")
        _launch(f"prefill.{kv}", launch, PREFILL_LAUNCH)
    dec = _mapping("decode", table.get("decode", {}))
    keys = ("segments", "launch") if old else ("segments", "segments_int8", "launch", "qk_int8")
    unknown = sorted(k for k in dec if k not in keys)
    if unknown:
        raise TableError(f"key 'decode': unknown key(s) {', '.join(map(repr, unknown))}; expected "
                         + ", ".join(f"'{k}'" for k in keys))
    if old:
        _batch_segments("decode.segments", _mapping("decode.segments", dec.get("segments", {})), None)
    for name in () if old else ("segments", "segments_int8"):
        for kv, batches in _mapping(f"decode.{name}", dec.get(name, {})).items():
            if not _count(kv, MAX_TABLE_SEGMENTS):
                raise TableError(f"key 'decode.{name}.{kv}': the KV heads of one rank, a count >= 1 "
                                 "(without leading zeros)")
            if int(kv) != val["heads"][1]:
                raise TableError(f"key 'decode.{name}.{kv}': measured at {kv} KV heads but the validators' heads "
                                 f"are {val['heads']} (one table per rank geometry)")
            for b, ctxs in _mapping(f"decode.{name}.{kv}", batches).items():
                _batch_segments(f"decode.{name}.{kv}", {b: 1}, None)
                _batch_segments(f"decode.{name}.{kv}.{b}", _mapping(f"decode.{name}.{kv}.{b}", ctxs), "context")
    if "qk_int8" in dec and not isinstance(dec["qk_int8"], bool):
        raise TableError(f"key 'decode.qk_int8': true (the int8 dot) or false (converted K tiles), "
                         f"got {dec['qk_int8']!r:.60}")
    for kv, launch in _mapping("decode.launch", dec.get("launch", {})).items():
        if kv not in KV_KINDS:
            raise TableError(f"key 'decode.launch.{kv}': expected '16bit' or 'int8'")
        _launch(f"decode.launch.{kv}", launch, DECODE_LAUNCH)
    return table


def _number(key: str) -> bool:
    """A key that stands for a number is written as that number reads back: digits, no leading zero (the
    loader keys its maps by int(key), so "010" beside "10" would be one key, the last replacing the other)."""
    # the length first: int() of thousands of digits raises ValueError, which is no TableError
    return key.isdigit() and key.isascii() and len(key) <= 12 and key == str(int(key))


def _count(key: str, top: int) -> bool:
    return _number(key) and 1 <= int(key) <= top


def _batch_segments(where: str, mapping: dict, what: str | None) -> None:
    """{"<batch>" (or "<context>" tokens): segments}, each a count the merge kernel holds (1-MAX_TABLE_SEGMENTS)."""
    for k, s in mapping.items():
        if what is None and not _count(k, MAX_DECODE_BATCH):
            raise TableError(f"key '{where}.{k}': a batch size 1-{MAX_DECODE_BATCH} (without leading zeros)")
        if what == "context" and not _count(k, MAX_CONTEXT):
            raise TableError(f"key '{where}.{k}': a context length in tokens 1-{MAX_CONTEXT} (without leading zeros)")
        if not (_is_int(s) and 1 <= s <= MAX_TABLE_SEGMENTS):
            raise TableError(f"key '{where}.{k}': segments must be a whole number from 1 to "
                             f"{MAX_TABLE_SEGMENTS} (what the merge kernel holds), got {s!r:.60}")


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise TableError(f"key {k!r} appears twice in one object")
        seen[k] = v
    return seen


def parse(text: str) -> dict:
    """A table from its JSON text (duplicate keys refused), validated."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as e:      # json.JSONDecodeError; RecursionError is not a ValueError
        raise TableError(f"not valid JSON: {e}") from None
    except RecursionError:
        raise TableError("not valid JSON: nested too deeply") from None
    return validate(data)


MAX_TABLE_BYTES = 4 * 2**20     # a table is a few KiB; the largest the calibration can write is far below


def read(path: str) -> dict:
    """The table in file `path`, validated. Only a regular file of at most MAX_TABLE_BYTES is read: a FIFO
    (opened without waiting for a writer), a device such as /dev/zero, a folder or a larger file is refused
    with the reason, so no file can hold up or exhaust a server at start-up."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise TableError(f"cannot read it: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TableError("not a regular file (a folder, FIFO, device or socket); a table is a JSON file")
        if st.st_size > MAX_TABLE_BYTES:
            raise TableError(f"{st.st_size} bytes, more than a table's {MAX_TABLE_BYTES}")
        data = b""
        while len(data) <= MAX_TABLE_BYTES:
            chunk = os.read(fd, MAX_TABLE_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise TableError(f"cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_TABLE_BYTES:
        raise TableError(f"more than a table's {MAX_TABLE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TableError(f"not valid JSON: {e}") from None
    return parse(text)


_HEX = set("0123456789abcdef")


def shipping_problems(table: dict) -> list[str]:
    """Why a valid table should not be shipped as it is (carried into a tree, a wheel, a submission):
    its provenance names a machine's path, or a commit that is neither clean nor dirty with the hash of
    its diff. Recorded, never matched: the loader does not refuse a table for these."""
    prov = table.get("provenance")
    if not isinstance(prov, dict) or not prov:
        return ["it has no provenance (commit, command, report)"]
    out = []
    for key in ("command", "report"):
        v = prov.get(key)
        words = v.split() if isinstance(v, str) else []
        if any(w.startswith(("/", "~")) or ":\\" in w for w in words):
            out.append(f"provenance.{key} names a path on the machine that made it ({v!r:.80})")
    commit = prov.get("commit")
    sha = commit.split()[0] if isinstance(commit, str) and commit.strip() else ""
    if not (7 <= len(sha) <= 40 and set(sha) <= _HEX):
        out.append(f"provenance.commit {commit!r:.60} is not a commit hash")
    elif commit != sha:
        diff = prov.get("diff_sha256")
        if not (isinstance(diff, str) and len(diff) == 64 and set(diff) <= _HEX):
            out.append(f"provenance.commit {commit!r} was dirty and provenance.diff_sha256 does not give the "
                       "hash of its diff")
    return out


def committed_tables(folder: str = HERE) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.json")))


def choose(ident: dict, env: str | None, folder: str = HERE, tp: int | None = None
           ) -> tuple[dict | None, str, list[str]]:
    """(table or None, one line saying which and why, malformed tables refused on the way: "file: why").
    Pure: no logging, no device query. A malformed table is skipped, whichever device it was made for:
    it never decides the selection for another. `tp`: the running tensor-parallel degree; a table
    measured at another degree is refused with the reason (None: not checked)."""
    if env is not None and env.strip().lower() in ("0", "off", "none"):
        return None, f"{ENV}={env}: built-in defaults", []
    if env:
        try:
            table = read(env)
        except TableError as e:
            return None, f"{ENV}={env} refused: {e}; built-in defaults", [f"{env}: {e}"]
        why = mismatch(table, ident, tp)
        if why:
            return None, f"{ENV}={env} refused: {why}; built-in defaults", []
        return table, f"table {env} (validators match {ident.get('device_name')} {ident.get('arch')})", []
    seen, bad = [], []
    for path in committed_tables(folder):
        name = os.path.basename(path)
        try:
            table = read(path)
        except TableError as e:
            seen.append(f"{name}: {e}")
            bad.append(f"{path}: {e}")
            continue
        why = mismatch(table, ident, tp)
        if why is None:
            return table, f"table {name} (validators match {ident.get('device_name')} {ident.get('arch')})", bad
        seen.append(f"{name}: {why}")
    where = "; ".join(seen) if seen else "no table is installed"
    return None, (f"no table for {ident.get('device_name')} {ident.get('arch')} "
                  f"{ident.get('compute_units')} CUs ({where}); built-in defaults"), bad


def running_tp() -> int | None:
    """The tensor-parallel degree of this process inside vLLM (its parallel state, set up before the
    model's layers and attention backends are built, which is where the table is first asked for), or
    None outside vLLM or before that."""
    try:
        # inside vLLM only: this file also runs in the tool, where vLLM may be absent
        from vllm.distributed import parallel_state
    except Exception:  # noqa: BLE001 - no vLLM here, or one that cannot import: not known
        return None
    try:
        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - a vLLM without these helpers: not known
        pass
    return None


def active() -> dict | None:
    """The table this process uses at its tensor-parallel degree, chosen and logged once per degree
    (an unknown degree counts as 1, and is chosen again once vLLM's parallel state knows it). Called
    where vLLM builds its layers and attention backends, never inside a traced forward. Whatever the
    folder or VLLM_FORGE_TUNED hold, this returns (a table that cannot be used means the built-in
    defaults), so no table stops a server."""
    tp = running_tp()
    return _active_at(tp or 1, tp is not None)


@functools.cache
def _active_at(tp: int, tp_known: bool) -> dict | None:
    try:
        ident = device_identity()
    except Exception as e:  # noqa: BLE001 - no device query: defaults
        logger.warning("dcu-forge tuned table: no device identity (%s); built-in defaults", e)
        return None
    try:
        table, line, bad = choose(ident, os.environ.get(ENV), tp=tp)
    except Exception as e:  # noqa: BLE001 - a loader bug must not stop the server either
        logger.warning("dcu-forge tuned table: could not choose a table (%s: %s); built-in defaults",
                       type(e).__name__, e)
        return None
    for b in bad:
        logger.warning("dcu-forge tuned table: refused %s", b)
    (logger.info if table is not None or os.environ.get(ENV) is None else logger.warning)(
        "dcu-forge tuned table (tensor-parallel degree %s): %s", tp if tp_known else "1, not known yet", line)
    if table is not None:
        for text in describe(table):
            logger.info("dcu-forge tuned table: %s", text)
    return table


active.cache_clear = _active_at.cache_clear


def describe(table: dict) -> list[str]:
    """One line per route the table sets, for the server log."""
    lines = []
    for kind, shapes in sorted((table.get("gemv") or {}).items()):
        for shape, rows in sorted(shapes.items()):
            ms = sorted(rows, key=int)
            gemv = ", ".join(f"M={m} {'built-in' if rows[m] == [0, 0] else f'block {rows[m][0]} rows {rows[m][1]}'}"
                             for m in ms if rows[m] != GEMV_MMA)
            mma = ", ".join(f"M={m}" for m in ms if rows[m] == GEMV_MMA)
            picks = "; ".join(p for p in (gemv and f"forge GEMV at {gemv}",
                                          mma and f"forge skinny GEMM (matrix units, built-in launch) at {mma}") if p)
            lines.append(f"gemv {kind} {shape}: {picks}; other token counts: platform GEMM")
    for kv, launch in sorted((table.get("prefill") or {}).items()):
        lines.append(f"prefill {kv}: BLOCK_M {launch[0]}, TILE_N {launch[1]}, warps {launch[2]}, stages {launch[3]}")
    dec = table.get("decode") or {}
    for kv_int8 in (False, True) if dec.get("segments_int8") else (False,):
        for kv, batches in sorted(decode_segment_table(table, kv_int8, alone=kv_int8).items()):
            for b, ctxs in sorted(batches.items()):
                picks = ", ".join(f"{s} up to {c} tokens" for c, s in sorted(ctxs.items()))
                lines.append(f"decode {'int8 ' if kv_int8 else ''}{kv} KV head(s), batch {b}: {picks} segments")
    for kv, launch in sorted((dec.get("launch") or {}).items()):
        lines.append(f"decode {kv}: TILE_N {launch[0]}, warps {launch[1]}, stages {launch[2]}")
    if "qk_int8" in dec:
        lines.append("decode int8 Q.K: " + ("the int8 dot (built-in)" if dec["qk_int8"] else
                                            "K tiles converted to the query dtype (the int8 dot measured slower)"))
    return lines


def gemv_route(fused: bool = False) -> dict[tuple[int, int], dict[int, tuple[int, int] | str]] | None:
    """(N, K) -> {token count: (block, rows) of our GEMV, or GEMV_MMA ("mma": the Triton skinny GEMM at
    its built-in launch)} from the active table; None: no table."""
    table = active()
    if table is None or "gemv" not in table:
        return None
    shapes = (table["gemv"] or {}).get("fused" if fused else "plain") or {}
    out: dict[tuple[int, int], dict[int, tuple[int, int] | str]] = {}
    for shape, rows in shapes.items():
        n, k = (int(p) for p in shape.split("x"))
        out[(n, k)] = {int(m): GEMV_MMA if l == GEMV_MMA else (int(l[0]), int(l[1])) for m, l in rows.items()}
    return out


def prefill_launch(kv_int8: bool) -> tuple[int, int, int, int] | None:
    table = active()
    launch = ((table or {}).get("prefill") or {}).get("int8" if kv_int8 else "16bit")
    return tuple(launch) if launch else None


def decode_segment_table(table: dict | None, kv_int8: bool = False,
                         alone: bool = False) -> dict[int, dict[int, dict[int, int]]]:
    """{KV heads: {batch: {context: segments}}} of a table, an old one's read as 4 KV heads, 32K; with
    `kv_int8`, the int8 cache's: "segments_int8" over "segments" where it measured the batch (`alone`:
    "segments_int8" by itself)."""
    dec = (table or {}).get("decode") or {}
    segs = dec.get("segments") or {}
    if (table or {}).get("schema") == OLD_SCHEMA:
        kv = OLD_GEOMETRY["heads"][1]
        return {kv: {int(b): {OLD_GEOMETRY["context"]: int(s)} for b, s in segs.items()}} if segs else {}
    out: dict[int, dict[int, dict[int, int]]] = {}
    for name in (() if alone else ("segments",)) + (("segments_int8",) if kv_int8 else ()):
        for kv, batches in (dec.get(name) or {}).items():
            for b, ctxs in batches.items():
                out.setdefault(int(kv), {})[int(b)] = {int(c): int(s) for c, s in ctxs.items()}
    return out


def decode_segments(num_seqs: int, num_kv_heads: int | None = None, max_context: int | None = None,
                    kv_int8: bool = False) -> int | None:
    """The measured segment count for a batch of `num_seqs` on a rank with `num_kv_heads` KV heads
    (None: the table's) serving contexts up to `max_context` (None: the longest measured), for an int8
    KV cache with `kv_int8`; None where the table did not measure it (the built-in heuristic runs)."""
    by_kv = decode_segment_table(active(), kv_int8)
    if num_kv_heads is None and len(by_kv) == 1:
        num_kv_heads = next(iter(by_kv))
    ctxs = by_kv.get(num_kv_heads, {}).get(int(num_seqs))
    if not ctxs:
        return None
    at_or_above = [c for c in ctxs if max_context is None or c >= max_context]
    return ctxs[min(at_or_above) if at_or_above and max_context is not None else max(ctxs)]


def decode_qk_int8() -> bool | None:
    """The int8 cache's Q.K path from the active table: False (converted K tiles) where the table says
    so; None otherwise (the kernel's built-in: the int8 dot, falling back where it does not build). A
    table's true is the built-in too, never the int8 dot asked for by name (whose build error is raised)."""
    return False if ((active() or {}).get("decode") or {}).get("qk_int8") is False else None


def decode_launch(kv_int8: bool) -> tuple[int, int, int] | None:
    table = active()
    launch = (((table or {}).get("decode") or {}).get("launch") or {}).get("int8" if kv_int8 else "16bit")
    return tuple(launch) if launch else None
