"""Option values every verb reads the same way: a TCP port, a count (with an upper bound where one
exists), a value that may not be empty, and the boolean make variables (make ... FORCE=1, THREEWAY=1).
A value outside its rule is refused, never read as another or as absent."""

from __future__ import annotations

import argparse
import math
import os
import re

from .errors import ForgeError

# the one way the tool reads a number a user typed: ASCII digits with an optional sign, point and
# exponent. Python's float() and int() also take "1_000", other scripts' digits ("१२"), "inf", "nan" and
# surrounding blanks; none of those is a number on our command line.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_WHOLE = re.compile(r"[+-]?[0-9]+")


def parse_number(text: str) -> float | None:
    """`text` as a finite number, or None when it is not one written in plain ASCII digits (see _NUMBER)
    or its value is out of a float's range."""
    if not isinstance(text, str) or not _NUMBER.fullmatch(text):
        return None
    v = float(text)
    return v if math.isfinite(v) else None


def parse_whole(text: str) -> int | None:
    """`text` as a whole number written in plain ASCII digits (an optional sign), else None."""
    if not isinstance(text, str) or not _WHOLE.fullmatch(text) or len(text) > 30:
        return None
    return int(text)


def not_plain(text: str, whole: bool) -> str | None:
    """What keeps a value's text from being written plainly, as the finals' start script and client pass it on
    as written: "a sign" (+64, -4) or, for a whole number, "a leading zero" (064); None where nothing does."""
    if text.startswith(("+", "-")):
        return "a sign"
    return "a leading zero" if whole and len(text) > 1 and text.startswith("0") else None


def unplain(text: str, whole: bool = True) -> str | None:
    """What keeps `text`, a number as parse_whole (or, not `whole`, parse_number) reads it, from being written
    plainly: "a sign" (+4) or, for a whole number, "a leading zero" (04), as the final round's variables refuse
    them (not_plain); None where nothing does, or `text` is no such number. A negative number is
    left to the value's range ("-4" is refused by what it is)."""
    v = parse_whole(text) if whole else parse_number(text)
    return None if v is None or text.startswith("-") else not_plain(text, whole)


def refuse_unplain(text: str, option: str, whole: bool = True, example: str | None = None) -> None:
    """Refuse `option`'s value `text` (one number, or comma-separated ones) where a number of it is not written
    plainly (`unplain`), naming it, with the plain numbers as the fix (written after `example`, default `option`):
    the value would be read as a number that is not what was typed, where the final round's start script and
    client take the text as written."""
    items = [x.strip() for x in text.split(",")]
    bad = [(x, why) for x in items for why in [unplain(x, whole)] if why]
    if bad:
        x, why = bad[0]
        plain = [(str(parse_whole(y)) if whole else y[1:]) if unplain(y, whole) else y for y in items]
        fixed = ",".join(dict.fromkeys(plain))
        raise ForgeError(f"{option} {text!r}: " + (f"{x!r}: " if len(items) > 1 else "") + f"{why} before the number",
                         hint=f"write the plain number{'s' if len(items) > 1 else ''}, e.g. "
                              + (f"{example} {fixed}" if example else written(option, fixed)))


def written(what: str, value: str) -> str:
    """`what` given `value` as the user writes it: a make or environment variable (`named`'s UTIL) as UTIL=0.95,
    an option as --gpu-memory-utilization 0.95."""
    return f"{what}={value}" if what.isupper() and what.isidentifier() else f"{what} {value}"


def refuse_repeats(text: str, option: str, values: list, why: str) -> None:
    """Refuse a list option's value `text` where two of its `values` (as read) are one, naming it: `why` says what
    the repeat would do (its configurations modelled or served once), never dropped silently."""
    if len(set(values)) < len(values):
        raise ForgeError(f"{option} {text}: a value given twice ({why})", hint="give each value once")


def number_in(lo: float, hi: float, what: str, example: str, lo_open: bool = False):
    """An argparse type: a number (parse_number) from `lo` to `hi` (`lo` itself excluded with
    `lo_open`); `what` names the quantity, `example` a good value."""
    def check(text: str) -> float:
        v = parse_number(text)
        if v is None or v < lo or (lo_open and v == lo) or v > hi:
            low = f"> {lo:g}" if lo_open else f">= {lo:g}"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} {low} and <= {hi:g} (e.g. {example})")
        return v
    check.__name__ = "number"
    return check


def whole_in(lo: int, hi: int | None, what: str):
    """An argparse type: a whole number (parse_whole) from `lo` to `hi` (None: no upper bound)."""
    def check(text: str) -> int:
        v = parse_whole(text)
        if v is None or v < lo or (hi is not None and v > hi):
            rng = f"{lo} or more" if hi is None else f"{lo} to {hi}"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} (a whole number, {rng})")
        return v
    check.__name__ = "count"
    return check


