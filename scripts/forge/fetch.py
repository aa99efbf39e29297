"""Stage 1: the pinned vLLM source, fetched (or taken from VLLM_SRC), verified by hash, extracted.

Nothing unverified is ever used: a download lands in a .part file that is only renamed into the
cache after its sha256 matches configs/upstream.yaml; the cache is re-verified on every use.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from . import config, proc, ui
from .errors import ForgeError
from .hashing import sha256_file, tree_sha256
from .paths import CACHE, rel

MARKER = ".forge-verified"


def _mismatch(what: str, expected: str, got: str, hint: str) -> ForgeError:
    return ForgeError(f"{what}: sha256 mismatch\n  expected {expected} (configs/upstream.yaml)\n"
                      f"  got      {got}", hint=hint)


# --- pip's configured index ----------------------------------------------------------------

def pip_index_urls() -> list[str]:
    """The index URLs pip itself would use: PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, pip's config files,
    else pip's built-in default. No host name is written in this repository."""
    urls: list[str] = []
    cfg: dict[str, str] = {}
    try:
        out = proc.output(["python3", "-m", "pip", "config", "list"], what="pip config")
        for line in out.splitlines():
            k, _, v = line.partition("=")
            cfg[k.strip()] = v.strip().strip("'\"")
    except ForgeError:
        pass
    primary = os.environ.get("PIP_INDEX_URL") or cfg.get("global.index-url") or cfg.get(":env:.index-url")
    if not primary:
        try:
            from pip._internal.models.index import PyPI  # pip's own default index
            primary = PyPI.simple_url
        except Exception:  # pragma: no cover - pip without that module
            primary = None
    if primary:
        urls.append(primary)
    extra = os.environ.get("PIP_EXTRA_INDEX_URL") or cfg.get("global.extra-index-url") or ""
    urls += [u for u in extra.split() if u]
    return urls


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href:
            self.links.append((data.strip(), self._href))
            self._href = None


def find_sdist_url(index: str, project: str, filename: str) -> tuple[str, str | None] | None:
    """(url, sha256 the index lists) for `filename` on a PEP 503/691 simple index, or None."""
    base = index.rstrip("/") + f"/{project}/"
    page = base + "index.html" if base.startswith("file:") else base
    req = urllib.request.Request(page, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            ctype = r.headers.get("Content-Type", "")
            body = r.read()
    except (OSError, ValueError):
        return None
    if "json" in ctype:
        for f in json.loads(body).get("files", []):
            if f.get("filename") == filename:
                return urllib.parse.urljoin(base, f["url"]), f.get("hashes", {}).get("sha256")
        return None
    parser = _Links()
    parser.feed(body.decode(errors="replace"))
    for text, href in parser.links:
        if text == filename or href.split("#")[0].rsplit("/", 1)[-1] == filename:
            m = re.search(r"#sha256=([0-9a-f]{64})", href)
            return urllib.parse.urljoin(page, href.split("#")[0]), m.group(1) if m else None
    return None


def download(url: str, dest: Path, sha256: str) -> None:
    """Download to dest.part, verify, then rename. A partial or wrong file is never left as dest."""
    part = dest.with_name(dest.name + ".part")
    part.unlink(missing_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=120) as r, open(part, "wb") as f:
            prog = ui.Progress(f"download {dest.name}", int(r.headers.get("Content-Length") or 0))
            while chunk := r.read(1 << 20):
                f.write(chunk)
                prog.update(len(chunk))
            prog.close()
        got = sha256_file(part)
        if got != sha256:
            raise _mismatch(f"downloaded {dest.name}", sha256, got,
                            "the index served a different file; nothing was kept. Check the index or use VLLM_SRC")
        part.rename(dest)
    finally:
        part.unlink(missing_ok=True)


# --- the pinned source as a verified, extracted tree ---------------------------------------

def _extract(tarball: Path, dest: Path, top: str, tree_hash: str) -> Path:
    """Extract into dest/<top> via a temp dir; verify the content hash; mark it verified."""
    final = dest / top
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest))
    try:
        with tarfile.open(tarball) as tf:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(tmp, **kw)
        got = tree_sha256(tmp / top)
        if got != tree_hash:
            raise _mismatch(f"extracted {tarball.name}", tree_hash, got,
                            "the tarball is verified but its contents differ; check configs/upstream.yaml tree_sha256")
        (tmp / top / MARKER).write_text(tree_hash + "\n")
        shutil.rmtree(final, ignore_errors=True)
        (tmp / top).rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _verified_dir(d: Path, tree_hash: str) -> bool:
    m = d / MARKER
    return m.is_file() and m.read_text().strip() == tree_hash


