"""Stage 2: build/vllm, a git repository holding pristine upstream + our kernel overlay + one commit
per patch, each marked so `patches-refresh` can export them again. The same series builds on each
base of bases.py: the sdist (build/vllm), the vendor tree (BASE=vendor VENDOR_SRC=...:
build/vllm-vendor) and CI's stand-in for it (BASE=standin: build/vllm-standin).

    refs/forge/upstream   the base: "upstream vLLM 0.18.1 (sdist sha256 …)", "vendor vLLM …", "vendor stand-in …"
    refs/forge/overlay    "forge kernel overlay (kernels/overlay.yaml)"
    HEAD                  one commit per entry of patches/series

Commits are deterministic (fixed identity and dates), so the same inputs give the same hashes.
Reruns are incremental: the longest unchanged prefix of (upstream, overlay, patches) is kept.

Interrupts: the upstream commit is made in a temporary folder next to the tree and renamed into
place with its state, so the tree is either absent or a git repository with a record. While the
overlay and patches are applied, the record says so ("pending"); a rerun after an interrupt at any
moment (Ctrl-C, kill -9, power loss) removes git's stale locks, aborts a half-applied patch, resets
to the last recorded commit and carries on. A lock file keeps two runs off the same tree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from .. import config, options, proc, records, tunedtable, ui
from ..errors import ForgeError
from ..hashing import combine, manifest_hash, sha256_file
from ..paths import KERNELS, PATCHES, ROOT, Lock, rel, write_atomic
from ..recipe.patchfile import hunk_for, parse, read_series
from . import bases, fetch

UPSTREAM_REF = "refs/forge/upstream"
OVERLAY_REF = "refs/forge/overlay"
STATE = "forge-state.json"          # inside .git: what the tree was built from
FIXED_DATE = "2026-01-01T00:00:00+00:00"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "dcu-forge", "GIT_AUTHOR_EMAIL": "forge@localhost",
    "GIT_COMMITTER_NAME": "dcu-forge", "GIT_COMMITTER_EMAIL": "forge@localhost",
    "GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE,
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
}


def git(tree: Path, *args, **kw):
    kw.setdefault("what", f"git {args[0]}")
    return proc.run(["git", "-C", tree, *args], env={**GIT_ENV, **kw.pop("env", {})}, **kw)


def git_out(tree: Path, *args, **kw) -> str:
    return git(tree, *args, capture=True, **kw).stdout.strip()


# --- overlay --------------------------------------------------------------------------------

# where the overlay places the per-device tuned tables (configs/kernels/tuned/*.json)
TUNED_DST = "vllm/forge_tuned"
OVERLAY_SCHEMA = {"files": config.Field(list, item={"src": config.Field(str), "dst": config.Field(str)})}


def overlay_entries() -> list[dict]:
    """The overlay's files, one entry per file: an entry whose `src` has a `*` (e.g. the per-device
    tables, configs/kernels/tuned/*.json) names a folder as `dst` (ending in /) and stands for every
    matching file, in name order; it may match none."""
    data = config.load(KERNELS / "overlay.yaml", OVERLAY_SCHEMA)
    files = []
    for i, e in enumerate(data["files"]):
        if e["dst"].startswith("/") or ".." in Path(e["dst"]).parts or ".." in Path(e["src"]).parts:
            raise ForgeError(f"kernels/overlay.yaml: key 'files[{i}]': src and dst must be relative paths "
                             "inside the project and the tree")
        if "*" in e["src"]:
            if not e["dst"].endswith("/"):
                raise ForgeError(f"kernels/overlay.yaml: key 'files[{i}].dst': a pattern's destination is "
                                 f"a folder ending in '/', got {e['dst']!r}")
            matched = [p for p in sorted(ROOT.glob(e["src"])) if p.is_file()]
            if e["dst"].rstrip("/") == TUNED_DST:
                for p in matched:        # what the server would refuse never enters a tree or a wheel
                    tunedtable.check_table(p, fix="re-make it with `forge calibrate --install`, or remove it")
            files += [{"src": str(p.relative_to(ROOT)), "dst": e["dst"] + p.name} for p in matched]
            continue
        if not (ROOT / e["src"]).is_file():
            raise ForgeError(f"kernels/overlay.yaml: key 'files[{i}].src': {e['src']} does not exist",
                             hint="fix the path or add the file")
        files.append(e)
    return files


def overlay_hash(entries: list[dict]) -> str:
    return combine(*(f"{e['src']}>{e['dst']}:{sha256_file(ROOT / e['src'])}" for e in entries))


# --- state ------------------------------------------------------------------------------------

def read_state(tree: Path) -> dict:
    p = tree / ".git" / STATE
    try:
        return records.read_json(p) if p.exists() else {}
    except ForgeError:
        return {}


def write_state(tree: Path, state: dict) -> None:
    write_atomic(tree / ".git" / STATE, json.dumps(state, indent=1))


def series_inputs(patches_dir: Path = PATCHES) -> list[tuple[str, str]]:
    return [(n, sha256_file(patches_dir / n)) for n in read_series(patches_dir)]


def planned_state(patches_dir: Path = PATCHES) -> dict:
    """What the sdist tree's record says once `make tree` has brought it up to date, from the inputs
    alone (nothing fetched or built): the keys provenance.series_hash reads."""
    return {"upstream": bases.sdist_key(), "overlay": overlay_hash(overlay_entries()),
            "patches": [[n, d, None] for n, d in series_inputs(patches_dir)]}


# --- building ---------------------------------------------------------------------------------

def _commit_all(tree: Path, message: str, paths: list[str] | None = None) -> str:
    git(tree, "add", "-f", *(["--", *paths] if paths else ["-A"]))
    git(tree, "commit", "-q", "--allow-empty", "--no-verify", "-m", message)
    return git_out(tree, "rev-parse", "HEAD")


def _copy_base(base: "bases.Base", dest: Path) -> None:
    if base.files is not None:          # a git checkout: its tracked files only
        dest.mkdir(parents=True)
        for f in base.files:
            s, d = base.pristine / f, dest / f
            if not (s.exists() or s.is_symlink()):
                continue
            d.parent.mkdir(parents=True, exist_ok=True)
            if s.is_symlink():
                os.symlink(os.readlink(s), d)
            else:
                shutil.copy2(s, d)
    elif base.name == "vendor":
        shutil.copytree(base.pristine, dest, symlinks=True, ignore=bases.copy_ignore(base.pristine))
    else:
        shutil.copytree(base.pristine, dest, symlinks=True, ignore=shutil.ignore_patterns(".git", *fetch.INTERNAL))


def init_upstream(tree: Path, base: "bases.Base") -> dict:
    """A new tree holding the base's pristine source as one commit, built in a temporary folder and
    renamed into place with its state; an existing tree (already found clean, or FORCE) is replaced."""
    ui.info(f"creating {rel(tree)} from the pristine {base.name} base")
    tmp = _partial(tree)
    shutil.rmtree(tmp, ignore_errors=True)
    tree.parent.mkdir(parents=True, exist_ok=True)
    _copy_base(base, tmp)
    if base.name == "vendor":           # what was copied is what was verified
        vcfg = bases.vendor_cfg()
        if manifest_hash(bases.scope_manifest(tmp, vcfg)) != vcfg["scope_sha256"]:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ForgeError(f"VENDOR_SRC={base.pristine} changed while it was copied", hint="rerun")
    git(tmp, "init", "-q", "-b", "forge")
    git(tmp, "config", "core.autocrlf", "false")
    git(tmp, "config", "gc.auto", "0")
    # upstream ships build outputs' names in its own .gitignore; keep every file of the sdist
    info = tmp / ".git" / "info"
    info.mkdir(parents=True, exist_ok=True)
    sha = _commit_all(tmp, base.message)
    git(tmp, "update-ref", UPSTREAM_REF, sha)
    state = {"upstream": base.key, "base": base.name, "pristine": str(base.pristine), "head": sha,
             "pending": "build"}
    write_state(tmp, state)
    if tree.exists():
        old = _old(tree)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(tree, old)
        os.rename(tmp, tree)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, tree)
    return state


def _step(tree: Path, state: dict, fn):
    """Run one step; when it refuses (a patch that does not apply: the tree is back at the last
    good commit, clean) the record stops saying 'pending', so the user's fix in the tree is kept."""
    try:
        return fn()
    except ForgeError:
        state.pop("pending", None)
        write_state(tree, state)
        raise


def _partial(tree: Path) -> Path:
    return tree.parent / f".{tree.name}.partial"


def _old(tree: Path) -> Path:
    return tree.parent / f".{tree.name}.replaced"


def _recover(tree: Path, state: dict) -> dict:
    """Undo the half-done step of an interrupted run (the record says 'pending'): git's stale lock
    files, a half-applied patch, a half-written work tree; back to the last recorded commit."""
    ui.info(f"{rel(tree)}: an earlier run was interrupted; resuming from its last recorded commit "
            f"{state['head'][:12]}")
    g = tree / ".git"
    for lock in [g / "index.lock", g / "HEAD.lock", g / "ORIG_HEAD.lock", g / "config.lock",
                 *g.glob("refs/**/*.lock"), *g.glob("*.tmp"), *g.glob(".*.tmp")]:
        lock.unlink(missing_ok=True)
    git(tree, "am", "--abort", check=False, capture=True)
    shutil.rmtree(g / "rebase-apply", ignore_errors=True)
    git(tree, "reset", "-q", "--hard", state["head"])
    return state


