"""dcu-forge's switches, the VLLM_FORGE_* environment variables: one validator per switch value.

The patched vLLM reads its switches through `read` (vllm/envs.py: this file is carried into the tree
as vllm/forge_switches.py by kernels/overlay.yaml), and the tool checks a serve profile's values with
`check` (scripts/forge/switches.py loads this file from the checkout), so a value the profile checker
takes is one the server reads as written, and a value the server would refuse (or read as another)
never reaches it. A switch's value is one of its words, exactly as written: "yes", "on", "true" or
"maybe" is refused, never read as "0" or "1"; a value is one line.

VLLM_FORGE_TUNED names a table file: its value is checked here for its form only (one line, not
empty); the table itself is the tuned table's loader's to accept or refuse (vllm/forge_tuned), which
never stops the server.

Standard library only, no import of vLLM or torch: both sides load this file on its own."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

GEMV_ROWS = (1, 2, 3, 4)      # "NxK" without an M: the GEMV's 1-4 tokens
GEMV_MAX_TOKENS = 16          # "NxK/M": any M the GEMV runs (5-16: its skinny build)
MMA_MAX_TOKENS = 32           # "NxK/M=mma": any M the Triton skinny GEMM runs
_SHAPE = re.compile(r"[ \t]*([0-9]+)[ \t]*[xX][ \t]*([0-9]+)[ \t]*"
                    r"(?:/[ \t]*(3[0-2]|[12][0-9]|[1-9])[ \t]*(?:=[ \t]*(mma)[ \t]*)?)?")
GEMV_SHAPES_FORM = ('"NxK" (output x input features, 1-4 tokens), "NxK/M" (M = 1..16 tokens only) or "NxK/M=mma" '
                    '(M = 1..32 tokens on the matrix-unit skinny GEMM), comma-separated, e.g. '
                    '"14336x5120,5120x17408/1,5120x17408/24=mma"; or "all" (1-4 tokens)')


class SwitchError(ValueError):
    """A value that is not one of its switch's values, or a name that is not a switch."""


def gemv_launches(spec: str) -> dict[tuple[int, int], dict[int, str]] | None:
    """VLLM_FORGE_GEMV_SHAPES parsed: (N, K) -> {token count: "gemv" or "mma"} (the forge GEMV at its
    built-in launch, or the matrix-unit skinny GEMM); None for "all"; {} for "" (no override: the tables
    decide). SwitchError names the item that is not a shape, or a (shape, token count) given both ways."""
    spec = spec.strip()
    if spec == "all":
        return None
    out: dict[tuple[int, int], dict[int, str]] = {}
    if not spec:
        return out
    for item in spec.split(","):
        m = _SHAPE.fullmatch(item)
        if not m:
            raise SwitchError(f"VLLM_FORGE_GEMV_SHAPES: {item!r} is not NxK, NxK/M or NxK/M=mma; allowed: "
                              f"{GEMV_SHAPES_FORM}")
        how = m.group(4) or "gemv"
        if how == "gemv" and m.group(3) and int(m.group(3)) > GEMV_MAX_TOKENS:
            raise SwitchError(f"VLLM_FORGE_GEMV_SHAPES: {item!r}: the GEMV runs 1-{GEMV_MAX_TOKENS} tokens; above "
                              f"that only the skinny GEMM (NxK/M=mma, M up to {MMA_MAX_TOKENS}); allowed: "
                              f"{GEMV_SHAPES_FORM}")
        rows = out.setdefault((int(m.group(1)), int(m.group(2))), {})
        for r in ([int(m.group(3))] if m.group(3) else GEMV_ROWS):
            if rows.get(r, how) != how:
                raise SwitchError(f"VLLM_FORGE_GEMV_SHAPES: {spec!r}: {m.group(1)}x{m.group(2)} at {r} token(s) is "
                                  "given both on the GEMV and on the skinny GEMM (=mma); name it once")
            rows[r] = how
    return out


def gemv_shapes(spec: str) -> dict[tuple[int, int], set[int]] | None:
    """VLLM_FORGE_GEMV_SHAPES parsed: (N, K) -> the token counts that take one of our kernels; None for
    "all"; {} for "" (no override: the tables decide). SwitchError as `gemv_launches`."""
    launches = gemv_launches(spec)
    return None if launches is None else {nk: set(rows) for nk, rows in launches.items()}


def _shapes(name: str, value: str) -> str:
    gemv_shapes(value)
    return value


def _table(name: str, value: str) -> str:
    if not value.strip():
        raise SwitchError(f"{name}={value!r}: empty; allowed: a table file's path, or 0 for the built-in "
                          "defaults (leave it unset for the installed table that matches the device)")
    return value


# name -> (default, the values it takes, or a checker of its value, and what the values are)
SWITCHES: dict[str, tuple] = {
    "VLLM_FORGE_DECODE": ("1", ("0", "1"), "1: our split-KV decode kernel; 0: upstream's unified kernel"),
    "VLLM_FORGE_PREFILL": ("1", ("0", "1"), "1: our chunked-prefill kernel; 0: upstream's unified kernel"),
    "VLLM_FORGE_PREFILL_TILES": ("1", ("0", "1"), "1: 64-row prefill tiles; 0: upstream's 16"),
    "VLLM_FORGE_INT8_WRITE": ("triton", ("triton", "compiled"), "the int8 KV cache's writer"),
    "VLLM_FORGE_GEMV": ("auto", ("0", "1", "auto"), "our decode GEMV: auto, 1 (also on CUDA) or 0 (off)"),
    "VLLM_FORGE_GEMV_SHAPES": ("", _shapes, GEMV_SHAPES_FORM),
    "VLLM_FORGE_CUSTOM_AR": ("auto", ("auto", "1"), "vLLM's custom all-reduce on ROCm: auto (XGMI only) or 1"),
    "VLLM_FORGE_TUNED": (None, _table, "a tuned table's path, or 0 for the built-in defaults"),
}


def check(name: str, value) -> str:
    """`value` of switch `name` as the switch reads it; SwitchError (naming the switch, the value and
    what it takes) when it is not one of the switch's values, or `name` is no switch."""
    if name not in SWITCHES:
        raise SwitchError(f"{name} is not a dcu-forge switch; the switches are: {', '.join(SWITCHES)}")
    _, allowed, what = SWITCHES[name]
    if not isinstance(value, str):
        raise SwitchError(f"{name}={value!r}: a switch's value is a string")
    if any(c in value for c in "\n\r\0"):
        raise SwitchError(f"{name}={value!r}: a value is one line (no newline)")
    if callable(allowed):
        return allowed(name, value)
    if value not in allowed:
        raise SwitchError(f"{name}={value!r} is not one of its values: {', '.join(allowed)} ({what})")
    return value


def read(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Switch `name` as this process's environment (or `environ`) sets it, checked; its default when
    it is unset."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None:
        return SWITCHES[name][0]
    return check(name, value)


def on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A 0/1 switch read as a bool ("1": on)."""
    return read(name, environ) == "1"
