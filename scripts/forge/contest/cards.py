"""The cards a server started now would see, and the check that a multi-card topology fits them: one
card per rank, no device listed twice. Counting rule: the device variables (CUDA_VISIBLE_DEVICES,
HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES; with several set, the shortest list, since each narrows
what the next sees; a list ends at a negative index), else torch's device count when torch imports, else "cannot tell", and a
multi-card start is then refused until a device variable names the cards."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ForgeError

DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Visible:
    count: int | None            # None: cannot tell
    ids: tuple[str, ...] | None  # the device list a variable gave, else None
    source: str


def visible_cards(environ: Mapping[str, str] | None = None, torch_count: Any = None) -> Visible:
    """How many cards a server started now would see (the module's counting rule). `torch_count`: a
    callable standing in for torch.cuda.device_count (tests)."""
    environ = os.environ if environ is None else environ
    lists = [(v, listed(environ[v])) for v in DEVICE_VARS if v in environ]
    if lists:
        var, ids = min(lists, key=lambda p: len(p[1]))
        return Visible(len(ids), ids, f"{var}={environ[var]}")
    if torch_count is None:
        try:
            import torch  # heavy and optional here: only when no device variable says it
            torch_count = torch.cuda.device_count
        except Exception:                      # not installed, or a broken install: cannot tell
            return Visible(None, None, "no device variable set and torch is not importable")
    try:
        return Visible(int(torch_count()), None, "torch.cuda.device_count()")
    except Exception as e:                     # a driver error: cannot tell
        return Visible(None, None, f"torch.cuda.device_count() failed ({type(e).__name__})")


def listed(value: str) -> tuple[str, ...]:
    """The devices a device variable lists: a negative index hides itself and every device after it
    (CUDA's rule, and torch's parse of the list), so the list ends there."""
    out: list[str] = []
    for x in (x.strip() for x in value.split(",")):
        if x.startswith("-") and x[1:].isdigit():
            break
        if x:
            out.append(x)
    return tuple(out)


def check_cards(need: int, topology: str, visible: Visible, cite: str, where: str = "server") -> None:
    """Refuse a start of `topology` (needing `need` cards, one per rank) that `visible` cannot hold:
    the count unknown, a device listed twice among the first `need`, or fewer cards than `need`.
    `cite`: the rule's text and name, as the refusal quotes it."""
    if visible.count is None:
        raise ForgeError(f"{where}: cannot tell how many cards are visible ({visible.source}); {topology} needs {need}",
                         hint="set HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES) to the cards to use, e.g. 0,1")
    if visible.ids is not None:
        first = visible.ids[:need]
        dup = sorted({x for x in first if first.count(x) > 1})
        if dup:
            raise ForgeError(f"{where}: {topology} would put two ranks on device {dup[0]} ({visible.source}): {cite}",
                             hint="list each card once in the device variable")
    if visible.count < need:
        raise ForgeError(f"{where}: {topology} needs {need} cards, {visible.count} visible ({visible.source}): {cite}",
                         hint="make the cards visible, or choose a topology that fits")
