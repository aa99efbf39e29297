"""Patch tooling: lint (review records, forbidden paths), check (applies to every base present and
matches its tree; the vendor and stand-in trees build offline), refresh (export build/vllm's
commits back to patches/)."""

from __future__ import annotations

import fnmatch
import posixpath
import re
import shutil
from pathlib import Path

from .. import ui
from ..contest.rules import load_contest
from ..errors import ForgeError
from ..hashing import sha256_file
from ..paths import BUILD, PATCHES, TREE, rel
from ..recipe.patchfile import REVIEW_SECTIONS, diff_paths, parse, read_series
from . import bases, offline, tree


def lint_patch(patch, forbidden: list[dict], rules: dict) -> list[str]:
    """Problems with one patch (empty list: fine)."""
    problems = []
    sections = patch.sections()
    for s in REVIEW_SECTIONS:
        if not sections.get(s):
            problems.append(f"review record: missing or empty '{s}:' section")
    if not patch.files:
        problems.append("no diff")
    for f in patch.files:
        if f.created:
            problems.append(f"creates {f.new}: new files come from kernels/ through kernels/overlay.yaml")
    for path in patch.touched():
        problems += [f"touches {path}, {hit}" for hit in forbidden_hits(path, forbidden, rules)]
    return problems


def forbidden_hits(path: str, forbidden: list[dict], rules: dict) -> list[str]:
    return [f"forbidden by the contest ({fp['glob']}): \"{rules[fp['rule']]['text']}\""
            for fp in forbidden if fnmatch.fnmatchcase(path, fp["glob"])]


def lint_overlay(entries: list[dict], forbidden: list[dict], rules: dict) -> list[str]:
    """Problems with kernels/overlay.yaml: a file it adds to the tree where the contest forbids changes
    (a new file there changes that code as much as a patch does)."""
    return [f"kernels/overlay.yaml: key 'files[{i}].dst': {e['dst']} is {hit}"
            for i, e in enumerate(entries) for hit in forbidden_hits(posixpath.normpath(e["dst"]), forbidden, rules)]


def lint(patches_dir: Path = PATCHES) -> int:
    """Lint the series (review records, forbidden paths) and every other patch file under patches/
    (forbidden paths: a file outside the series may still be applied by hand or join it later)."""
    contest = load_contest()
    names = read_series(patches_dir)
    empty = [] if names else [f"{rel(patches_dir / 'series')} lists no patch" if (patches_dir / "series").is_file()
                              else f"{rel(patches_dir / 'series')} not found"]
    listed = set(names)
    bad = 0
    for stray in sorted(p.name for p in patches_dir.glob("*.patch") if p.name not in listed):
        ui.warn(f"{rel(patches_dir / stray)} is not in patches/series and is not applied")
    for name in names:
        problems = lint_patch(parse(patches_dir / name, name), contest["forbidden_paths"], contest["rules"])
        for p in problems:
            print(f"{rel(patches_dir / name)}: {p}")
        bad += bool(problems)
    others = sorted(p for p in patches_dir.rglob("*") if p.suffix in (".patch", ".diff") and p.is_file()
                    and p.relative_to(patches_dir).as_posix() not in listed)
    for f in others:
        problems = [f"touches {path}, {hit}" for path in diff_paths(f)
                    for hit in forbidden_hits(path, contest["forbidden_paths"], contest["rules"])]
        for p in problems:
            print(f"{rel(f)}: {p}")
        bad += bool(problems)
    overlay = lint_overlay(tree.overlay_entries(), contest["forbidden_paths"], contest["rules"])
    for p in overlay:
        print(p)
    if bad or overlay or empty:
        what = empty + ([f"{bad} patch(es) failed the lint"] if bad else [])
        what += [f"kernels/overlay.yaml adds {len(overlay)} file(s) where the contest forbids changes"] if overlay else []
        raise ForgeError("; ".join(what),
                         hint="patches/series names the patches `make tree` applies, one file name per line; "
                              "every message needs Why:/What:/Risk:/Evidence:/Rule check: sections "
                              "(see README 'Adding a patch'); forbidden paths are in configs/contest.yaml, and "
                              "neither a patch (in the series or not) nor an overlay destination may fall under them")
    ui.info(f"lint: {len(names)} patches carry their review record, and they, {len(others)} other patch file(s) "
            "under patches/ and kernels/overlay.yaml touch nothing forbidden")
    return 0


