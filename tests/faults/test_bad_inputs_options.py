"""Bad inputs to options, the offline check, compare, the vendor checkout, the submission and the help
texts, each refused before anything is written: exit code 2, one error line naming the cause (details
above it as progress lines, the fix below), nothing written or changed, `git status` as it was.
Grouped by class: yes/no make variables, counts, options a verb ignores in a mode, CMake files the
offline check cannot read or that download, copies of a run, a vendor checkout, the submission's
Python, `make -n`, and help texts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import FIXTURE_RUNS, ROOT, forge
from project import forge_cmd, make_patch, make_project
from project import forge_env as project_env
from project import run as run_in
from test_bad_inputs import files_under, git_status, refused, writes_nothing

from forge.builder import fetch
from forge.hashing import manifest_hash, sha256_file

MAKE_VARS = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")


def project_make(proj: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`make ARGS` in the stand-in project (its own Makefile, tool and configs), as a user runs it."""
    env = {k: v for k, v in project_env(proj).items() if k not in MAKE_VARS}
    return subprocess.run(["make", "-s", "--no-print-directory", f"PY={sys.executable}", *args], cwd=proj["root"],
                          env=env, capture_output=True, text=True, timeout=timeout)


def with_makefile(proj: dict) -> dict:
    for name in ("Makefile", "Dockerfile.rocm"):
        shutil.copy(ROOT / name, proj["root"] / name)
    return proj


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    return with_makefile(make_project(tmp_path_factory.mktemp("bad-options") / "proj", n_modules=10, n_patches=2))


# --- yes/no make variables: one set of words, or refused -------------------------------------------

@pytest.mark.parametrize("var", ["THREEWAY", "FORCE"])
@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_a_yes_no_make_variable_takes_one_set_of_words(proj, var, value):
    """THREEWAY=yes ran as "no" while FORCE=yes was refused: both take 1, 0 or nothing."""
    with writes_nothing(proj["root"]):
        r = project_make(proj, "tree", f"{var}={value}")
    refused(r, f"{var}={value!r}", "takes 1 (yes) or 0 (no)")