def apply_overlay(tree: Path, entries: list[dict]) -> str:
    for i, e in enumerate(entries):
        dst = tree / e["dst"]
        if git(tree, "cat-file", "-e", f"{UPSTREAM_REF}:{e['dst']}", check=False, capture=True).returncode == 0:
            raise ForgeError(f"kernels/overlay.yaml: key 'files[{i}].dst': {e['dst']} exists upstream",
                             hint="the overlay only adds files; change upstream files with a patch")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / e["src"], dst)
    # only the overlay's own files: nothing else lying in the work tree rides along
    sha = _commit_all(tree, "forge kernel overlay (kernels/overlay.yaml)\n\n" +
                      "\n".join(f"{e['src']} -> {e['dst']}" for e in entries), [e["dst"] for e in entries])
    git(tree, "update-ref", OVERLAY_REF, sha)
    return sha


def _diagnose(tree: Path, patch_path: Path, name: str, am_output: str) -> ForgeError:
    """Name the patch, file and hunk that failed."""
    patch = parse(patch_path, name)
    res = git(tree, "apply", "--check", "-v", patch_path, check=False, capture=True)
    text = (res.stderr or "") + (res.stdout or "") + "\n" + am_output
    problems = []
    for m in re.finditer(r"error: patch failed: (.+?):(\d+)", text):
        f, line = m.group(1), int(m.group(2))
        problems.append(f"{f}: {hunk_for(patch, f, line)} does not apply (upstream line {line})")
    for m in re.finditer(r"error: (.+?): (does not exist in index|No such file or directory|already exists in working directory)", text):
        problems.append(f"{m.group(1)}: {m.group(2)}")
    if not problems:
        errs = [l.strip() for l in text.splitlines() if l.strip().startswith(("error:", "fatal:", "Patch failed"))]
        problems += errs or [l for l in text.strip().splitlines() if not l.startswith("hint:")][-5:] or ["git am failed"]
    return ForgeError(
        f"patch '{name}' ({patch.subject}) failed to apply:\n  " + "\n  ".join(dict.fromkeys(problems)) +
        f"\n  {rel(tree)} is left at the last good commit",
        hint="rebase the patch: edit in build/vllm (git am --3way, or re-create the change and commit), "
             "then `make patches-refresh`; THREEWAY=1 make tree tries a 3-way merge")


