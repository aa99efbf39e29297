"""The contest container's toolchain in the test loop: Python 3.10, torch 2.10, Triton 3.4.0.

The container runs Python 3.10, torch 2.10 and Triton 3.4.0 (a vendor build); the project venv
checks our Triton kernels with a newer Triton and the tool with a newer Python. A Triton feature
newer than 3.4 in one of our kernels would fail at the first request on the card, and a Python
feature newer than 3.10 in the tool would fail there at its first command. So `make test` (and
`forge toolchain-check` alone) builds a second, small venv, build/toolchain/venv, from
requirements/container-toolchain.txt (torch 2.10 and Triton 3.4.0 from the package index) with
Python 3.10 (`python3.10` on PATH, else pyenv's 3.10.x, else this box's Python, which it says), and
runs with it:

  1. the tool under 3.10: every tracked Python file compiles, every standard-library module and name
     that a file imports (at any depth) exists there, and every module of the tool imports;
  2. the kernels' self-test under Triton's interpreter (every kernel, float64 references);
  3. the kernels' ahead-of-time compile for the AMD stand-in targets (configs/build.yaml
     aot_targets) with the LDS (<= 64 KiB) and no-spill gate. Triton 3.4's AMD backend links with an
     external ld.lld: TRITON_HIP_LLD_PATH, else ld.lld on PATH, else a versioned one (Debian's
     lld-15: /usr/bin/ld.lld-15). .ci/run installs it.

The venv is reused while the requirements file and the Python it was made with are unchanged;
the checks always run. `make test` builds it in the background while the rehearsal runs, then runs
the checks. Results: build/toolchain/{tool-py,selftest,aot,toolchain}.json and the logs beside them.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

from .. import config, proc, ui
from ..errors import ForgeError
from ..hashing import sha256_file
from ..paths import BUILD, KERNELS, ROOT, rel, write_atomic
from .rehearsal import run_json_tool
from .toolchainfind import CONTAINER_PYTHON, LLD_ENV, LLD_FIX, PYTHON_ENV, find_lld, find_python

REQUIREMENTS = ROOT / "requirements" / "container-toolchain.txt"
WORK = BUILD / "toolchain"
VENV = WORK / "venv"


def _marker(version: tuple[int, ...]) -> str:
    return f"python {'.'.join(map(str, version))}\n{rel(REQUIREMENTS)} {sha256_file(REQUIREMENTS)}\n"


def venv_current(version: tuple[int, ...], venv: Path = VENV) -> bool:
    marker = venv / ".forge-installed"
    return (venv / "bin" / "python").exists() and marker.is_file() and marker.read_text() == _marker(version)


def ensure_venv(python: str, version: tuple[int, ...], venv: Path = VENV) -> Path:
    """build/toolchain/venv with requirements/container-toolchain.txt, made with `python`; reused
    while both are unchanged."""
    py = venv / "bin" / "python"
    marker = venv / ".forge-installed"
    want = _marker(version)
    if venv_current(version, venv):
        ui.info(f"{rel(venv)} is current (Python {'.'.join(map(str, version))}, {rel(REQUIREMENTS)})")
        return py
    log = venv.parent / "venv.log"
    log.unlink(missing_ok=True)
    shutil.rmtree(venv, ignore_errors=True)
    ui.info(f"creating {rel(venv)} with Python {'.'.join(map(str, version))}; installing "
            f"{rel(REQUIREMENTS)} (a few minutes; log: {rel(log)})")
    proc.run([python, "-m", "venv", venv], log=log, what="venv creation",
             hint=f"see {rel(log)}; Debian: apt-get install python3-venv")
    for group in install_groups(pinned()):
        proc.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-cache-dir", *group], log=log,
                 what=f"pip install {' '.join(group)} (from {rel(REQUIREMENTS)})",
                 hint=f"see {rel(log)}; pip's configured index must serve every pin in {rel(REQUIREMENTS)}")
    write_atomic(marker, want)
    return py


# the pins whose wheels are large (torch, its NVIDIA libraries, Triton), each installed by a pip of its own
LARGE = re.compile(r"^(torch|triton|nvidia-.*)$")


def install_groups(pins: dict[str, str]) -> list[list[str]]:
    """The pins in pip invocations: each large wheel alone, the small ones together. pip downloads every
    wheel of an invocation before it installs any, so one invocation for all of them held the 3.7 GB of
    downloads on disk beside the 6.1 GB they unpack to."""
    specs = [f"{n}=={v}" for n, v in pins.items()]
    small = [s for s in specs if not LARGE.match(s.split("==")[0])]
    return [[s] for s in specs if LARGE.match(s.split("==")[0])] + ([small] if small else [])


_VERSIONS = r"""
import json, sys, numpy, torch, triton
print(json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "torch": torch.__version__,
                  "triton": triton.__version__, "numpy": numpy.__version__}))
