"""Option values every verb reads the same way: a TCP port, a count, a value that may not be empty,
and FORCE (make ... FORCE=1). A value outside its rule is refused, never read as another or as absent."""

from __future__ import annotations

import argparse
import os

from .errors import ForgeError


def port(text: str) -> int:
    """A TCP port, 1 to 65535 (argparse type)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return v


def count(text: str) -> int:
    """A whole number of at least 1 (argparse type): processes, repeats."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (a whole number, 1 or more)")
    return v


def nonempty(option: str, required: bool = False):
    """An argparse type for `option` that refuses an empty value (an empty value is not the default;
    for a `required` argument, such as a positional one, it is no value at all)."""
    def check(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"an empty value; give {option}" if required else
                                             f"an empty value; leave {option} out for its default")
        return text
    check.__name__ = "value"
    return check


def forced(flag: bool) -> bool:
    """--force, or FORCE=1 in the environment (`make ... FORCE=1`). FORCE set to anything other than
    1, 0 or nothing is refused: FORCE=yes must not quietly mean "no"."""
    v = os.environ.get("FORCE", "")
    if v.strip() not in ("", "0", "1"):
        raise ForgeError(f"FORCE={v!r}: expected FORCE=1 (or leave it unset)",
                         hint="make ... FORCE=1 (or --force) replaces or discards what the command would keep")
    return bool(flag) or v.strip() == "1"