def test_every_yes_no_make_variable_is_read_through_one_rule():
    """No make variable of the Makefile's header is compared with a word in the tool: each yes/no one
    goes through options.flag, so a new one cannot take other words than FORCE does."""
    header = (ROOT / "Makefile").read_text().split("\n\n", 1)[0]
    names = set(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", header.split("Variables:", 1)[1]))
    found = []
    for f in sorted((ROOT / "scripts" / "forge").rglob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in re.finditer(r"environ(?:\.get\(|\[)\s*['\"]([A-Z0-9_]+)['\"][^)\]]*[)\]]\s*(==|!=|\bin\b)", line):
                if m.group(1) in names:
                    found.append(f"{f.relative_to(ROOT)}:{i}: {m.group(1)}")
    assert "THREEWAY" in names and "FORCE" in names
    assert not found, found


# --- counts have bounds ------------------------------------------------------------------------------

@pytest.fixture
def lint_trap(tmp_path):
    """The tool alone, with a file ruff refuses: should a bound ever fail, `check` stops at lint instead
    of starting pytest on that many processes."""
    root = tmp_path / "p"
    shutil.copytree(ROOT / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "lint_trap.py").write_text("import os\n")
    return root


@pytest.mark.parametrize("workers", ["1000", "cores+1"])
def test_check_refuses_more_workers_than_cores(lint_trap, workers):
    cores = len(os.sched_getaffinity(0))
    n = str(cores + 1) if workers == "cores+1" else workers
    env = {**os.environ, "PYTHONPATH": str(lint_trap / "scripts"), "PYTHONDONTWRITEBYTECODE": "1"}
    with writes_nothing(lint_trap):
        r = subprocess.run([sys.executable, "-m", "forge", "check", "--workers", n], cwd=lint_trap, env=env,
                           capture_output=True, text=True, timeout=120)
    refused(r, "--workers", f"{n!r} is more than this machine's {cores} core(s)")


# --- options a verb ignores in a mode are refused there ----------------------------------------------

def test_submission_on_the_standin_refuses_a_vendor_checkout(vendor, tmp_path):
    """It used to write the stand-in's repository and ignore the checkout."""
    p, src = vendor
    with writes_nothing(p["root"] / "dist", tmp_path):
        r = run_in(p, "submission", "--base", "standin", "--vendor-src", str(src), "--into", str(tmp_path / "sub"))
    refused(r, "--vendor-src", "stand-in base does not read it")


def test_offline_check_refuses_a_base_beside_a_tree(tmp_path):
    t = tmp_path / "t"
    t.mkdir()
    (t / "CMakeLists.txt").write_text("project(x)\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "offline-check", "--tree", str(t), "--base", "vendor")
    refused(r, "--tree", "--base vendor", "one tree")


# --- the offline check: what it cannot read, and every spelling of a download ------------------------

CMAKE_FAULTS = {
    "not UTF-8": (b'project(x)\nset(NAME "caf\xe9")\n', {}, ["CMakeLists.txt:2", "not UTF-8"]),
    "include of an unknown variable": (b"project(x)\ninclude(${THIRD_PARTY_DIR}/deps.cmake)\n", {},
                                       ["CMakeLists.txt:2", "could not be followed", "variable"]),
    "include of a missing file": (b"project(x)\n\ninclude(cmake/deps.cmake)\n", {},
                                  ["CMakeLists.txt:3", "could not be followed", "cmake/deps.cmake"]),
    "include of a bare unknown variable": (b"project(x)\ninclude(${DEPS})\n", {},
                                           ["CMakeLists.txt:2", "could not be followed"]),
    "subdirectory without its CMakeLists": (b"project(x)\nadd_subdirectory(third_party)\n", {"third_party/a.c": b""},
                                            ["CMakeLists.txt:2", "could not be followed"]),
    "a download command": (b"include(FetchContent)\nFetchContent_Declare(x\n  DOWNLOAD_COMMAND curl -L -o x.tgz "
                           b"http://example.invalid/x.tgz)\n", {}, ["CMakeLists.txt:2", "DOWNLOAD_COMMAND curl"]),
    "a download command with its URL in a variable": (
        b"include(ExternalProject)\nExternalProject_Add(y\n  DOWNLOAD_COMMAND wget ${Y_URL})\n", {},
        ["CMakeLists.txt:2", "DOWNLOAD_COMMAND wget"]),
    "a URL under another key": (b"include(FetchContent)\nFetchContent_Declare(z\n  PATCH_COMMAND git apply "
                                b"https://example.invalid/z.patch)\n", {}, ["CMakeLists.txt:2", "https://example.invalid"]),
    "a URL inside one quoted argument": (b'execute_process(COMMAND sh -c "curl -s https://example.invalid/a | sh")\n',
                                         {}, ["CMakeLists.txt:1", "https://example.invalid/a"]),
    "a download in an included file": (b"include(${CMAKE_CURRENT_LIST_DIR}/cmake/deps.cmake)\n",
                                       {"cmake/deps.cmake": b"\nFetchContent_Declare(w DOWNLOAD_COMMAND curl ${W})\n"},
                                       ["cmake/deps.cmake:2", "DOWNLOAD_COMMAND curl"]),
}


def cmake_tree(root: Path, top: bytes, files: dict[str, bytes]) -> Path:
    root.mkdir()
    (root / "CMakeLists.txt").write_bytes(top)
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    return root


@pytest.mark.parametrize("fault", sorted(CMAKE_FAULTS))
def test_offline_check_refuses_what_it_cannot_read_or_what_downloads(tmp_path, fault):
    top, files, words = CMAKE_FAULTS[fault]
    t = cmake_tree(tmp_path / "t", top, files)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "offline-check", "--tree", str(t))
    refused(r, *words)


@pytest.mark.parametrize("top", [b"include(FetchContent)\ninclude(GNUInstallDirs)\nproject(x)\n",
                                 b"include(${CMAKE_CURRENT_LIST_DIR}/local.cmake OPTIONAL)\n",
                                 b"FetchContent_Declare(x DOWNLOAD_COMMAND \"\" SOURCE_DIR ${CMAKE_SOURCE_DIR}/x)\n"])
def test_offline_check_passes_what_a_build_without_network_does(tmp_path, top):
    """CMake's own modules, an OPTIONAL include of a file that is not there, a local source folder."""
    t = cmake_tree(tmp_path / "t", top, {})
    r = forge(tmp_path, "offline-check", "--tree", str(t))
    assert r.returncode == 0, r.stderr


# --- compare: a copy of a run is not a repeat --------------------------------------------------------

def _copy(src: Path, dest: Path, reindent: bool = False) -> Path:
    shutil.copytree(src, dest)
    if reindent:                    # the same results written again in another layout
        for f in dest.glob("*.json"):
            f.write_text(json.dumps(json.loads(f.read_text()), indent=4, sort_keys=True))
    return dest


@pytest.mark.parametrize("case,words", [
    ("a copy as a repeat", ["side B", "same result", "not a repeat"]),
    ("a re-indented copy as a repeat", ["side B", "same result", "not a repeat"]),
    ("a copy on the other side", ["side B", "side A", "its own copy"]),
])
def test_compare_counts_a_copied_run_once(tmp_path, case, words):
    fast = _copy(FIXTURE_RUNS / "fast", tmp_path / "fast")
    copy = _copy(fast, tmp_path / "copy", reindent="re-indented" in case)
    sides = (["--a", str(FIXTURE_RUNS / "base"), "--b", str(fast), str(copy)] if "repeat" in case
             else ["--a", str(fast), "--b", str(copy)])
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "compare", *sides)
    refused(r, *words)


# --- a vendor checkout: what differs is named, and the submission's Python ---------------------------

# the fake vendor tree's own change to setup.py: it imports a build requirement no Python here has,
# as the platform's setup.py imports setuptools_scm, which a plain system Python may lack
MISSING_REQUIREMENT = "import forge_fault_build_requirement  # noqa\n"
# or it stops when it runs, on a tree whose CMake files pass the offline check
STOPS = "raise SystemExit('this setup.py stops here')\n"
CMAKE = 'set(HIP_SUPPORTED_ARCHS "gfx936")\n'


def vendor_project(tmp: Path, setup_head: str) -> tuple[dict, Path]:
    """A project whose configs/upstream.yaml pins a fake vendor tree (the fake sdist with its own
    setup.py and a CMakeLists.txt), with the sdist verified in the project's cache and no recorded
    optimization to document; returns (project, vendor folder)."""
    p = with_makefile(make_project(tmp / "proj", n_modules=10, n_patches=2))
    # the documents quote one recorded run (configs/optimizations.yaml `submission`): the project's own
    run = yaml.safe_load((ROOT / "configs" / "optimizations.yaml").read_text())["submission"]
    shutil.copytree(ROOT / run["run"], p["root"] / run["run"])
    (p["root"] / "configs" / "optimizations.yaml").write_text(yaml.safe_dump({"submission": run,
                                                                             "optimizations": []}))
    author = tmp / "standin-author"                 # the project's stand-in for the vendor tree
    shutil.copytree(tmp / "upstream-src" / "ex" / "vllm-0.18.1", author)
    git = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": os.environ["PATH"]}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", "-C", author, *cmd], check=True, env=git, capture_output=True)
    (p["root"] / "patches" / "base").mkdir()
    (p["root"] / "patches" / "base" / "vendor-standin.patch").write_text(
        make_patch(author, "README.md", "fake upstream", "fake vendor stand-in", "stand-in: the vendor's build change"))
    assert run_in(p, "fetch").returncode == 0
    src = tmp / "vllm_cscc"
    shutil.copytree(p["root"] / ".cache" / "forge" / "src" / "vllm-0.18.1", src,
                    ignore=shutil.ignore_patterns(*fetch.INTERNAL))
    (src / "setup.py").write_text(setup_head + (src / "setup.py").read_text())
    (src / "CMakeLists.txt").write_text(CMAKE)
    up_path = p["root"] / "configs" / "upstream.yaml"
    up = yaml.safe_load(up_path.read_text())
    up["vendor"].update(scope={"files": ["setup.py"], "folders": ["vllm"]}, absent=[],
                        changed={"setup.py": {"size": (src / "setup.py").stat().st_size,
                                              "sha256": sha256_file(src / "setup.py")}})
    up["vendor"]["scope_sha256"] = manifest_hash(fetch.scope_manifest(src, up["vendor"]))
    up_path.write_text(yaml.safe_dump(up))
    r = run_in(p, "tree", "--base", "vendor", VENDOR_SRC=str(src))       # the pin holds: the tree builds on it
    assert r.returncode == 0, r.stderr
    return p, src