"""


def versions(py: Path) -> dict:
    out = proc.output([py, "-c", _VERSIONS], what="import torch, triton in the toolchain venv",
                      env={"PYTHONPATH": ""}).splitlines()[-1]
    return json.loads(out)


def pinned() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def tracked_python_files() -> list[str]:
    """Every tracked Python file (git ls-files), relative to the root; outside a git checkout,
    every .py under the root but build outputs and venvs."""
    res = proc.run(["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture=True, check=False)
    if res.returncode == 0:
        return sorted(f for f in res.stdout.split("\0") if f)
    skip = {"build", "dist", ".venv", ".cache", ".git"}
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                  if not skip.intersection(p.relative_to(ROOT).parts))


# Run by the toolchain venv's Python in the repository root: compile (without writing bytecode)
# every file named on stdin and look up every standard-library module and name it imports (at any
# depth: an import inside a function too), import every module of the tool, print the failures as JSON.
_TOOL_CHECK = r"""
import ast, importlib, json, pkgutil, sys, traceback
sys.path.insert(0, "scripts")
bad = []
files = sys.stdin.read().split("\n")
# the standard library of this Python and of the (newer) one the tool runs on: a module only the
# newer one has is looked up too
stdlib = set(sys.stdlib_module_names) | set(json.loads(sys.argv[1]))

def lookup(mod, name, where):
    try:
        m = importlib.import_module(mod)
    except ImportError as e:
        bad.append({"where": where, "error": f"ImportError: {e}"})
        return
    if name is not None and not hasattr(m, name):
        try:
            importlib.import_module(f"{mod}.{name}")
        except ImportError:
            bad.append({"where": where, "error": f"ImportError: cannot import name {name!r} from {mod!r}"})

for f in filter(None, files):
    try:
        tree = compile(open(f, "rb").read(), f, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        compile(tree, f, "exec", dont_inherit=True)
    except SyntaxError as e:
        bad.append({"where": f"{f}:{e.lineno}", "error": f"SyntaxError: {e.msg}"})
        continue
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in stdlib:
                    lookup(a.name, None, f"{f}:{node.lineno}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] in stdlib and node.module != "__future__":
            for a in node.names:
                lookup(node.module, None if a.name == "*" else a.name, f"{f}:{node.lineno}")
import forge
mods = ["forge"] + [m.name for m in pkgutil.walk_packages(forge.__path__, "forge.") if m.name != "forge.__main__"]
for name in mods:
    try:
        importlib.import_module(name)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        bad.append({"where": f"{name} ({tb.filename}:{tb.lineno})", "error": f"{type(e).__name__}: {e}"})
print(json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "files": len([f for f in files if f]),
                  "modules": len(mods), "problems": bad}))
