"""`forge offline-check`: a HIP build of the tree fetches nothing. The contest's platform builds a
submission with `python setup.py bdist_wheel` and no network; vLLM 0.18.1's CMakeLists.txt clones
Triton for `triton_kernels` on HIP at configure time, so a tree that still reaches that clone cannot
be built there.

The check reads the top CMakeLists.txt and every CMake file it includes (or adds as a
subdirectory), follows the branches a HIP build takes, and fails naming file:line for each reachable
command that declares a download: FetchContent_Declare / FetchContent_Populate / ExternalProject_Add
with GIT_REPOSITORY, URL, SVN_REPOSITORY, HG_REPOSITORY or CVS_REPOSITORY, file(DOWNLOAD ...), and
an execute_process that names a remote URL.

What it evaluates: VLLM_GPU_LANG is HIP and VLLM_TARGET_DEVICE is rocm (what setup.py sets for a ROCm
torch); NOT/AND/OR, parentheses, string and number comparisons of known values, constants, and
EXISTS / IS_DIRECTORY of a path inside the tree (a local copy shipped with the tree is a local-path
alternative this check can see). Every other condition (a cache variable, an environment variable, a
compiler version) is not evaluated and both of its branches count as reachable: a download behind
`if(DEFINED ENV{X_SRC_DIR})`'s else branch is reported, naming X_SRC_DIR as the local-path
alternative that the platform's build does not set. Function and macro bodies count as reachable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import ui
from ..errors import ForgeError
from ..paths import rel
from .cmakelang import Cmd, Cond, expand, parse_cmake

KNOWN = {"VLLM_GPU_LANG": "HIP", "VLLM_TARGET_DEVICE": "rocm"}
DOWNLOAD_KEYS = ("GIT_REPOSITORY", "URL", "SVN_REPOSITORY", "HG_REPOSITORY", "CVS_REPOSITORY")
DECLARERS = ("fetchcontent_declare", "fetchcontent_populate", "externalproject_add")
REMOTE = re.compile(r"^(https?|ftp|git|ssh)://|^git@")


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
    notes: list[str] = field(default_factory=list)

    def file(self, path: Path, ctx: dict, guards: list[str]) -> None:
        r = path.relative_to(self.root).as_posix()
        if r in self.files:
            return
        self.files.append(r)
        cmds = parse_cmake(path.read_text(errors="replace"))
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
            for k in DOWNLOAD_KEYS:
                if k in args and args.index(k) + 1 < len(args):
                    self.findings.append(Finding(r, c.line, f"{c.name}({args[0] if args else ''} {k} "
                                                            f"{args[args.index(k) + 1]}) downloads", g, alternative))
                    break
        elif c.name == "file" and args[:1] == ["DOWNLOAD"]:
            self.findings.append(Finding(r, c.line, f"file(DOWNLOAD {args[1] if len(args) > 1 else ''}) downloads",
                                         g, alternative))
        elif c.name == "execute_process" and any(REMOTE.match(a) for a in args):
            url = next(a for a in args if REMOTE.match(a))
            self.findings.append(Finding(r, c.line, f"execute_process(... {url} ...) reaches the network", g,
                                         alternative))
        elif c.name in ("include", "add_subdirectory") and args:
            target = self._resolve(c.name, args[0], ctx, path)
            if target is None:
                if c.name == "add_subdirectory" or "/" in args[0] or args[0].endswith(".cmake"):
                    self.notes.append(f"{where}: {c.text()} could not be followed (unknown path)")
                return
            sub_ctx = dict(ctx)
            if c.name == "add_subdirectory":
                sub_ctx["CMAKE_CURRENT_SOURCE_DIR"] = str(target.parent)
            sub_ctx["CMAKE_CURRENT_LIST_DIR"] = str(target.parent)
            self.file(target, sub_ctx, g + [f"{where} {c.text()}"])

    def _resolve(self, how: str, arg: str, ctx: dict, path: Path) -> Path | None:
        local = {**ctx, "CMAKE_CURRENT_LIST_DIR": str(path.parent)}
        s = expand(arg, local)
        if s is None:
            return None
        p = Path(s)
        if how == "add_subdirectory":
            p = p if p.is_absolute() else Path(ctx["CMAKE_CURRENT_SOURCE_DIR"]) / p
            return p / "CMakeLists.txt" if (p / "CMakeLists.txt").is_file() else None
        if "/" not in s and not s.endswith(".cmake"):
            mod = self.root / "cmake" / f"{s}.cmake"       # a module of the tree's own cmake/ folder
            return mod if mod.is_file() else None          # else one of CMake's (FetchContent, ...)
        p = p if p.is_absolute() else Path(ctx["CMAKE_CURRENT_SOURCE_DIR"]) / p
        return p if p.is_file() else None


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
    """Raise (naming file:line) when a HIP build of `root` would download anything."""
    w = check_tree(root)
    label = label or rel(root)
    if w.findings:
        raise ForgeError(f"{label}: a HIP build downloads at configure time ({len(w.findings)} reachable "
                         "download(s)); the platform builds without network:\n  "
                         + "\n  ".join(str(f) for f in w.findings),
                         hint="build on the vendor base (BASE=vendor) or the stand-in; a patch that adds a "
                              "download must take it from a path inside the tree instead")
    for n in w.notes:
        ui.warn(n)
    ui.info(f"offline check: {label}: no download reachable for HIP ({len(w.files)} CMake files read)")
    return w


def cmd_offline_check(args) -> int:
    from . import bases, tree
    root = Path(args.tree) if args.tree else bases.tree_dir(args.base)
    if not args.tree:
        tree.build_tree(base=args.base)
    require_offline(root)
    return 0


def register(sub) -> None:
    p = sub.add_parser("offline-check", help="fail naming file:line if a HIP build of the tree would download",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--tree", help="a vLLM source tree to check (default: the BASE's patched tree, built first)")
    from .tree import add_base_argument
    add_base_argument(p)
    p.set_defaults(func=cmd_offline_check)