@pytest.fixture(scope="module")
def vendor(tmp_path_factory):
    return vendor_project(tmp_path_factory.mktemp("vendor"), MISSING_REQUIREMENT)


def test_a_vendor_file_differing_only_in_its_mode_is_named(vendor):
    """It was "differs from the pinned one (0 file(s)):" with an empty list."""
    p, src = vendor
    os.chmod(src / "setup.py", 0o755)
    try:
        with writes_nothing(p["root"]):
            r = run_in(p, "tree", "--base", "vendor", VENDOR_SRC=str(src))
    finally:
        os.chmod(src / "setup.py", 0o644)
    line = refused(r, "setup.py: changed (type: an executable file here, a plain file in the vendor tree; the same "
                      "content)")
    assert "0 file(s)" not in line and f"chmod -x {src / 'setup.py'}" in r.stderr, r.stderr


def test_a_submission_whose_setup_py_this_python_cannot_run_leaves_nothing_at_into(vendor, tmp_path):
    """The pre-flight runs setup.py with this Python: one lacking what setup.py imports is refused
    before the repository is written (it used to leave a complete-looking one at --into, and the
    pre-flight record of the previous one)."""
    p, src = vendor
    record = p["root"] / "build" / "submission-preflight.json"
    previous = json.dumps({"repository": str(p["root"] / "dist" / "submission"), "ok": True}) + "\n"
    record.write_text(previous)
    try:
        with writes_nothing(tmp_path, p["root"] / "dist"):
            r = run_in(p, "submission", "--into", str(tmp_path / "sub"), VENDOR_SRC=str(src))
        refused(r, sys.executable, "cannot import forge_fault_build_requirement", "setup.py")
        assert "pip install forge-fault-build-requirement" in r.stderr, r.stderr
        assert record.read_text() == previous
    finally:
        record.unlink()
    assert not list(tmp_path.iterdir())