def apply_patch(tree: Path, patch_path: Path, name: str, threeway: bool = False) -> str:
    args = ["am", "-q", "--keep-cr", "--committer-date-is-author-date"]
    if threeway:
        args.append("--3way")
    res = git(tree, *args, patch_path, check=False, capture=True)
    if res.returncode != 0:
        out = (res.stdout or "") + (res.stderr or "")
        git(tree, "am", "--abort", check=False, capture=True)
        raise _diagnose(tree, patch_path, name, out)
    return git_out(tree, "rev-parse", "HEAD")


def check_clean(tree: Path, state: dict) -> None:
    """Refuse to rewrite a tree holding work that is not in patches/."""
    dirty = git_out(tree, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise ForgeError(f"{rel(tree)} has uncommitted changes:\n{dirty[:800]}",
                         hint="commit them in build/vllm and run `make patches-refresh`, "
                              "or discard them with `make tree FORCE=1`")
    head = git_out(tree, "rev-parse", "HEAD")
    if state.get("head") and head != state["head"]:
        raise ForgeError(f"{rel(tree)} has commits that are not in patches/ (HEAD {head[:12]}, "
                         f"last built {state['head'][:12]})",
                         hint="export them with `make patches-refresh`, or discard them with `make tree FORCE=1`")


def build_tree(tree: Path | None = None, *, patches_dir: Path = PATCHES, force: bool = False,
               threeway: bool = False, source: str = "auto", base: str = "sdist",
               vendor_src: str | None = None) -> dict:
    """Bring `tree` (default: the base's tree folder) up to date with the base + overlay + series.
    Returns the state."""
    tree = tree or bases.tree_dir(base)
    b = bases.resolve(base, source, vendor_src)
    entries = overlay_entries()
    ov_hash = overlay_hash(entries)
    series = series_inputs(patches_dir)
    tree.parent.mkdir(parents=True, exist_ok=True)
    with Lock(tree.parent / f".{tree.name}.lock", rel(tree)):
        # leftovers of a run killed while it made or replaced the tree: never the tree itself
        shutil.rmtree(_partial(tree), ignore_errors=True)
        shutil.rmtree(_old(tree), ignore_errors=True)
        return _build_locked(tree, patches_dir, force, threeway, b, entries, ov_hash, series)


def _build_locked(tree, patches_dir, force, threeway, b, entries, ov_hash, series) -> dict:
    exists = (tree / ".git").is_dir()
    state = read_state(tree) if exists else {}
    if tree.exists() and not exists and any(tree.iterdir()) and not force:
        raise ForgeError(f"{rel(tree)} exists but is not a git repository made by `make tree`",
                         hint="move it away to keep what is in it, or replace it with `make tree FORCE=1`")
    if exists and not state and not force:
        raise ForgeError(f"{rel(tree)} exists but has no record of how it was built (.git/{STATE})",
                         hint="move it away to keep its work, or rebuild it with `make tree FORCE=1`")
    if state.get("pending") and state.get("head"):
        state = _recover(tree, state)
    elif state and not force:
        check_clean(tree, state)
    elif state and force:
        git(tree, "am", "--abort", check=False, capture=True)
        git(tree, "reset", "-q", "--hard")

    if state.get("upstream") != b.key or state.get("pristine") != str(b.pristine) or not state.get("head"):
        if tree.exists() and not exists:
            shutil.rmtree(tree)             # an empty folder, or FORCE
        state = init_upstream(tree, b)
    else:
        state["pending"] = "build"
        write_state(tree, state)
    # from here on the record says "pending": an interrupt is undone by the next run (_recover)
    if state.get("overlay") != ov_hash:
        git(tree, "reset", "-q", "--hard", UPSTREAM_REF)
        state.update(head=git_out(tree, "rev-parse", UPSTREAM_REF), patches=[])
        state.pop("overlay", None)
        write_state(tree, state)
        ui.info(f"applying kernel overlay ({len(entries)} files)")
        sha = _step(tree, state, lambda: apply_overlay(tree, entries))
        state.update(overlay=ov_hash, overlay_commit=sha, head=sha, patches=[])
        write_state(tree, state)
    # keep the longest prefix of already-applied, unchanged patches
    applied = state.get("patches", [])
    keep = 0
    while keep < len(applied) and keep < len(series) and applied[keep][:2] == list(series[keep]):
        keep += 1
    base = applied[keep - 1][2] if keep else state["overlay_commit"]
    todo = series[keep:]
    if keep < len(applied) or git_out(tree, "rev-parse", "HEAD") != base:
        git(tree, "reset", "-q", "--hard", base)
    state["patches"] = applied[:keep]
    state["head"] = base
    write_state(tree, state)
    if not todo:
        ui.info(f"{rel(tree)} is up to date ({len(series)} patches)")
    for i, (name, digest) in enumerate(todo, keep + 1):
        ui.info(f"[{i}/{len(series)}] applying {name}")
        sha = _step(tree, state, lambda: apply_patch(tree, patches_dir / name, name, threeway))
        state["patches"].append([name, digest, sha])
        state["head"] = sha
        write_state(tree, state)
    state.pop("pending", None)
    write_state(tree, state)
    return state


def cmd_tree(args) -> int:
    force = options.forced(args.force)
    threeway = options.flag("THREEWAY", args.threeway, hint="make tree THREEWAY=1 (or --threeway) lets git am merge")
    state = build_tree(force=force, threeway=threeway, base=args.base)
    print(f"{rel(bases.tree_dir(args.base))} at {state['head'][:12]}: {args.base} base + overlay + "
          f"{len(state['patches'])} patches")
    return 0


def register(sub) -> None:
    p = sub.add_parser("tree", help="build/vllm: pristine upstream + kernel overlay + one commit per patch (no-op when current)",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--force", action="store_true", help="discard uncommitted/unexported work in build/vllm (also FORCE=1)")
    p.add_argument("--threeway", action="store_true", help="let git am fall back to a 3-way merge (also THREEWAY=1)")
    add_base_argument(p)
    p.set_defaults(func=cmd_tree)


def add_base_argument(p) -> None:
    p.add_argument("--base", choices=bases.BASES, default=os.environ.get("BASE") or "sdist",
                   help="sdist (default: build/vllm), vendor (VENDOR_SRC=<vllm_cscc checkout>: build/vllm-vendor) "
                        "or standin (CI's stand-in for the vendor tree: build/vllm-standin); also BASE=")
