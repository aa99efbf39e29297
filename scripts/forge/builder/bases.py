"""The bases one patch series applies to, each a verified pristine folder for `make tree`:

  sdist    the pinned PyPI sdist (configs/upstream.yaml sdist; the default; build/vllm)
  vendor   the vendor's vLLM tree a submission is a fork of (OpenDAS vllm_cscc v0.18.1), given
           by the user as VENDOR_SRC=<git checkout or folder>, verified by the content of the
           files vLLM's build and runtime read (configs/upstream.yaml vendor; build/vllm-vendor)
  standin  CI's stand-in for the vendor tree: the sdist plus patches/base/vendor-standin.patch,
           our own re-creation of the vendor's seven build changes (build/vllm-standin)

Each base gives tree.build_tree the folder to copy, the key its tree is rebuilt on, and the
message of the tree's first commit.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import config, proc, ui
from ..errors import ForgeError
from ..hashing import combine, file_entry, manifest_hash, sha256_file, tree_manifest
from ..paths import BUILD, CACHE, ROOT, TREE, Lock, rel
from ..recipe.patchfile import parse
from . import fetch
from .fetch import SKIP_ANYWHERE, in_scope, scope_manifest, vendor_cfg

BASES = ("sdist", "standin", "vendor")
# never part of a vendor checkout's content at its top: a build's outputs (SKIP_ANYWHERE: builder/fetch.py)
SKIP_AT_TOP = ("build", "dist", ".deps", "vllm.egg-info")


@dataclass
class Base:
    name: str
    pristine: Path
    key: str                        # the tree is rebuilt from scratch when this changes
    message: str                    # the tree's first commit
    files: list[str] | None = None  # copy only these (a git checkout's tracked files); None: all


def tree_dir(base: str) -> Path:
    """Where `make tree BASE=<base>` builds: the sdist's tree stays build/vllm."""
    check_name(base)
    return TREE if base == "sdist" else BUILD / f"vllm-{base}"


def check_name(base: str) -> None:
    if base not in BASES:
        raise ForgeError(f"BASE={base}: not a base", hint=f"bases: {', '.join(BASES)} (default sdist)")


# --- the vendor tree's pin ---------------------------------------------------------------------

def expected_vendor_manifest(sdist_dir: Path, vcfg: dict) -> dict[str, list]:
    """The vendor's scoped manifest derived from the verified sdist's: the absent files left out, the
    changed files' pinned hashes put in. Its hash is vendor.scope_sha256 (checked by a test)."""
    man = fetch.read_manifest(sdist_dir)
    if man is None:
        raise ForgeError(f"{rel(sdist_dir)} has no manifest", hint="run `make fetch`")
    out = {p: e for p, e in man["files"].items() if in_scope(p, vcfg) and p not in vcfg["absent"]}
    for p, c in vcfg["changed"].items():
        out[p] = [out.get(p, ["f"])[0], c["size"], c["sha256"]]
    return out


def _git_tracked(src: Path) -> list[str]:
    out = proc.run(["git", "-C", src, "ls-files", "-z"], capture=True, what="git ls-files",
                   hint="is VENDOR_SRC a git checkout git can read? (git config --global --add safe.directory)").stdout
    return sorted(p for p in out.split("\0") if p)


def _cached_sdist() -> Path | None:
    """The verified, extracted sdist when it is already in the cache (never downloaded for this)."""
    sd = config.upstream()["sdist"]
    d = CACHE / "src" / sd["filename"].removesuffix(".tar.gz")
    man = fetch.read_manifest(d)
    return d if man and manifest_hash(man["files"]) == sd["tree_sha256"] else None


