"""Stage 1: the pinned vLLM source, fetched (or taken from VLLM_SRC), verified by hash, extracted.

Nothing unverified is ever used: a download lands in a .part file that is only renamed into the
cache after its sha256 matches configs/upstream.yaml; the cache is re-verified on every use.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from .. import config, proc, records, ui
from ..errors import ForgeError
from ..hashing import file_entry, manifest_diff, manifest_hash, sha256_file, tree_manifest, tree_sha256
from ..paths import CACHE, Lock, rel, set_aside
from ..tarsafe import extract_tar
from .pipindex import download, find_sdist_url, mismatch, pip_index_urls

# --- the pinned source as a verified, extracted tree ---------------------------------------
#
# An extracted tree carries MARKER: the manifest of the sdist's members as extracted (path, kind,
# size, sha256). The manifest is authenticated by configs/upstream.yaml (its tree hash must be the
# pinned tree_sha256) and every use re-hashes the tree against it: a changed, added or missing file
# is refused by name and the tree is moved aside (<name>.rejected), never used and never deleted.
# Cost: about 0.2 s for the 4,297 files of vllm-0.18.1 (measured: warm page cache, one core);
# the first use after a reboot reads the 74 MB from disk once.

MARKER = ".forge-manifest.json"
LEGACY_MARKERS = (".forge-verified",)       # earlier releases' marker: no manifest, not trusted
INTERNAL = (MARKER, *LEGACY_MARKERS)        # never part of the source


KINDS = {"f": "a plain file", "x": "an executable file", "l": "a symbolic link"}


def manifest_differences(expected: dict[str, list], got: dict[str, list], what: str) -> tuple[list[str], dict[str, str]]:
    """manifest_diff's lines, a file whose content matches but whose mode does not said so in words
    ("changed (type: an executable file here, a plain file in the sdist; the same content)"); and
    {path: the chmod that restores it} for those."""
    lines, modes = [], {}
    for line in manifest_diff(expected, got, what=what):
        p = line.split(": ", 1)[0]
        e, g = expected.get(p), got.get(p)
        if e and g and e[2] == g[2] and e[0] != g[0] and {e[0], g[0]} <= set(KINDS):
            line = f"{p}: changed (type: {KINDS[g[0]]} here, {KINDS[e[0]]} in {what}; the same content)"
            if {e[0], g[0]} == {"f", "x"}:
                modes[p] = "-x" if g[0] == "x" else "+x"
        lines.append(line)
    return lines, modes


def _tree_mismatch(d: Path, problems: list[str], hint: str) -> ForgeError:
    shown = problems[:20] + ([f"… and {len(problems) - 20} more"] if len(problems) > 20 else [])
    return ForgeError(f"{rel(d)}: the extracted source differs from the pinned sdist "
                      f"({len(problems)} file(s)):\n  " + "\n  ".join(shown), hint=hint)


def read_manifest(d: Path) -> dict | None:
    try:
        data = records.read_json(d / MARKER)
        return data if isinstance(data.get("files"), dict) else None
    except (ForgeError, AttributeError):
        return None


def verify_extracted(d: Path, tree_hash: str | None, origin: str) -> None:
    """Refuse a tree that is not exactly what was extracted: set it aside and name the files.
    `tree_hash`: the pinned hash the manifest must carry (None for a git export, bound to its
    commit by `origin`)."""
    man = read_manifest(d)
    if man is None or man.get("origin") != origin or \
            (tree_hash is not None and manifest_hash(man["files"]) != tree_hash):
        bad = set_aside(d)
        why = "has no manifest" if man is None else "has a manifest that is not the pinned one"
        raise ForgeError(f"{rel(d)} {why}: it cannot be verified, so it is not used; moved to {rel(bad)}",
                         hint="rerun: the source is extracted again from the verified sdist")
    problems = manifest_differences(man["files"], tree_manifest(d, exclude=INTERNAL), "the sdist")[0]
    if problems:
        bad = set_aside(d)
        raise _tree_mismatch(d, problems, f"the extracted tree was edited or damaged; moved to {rel(bad)} "
                                          "(compare it there); rerun to extract it again from the verified sdist")


def _extract(tarball: Path, final: Path, tree_hash: str | None, origin: str, prefix: str = "") -> Path:
    """Extract `tarball` (its top folder `prefix`, or its root) into a temporary folder next to
    `final`, check it against `tree_hash`, write its manifest, then rename it into place: `final`
    is either absent or complete and verified, whenever the process is stopped."""
    dest = final.parent
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest))
    try:
        with tarfile.open(tarball) as tf:
            members = {m.name.rstrip("/") for m in tf.getmembers() if m.isfile() or m.issym() or m.islnk()}
            extract_tar(tf, tmp)
        top = tmp / prefix if prefix else tmp
        files = tree_manifest(top, exclude=())
        pre = f"{prefix}/" if prefix else ""
        if {pre + p for p in files} != members:
            extra = sorted({pre + p for p in files} ^ members)[:5]
            raise ForgeError(f"{tarball.name}: extracting it did not give its members ({', '.join(extra)})",
                             hint="the file system changed names or modes; extract somewhere else (FORGE_CACHE_DIR)")
        got = manifest_hash(files)
        if tree_hash is not None and got != tree_hash:
            raise mismatch(f"extracted {tarball.name}", tree_hash, got,
                           "the tarball is verified but its contents differ; check configs/upstream.yaml tree_sha256")
        (top / MARKER).write_text(json.dumps({"origin": origin, "files": files}, sort_keys=True) + "\n")
        if final.exists():          # only an unverifiable one reaches here; it was set aside already
            set_aside(final)
        os.rename(top, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _clean_stale(dest: Path) -> None:
    """Temporary folders of an interrupted extraction (the caller holds the cache's lock)."""
    for t in dest.glob(".extract-*"):
        shutil.rmtree(t, ignore_errors=True)
    for t in dest.glob("*.part"):
        t.unlink(missing_ok=True)


def _use_extracted(final: Path, tree_hash: str | None, origin: str) -> bool:
    """True when `final` exists and verifies; a legacy tree (marker without manifest) is moved aside
    quietly and re-extracted; anything else that fails is refused (ForgeError)."""
    if not final.exists():
        return False
    if not (final / MARKER).exists() and any((final / m).exists() for m in LEGACY_MARKERS):
        bad = set_aside(final)
        ui.info(f"{rel(final)} was extracted by an earlier release without a manifest; moved to {rel(bad)}, "
                "extracting again")
        return False
    verify_extracted(final, tree_hash, origin)
    return True


def _from_git_checkout(src: Path, cfg: dict) -> Path:
    commit = cfg["git"]["commit"]
    head = proc.output(["git", "-C", src, "rev-parse", "HEAD"], what="git rev-parse")
    if not head.startswith(commit):
        raise ForgeError(f"VLLM_SRC={src}: checkout is at {head[:12]}, the pinned commit is {commit} "
                         f"(tag {cfg['git']['tag']})", hint=f"git -C {src} checkout {cfg['git']['tag']}")
    srcdir = CACHE / "src"
    srcdir.mkdir(parents=True, exist_ok=True)
    dest = srcdir / f"vllm-git-{commit}"
    origin = f"git {head}"
    with Lock(srcdir / ".lock", "the verified source"):
        _clean_stale(srcdir)
        if _use_extracted(dest, None, origin):
            return dest
        ui.info(f"exporting git checkout {src} at {head[:12]}")
        arch = srcdir / f"vllm-git-{commit}.tar.part"
        proc.run(["git", "-C", src, "archive", "--prefix=top/", "-o", arch, "HEAD"], what="git archive")
        try:
            return _extract(arch, dest, None, origin, prefix="top")
        finally:
            arch.unlink(missing_ok=True)


def clone_git(cfg: dict) -> Path:
    url = os.environ.get("VLLM_GIT_URL") or cfg["git"]["url"]
    if not url:
        raise ForgeError("--source git: no mirror URL", hint="set VLLM_GIT_URL or git.url in configs/upstream.yaml")
    dest = CACHE / "git" / "vllm"
    if not (dest / ".git").is_dir():
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        proc.run(["git", "clone", "--branch", cfg["git"]["tag"], "--depth", "1", url, dest],
                 what="git clone of the vLLM mirror")
    return _from_git_checkout(dest, cfg)


def ensure_source(source: str = "auto") -> Path:
    """Path of a verified, extracted pristine vLLM source tree. `source`: auto | index | git.
    Verified on every call: the sdist by its sha256, the extracted tree file by file against its
    manifest. Safe to interrupt at any moment: a rerun resumes (see _extract, download)."""
    cfg = config.upstream()
    sd = cfg["sdist"]
    top = sd["filename"].removesuffix(".tar.gz")
    srcdir = CACHE / "src"
    srcdir.mkdir(parents=True, exist_ok=True)
    tarball = srcdir / sd["filename"]

    env_src = os.environ.get("VLLM_SRC")
    if env_src:
        p = Path(env_src).expanduser()
        if p.is_dir():
            if (p / ".git").exists():
                return _from_git_checkout(p, cfg)
            ui.info(f"verifying source tree VLLM_SRC={p}")
            got_files = tree_manifest(p, exclude=(".git", *INTERNAL))
            got = manifest_hash(got_files)
            if got != sd["tree_sha256"]:
                known = read_manifest(srcdir / top)
                hint = ("point VLLM_SRC at an unmodified extracted vllm-0.18.1 sdist, a v0.18.1 git checkout, "
                        "or the sdist tarball")
                if known and manifest_hash(known["files"]) == sd["tree_sha256"]:
                    raise _tree_mismatch(p, manifest_differences(known["files"], got_files, "the sdist")[0], hint)
                raise mismatch(f"VLLM_SRC={p}", sd["tree_sha256"], got, hint)
            return p
        if not p.is_file():
            raise ForgeError(f"VLLM_SRC={p}: no such file or directory",
                             hint="give the vllm-0.18.1.tar.gz sdist, an extracted tree, or a git checkout")

    if source == "git":
        return clone_git(cfg)

    with Lock(srcdir / ".lock", "the verified source"):
        _clean_stale(srcdir)
        origin = f"sdist {sd['sha256']}"
        if env_src:
            got = sha256_file(p)
            if got != sd["sha256"]:
                raise mismatch(f"VLLM_SRC={p}", sd["sha256"], got,
                               "this tarball is not the pinned vllm-0.18.1 sdist; it was not used")
            if not (tarball.is_file() and sha256_file(tarball) == got):
                tmp = tarball.with_name(tarball.name + ".part")
                shutil.copyfile(p, tmp)
                os.replace(tmp, tarball)
        if tarball.is_file():
            got = sha256_file(tarball)
            if got != sd["sha256"]:
                bad = set_aside(tarball)
                raise mismatch(f"cached {rel(tarball)}", sd["sha256"], got,
                               f"the cached file was tampered with or corrupted; moved to {rel(bad)}; "
                               "rerun to fetch again")
        else:
            _fetch_from_index(sd, tarball)
        if _use_extracted(srcdir / top, sd["tree_sha256"], origin):
            return srcdir / top
        ui.info(f"verified {sd['filename']} sha256 {sd['sha256'][:16]}…; extracting")
        return _extract(tarball, srcdir / top, sd["tree_sha256"], origin, prefix=top)


def _fetch_from_index(sd: dict, tarball: Path) -> None:
    ui.info(f"fetching {sd['filename']} through pip's configured package index")
    tried = []
    for index in pip_index_urls():
        found = find_sdist_url(index, sd["project"], sd["filename"])
        tried.append(index)
        if not found:
            continue
        url, listed = found
        if listed and listed != sd["sha256"]:
            raise mismatch(f"{sd['filename']} as listed by the index", sd["sha256"], listed,
                           "the index lists a different file under this name; not downloaded")
        download(url, tarball, sd["sha256"])
        return
    raise ForgeError(f"{sd['filename']} not found on pip's configured indexes ({len(tried)} tried)",
                     hint="offline? set VLLM_SRC=/path/to/vllm-0.18.1.tar.gz (or a git checkout); "
                          "or --source git with VLLM_GIT_URL")


# --- the vendor tree's pinned scope (configs/upstream.yaml `vendor`; builder/bases.py builds on it) --

# never part of a vendor checkout's content: Python's byte-code caches (an import of vllm/envs.py by
# setup.py writes one), git's folder and our own markers
SKIP_ANYWHERE = (".git", "__pycache__", *INTERNAL)


def vendor_cfg() -> dict:
    v = config.upstream().get("vendor")
    if not v:
        raise ForgeError("configs/upstream.yaml has no 'vendor' section: the vendor tree is not pinned",
                         hint="restore the vendor section (scope, scope_sha256, changed, absent, standin_patch)")
    return v


def in_scope(path: str, vcfg: dict) -> bool:
    parts = path.split("/")
    if any(p in ("__pycache__", ".git") for p in parts):
        return False
    return path in vcfg["scope"]["files"] or (len(parts) > 1 and parts[0] in vcfg["scope"]["folders"])


def scope_manifest(root: Path, vcfg: dict, files: list[str] | None = None) -> dict[str, list]:
    """{path: [kind, size, sha256]} of the scoped files under root (of `files` when given: a git
    checkout's tracked files; a tracked file that is gone is left out and shows as missing)."""
    root = Path(root)
    if files is not None:
        return {p: file_entry(root / p) for p in files
                if in_scope(p, vcfg) and ((root / p).exists() or (root / p).is_symlink())}
    out = {p: file_entry(root / p) for p in vcfg["scope"]["files"] if (root / p).exists() or (root / p).is_symlink()}
    for d in vcfg["scope"]["folders"]:
        if (root / d).is_dir():
            out.update({f"{d}/{p}": e for p, e in tree_manifest(root / d, exclude=SKIP_ANYWHERE).items()})
    return out


def cmd_fetch(args) -> int:
    if args.print_tree_hash:
        if args.vendor_scope:
            print(manifest_hash(scope_manifest(Path(args.print_tree_hash), vendor_cfg())))
        else:
            print(tree_sha256(Path(args.print_tree_hash), exclude=(".git", *INTERNAL)))
        return 0
    path = ensure_source(args.source)
    print(path)
    return 0


def register(sub) -> None:
    p = sub.add_parser("fetch", help="fetch and verify the pinned vLLM 0.18.1 source; prints the verified tree's path",
                       description=__doc__)
    p.add_argument("--source", choices=("auto", "index", "git"), default="auto",
                   help="auto: VLLM_SRC, cache, then pip's index; git: the mirror (VLLM_GIT_URL)")
    p.add_argument("--print-tree-hash", metavar="DIR", help="print the content hash of an extracted tree and exit")
    p.add_argument("--vendor-scope", action="store_true",
                   help="with --print-tree-hash: hash only the files the vendor pin covers (vendor.scope_sha256)")
    p.set_defaults(func=cmd_fetch)