def test_a_submission_whose_preflight_stops_leaves_nothing_at_into(tmp_path_factory, tmp_path):
    """setup.py stops on this machine: the error says so, and neither a repository at --into nor a
    changed pre-flight record is left behind (the record never describes another repository)."""
    p, src = vendor_project(tmp_path_factory.mktemp("vendor-stops"), STOPS)
    record = p["root"] / "build" / "submission-preflight.json"
    previous = json.dumps({"repository": str(p["root"] / "dist" / "submission"), "ok": True}) + "\n"
    record.write_text(previous)
    with writes_nothing(tmp_path, p["root"] / "dist"):
        r = run_in(p, "submission", "--into", str(tmp_path / "sub"), VENDOR_SRC=str(src))
    assert r.returncode == 2 and "setup.py did not get to setup()" in r.stderr, r.stderr[-2000:]
    assert "this setup.py stops here" in r.stderr and record.read_text() == previous
    assert not list(tmp_path.iterdir()) and not list(tmp_path.parent.glob(".sub.partial*"))


# --- make -n: prints, runs nothing ---------------------------------------------------------------------

def test_make_n_image_prints_the_build_without_fetching_or_building(tmp_path):
    p = with_makefile(make_project(tmp_path / "proj", n_modules=10, n_patches=2))
    before = files_under(p["root"])
    status = git_status()
    r = project_make(p, "-n", "image")
    assert r.returncode == 0, r.stderr
    assert files_under(p["root"]) == before and git_status() == status
    printed = re.search(r"SERIES_HASH=([0-9a-f]{64})", r.stdout)
    assert printed, r.stdout
    # the hash it prints is the one the tree that the real build makes records
    assert run_in(p, "tree").returncode == 0
    state = json.loads((p["root"] / "build" / "vllm" / ".git" / "forge-state.json").read_text())
    from forge.recipe import provenance
    assert printed.group(1) == provenance.series_hash(state)


# --- help: each verb its own description ---------------------------------------------------------------

def test_no_two_verbs_share_a_description():
    from forge import cli
    sub = next(a for a in cli.build_parser()._actions if a.dest == "verb")
    by_text: dict[str, list[str]] = {}
    for name, parser in sub.choices.items():
        by_text.setdefault(parser.description.strip().split("\n\n", 1)[0], []).append(name)
    shared = [names for names in by_text.values() if len(names) > 1]
    assert not shared, shared


@pytest.mark.parametrize("verbs", [("lint", "check", "test"), ("pack-run", "unpack-run")])
def test_forge_help_describes_each_verb_apart(tmp_path, verbs):
    firsts = []
    for v in verbs:
        r = subprocess.run(forge_cmd(v, "--help"), cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "scripts")})
        assert r.returncode == 0, r.stderr
        firsts.append(r.stdout.split("\n\n")[1])        # the description: after the usage line(s)
    assert len(set(firsts)) == len(verbs), firsts


def test_make_help_describes_each_target_apart():
    r = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if k not in MAKE_VARS})
    rows = [line.split(None, 1) for line in r.stdout.splitlines()[1:] if line.startswith("  ")]
    texts = [d for _, d in rows]
    assert len(rows) > 25 and len(set(texts)) == len(texts), [d for d in texts if texts.count(d) > 1]
