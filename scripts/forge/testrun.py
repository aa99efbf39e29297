"""`make test` (what CI runs): the rehearsal (which includes patches-check and the wheel), the image
rehearsal (Dockerfile.rocm on a stand-in base; skipped with a warning where no builder exists), then the
whole pytest suite: unit tests, kernel tests (Triton interpreter on CPU, real sizes on a GPU), tree
tests (against the patched vLLM the rehearsal installed); GPU-only e2e tests skip without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import shutil

from . import image, rehearsal, ui
from .paths import ROOT


def cmd_test(args) -> int:
    if not args.no_rehearsal:
        rehearsal.rehearse()
        if args.no_image:
            ui.warn("image rehearsal skipped (--no-image)")
        elif shutil.which("buildah") or shutil.which("docker") and \
                subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
            image.image_rehearsal()
        else:
            ui.warn("image rehearsal skipped: no buildah and no running Docker engine "
                    "(.ci/run installs buildah and debootstrap)")
    ui.info("pytest " + " ".join(args.pytest_args or ["tests"]))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"))
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", *(args.pytest_args or ["tests"])],
                        cwd=ROOT, env=env).returncode
    return rc


def register(sub) -> None:
    p = sub.add_parser("test", help="rehearsal + the whole test suite (what CI runs)", description=__doc__)
    p.add_argument("--no-rehearsal", action="store_true", help="skip the rehearsals (tree tests then need an earlier one)")
    p.add_argument("--no-image", action="store_true", help="skip the image rehearsal")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest (default: tests)")
    p.set_defaults(func=cmd_test)