def _from_git_checkout(src: Path, cfg: dict) -> Path:
    commit = cfg["git"]["commit"]
    head = proc.output(["git", "-C", src, "rev-parse", "HEAD"], what="git rev-parse")
    if not head.startswith(commit):
        raise ForgeError(f"VLLM_SRC={src}: checkout is at {head[:12]}, the pinned commit is {commit} "
                         f"(tag {cfg['git']['tag']})", hint=f"git -C {src} checkout {cfg['git']['tag']}")
    dest = CACHE / "src" / f"vllm-git-{commit}"
    marker = dest / MARKER
    if marker.is_file() and marker.read_text().strip() == head:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    ui.info(f"exporting git checkout {src} at {head[:12]}")
    arch = dest.with_suffix(".tar")
    proc.run(["git", "-C", src, "archive", "-o", arch, "HEAD"], what="git archive")
    with tarfile.open(arch) as tf:
        tf.extractall(dest)
    arch.unlink()
    marker.write_text(head + "\n")
    return dest


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
    """Path of a verified, extracted pristine vLLM source tree. `source`: auto | index | git."""
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
            got = tree_sha256(p, exclude=(".git", MARKER))
            if got != sd["tree_sha256"]:
                raise _mismatch(f"VLLM_SRC={p}", sd["tree_sha256"], got,
                                "point VLLM_SRC at an unmodified extracted vllm-0.18.1 sdist, a v0.18.1 git checkout, "
                                "or the sdist tarball")
            return p
        if p.is_file():
            got = sha256_file(p)
            if got != sd["sha256"]:
                raise _mismatch(f"VLLM_SRC={p}", sd["sha256"], got,
                                "this tarball is not the pinned vllm-0.18.1 sdist; it was not used")
            if not (tarball.is_file() and sha256_file(tarball) == got):
                tmp = tarball.with_name(tarball.name + ".part")
                shutil.copyfile(p, tmp)
                tmp.rename(tarball)
        else:
            raise ForgeError(f"VLLM_SRC={p}: no such file or directory",
                             hint="give the vllm-0.18.1.tar.gz sdist, an extracted tree, or a git checkout")

    if source == "git":
        return clone_git(cfg)

    if _verified_dir(srcdir / top, sd["tree_sha256"]) and tarball.is_file():
        got = sha256_file(tarball)
        if got == sd["sha256"]:
            return srcdir / top
    if tarball.is_file():
        got = sha256_file(tarball)
        if got != sd["sha256"]:
            bad = tarball.with_name(tarball.name + ".rejected")
            tarball.rename(bad)
            raise _mismatch(f"cached {rel(tarball)}", sd["sha256"], got,
                            f"the cached file was tampered with or corrupted; moved to {rel(bad)}; rerun to fetch again")
    else:
        ui.info(f"fetching {sd['filename']} through pip's configured package index")
        tried = []
        for index in pip_index_urls():
            found = find_sdist_url(index, sd["project"], sd["filename"])
            tried.append(index)
            if not found:
                continue
            url, listed = found
            if listed and listed != sd["sha256"]:
                raise _mismatch(f"{sd['filename']} as listed by the index", sd["sha256"], listed,
                                "the index lists a different file under this name; not downloaded")
            download(url, tarball, sd["sha256"])
            break
        else:
            raise ForgeError(f"{sd['filename']} not found on pip's configured indexes ({len(tried)} tried)",
                             hint="offline? set VLLM_SRC=/path/to/vllm-0.18.1.tar.gz (or a git checkout); "
                                  "or --source git with VLLM_GIT_URL")
    ui.info(f"verified {sd['filename']} sha256 {sd['sha256'][:16]}…; extracting")
    return _extract(tarball, srcdir, top, sd["tree_sha256"])


def cmd_fetch(args) -> int:
    if args.print_tree_hash:
        print(tree_sha256(Path(args.print_tree_hash), exclude=(".git", MARKER)))
        return 0
    path = ensure_source(args.source)
    print(path)
    return 0


def register(sub) -> None:
    p = sub.add_parser("fetch", help="fetch and verify the pinned vLLM source; prints the verified tree's path",
                       description=__doc__)
    p.add_argument("--source", choices=("auto", "index", "git"), default="auto",
                   help="auto: VLLM_SRC, cache, then pip's index; git: the mirror (VLLM_GIT_URL)")
    p.add_argument("--print-tree-hash", metavar="DIR", help="print the content hash of an extracted tree and exit")
    p.set_defaults(func=cmd_fetch)
