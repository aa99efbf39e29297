"""The project's own checks, fastest first.

`make lint`: ruff with the project's configuration (pyproject.toml) over every tracked Python file.
`make check` (the inner loop, a few minutes): lint, then the unit tests and the fault-injection suite.
`make test` (what CI runs): lint, the rehearsal (which includes patches-check and the wheel), the
contest container's toolchain check (Python 3.10, torch 2.10, Triton 3.4.0 in build/toolchain/venv: the
tool, the kernels' self-test and their AMD ahead-of-time compile; `forge toolchain-check --help`), then,
while the image rehearsal (Dockerfile.rocm on a stand-in base; skipped with a warning where no builder
exists) runs in the background (its output in build/test-reports/image-rehearsal.out; its failure fails
the run, an interrupt stops it), the fault-injection suite (tests/faults/; its summary line counts the
cases) and the rest of the pytest suite: unit tests, kernel tests (Triton interpreter on CPU, real sizes on a GPU), tree tests (against
the patched vLLM the rehearsal installed); GPU-only e2e tests skip without a GPU. The rehearsals'
reports go to build/test-reports/: a test run leaves the tracked reports/ as it found it. pytest runs on
--workers processes (pytest-xdist) and prints its 15 slowest tests, so growth shows."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

from . import options, proc, ui
from .builder import buildah, rehearsal, toolchain
from .errors import ForgeError
from .paths import BUILD, ROOT, rel

# What a fresh `make test` writes, measured on a fresh clone: the rehearsal venv (torch with its CUDA
# libraries, vLLM's dependencies) about 6.5 GB, the toolchain venv (torch 2.10 with the CUDA libraries it
# loads, Triton 3.4.0) 6.1 GB; the image rehearsal's need depends on buildah's storage driver
# (buildah.NEED_GB).
# The tests' temporary trees at once (pytest removes a passed test's tmp_path as it ends): at most about
# 1.5 GB on two workers.
NEED_GB = {"rehearsal": 7.0, "toolchain": 6.5, "tests": 2.0}
MARGIN_GB = 1.0
# `make test` keeps its rehearsal reports out of the tracked reports/ (what `make rehearsal` and
# `make image-rehearsal` record), so a test run leaves the working tree as it found it.
TEST_REPORTS = BUILD / "test-reports"
# Fault injection (tests/faults/): interrupted stages, tampered or missing inputs, forbidden options,
# corrupt results.
FAULTS = ROOT / "tests" / "faults"
UNIT = ROOT / "tests" / "unit"
SLOWEST = 15          # pytest's --durations: the slowest tests of every run are printed


def _existing(path) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def free_gb(path) -> float:
    return shutil.disk_usage(_existing(path)).free / 2**30


def disk_preflight(with_image: bool, with_toolchain: bool = True) -> None:
    need = NEED_GB["rehearsal"] if not (BUILD / "rehearsal" / "venv").is_dir() else 1.0
    if with_toolchain and not toolchain.VENV.is_dir():
        need += NEED_GB["toolchain"]
    where = {str(BUILD): need}
    if with_image:
        root = _containers_root()
        where[root] = where.get(root, 0) + buildah.NEED_GB[buildah.storage_driver()]
    by_fs: dict[int, tuple[str, float]] = {}    # one file system holding both needs both
    for path, gb in where.items():
        dev = os.stat(_existing(path)).st_dev
        first, total = by_fs.get(dev, (path, 0.0))
        by_fs[dev] = (first, total + gb)
    for path, gb in by_fs.values():
        have = free_gb(path)
        if have < gb:
            images = (f" and `buildah --storage-driver {buildah.storage_driver()} rmi --prune` (untagged images)"
                      if with_image else "")
            ui.warn(f"{path}: {have:.1f} GB free, this run needs about {gb:.1f} GB; it may stop with "
                    f"'No space left on device'. Free space with `make clean` (build outputs){images}")


def _containers_root() -> str:
    return "/var/lib/containers" if os.geteuid() == 0 else os.path.expanduser("~/.local/share/containers")


def make_room(with_image: bool) -> bool:
    """After the toolchain check: where the disk cannot also hold the image rehearsal and the tests'
    temporary trees, remove the toolchain venv (6 GB, its check done; the next `make test` rebuilds it)
    and say so. True when it removed it."""
    venv = toolchain.VENV
    if not venv.is_dir():
        return False
    need = NEED_GB["tests"]
    if with_image and os.stat(_existing(_containers_root())).st_dev == os.stat(_existing(BUILD)).st_dev:
        need += buildah.NEED_GB[buildah.storage_driver()]
    have = free_gb(BUILD)
    if have >= need + MARGIN_GB:
        return False
    shutil.rmtree(venv, ignore_errors=True)
    ui.warn(f"{have:.1f} GB free, and the image rehearsal and the tests need about {need:.1f} GB: removed "
            f"{rel(venv)} ({free_gb(BUILD) - have:.1f} GB; its check is done, the next `make test` rebuilds it)")
    return True


def default_workers() -> int:
    """Two on CI's two cores; at most four (each tree-test worker holds a Python with torch loaded)."""
    return max(1, min(os.cpu_count() or 1, 4))


