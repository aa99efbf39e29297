"""The cards a server started now would see, and the check that a multi-card topology fits them: one
card per rank, no device listed twice. Counting rule: the device variables (CUDA_VISIBLE_DEVICES,
HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES; with several set, the shortest list, since each narrows
what the next sees; a list ends at a negative index), else torch's device count when torch imports, else "cannot tell", and a
multi-card start is then refused until a device variable names the cards. Also the cards' total memory as
their management tool reports it (`card_memory`: nvidia-smi, hy-smi or rocm-smi)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from shutil import which
from typing import Any, Callable, Mapping

from .. import proc, ui
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


# the tools and how each gives the cards' total memory: nvidia-smi in MiB, one card a line; rocm-smi
# "GPU[i] : VRAM Total Memory (B): N", hy-smi "HCU[i] : vram Total Memory (MiB): N" (DCU[i] on some drivers)
SMI = (("nvidia-smi", ["--query-gpu=memory.total", "--format=csv,noheader,nounits"]),
       ("hy-smi", ["--showmeminfo", "vram"]), ("rocm-smi", ["--showmeminfo", "vram"]))
_VRAM = re.compile(r"(?im)^\s*\w+\[\s*\d+\s*\]\s*:\s*vram total memory \((b|kib|mib|gib)\)\s*:\s*(.*?)\s*$")
UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
MIB = UNITS["mib"]


class _Unread(Exception):
    """A tool's answer with a card's figure that is no memory."""


def _totals(tool: str, text: str) -> list[int]:
    """Each card's total memory in bytes as `tool` reports it, in its order; [] where it names no card. A card's
    figure that is not a whole number of its unit above 0 ("[N/A]", "0", "81559 MiB") makes the answer unread
    (_Unread): taken, a card was priced at 0 bytes, or the figures after it went to the cards before it."""
    if tool == "nvidia-smi":
        figures = [("MiB", x.strip()) for x in text.splitlines() if x.strip()]
    else:
        figures = [(unit, value) for unit, value in _VRAM.findall(text)]
    for i, (unit, value) in enumerate(figures):
        if not (value.isascii() and value.isdigit() and int(value) > 0):
            raise _Unread(f"{tool}: card {i}'s total memory {value[:40]!r} is not a number of {unit} above 0")
    return [int(value) * UNITS[unit.lower()] for unit, value in figures]


ORDERED_BY = ", "       # card_memory's source names the device variable that ordered its cards after this


def card_memory(environ: Mapping[str, str] | None = None,
                run: Callable[[list[str]], str] | None = None) -> tuple[list[int], str] | None:
    """The total memory in bytes of each card a server started now would see, in the order it sees them,
    and where the figures come from; None where no tool answers with figures (one that answers with a card's
    figure it cannot give is said, and the next tool asked). `run`: stands in for the tools (tests)."""
    environ = os.environ if environ is None else environ
    out = None
    for tool, args in SMI:
        if run is None and not which(tool):
            continue
        try:
            text = (run or (lambda cmd: proc.output(cmd, what=tool, timeout=30)))([tool, *args])
            totals = _totals(tool, text)
        except ForgeError:
            continue
        except _Unread as e:
            ui.warn(f"{e}: no card's memory is read from {tool}'s answer")
            continue
        if totals:
            out = (totals, tool)
            break
    if out is None:
        return None
    totals, source = out
    # the device variables narrow and reorder what a server sees (cards.visible_cards' rule: the
    # shortest list, each ending at a negative index); ids the tool's order does not give (UUIDs) leave
    # every card counted
    lists = [(v, listed(environ[v])) for v in DEVICE_VARS if v in environ]
    if lists:
        var, ids = min(lists, key=lambda p: len(p[1]))
        if all(x.isdigit() and int(x) < len(totals) for x in ids):
            return [totals[int(x)] for x in ids], f"{source}{ORDERED_BY}{var}={environ[var]}"
    return totals, source


def ranks_cards(seen: tuple[list[int], str], ranks: int) -> list[int]:
    """The memory of the cards a server's `ranks` take, of card_memory's answer `seen`: the first `ranks` where a
    device variable listed the cards as the server sees them (pricing the smallest of a longer list priced a card
    no rank uses); every card where none did (the runtime's order may not be the tool's)."""
    totals, source = seen
    return totals[:ranks] if ORDERED_BY in source else totals