def check(patches_dir: Path = PATCHES, scratch: Path = BUILD / "patches-check",
          which: list[str] | None = None) -> dict[str, str]:
    """Apply the series to a fresh tree on every base present (bases.present: the sdist, the
    stand-in, the vendor tree when VENDOR_SRC is given); compare each with its `make tree` folder when
    there is one; on the bases a submission is built from (vendor, stand-in) a HIP build must reach
    no download (offline.py). Returns {base: checked tree id}."""
    lint(patches_dir)
    out = {}
    for base in which or bases.present():
        where = scratch if base == "sdist" else scratch.with_name(f"{scratch.name}-{base}")
        shutil.rmtree(where, ignore_errors=True)
        state = tree.build_tree(where, patches_dir=patches_dir, base=base)
        checked = tree.git_out(where, "rev-parse", "HEAD^{tree}")
        ui.info(f"{base} base: the series applies cleanly ({len(state['patches'])} patches)")
        mine = bases.tree_dir(base)
        if (mine / ".git").is_dir() and patches_dir == PATCHES:
            ours = tree.git_out(mine, "rev-parse", "HEAD^{tree}")
            dirty = tree.git_out(mine, "status", "--porcelain", "--untracked-files=no")
            if ours != checked or dirty:
                raise ForgeError(f"{rel(mine)} differs from what patches/ produces on the {base} base"
                                 + (" (uncommitted changes)" if dirty else ""),
                                 hint=f"export your {rel(mine)} commits with `make patches-refresh`, "
                                      f"or rebuild the tree from patches/ with `make tree BASE={base} FORCE=1`")
            ui.info(f"{rel(mine)} matches patches/")
        if base == "sdist":
            ui.info("sdist base: not checked offline (for HIP its CMakeLists.txt clones Triton for triton_kernels; "
                    "a submission is built on the vendor base)")
        else:
            offline.require_offline(where, f"{base} base with the series")
        shutil.rmtree(where, ignore_errors=True)
        out[base] = checked
    return out


def _slug(subject: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "_", subject.lower()).strip("_")
    return (s[:60].rstrip("_") or "patch") + ".patch"


PATCH_AUTHOR = "From: dcu-forge <forge@localhost>"
PATCH_DATE = "Date: Thu, 1 Jan 2026 00:00:00 +0000"


def normalize_header(text: str) -> str:
    """Patches carry the project's identity and a fixed date: re-exporting an unchanged commit
    (after a rebase, on another machine) rewrites nothing, and no personal or machine identity
    ends up in patches/."""
    head, sep, rest = text.partition("\n\n")
    out, skip = [], False
    for line in head.split("\n"):
        if skip and line.startswith((" ", "\t")):
            continue
        skip = False
        if line.startswith("From: "):
            out.append(PATCH_AUTHOR)
            skip = True
        elif line.startswith("Date: "):
            out.append(PATCH_DATE)
            skip = True
        else:
            out.append(line)
    return "\n".join(out) + sep + rest


def refresh(tree_dir: Path = TREE, patches_dir: Path = PATCHES) -> list[str]:
    """Write each commit after the overlay back to patches/, keeping names where the subject is unchanged."""
    if not (tree_dir / ".git").is_dir():
        raise ForgeError(f"{rel(tree_dir)} does not exist", hint="run `make tree` first")
    dirty = tree.git_out(tree_dir, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise ForgeError(f"{rel(tree_dir)} has uncommitted changes:\n{dirty[:800]}",
                         hint="commit them in build/vllm first (git commit, or git commit --fixup + rebase --autosquash)")
    old = read_series(patches_dir)
    old_subjects = {parse(patches_dir / n, n).subject: n for n in old}
    commits = tree.git_out(tree_dir, "rev-list", "--reverse", f"{tree.OVERLAY_REF}..HEAD").split()
    names, used = [], set()
    patches_dir.mkdir(parents=True, exist_ok=True)
    state = tree.read_state(tree_dir)
    state["patches"] = []
    for sha in commits:
        # raw output: a context line of a blank line is a lone space that stripping would destroy
        text = tree.git(tree_dir, "format-patch", "-1", "--stdout", "--zero-commit", "--no-signature",
                        "--no-stat", "--full-index", sha, capture=True).stdout
        text = normalize_header(text)
        subject = tree.git_out(tree_dir, "log", "-1", "--format=%s", sha)
        name = old_subjects.get(subject) or _slug(subject)
        while name in used:
            name = name.removesuffix(".patch") + "_2.patch"
        used.add(name)
        dest = patches_dir / name
        if not dest.is_file() or dest.read_text() != text:
            dest.write_text(text)
            ui.info(f"wrote {rel(dest)}")
        names.append(name)
        state["patches"].append([name, sha256_file(dest), sha])
    for n in old:
        if n not in names:
            (patches_dir / n).unlink()
            ui.info(f"removed {rel(patches_dir / n)} (no longer in the tree)")
    (patches_dir / "series").write_text(
        "# Order in which patches apply on top of upstream + kernel overlay (make tree).\n"
        + "".join(f"{n}\n" for n in names))
    state["head"] = tree.git_out(tree_dir, "rev-parse", "HEAD")
    tree.write_state(tree_dir, state)
    ui.info(f"patches/series: {len(names)} patches")
    return names


def cmd_lint(args) -> int:
    return lint()


def cmd_check(args) -> int:
    done = check()
    print("patches-check: OK (" + ", ".join(f"{b} tree {t[:12]}" for b, t in done.items()) + ")")
    return 0


def cmd_refresh(args) -> int:
    refresh()
    return lint()


def register(sub) -> None:
    sub.add_parser("patches-lint", help="check every patch's review record and the contest's forbidden paths"
                   ).set_defaults(func=cmd_lint)
    sub.add_parser("patches-check", help="prove patches/ applies to every base present, matches its tree, "
                                         "and (vendor, stand-in) builds offline").set_defaults(func=cmd_check)
    sub.add_parser("patches-refresh", help="write build/vllm's commits back to patches/ (messages preserved)"
                   ).set_defaults(func=cmd_refresh)