def strict(kind: type):
    """The argparse type that stands for `int` or `float` in every verb (cli.ForgeParser swaps it in):
    the same number, read only as parse_whole / parse_number read it."""
    def check(text: str):
        v = parse_whole(text) if kind is int else parse_number(text)
        if v is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not a " + ("whole number" if kind is int else "finite number")
                                             + " written in plain digits (e.g. " + ("4" if kind is int else "1.5") + ")")
        return v
    check.__name__ = kind.__name__
    return check


def port(text: str) -> int:
    """A TCP port, 1 to 65535 (argparse type)."""
    v = parse_whole(text)
    v = 0 if v is None else v
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return v


def shm_size(text: str) -> str:
    """A container's shared memory as docker and podman read --shm-size: a whole number of bytes, or of
    k, m or g (argparse type)."""
    t = text.strip()
    if not re.fullmatch(r"[1-9][0-9]{0,15}[bkmgBKMG]?", t):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size of shared memory (a whole number with an "
                                         "optional unit b, k, m or g, e.g. 64g)")
    return t


def count(text: str) -> int:
    """A whole number of at least 1 (argparse type): processes, repeats."""
    v = parse_whole(text)
    v = 0 if v is None else v
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


def comma_items(text: str, option: str, hint: str) -> list[str]:
    """The items of a comma-separated option value, blanks stripped; an empty item ("bf16,", "16,,32") is
    refused as what it is, a comma too many, never read as a value named ''."""
    items = [x.strip() for x in text.split(",")]
    if any(not x for x in items):
        raise ForgeError(f"{option} {text!r}: an empty item (a comma too many, or nothing between two)", hint=hint)
    return items


def tier_items(text: str | None, tiers: list[str]) -> list[str] | None:
    """--tiers as bench-all-tiers and sweep read it (None: left out, every tier): the tiers typed, each as
    written (a name is checked by the verb); a list of nothing ("," or " ") names no tier, and an empty item
    among names ("4-8K,", "4-8K,,8-16K") is refused as comma_items refuses one, never skipped."""
    if text is None:
        return None
    hint = f"tiers: {', '.join(tiers)}"
    if not text.replace(",", "").strip():
        raise ForgeError("--tiers names no tier", hint=hint)
    return comma_items(text, "--tiers", hint)


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


def named(option: str, var: str, value: str) -> str:
    """How a refusal names a value: the make variable `var` where `make ... VAR=value` passed it as
    `option` (make runs the verb with VAR in its environment), else the option."""
    return var if os.environ.get("MAKELEVEL") and os.environ.get(var) == value else option


def forced(given: bool) -> bool:
    """--force, or FORCE=1 in the environment (`make ... FORCE=1`); see `flag`."""
    return flag("FORCE", given, hint="make ... FORCE=1 (or --force) replaces or discards what the command would keep")


def idle_force(given: bool, without: str, fix: str) -> None:
    """Refuse --force given where the command writes nothing (`without`: what it lacks, e.g. "without --out"):
    nothing is replaced, so the flag would be ignored without a word. `fix` says how to write. FORCE=1 in the
    environment alone is not refused (a shell may keep it); given through make (`make ... FORCE=1`), FORCE is named."""
    if given:
        force = "FORCE=1" if named("--force", "FORCE", "1") == "FORCE" else "--force"
        raise ForgeError(f"{force} {without}: nothing is written, so there is nothing for {force} to replace",
                         hint=f"{fix}, or leave out {force}")


def _dashed(token: str) -> str:
    """A long option as vLLM's parser reads it: `--max_num_seqs=4` is `--max-num-seqs=4` (the value kept)."""
    if not token.startswith("--"):
        return token
    name, eq, value = token.partition("=")
    return name.replace("_", "-") + eq + value


def last_value(argv: list[str], *options: str) -> str | None:
    """The value a command line's parser keeps for an option (vLLM's, the benchmark client's: its last
    occurrence, any of its spellings, `--opt V`, `--opt=V` or `--opt_name V`), or None."""
    argv = [_dashed(a) for a in argv]
    vals = [v for i, a in enumerate(argv) for o in options
            for v in ([argv[i + 1]] if a == o and i + 1 < len(argv) else [a[len(o) + 1:]] if a.startswith(o + "=")
                      else [])]
    return vals[-1] if vals else None


def last_int(argv: list[str], *options: str) -> int | None:
    """`last_value` as a whole number, or None where it is absent or not digits."""
    v = last_value(argv, *options)
    return int(v) if v is not None and v.isdigit() else None
