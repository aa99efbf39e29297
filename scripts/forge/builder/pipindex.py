"""pip's configured package index, as the fetch stage (builder/fetch.py) reaches it: the index URLs pip
itself would use, the pinned sdist's link on a PEP 503/691 simple index, and a download that is kept only
once its sha256 matches the pin. No host name is written in this repository."""

from __future__ import annotations

import json
import os
import re
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from .. import proc, ui
from ..errors import ForgeError
from ..hashing import sha256_file


def mismatch(what: str, expected: str, got: str, hint: str) -> ForgeError:
    """A file or tree whose sha256 is not the one configs/upstream.yaml pins."""
    return ForgeError(f"{what}: sha256 mismatch\n  expected {expected} (configs/upstream.yaml)\n"
                      f"  got      {got}", hint=hint)


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
            from pip._internal.models.index import PyPI  # pip's own default index (its internals: optional)
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
            raise mismatch(f"downloaded {dest.name}", sha256, got,
                           "the index served a different file; nothing was kept. Check the index or use VLLM_SRC")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
