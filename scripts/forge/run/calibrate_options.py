"""`forge calibrate`'s options, read and checked before anything is measured or written: the families
(--families, --redo), the seed, and what a smoke calibration may not be used for."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from .. import options as opts
from .. import paths
from ..errors import ForgeError
from ..records import guard_recorded, tracked_changes
from . import calibration_docs as cd

FAMILIES = cd.FAMILIES
SEED_MAX = 2**31 - 1      # the families seed torch generators with seed + 0..3


def families(text: str) -> list[str]:
    """--families: a comma-separated list (argparse type; each name is checked by check_options)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no family (families: {', '.join(FAMILIES)}; leave the "
                                         "option out for all)")
    if len(names) < len(text.split(",")):      # as plan, predict and sweep refuse theirs: never skipped
        raise argparse.ArgumentTypeError(f"{text!r}: an empty item (a comma too many, or nothing between two)")
    return names


def seed(text: str) -> int:
    """--seed: plain digits, 0 to SEED_MAX (argparse type)."""
    v = opts.parse_whole(text)
    if v is None or not 0 <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed (a whole number in plain digits, 0 to {SEED_MAX})")
    return v


def python(text: str | None) -> str | None:
    """--python: a path to an executable file, or a name found on PATH (python3), as the shell finds it;
    returned as the path that runs."""
    if text is None:
        return None
    found = shutil.which(text) if text.strip() else None
    if not found:
        raise ForgeError(f"--python {text}: not an executable file" + ("" if "/" in text else " nor a program on PATH"),
                         hint="give the Python that has torch (and the installed vLLM) on this machine")
    return found


def check_options(args) -> None:
    """Refuse an unknown family, a --redo of a family this calibration does not measure, an --out among
    the checkout's own files (build/ and reports/ take calibrations), and --install of a smoke
    calibration's table (tiny shapes under Triton's interpreter: nothing real is measured)."""
    bad = [f for f in args.families if f not in FAMILIES]
    if bad:
        raise ForgeError(f"--families: unknown {', '.join(bad)}", hint=f"families: {', '.join(FAMILIES)}")
    for f in args.redo or []:
        if f not in FAMILIES:
            raise ForgeError(f"--redo: unknown family {f!r}", hint=f"families: {', '.join(FAMILIES)}")
        if f not in args.families:
            raise ForgeError(f"--redo {f}: not among --families {','.join(args.families)}, so it would not be "
                             "measured again", hint=f"add {f} to --families, or leave out --redo {f}")
    if args.out is not None:
        paths.results_folder(args.out)
    installs = [o for o, given in (("--install", args.install), ("--install-vllm", args.install_vllm)) if given]
    if args.smoke and installs:
        raise ForgeError(f"{' and '.join(installs)} with --smoke: a smoke calibration runs tiny shapes under "
                         "Triton's interpreter and measures nothing real; its table is not one to install",
                         hint="calibrate on the card (or a GPU machine) without --smoke to install a table, or "
                              f"leave out {' and '.join(installs)}")


def check_install(args, doc: dict, out: str) -> None:
    """Refuse --install / --install-vllm of a calibration a family of which failed (a timeout, a crash):
    its table would ship without that family's decisions, as if the device had been calibrated."""
    installs = [o for o, given in (("--install", args.install), ("--install-vllm", args.install_vllm)) if given]
    failed = {f: info.get("failed") for f, info in doc.get("families", {}).items() if info.get("failed")}
    if installs and failed:
        raise ForgeError(f"{' and '.join(installs)}: the calibration in {out} is not finished: family "
                         + "; ".join(f"{f} failed ({why})" for f, why in failed.items())
                         + "; its table would ship without their decisions, so nothing was installed",
                         hint=f"calibrate again into --out {out} (the failed families run again, the others are "
                              "kept), then install")


def before_measuring(args, ident: dict, now: list[str], force: bool, dest: Path) -> None:
    """Refused before anything is measured, on the device that would measure (`ident`): families to measure
    (`now`) where torch sees no GPU, without --smoke (every candidate would fail, and the table would decide
    nothing while the command said it calibrated); --install over a committed table at `dest` (minutes of the
    card's time, then the refusal, used to come the other way round)."""
    if now and not args.smoke and str(ident.get("device_name", "")).lower() == "cpu":
        raise ForgeError(f"calibrate: this Python's torch sees no GPU (device 'cpu'), so {', '.join(now)} would be "
                         "measured on nothing: every candidate would fail and the table decide nothing",
                         hint="run it where the card is (the DCU container, the image or a GPU machine; --python "
                              "names the Python that sees it), or --smoke for the interpreter's check of tiny shapes")
    if getattr(args, "install", False) and not force:
        guard_recorded(paths.rel(dest), "a committed table" if tracked_changes({dest: None}) else None,
                       doing="--install", force=False, hint="checked before measuring, so nothing was measured; "
                       "to keep that table, calibrate without --install (the new one stays in the output folder)")
