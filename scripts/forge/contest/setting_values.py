"""A round's setting as written, read as the number the server gets: a value from configs/contest.yaml
must already be a number of the setting's type (`is_number`); a value a user gives (an environment
variable, a profile's field, an option) is a number, or its text in plain ASCII digits, that is
finite and, for a whole-number setting, whole (`coerce`); anything else is a one-line ForgeError."""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import ForgeError

# a number as a user types it: ASCII digits, an optional sign, point and exponent (float() would also
# take "1_000", other scripts' digits and surrounding blanks)
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_WHOLE = re.compile(r"[+-]?[0-9]{1,30}")


def is_number(v: Any, typ: str) -> bool:
    """Whether `v`, a loaded YAML value, is a number of type `typ` ("int": a whole number, "float": any)."""
    return not isinstance(v, bool) and (isinstance(v, int) or (typ == "float" and isinstance(v, float)))


def coerce(raw: Any, typ: str, what: str, where: str, hint: str) -> float | int:
    """`raw` (a number, or its text) as a number of type `typ`; a refusal names `what` at `where` and
    gives `hint`."""
    if isinstance(raw, bool):
        raise ForgeError(f"{where}: {what} {raw!r} is not a number", hint=hint)
    if not isinstance(raw, (int, float)) and not (isinstance(raw, str) and _NUMBER.fullmatch(raw)):
        raise ForgeError(f"{where}: {what} {raw!r} is not a number in plain digits", hint=hint)
    if typ == "int" and isinstance(raw, str):
        # the start script and the client pass the text as is, and vLLM reads it with int(): "1e3" and
        # "4.0" are refused there, so they are here
        if not _WHOLE.fullmatch(raw):
            raise ForgeError(f"{where}: {what} {raw!r} is not a whole number in plain digits", hint=hint)
        return int(raw)
    v = float(raw) if isinstance(raw, str) else raw
    if not math.isfinite(v):
        raise ForgeError(f"{where}: {what} {raw!r} is not a finite number", hint=hint)
    if typ == "int":
        if isinstance(v, float) and not v.is_integer():       # float(v) of a long whole number rounds: not this
            raise ForgeError(f"{where}: {what} {raw!r} is not a whole number", hint=hint)
        return int(v)
    if float(f"{v:g}") != v:
        # the sweep's run folders, the model's labels and the headroom's lines write a utilization with 6
        # significant digits: 0.9500000001 was served as itself, named 0.95, and a sweep of 0.95,0.9500000001
        # kept one of the two under the other's name
        raise ForgeError(f"{where}: {what} {raw!r} has more than 6 significant digits: forge's runs, records and "
                         f"lines would name it {v:g}, as they name {v:g} itself", hint=f"write at most 6 significant digits, e.g. {v:g}")
    return float(v)


def mistyped(environ, known: set[str], stems: set[str]) -> list[tuple[str, str | None]]:
    """The variables set in `environ` that read as one of `known` mistyped, each with the one it reads as (None:
    none alone): a known name in other letter case (max_num_seqs), or a stem's name ("MAX_NUM_SEQS") with a suffix
    holding a digit that names no tier (MAX_NUM_SEQS_4_8k, MAX_NUM_SEQS_48K). Nothing reads such a variable: the
    server would get the value it would get without it."""
    def bare(name: str) -> str:
        return re.sub(r"[^A-Z0-9]", "", name.upper())
    out = []
    for name in sorted(environ):
        if name in known or environ.get(name, "") == "":
            continue
        stem = next((s for s in stems if name.upper().startswith(s + "_") and re.search(r"[0-9]", name[len(s):])), None)
        if name.upper() in known or stem:
            near = [k for k in known if bare(k) == bare(name)]
            out.append((name, near[0] if len(near) == 1 else None))
    return out
