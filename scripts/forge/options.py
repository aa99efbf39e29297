"""Option values every verb reads the same way: a TCP port, a count (with an upper bound where one
exists), a value that may not be empty, and the boolean make variables (make ... FORCE=1, THREEWAY=1).
A value outside its rule is refused, never read as another or as absent."""

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


def count_upto(most: int, what: str):
    """An argparse type: a count (as `count`) of at most `most`; `what` names the bound, e.g. "this
    machine's 2 cores"."""
    def check(text: str) -> int:
        v = count(text)
        if v > most:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {what} (at most {most})")
        return v
    check.__name__ = "count"
    return check


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's share), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


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


BOOLEAN_WORDS = ("", "0", "1")      # what every boolean make variable takes: nothing or 0 (no), 1 (yes)


def flag(name: str, given: bool = False, hint: str | None = None) -> bool:
    """A boolean make variable read from the environment (`make ... NAME=1`), or'ed with its option
    (`given`). Every one takes the same words, 1 (yes), 0 or nothing (no); any other value is refused:
    NAME=yes must not quietly mean "no"."""
    v = os.environ.get(name, "")
    if v.strip() not in BOOLEAN_WORDS:
        raise ForgeError(f"{name}={v!r}: a yes/no make variable takes 1 (yes) or 0 (no), or leave it unset",
                         hint=hint or f"make ... {name}=1")
    return bool(given) or v.strip() == "1"


def forced(given: bool) -> bool:
    """--force, or FORCE=1 in the environment (`make ... FORCE=1`); see `flag`."""
    return flag("FORCE", given, hint="make ... FORCE=1 (or --force) replaces or discards what the command would keep")
