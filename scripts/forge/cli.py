"""The `forge` command. Each module of this package that defines `register(subparsers)` adds its
verbs; a verb's handler takes the parsed args and returns an exit code (or None for 0)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import __version__
from .errors import ForgeError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forge",
        description="Build, serve, benchmark and score a patched vLLM 0.18.1 for Qwen3.5-27B on Hygon DCU.")
    p.add_argument("--version", action="version", version=f"dcu-forge {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    pkg = importlib.import_module(__package__)
    for mod in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
        if mod in ("cli", "__main__"):
            continue
        m = importlib.import_module(f"{__package__}.{mod}")
        if hasattr(m, "register"):
            m.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except ForgeError as e:
        print(f"forge {args.verb}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"forge {args.verb}: interrupted; finished stages are kept, rerun to resume",
              file=sys.stderr)
        return 130
    return int(rc or 0)