def lint() -> int:
    """ruff check with the project's configuration; 0 when it finds nothing."""
    if importlib.util.find_spec("ruff") is None:
        raise ForgeError(f"ruff is not installed for {sys.executable}",
                         hint="make venv (requirements/dev.txt pins it), or run make through the project venv")
    ui.info("lint: ruff check (pyproject.toml's configuration, every tracked Python file)")
    rc = proc.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, check=False).returncode
    if rc:
        ui.warn("lint found problems: fix them (`ruff check --fix` sorts imports and drops unused ones); "
                "the tests do not run until lint is clean")
    return rc


def pytest_runs(runs: list[list[str]], workers: int) -> int:
    """Each run of pytest in turn on `workers` processes; the worst exit code."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"))
    spread: list[str] = []
    if workers > 1:
        if importlib.util.find_spec("xdist") is None:
            ui.warn("pytest-xdist is not installed: the tests run on one process (make venv installs it)")
        else:
            spread = ["-n", str(workers), "--dist", "worksteal"]
    rc = 0
    for pytest_args in runs:
        ui.info("pytest " + " ".join(pytest_args) + (f" (on {workers} workers)" if spread else ""))
        rc = max(rc, proc.run([sys.executable, "-m", "pytest", "-q", "-rs", f"--durations={SLOWEST}", *spread,
                               *pytest_args], cwd=ROOT, env=env, check=False).returncode)
    return rc


def cmd_lint(args) -> int:
    return lint()


def cmd_check(args) -> int:
    return lint() or pytest_runs([[str(UNIT.relative_to(ROOT)), str(FAULTS.relative_to(ROOT))]], args.workers)


def cmd_test(args) -> int:
    rc = lint()
    if rc:
        return rc
    skipped: list[str] = []         # the stages this box cannot run, named again in the run's last lines
    if not args.no_rehearsal:
        disk_preflight(with_image=not args.no_image and bool(shutil.which("buildah")),
                       with_toolchain=not args.no_toolchain)
        # the toolchain venv (minutes of download and unpacking) builds in the background meanwhile
        pre = None if args.no_toolchain else toolchain.preflight(need_lld=False)
        if pre is not None and pre.get("skipped"):
            skipped.append(pre["skipped"])
        child = toolchain.start_venv(pre) if pre is not None else None
        try:
            rehearsal.rehearse(report_dir=TEST_REPORTS)
            if pre is not None:
                toolchain.finish(pre, child)
                make_room(with_image=not args.no_image and bool(shutil.which("buildah")))
            else:
                ui.warn("container toolchain check skipped (--no-toolchain): the kernels were not checked "
                        "under Triton 3.4.0 nor the tool under Python 3.10")
        finally:
            toolchain.stop_venv(child)
    image_child = None
    if not args.no_rehearsal:
        if args.no_image:
            ui.warn("image rehearsal skipped (--no-image)")
        elif shutil.which("buildah") or shutil.which("docker") and \
                proc.run(["docker", "info"], capture=True, check=False).returncode == 0:
            image_child = start_image_rehearsal()
        else:
            why = "the image rehearsal: no buildah and no running Docker engine (.ci/run installs buildah and debootstrap)"
            ui.warn(f"skipped {why}")
            skipped.append(why)
        ui.info(f"rehearsal reports of this test run: {TEST_REPORTS} (reports/ is left as it was)")
    if args.pytest_args:
        runs = [args.pytest_args]
    else:
        # the fault-injection suite first, on its own: its summary line counts the cases it tried
        runs = [[str(FAULTS.relative_to(ROOT))], ["tests", f"--ignore={FAULTS.relative_to(ROOT)}"]]
    try:
        rc = pytest_runs(runs, args.workers)
    except BaseException:
        if image_child is not None:
            ui.warn(f"stopping the image rehearsal ({proc.stop_group(image_child.pid, grace_s=20)}); "
                    "the next `make test` resumes it")
        raise
    rc = max(rc, finish_image_rehearsal(image_child))
    for why in skipped:             # the summary's last lines: what this run did not check
        ui.warn(f"make test skipped {why}")
    return rc


# The image rehearsal (a builder copying image layers and a container installing the wheel: disk and
# network more than CPU, about one core) runs beside the pytest runs instead of before them.
IMAGE_LOG = TEST_REPORTS / "image-rehearsal.out"


def start_image_rehearsal():
    """`forge image-rehearsal` in the background, its report in TEST_REPORTS and its output in IMAGE_LOG."""
    IMAGE_LOG.unlink(missing_ok=True)
    ui.info(f"image rehearsal: running beside the tests (output: {rel(IMAGE_LOG)})")
    return proc.start([sys.executable, "-m", "forge", "image-rehearsal", "--report-dir", TEST_REPORTS], log=IMAGE_LOG,
                      env={"PYTHONPATH": str(ROOT / "scripts")}, cwd=ROOT, what="the image rehearsal",
                      die_with_parent=True)


def finish_image_rehearsal(child) -> int:
    """Wait for start_image_rehearsal's run; 0 when it passed (or none ran), else its exit code, with the
    end of its output."""
    if child is None:
        return 0
    if child.poll() is None:
        with ui.step("image rehearsal: waiting for it to finish"):
            child.wait()
    if child.returncode == 0:
        ui.info(f"image rehearsal: passed ({rel(TEST_REPORTS / 'image-rehearsal.md')})")
        return 0
    ui.warn(f"image rehearsal FAILED (exit {child.returncode}); the end of {rel(IMAGE_LOG)}:\n"
            + proc.tail(IMAGE_LOG, 25))
    return child.returncode


def _workers_option(p) -> None:
    cores = options.usable_cores()
    p.add_argument("--workers", type=options.count_upto(cores, f"this machine's {cores} core(s)"),
                   default=default_workers(), metavar="N",
                   help="pytest processes, at most the cores (pytest-xdist; default: the cores, at most 4; 1: no xdist)")


# each verb's own description, ahead of the module's account of all three
DESCRIPTIONS = {
    "lint": "Run ruff with the project's configuration (pyproject.toml) over every tracked Python file (tools, "
            "kernels, tests); exit 0 when it finds nothing. The first step of `make check` and `make test`.",
    "check": "The inner loop, no rehearsal needed: lint, then the unit tests (tests/unit) and the fault-injection "
             "suite (tests/faults) on --workers processes; a few minutes on two cores.",
    "test": "What CI runs: lint (a finding stops it), the rehearsal (reports in build/test-reports/), then the "
            "fault-injection suite and the unit, kernel, compile and tree tests while the image rehearsal runs "
            "beside them; "
            "pytest arguments after the options replace the test selection.",
}


def register(sub) -> None:
    p = sub.add_parser("lint", help="ruff over every tracked Python file with the project's configuration",
                       description=DESCRIPTIONS["lint"] + "\n\n" + __doc__)
    p.set_defaults(func=cmd_lint)
    p = sub.add_parser("check", help="the inner loop: lint, unit tests and the fault-injection suite",
                       description=DESCRIPTIONS["check"] + "\n\n" + __doc__)
    _workers_option(p)
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("test", help="lint, the rehearsals and the whole test suite (what CI runs)",
                       description=DESCRIPTIONS["test"] + "\n\n" + __doc__)
    p.add_argument("--no-rehearsal", action="store_true", help="skip the rehearsals (tree tests then need an earlier one)")
    p.add_argument("--no-image", action="store_true", help="skip the image rehearsal")
    p.add_argument("--no-toolchain", action="store_true",
                   help="skip the contest container's toolchain check (Python 3.10, torch 2.10, Triton 3.4.0)")
    _workers_option(p)
    p.add_argument("pytest_args", nargs="*", help="passed to pytest (default: tests)")
    p.set_defaults(func=cmd_test)