def verify_vendor(src: Path) -> tuple[list[str] | None, str]:
    """Check a vendor checkout against the pin; returns (its tracked files or None for a plain
    folder, the scope's hash). A mismatch names the files (against the sdist-derived manifest when
    the sdist is in the cache) and says how to fix the usual cause."""
    vcfg = vendor_cfg()
    if not (src / "setup.py").is_file() or not (src / "vllm").is_dir():
        raise ForgeError(f"VENDOR_SRC={src}: not a vLLM source tree (no setup.py and vllm/ there)",
                         hint="give the folder of your vllm_cscc checkout (git clone -b v0.18.1 ... vllm_cscc)")
    files = _git_tracked(src) if (src / ".git").exists() else None
    got = scope_manifest(src, vcfg, files)
    if manifest_hash(got) == vcfg["scope_sha256"]:
        return files, vcfg["scope_sha256"]
    problems = []
    for p, c in vcfg["changed"].items():
        if p not in got:
            problems.append(f"{p}: missing")
        elif got[p][2] != c["sha256"]:
            problems.append(f"{p}: differs from the vendor's ({got[p][1]} bytes sha256 {got[p][2][:12]}…, "
                            f"pinned {c['size']} bytes {c['sha256'][:12]}…)")
    sdist = _cached_sdist()
    modes: dict[str, str] = {}
    if sdist is not None:
        named = {x.split(": ", 1)[0] for x in problems}
        diff, modes = fetch.manifest_differences(expected_vendor_manifest(sdist, vcfg), got, "the vendor tree")
        problems += [d for d in diff if d.split(": ", 1)[0] not in named]
    elif not problems:
        problems.append("files other than the seven vendor changes differ (`make fetch` first and this check "
                        "names them)")
    if not problems:                # the pin disagrees with itself: never a silent, empty list
        problems.append("no file differs from the pinned lists, yet the scope's hash does: configs/upstream.yaml "
                        "vendor.scope_sha256 does not match its own `changed` and `absent` entries")
    hints = []
    if modes:
        hints.append("restore the file mode" + ("s" if len(modes) > 1 else "") + ": "
                     + "; ".join(f"chmod {how} {src / p}" for p, how in sorted(modes.items()))
                     + (f" (or `git -C {src} checkout -- {' '.join(sorted(modes))}`)" if (src / ".git").exists() else ""))
    vp = src / "vllm" / "version.py"
    if vp.is_file() and "__hcu_version__" in vp.read_text(errors="replace"):
        hints.append("vllm/version.py was rewritten by an earlier `setup.py` build of this checkout (the vendor's "
                     "setup.py writes __hcu_version__ into it at build time): restore it with "
                     f"`git -C {src} checkout vllm/version.py` (a plain folder: copy it again from the checkout)")
    if (src / "PKG-INFO").is_file():
        hints.append("this looks like the PyPI sdist, not the vendor tree: use BASE=sdist, or point VENDOR_SRC at "
                     "the vllm_cscc checkout")
    hints.append("VENDOR_SRC must hold the vendor's vllm_cscc v0.18.1 files unmodified (the pin covers "
                 f"{', '.join(vcfg['scope']['files'])} and {', '.join(d + '/' for d in vcfg['scope']['folders'])}; "
                 "configs/upstream.yaml vendor); keep your changes in patches/, never in the checkout")
    if len(problems) == 1:
        raise ForgeError(f"VENDOR_SRC={src}: the vendor tree differs from the pinned one: {problems[0]}",
                         hint="; ".join(hints))
    shown = problems[:20] + ([f"… and {len(problems) - 20} more"] if len(problems) > 20 else [])
    raise ForgeError(f"VENDOR_SRC={src}: the vendor tree differs from the pinned one ({len(problems)} file(s)):\n  "
                     + "\n  ".join(shown), hint="; ".join(hints))



def vendor_base(src: str | os.PathLike | None = None) -> Base:
    raw = src or os.environ.get("VENDOR_SRC")
    if not raw:
        raise ForgeError("BASE=vendor needs the vendor's vLLM tree: no VENDOR_SRC given",
                         hint="clone it where you work (git clone -b v0.18.1 <vendor git>/OpenDAS/vllm_cscc.git) and "
                              "pass VENDOR_SRC=/path/to/vllm_cscc; it is distributed to contestants and never "
                              "downloaded by this tool. Without it, BASE=standin is CI's stand-in")
    p = Path(raw).expanduser()
    if not p.is_dir():
        raise ForgeError(f"VENDOR_SRC={p}: no such folder", hint="give the folder of your vllm_cscc checkout")
    p = p.resolve()
    ui.info(f"verifying the vendor tree VENDOR_SRC={p}")
    files, scope_hash = verify_vendor(p)
    vcfg = vendor_cfg()
    if files is None:
        content = manifest_hash(copy_manifest(p))
        where = "a folder"
    else:
        content = manifest_hash({f: file_entry(p / f) for f in files if (p / f).exists() or (p / f).is_symlink()})
        head = proc.output(["git", "-C", p, "rev-parse", "HEAD"], what="git rev-parse", check=False) or "?"
        where = f"a git checkout at {head[:12]}"
    msg = (f"vendor vLLM {config.upstream()['version']}: {vcfg['repository']} {vcfg['branch']} (scope sha256 "
           f"{scope_hash[:16]}…)\n\nThe vendor's vLLM tree, verified against configs/upstream.yaml vendor (pinned "
           f"from {vcfg['commit']}; taken from {where}).")
    return Base("vendor", p, combine("vendor", scope_hash, content), msg, files)