"""


def check_tool(py: Path, out: Path, root: Path = ROOT, files: list[str] | None = None) -> dict:
    """Compile `files` (default: every tracked Python file) and import every module of root/scripts/forge
    with `py`; a ForgeError lists what failed."""
    files = tracked_python_files() if files is None else files
    res = proc.run([py, "-B", "-c", _TOOL_CHECK, json.dumps(sorted(sys.stdlib_module_names))], cwd=root, input="\n".join(files), capture=True, check=False,
                   env={"PYTHONPATH": "", "PYTHONDONTWRITEBYTECODE": "1"}, what="the tool under the toolchain's Python")
    try:
        result = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ForgeError(f"the tool check under {py} printed no result (exit {res.returncode}):\n"
                         f"{(res.stdout + res.stderr)[-2000:]}") from None
    write_atomic(out, json.dumps(result, indent=1) + "\n")
    if result["problems"]:
        lines = "\n".join(f"  {p['where']}: {p['error']}" for p in result["problems"][:20])
        raise ForgeError(f"{len(result['problems'])} problem(s) under Python {result['python']} "
                         f"(the contest container's is {'.'.join(map(str, CONTAINER_PYTHON))}):\n{lines}",
                         hint="use only syntax and standard-library names that Python 3.10 has "
                              "(pyproject.toml's ruff target-version is py310)")
    return result


def hip_targets() -> list[str]:
    return [t for t in config.build()["aot_targets"] if t.startswith("hip:")]


def preflight(need_lld: bool = True) -> dict:
    """The Python and the ld.lld the check will use; a missing linker stops it here, before minutes go
    into the venv (without one the compile cannot run at all), unless not `need_lld`: then the
    ahead-of-time compile is left out (ld_lld None, `skipped` saying why) and the other checks run."""
    exe, version, how = find_python()
    vtext = ".".join(map(str, version))
    if how == "fallback":
        ui.warn(f"no Python {'.'.join(map(str, CONTAINER_PYTHON))} on this box (python3.10 on PATH, pyenv): "
                f"the toolchain venv uses this box's Python {vtext}, so the tool's check below is "
                "against that version's syntax and standard library (ruff's py310 target still applies)")
    lld = find_lld()
    targets = hip_targets()
    if lld is None and not need_lld:
        why = (f"no ld.lld on this box (Triton 3.4's AMD backend links with one; looked at {LLD_ENV}, ld.lld on "
               "PATH, /usr/bin/ld.lld-*, /usr/lib/llvm-*/bin/ld.lld)")
        ui.warn(f"container toolchain: the AMD ahead-of-time compile under Triton 3.4.0 is skipped: {why}; "
                f"fix: {LLD_FIX}")
        return {"python_exe": exe, "version": version, "python_from": how, "ld_lld": None, "targets": targets,
                "skipped": f"the container toolchain's AMD ahead-of-time compile: {why}; fix: {LLD_FIX}"}
    if lld is None:
        raise ForgeError(f"no ld.lld on this box: Triton 3.4's AMD backend links every kernel with one, so "
                         f"the ahead-of-time compile for {', '.join(targets)} cannot run (looked at {LLD_ENV}, "
                         "ld.lld on PATH, /usr/bin/ld.lld-*, /usr/lib/llvm-*/bin/ld.lld)", hint=LLD_FIX)
    return {"python_exe": exe, "version": version, "python_from": how, "ld_lld": lld, "targets": targets}


def start_venv(pre: dict):
    """Build build/toolchain/venv in a child process (its own process group) while the caller goes on:
    `make test` runs the rehearsal meanwhile. None when the venv is already current."""
    if venv_current(pre["version"], VENV):
        return None
    log = WORK / "venv-build.log"
    log.unlink(missing_ok=True)
    ui.info(f"building {rel(VENV)} in the background (log: {rel(log)})")
    return proc.start([sys.executable, "-m", "forge", "toolchain-check", "--venv-only"], log=log,
                      env={"PYTHONPATH": str(ROOT / "scripts"), PYTHON_ENV: pre["python_exe"],
                           "FORGE_BUILD_DIR": str(BUILD)},
                      what="the toolchain venv's build", die_with_parent=True)


def stop_venv(child) -> None:
    """Stop a background build that is still running (the caller failed before it was needed)."""
    if child is not None and child.poll() is None:
        proc.stop_group(child.pid, grace_s=10)


def finish(pre: dict, child) -> dict:
    """Wait for start_venv's build (if any), then run the checks."""
    if child is not None:
        with ui.step("container toolchain: waiting for its venv's build"):
            rc = child.wait()
        if rc != 0:
            log = WORK / "venv-build.log"
            raise ForgeError(f"the toolchain venv's build failed (exit {rc}):\n{proc.tail(log, 15)}",
                             hint=f"see {rel(log)}")
    return run_checks(WORK, pre)


