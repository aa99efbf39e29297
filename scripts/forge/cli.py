"""The `forge` command. Each module of this package that defines `register(subparsers)` adds its
verbs; a verb's handler takes the parsed args and returns an exit code (or None for 0)."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import signal
import sys

from . import __version__, options, proc
from .errors import ForgeError

STAGES = ("builder", "run", "lab")
# the packages whose modules may define verbs; a module of `ship` (above both stages) says in
# HELP_STAGE which stage's verbs its own are listed with
VERB_PACKAGES = ("", "builder", "run", "ship", "lab")
HEADINGS = {"builder": "build (source -> tree -> patches -> wheel -> image)",
            "run": "run (serve -> bench -> score -> report)",
            "lab": "lab (GPU stand-in harness; not the product)",
            "": "project (environment, tests)"}


# an option value that starts like a negative number ("-1", "-1.5,2,3", "-.5") is a value, so the
# verb's own check refuses it with its rule instead of argparse's "expected one argument"
_NUMBER_LIKE = re.compile(r"^-\.?\d")


class ForgeParser(argparse.ArgumentParser):
    """argparse with the tool's rules for option values: a value that starts like a negative number
    is a value; `type=int` and `type=float` read plain ASCII digits only (options.strict); an empty value is refused (unless `keep_empty`: the lab's verbs, where '' may mean
    "none"); and a mistake is one line naming the option, with where to look."""

    def __init__(self, *args, keep_empty: bool = False, **kw):
        self.keep_empty = keep_empty
        super().__init__(*args, **kw)

    def _parse_optional(self, arg_string):
        if _NUMBER_LIKE.match(arg_string) and not self._has_negative_number_optionals:
            return None
        return super()._parse_optional(arg_string)

    def _get_value(self, action, arg_string):
        # a whole number typed with a sign or a leading zero (--top 04, --num-prompts +8) is refused as the final
        # round's variables refuse one, after the option's own check (which refuses "+0" by its range)
        value = super()._get_value(action, arg_string)
        why = options.unplain(arg_string) if isinstance(value, int) and isinstance(arg_string, str) else None
        if why:
            opt = f"{action.option_strings[-1]} " if action.option_strings else ""
            raise argparse.ArgumentError(action, f"{arg_string!r}: {why} before the number\n  fix: write the plain "
                                                 f"number, e.g. {opt}{value}")
        return value

    def add_argument(self, *args, **kw):
        return self._once(self._nonempty(super().add_argument(*args, **_strict_numbers(kw))))

    @staticmethod
    def _once(action):
        # an option that holds one value, given twice (a Makefile variable and the same option typed): the
        # parser kept the last and said nothing
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = _StoreOnce
        return action

    def _nonempty(self, action):
        if not self.keep_empty and action.nargs != 0 and action.type is None and action.choices is None:
            action.type = options.nonempty(action.option_strings[-1] if action.option_strings else
                                           (action.metavar or action.dest).upper(),
                                           required=action.required or not action.option_strings)
        return action

    def add_argument_group(self, *args, **kw):
        # a group's options follow the parser's rules too (an empty value in a group was taken as omitted)
        group = super().add_argument_group(*args, **kw)
        plain = group.add_argument
        group.add_argument = lambda *a, **k: self._once(self._nonempty(plain(*a, **_strict_numbers(k))))
        return group

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        _GIVEN.clear()
        ns, extra = self.parse_known_args(argv, namespace)
        if extra:
            prog = f"{self.prog} {ns.verb}" if getattr(ns, "verb", None) else self.prog
            self.exit(2, f"{prog}: error: {leftover_message(argv, extra, prog)}\n  fix: `{prog} --help` lists its "
                         "options\n")
        return ns

    def error(self, message: str):
        # a message with its own fix (_get_value's) is given as it is
        fix = "" if "\n  fix: " in message else f"\n  fix: `{self.prog} --help` lists its options"
        self.exit(2, f"{self.prog}: error: {message}{fix}\n")


_GIVEN: dict[int, str] = {}       # the one-value options given in this parse: the action's id -> its first value


class _StoreOnce(argparse._StoreAction):
    """A one-value option given a second time is refused, naming both values (argparse kept the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if id(self) in _GIVEN:
            raise argparse.ArgumentError(self, f"given twice ({_GIVEN[id(self)]!r}, then {values!r}); it takes one "
                                               "value")
        _GIVEN[id(self)] = values
        super().__call__(parser, namespace, values, option_string)


def _strict_numbers(kw: dict) -> dict:
    """An option's keywords with `type=int` / `type=float` read as options.strict reads them: one reading
    of a typed number for every verb (plain ASCII digits; "1_000", "inf", other scripts' digits refused)."""
    if kw.get("type") in (int, float):
        kw = {**kw, "type": options.strict(kw["type"])}
    return kw


def leftover_message(argv: list[str], extra: list[str], prog: str = "forge") -> str:
    """What argparse would call "unrecognized arguments": an option `prog` (the verb) does not have, named;
    else words said of the option they follow when they come right after its one value: a value with a blank
    in it (make score RUN="a b") split into words. An option after a value is no such word: `--run R --bogus`
    was "--run takes one value, given 1 words ('R')"."""
    if extra[0].startswith("-") and not _NUMBER_LIKE.match(extra[0]):
        return f"{extra[0].split('=', 1)[0]}: not an option of {prog}"
    for i in range(2, len(argv)):
        if argv[i] == extra[0] and argv[i - 2].startswith("--") and "=" not in argv[i - 2] \
                and not argv[i - 1].startswith("-"):
            words = [argv[i - 1], *[w for w in argv[i:] if w in extra and (_NUMBER_LIKE.match(w) or w[:1] != "-")][:3]]
            unknown = [w.split("=", 1)[0] for w in extra if w.startswith("-") and not _NUMBER_LIKE.match(w)]
            return (f"{argv[i - 2]} takes one value, given {len(words)} words ({' '.join(map(repr, words))}): a value "
                    "is one plain word (a run id, a name, a path without blanks)"
                    + "".join(f"; {u}: not an option of {prog}" for u in dict.fromkeys(unknown)))
    return "unrecognized arguments: " + " ".join(extra)


class _Verbs:
    """What a module's register() is given: it adds the verb's parser as argparse would (described
    by its one-line help where it has no longer description) and keeps that help for the listing
    grouped by stage."""

    def __init__(self, sub, stage: str, listing: dict):
        self.sub, self.stage, self.listing = sub, stage, listing

    def add_parser(self, name: str, **kw):
        short = kw.pop("help", "") or ""
        if not short.strip():
            raise ValueError(f"verb {name}: no one-line help")         # caught by the tests, never by a user
        self.listing.setdefault(self.stage, []).append((name, short))
        kw.setdefault("description", short[:1].upper() + short[1:] + ".")
        return self.sub.add_parser(name, keep_empty=self.stage == "lab", **kw)


def listed_stage(module) -> str:
    """The stage whose verbs `forge --help` lists a verb module's with: its HELP_STAGE, else its
    package's ("" for the core's)."""
    default = module.__name__.split(".")[1] if module.__name__.count(".") > 1 else ""
    return getattr(module, "HELP_STAGE", default)


def verb_modules() -> list:
    """Every module of the core and of the packages above it that defines `register(subparsers)`, in
    the order they are registered: by the stage they are listed with, then by name."""
    found = []
    for prefix in VERB_PACKAGES:
        pkg = importlib.import_module(f"{__package__}.{prefix}".rstrip("."))
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            if info.ispkg or info.name in ("cli", "__main__"):
                continue
            m = importlib.import_module(f"{pkg.__name__}.{info.name}")
            if hasattr(m, "register"):
                found.append(m)
    order = ("", *STAGES)
    return sorted(found, key=lambda m: (order.index(listed_stage(m)), m.__name__.rsplit(".", 1)[1]))


def build_parser() -> argparse.ArgumentParser:
    p = ForgeParser(
        prog="forge", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build, serve, benchmark and score a patched vLLM 0.18.1 for Qwen3.5-27B on Hygon DCU.")
    p.add_argument("--version", action="version", version=f"dcu-forge {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", help="one of the verbs below")
    listing: dict[str, list[tuple[str, str]]] = {}
    for m in verb_modules():
        m.register(_Verbs(sub, listed_stage(m), listing))
    width = max(len(n) for verbs in listing.values() for n, _ in verbs) + 2
    lines = []
    for stage in (*STAGES, ""):
        lines += ["", f"{HEADINGS[stage]}:"]
        lines += [f"  {n:<{width}}{h}" for n, h in sorted(listing.get(stage, []))]
    p.epilog = "verbs, by stage:\n" + "\n".join(lines[1:]) + "\n\n`forge VERB --help` describes a verb."
    return p


def _os_error(e: OSError) -> str:
    """One line for an OSError that names a path: the path, what is wrong with it, what to check."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    if isinstance(e, NotADirectoryError):
        what = "a part of this path is a file, not a folder"
    elif isinstance(e, FileExistsError):
        what = "already exists" + (" as a file" if os.path.isfile(e.filename) else "")
    elif isinstance(e, IsADirectoryError):
        what = "is a folder, not a file"
    else:
        what = e.strerror or str(e)
    return f"{where}: {what}; check the path"


STARTING = "forge: interrupted while starting; nothing was done"
# the verbs whose finished stages a rerun keeps and goes on from (read from each verb's code): the verified
# source cache, the tree's recorded commits, the wheel and the rehearsals' venvs and stand-in base (reused
# while their inputs are unchanged), the image's build cache, a run's served record and finished tiers
# (--run-id), a sweep's measured configurations (--sweep-id), a calibration's families, an accuracy
# evaluation's records, an e2e results folder's tiers, `make test`'s image rehearsal. Every other verb has
# nothing to resume: Ctrl-C says so (interrupted() below).
RESUMES = frozenset({"fetch", "tree", "wheel", "image", "rehearsal", "image-rehearsal", "toolchain-check", "test",
                     "serve", "bench-all-tiers", "sweep", "calibrate", "accuracy", "e2e-gpu"})


def interrupted(verb: str, how: str) -> str:
    """The line for a verb ended by Ctrl-C or a signal (`how`): a resuming verb (RESUMES) keeps its
    finished stages; any other (plan, predict, ...) has none to resume, and is simply run again."""
    if verb in RESUMES:
        return f"forge {verb}: {how}; finished stages are kept, rerun to resume"
    return f"forge {verb}: {how}; it has no stages to resume: rerun the command"


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()             # imports every verb's module: the first moments of any verb
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print(STARTING, file=sys.stderr)
        return 130
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with proc.signals_as_interrupt():   # SIGTERM and SIGHUP end a verb as Ctrl-C does: its clean-up runs
            rc = args.func(args)
    except ForgeError as e:
        print(f"forge {args.verb}: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        # a path the verb could not create, read or write (a file where a folder is needed, no
        # permission, disk full): the user fixes the path; an OSError naming no path is unexpected
        if e.filename is None:
            raise
        print(f"forge {args.verb}: error: {_os_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, proc.Terminated) else signal.SIGINT
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(interrupted(args.verb, how), file=sys.stderr)
        return 128 + int(signum)
    return int(rc or 0)