def copy_manifest(src: Path) -> dict[str, list]:
    """What `make tree` copies from a plain vendor folder: everything but caches and build outputs."""
    return {p: e for p, e in tree_manifest(src, exclude=SKIP_ANYWHERE).items() if p.split("/")[0] not in SKIP_AT_TOP}


def copy_ignore(base_dir: Path):
    """shutil.copytree's ignore for a plain vendor folder (the same files copy_manifest hashes)."""
    def ignore(d: str, names: list[str]) -> list[str]:
        top = Path(d).resolve() == base_dir.resolve()
        return [n for n in names if n in SKIP_ANYWHERE or (top and n in SKIP_AT_TOP)]
    return ignore


# --- the stand-in ------------------------------------------------------------------------------

def standin_patch() -> Path:
    p = ROOT / vendor_cfg()["standin_patch"]
    if not p.is_file():
        raise ForgeError(f"configs/upstream.yaml: key 'vendor.standin_patch': {p} does not exist")
    return p


def standin_source(source: str = "auto") -> Path:
    """The verified sdist with the stand-in patch applied, cached next to it (rebuilt when the
    patch changes; verified file by file on every use, like the sdist)."""
    sd = config.upstream()["sdist"]
    pristine = fetch.ensure_source(source)
    patch = standin_patch()
    psha = sha256_file(patch)
    srcdir = CACHE / "src"
    final = srcdir / f"{sd['filename'].removesuffix('.tar.gz')}-standin-{psha[:12]}"
    origin = f"standin {sd['sha256']} {psha}"
    with Lock(srcdir / ".standin.lock", "the vendor stand-in"):
        if fetch._use_extracted(final, None, origin):
            return final
        for old in srcdir.glob(f"{sd['filename'].removesuffix('.tar.gz')}-standin-*"):
            shutil.rmtree(old, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".standin-", dir=srcdir))
        try:
            work = tmp / "tree"
            shutil.copytree(pristine, work, symlinks=True, ignore=shutil.ignore_patterns(*fetch.INTERNAL))
            # a repository of its own: git apply inside the project's checkout would apply there
            proc.run(["git", "init", "-q", work], capture=True, what="git init")
            res = proc.run(["git", "-C", work, "apply", "--whitespace=nowarn", patch], capture=True, check=False,
                           what="git apply")
            if res.returncode != 0:
                raise ForgeError(f"{rel(patch)} does not apply to the pinned sdist:\n{(res.stderr or '').strip()[-1500:]}",
                                 hint="re-create it against the sdist (README: the vendor stand-in)")
            shutil.rmtree(work / ".git")
            (work / fetch.MARKER).write_text(json.dumps({"origin": origin, "files": tree_manifest(work, exclude=())},
                                                        sort_keys=True) + "\n")
            os.rename(work, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def standin_base(source: str = "auto") -> Base:
    sd = config.upstream()["sdist"]
    patch = standin_patch()
    rec = parse(patch)
    msg = (f"vendor stand-in (CI): vLLM {config.upstream()['version']} sdist sha256 {sd['sha256'][:16]}… plus "
           f"{rel(patch)}; NOT the vendor tree\n\n{rec.subject}\n\n{rec.body}")
    return Base("standin", standin_source(source), combine("standin", sd["sha256"], sha256_file(patch)), msg)


def sdist_key() -> str:
    """The key the sdist's tree is built on (its record's `upstream`): the pinned sdist's sha256."""
    return config.upstream()["sdist"]["sha256"]


def sdist_base(source: str = "auto") -> Base:
    cfg = config.upstream()
    sha = sdist_key()
    return Base("sdist", fetch.ensure_source(source), sha, f"upstream vLLM {cfg['version']} (sdist sha256 {sha})")


def resolve(base: str = "sdist", source: str = "auto", vendor_src: str | None = None) -> Base:
    check_name(base)
    if base == "vendor":
        return vendor_base(vendor_src)
    if base == "standin":
        return standin_base(source)
    return sdist_base(source)


def present(vendor_src: str | None = None) -> list[str]:
    """The bases this machine can build: the sdist and the stand-in always, the vendor tree when
    VENDOR_SRC is given."""
    v = config.upstream().get("vendor")
    have_standin = bool(v) and (ROOT / v["standin_patch"]).is_file()
    return ["sdist"] + (["standin"] if have_standin else []) + \
        (["vendor"] if (vendor_src or os.environ.get("VENDOR_SRC")) else [])
