"""`forge offline-check`: a HIP build of the tree fetches nothing. The contest's platform builds a
submission with `python setup.py bdist_wheel` and no network; vLLM 0.18.1's CMakeLists.txt clones
Triton for `triton_kernels` on HIP at configure time, so a tree that still reaches that clone cannot
be built there.

The check reads the top CMakeLists.txt and every CMake file it includes (or adds as a
subdirectory), follows the branches a HIP build takes, and fails naming file:line for each reachable
command that declares a download: FetchContent_Declare / FetchContent_Populate / ExternalProject_Add
with GIT_REPOSITORY, URL, SVN_REPOSITORY, HG_REPOSITORY or CVS_REPOSITORY, with a DOWNLOAD_COMMAND
that runs a network tool (curl, wget, git, ...) or with a remote URL in any argument, file(DOWNLOAD
...), and an execute_process that names a remote URL. It also fails, naming file:line, where it
cannot see what a HIP build reads: a reachable include() or add_subdirectory() it cannot follow
(a path with a variable it does not know, a file that is not there; an include(... OPTIONAL) of a
missing file is skipped, as CMake skips it) and a CMake file that is not UTF-8 text.

What it evaluates: VLLM_GPU_LANG is HIP and VLLM_TARGET_DEVICE is rocm (what setup.py sets for a ROCm
torch); NOT/AND/OR, parentheses, string and number comparisons of known values, constants, and
EXISTS / IS_DIRECTORY of a path inside the tree (a local copy shipped with the tree is a local-path
alternative this check can see). Every other condition (a cache variable, an environment variable, a
compiler version) is not evaluated and both of its branches count as reachable: a download behind
`if(DEFINED ENV{X_SRC_DIR})`'s else branch is reported, naming X_SRC_DIR as the local-path
alternative that the platform's build does not set. Function and macro bodies count as reachable.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import ui
from ..errors import ForgeError
from ..paths import rel
from . import bases, tree
from .cmakelang import Cmd, Cond, expand, parse_cmake
from .tree import add_base_argument

KNOWN = {"VLLM_GPU_LANG": "HIP", "VLLM_TARGET_DEVICE": "rocm"}
DOWNLOAD_KEYS = ("GIT_REPOSITORY", "URL", "SVN_REPOSITORY", "HG_REPOSITORY", "CVS_REPOSITORY")
DECLARERS = ("fetchcontent_declare", "fetchcontent_populate", "externalproject_add")
REMOTE = re.compile(r"\b(https?|ftp|git|ssh|svn)://|(^|\s)git@[\w.-]+:")
# a DOWNLOAD_COMMAND running one of these fetches over the network whatever its URL's spelling
NETWORK_TOOLS = {"curl", "wget", "git", "svn", "hg", "scp", "rsync", "aria2c", "pip", "pip3"}
COMMAND_KEYS = ("DOWNLOAD_COMMAND", "UPDATE_COMMAND", "PATCH_COMMAND", "CONFIGURE_COMMAND", "BUILD_COMMAND",
                "INSTALL_COMMAND", "TEST_COMMAND")


@dataclass
class Finding:
    file: str
    line: int
    what: str
    guards: list[str] = field(default_factory=list)
    alternative: str | None = None

    def __str__(self) -> str:
        s = f"{self.file}:{self.line}: {self.what}"
        if self.guards:
            s += "\n      reachable for HIP through: " + "; ".join(self.guards)
        if self.alternative:
            s += f"\n      local-path alternative: {self.alternative} (not set by `setup.py bdist_wheel` on the platform)"
        return s


# --- walking the tree ---------------------------------------------------------------------------

@dataclass
class Walk:
    root: Path
    findings: list[Finding] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    unfollowed: list[Finding] = field(default_factory=list)     # reachable includes it could not read

    def file(self, path: Path, ctx: dict, guards: list[str]) -> None:
        r = path.relative_to(self.root).as_posix()
        if r in self.files:
            return
        self.files.append(r)
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise ForgeError(f"{r}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                             "the offline check cannot read what a HIP build would run from it",
                             hint="save the file as UTF-8, as CMake expects its files (a patch that writes it must "
                                  "write UTF-8)") from None
        cmds = parse_cmake(text)
        frames: list[dict] = []     # if-chains: {"outer": reachable before, "any_true", "guards"}
        reach, in_fn, alternative = True, 0, None
        g = list(guards)
        for c in cmds:
            where = f"{r}:{c.line}"
            if c.name == "if":
                cond = Cond(c.args, ctx, self.root)
                v = cond.value()
                frames.append({"outer": reach, "any_true": v is True, "guards": g, "alt": alternative,
                               "names": cond.names, "local": False, "open": None if v is not None else where})
                reach = reach and v is not False
                g = g + ([f"{where} {c.text()} (not evaluated)"] if v is None else [])
                continue
            if c.name in ("elseif", "else") and frames:
                fr = frames[-1]
                g = fr["guards"]
                if c.name == "elseif":
                    cond = Cond(c.args, ctx, self.root)
                    v = None if fr["any_true"] else cond.value()
                    reach = fr["outer"] and not fr["any_true"] and v is not False
                    fr["any_true"] = fr["any_true"] or v is True
                    fr["open"] = fr["open"] or (where if v is None else None)
                    g = g + ([f"{where} {c.text()} (not evaluated)"] if v is None else [])
                else:
                    reach = fr["outer"] and not fr["any_true"]
                    if fr["open"]:
                        g = g + [f"{where} else() of the if() at line {fr['open'].split(':')[-1]} (not evaluated)"]
                if fr["local"] and fr["names"]:
                    alternative = ", ".join(fr["names"])
                continue
            if c.name == "endif" and frames:
                fr = frames.pop()
                reach, g, alternative = fr["outer"], fr["guards"], fr["alt"]
                continue
            if c.name in ("function", "macro"):
                in_fn += 1
                continue
            if c.name in ("endfunction", "endmacro"):
                in_fn = max(0, in_fn - 1)
                continue
            if not reach:
                continue
            if c.name == "return" and not in_fn and not frames:
                break
            if c.name in DECLARERS and "SOURCE_DIR" in [a for a, _ in c.args] and frames:
                frames[-1]["local"] = True      # this branch takes a local copy: the others' alternative
            self._command(c, r, ctx, g, alternative, path)

    def _command(self, c: Cmd, r: str, ctx: dict, g: list[str], alternative: str | None, path: Path) -> None:
        args = [a for a, _ in c.args]
        where = f"{r}:{c.line}"
        if c.name in DECLARERS:
            what = _declared_download(args)
            if what:
                self.findings.append(Finding(r, c.line, f"{c.name}({args[0] if args else ''} {what}) downloads",
                                             g, alternative))
        elif c.name == "file" and args[:1] == ["DOWNLOAD"]:
            self.findings.append(Finding(r, c.line, f"file(DOWNLOAD {args[1] if len(args) > 1 else ''}) downloads",
                                         g, alternative))
        elif c.name == "execute_process" and any(REMOTE.search(a) for a in args):
            url = next(a for a in args if REMOTE.search(a))
            self.findings.append(Finding(r, c.line, f"execute_process(... {url} ...) reaches the network", g,
                                         alternative))
        elif c.name in ("include", "add_subdirectory") and args:
            target, why = self._resolve(c.name, args[0], ctx, path, optional="OPTIONAL" in args[1:])
            if target is None:
                if why:
                    self.unfollowed.append(Finding(r, c.line, f"{c.text()} could not be followed ({why})", g))
                return
            sub_ctx = dict(ctx)
            if c.name == "add_subdirectory":
                sub_ctx["CMAKE_CURRENT_SOURCE_DIR"] = str(target.parent)
            sub_ctx["CMAKE_CURRENT_LIST_DIR"] = str(target.parent)
            self.file(target, sub_ctx, g + [f"{where} {c.text()}"])

    def _resolve(self, how: str, arg: str, ctx: dict, path: Path, optional: bool = False
                 ) -> tuple[Path | None, str | None]:
        """(the file it reads, None); or (None, why it cannot be followed); or (None, None): nothing
        to follow (one of CMake's own modules, an OPTIONAL include of a missing file)."""
        local = {**ctx, "CMAKE_CURRENT_LIST_DIR": str(path.parent)}
        s = expand(arg, local)
        if s is None:
            return None, "its path holds a variable the check does not know"
        p = Path(s)
        if how == "add_subdirectory":
            p = p if p.is_absolute() else Path(ctx["CMAKE_CURRENT_SOURCE_DIR"]) / p
            return (p / "CMakeLists.txt", None) if (p / "CMakeLists.txt").is_file() else \
                (None, f"no {_shown(p / 'CMakeLists.txt', self.root)}")
        if "/" not in s and not s.endswith(".cmake"):
            mod = self.root / "cmake" / f"{s}.cmake"       # a module of the tree's own cmake/ folder
            return (mod if mod.is_file() else None), None  # else one of CMake's (FetchContent, ...)
        p = p if p.is_absolute() else Path(ctx["CMAKE_CURRENT_SOURCE_DIR"]) / p
        if p.is_file():
            return p, None
        return None, (None if optional else f"no file {_shown(p, self.root)}")


def _shown(p: Path, root: Path) -> str:
    """A path as the tree names it where it is inside the tree."""
    try:
        return Path(p).resolve().relative_to(root).as_posix()
    except ValueError:
        return str(p)


def _declared_download(args: list[str]) -> str | None:
    """What makes a FetchContent / ExternalProject declaration a download ('KEY value'), or None: a
    repository or URL key, a download (or other step) command running a network tool, or a remote
    URL in any argument."""
    for k in DOWNLOAD_KEYS:
        if k in args and args.index(k) + 1 < len(args):
            return f"{k} {args[args.index(k) + 1]}"
    for k in COMMAND_KEYS:
        if k in args and args.index(k) + 1 < len(args):
            step = args[args.index(k) + 1:]
            tool = Path(step[0].split()[0] if step[0].strip() else "").name
            if tool in NETWORK_TOOLS:
                url = next((a for a in step if REMOTE.search(a)), None)
                return f"{k} {tool}" + (f" ... {url}" if url else " ...")
    url = next((a for a in args if REMOTE.search(a)), None)
    return f"... {url} ..." if url else None


def check_tree(root: Path) -> Walk:
    """Walk `root`'s CMake files as a HIP build does; the findings are the reachable downloads."""
    root = Path(root).resolve()
    top = root / "CMakeLists.txt"
    if not top.is_file():
        raise ForgeError(f"{rel(root)}: no CMakeLists.txt", hint="give the vLLM tree (build/vllm-<base>)")
    ctx = {**KNOWN, "CMAKE_SOURCE_DIR": str(root), "CMAKE_CURRENT_SOURCE_DIR": str(root),
           "PROJECT_SOURCE_DIR": str(root), "CMAKE_CURRENT_LIST_DIR": str(root)}
    w = Walk(root)
    w.file(top, ctx, [])
    return w


def require_offline(root: Path, label: str | None = None) -> Walk:
    """Raise (naming file:line) when a HIP build of `root` would download anything, or reads a CMake
    file the check could not follow. Every problem is listed in full first; the error names the first."""
    w = check_tree(root)
    label = label or rel(root)
    problems = [*w.findings, *w.unfollowed]
    if problems:
        for f in problems:
            for line in str(f).splitlines():
                ui.info(f"offline check: {line.strip()}")
        what = ([f"a HIP build downloads at configure time ({len(w.findings)} reachable download(s)); the platform "
                 "builds without network"] if w.findings else []) + \
            ([f"{len(w.unfollowed)} reachable include(s) the check could not follow (a download there would go "
              "unseen)"] if w.unfollowed else [])
        hints = (["build on the vendor base (BASE=vendor) or the stand-in; a patch that adds a download must take "
                  "it from a path inside the tree instead"] if w.findings else []) + \
            (["give the include a path inside the tree made of known variables (CMAKE_CURRENT_LIST_DIR, "
              "CMAKE_SOURCE_DIR, ...), or mark an include of a file that may be absent OPTIONAL"] if w.unfollowed else [])
        raise ForgeError(f"{label}: " + "; ".join(what) + ": "
                         + str(problems[0]).splitlines()[0] + (" (all of them listed above)" if len(problems) > 1 else ""),
                         hint="; ".join(hints))
    ui.info(f"offline check: {label}: no download reachable for HIP ({len(w.files)} CMake files read)")
    return w


def cmd_offline_check(args) -> int:
    if args.tree and args.base is not None:
        raise ForgeError(f"--tree {args.tree} and --base {args.base}: --tree checks that folder, --base builds and "
                         "checks the base's patched tree; the one check reads one tree",
                         hint="give one of them: --tree DIR, or --base sdist|standin|vendor (make offline-check BASE=...)")
    if args.tree:
        require_offline(Path(args.tree))
        return 0
    base = args.base or os.environ.get("BASE") or "sdist"
    tree.build_tree(base=base)
    require_offline(bases.tree_dir(base))
    return 0


def register(sub) -> None:
    p = sub.add_parser("offline-check", help="fail naming file:line if a HIP build of the tree would download",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--tree", help="a vLLM source tree to check, instead of a base's (default: the BASE's patched tree, "
                                  "built first; not with --base)")
    add_base_argument(p)
    p.set_defaults(func=cmd_offline_check, base=None)       # None: not given (BASE=, else sdist)