def run_checks(work: Path = WORK, pre: dict | None = None) -> dict:
    """Build or reuse the venv and run the three checks; a ForgeError names the first that fails."""
    t0 = time.monotonic()
    pre = pre or preflight()
    exe, version, how, lld, targets = (pre[k] for k in ("python_exe", "version", "python_from", "ld_lld",
                                                        "targets"))
    result = {"python_from": how, "python_exe": exe, "ld_lld": lld, "stages": []}

    def stage(name, fn):
        s0 = time.monotonic()
        with ui.step(f"container toolchain: {name}"):
            detail = fn()
        result["stages"].append({"stage": name, "seconds": round(time.monotonic() - s0, 1)})
        return detail

    py = stage("venv", lambda: ensure_venv(exe, version, work / "venv"))
    have = stage("versions", lambda: versions(py))
    pins = pinned()
    for pkg in ("torch", "triton", "numpy"):
        if not have[pkg].split("+")[0] == pins[pkg]:
            raise ForgeError(f"the toolchain venv has {pkg} {have[pkg]}, {rel(REQUIREMENTS)} pins {pins[pkg]}",
                             hint=f"remove {rel(work / 'venv')} and rerun")
    result.update(have)
    ui.info(f"toolchain: Python {have['python']} ({how}), torch {have['torch']}, Triton {have['triton']}, "
            f"NumPy {have['numpy']}")
    tool = stage("the tool under Python " + have["python"], lambda: check_tool(py, work / "tool-py.json"))
    ui.info(f"{tool['files']} tracked Python files compile and {tool['modules']} modules of the tool import "
            f"under Python {tool['python']}")
    sel = stage("kernel self-test (Triton interpreter)",
                lambda: run_json_tool([py, KERNELS / "selftest.py"], work / "selftest.json",
                                      f"kernel self-test under Triton {have['triton']}",
                                      env={"TRITON_INTERPRET": "1", "PYTHONPATH": ""}))
    result["selftest"] = {"ok": sel["ok"], "checks": len(sel["checks"])}
    argv = [py, KERNELS / "aot.py"]
    for t in targets:
        argv += ["--target", t]
    if lld is None:                     # preflight(need_lld=False) said so
        result["aot"] = {"records": 0, "linker": None, "skipped": pre.get("skipped")}
    else:
        aot = stage("AOT compile + LDS/spill check (" + ", ".join(targets) + ")",
                    lambda: run_json_tool(argv, work / "aot.json",
                                          f"ahead-of-time compile under Triton {have['triton']}",
                                          env={LLD_ENV: lld, "PYTHONPATH": ""}))
        result["aot"] = {"records": len(aot["records"]), "linker": lld}
    result["seconds"] = round(time.monotonic() - t0, 1)
    write_atomic(work / "toolchain.json", json.dumps(result, indent=1) + "\n")
    return result


def cmd_toolchain_check(args) -> int:
    if args.venv_only:
        # the venv needs no linker: `make test` builds it in the background on a box without ld.lld too
        # (there the check leaves out only the AMD compile, preflight(need_lld=False))
        pre = preflight(need_lld=False)
        ensure_venv(pre["python_exe"], pre["version"])
        return 0
    r = run_checks()
    print(f"container toolchain: PASS in {r['seconds']} s (Python {r['python']}, torch {r['torch']}, "
          f"Triton {r['triton']}; {r['selftest']['checks']} self-test checks, {r['aot']['records']} AOT "
          f"compiles); results: {rel(WORK)}/")
    return 0


def register(sub) -> None:
    p = sub.add_parser("toolchain-check",
                       help="the contest container's Python 3.10, torch 2.10 and Triton 3.4.0: the tool, "
                            "the kernels' self-test and their AMD ahead-of-time compile",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv-only", action="store_true", help="build or reuse the venv, run no check")
    p.set_defaults(func=cmd_toolchain_check)
