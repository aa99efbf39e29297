"""Reading `git format-patch` files: the message (the patch's review record), the files and hunks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from email.header import decode_header, make_header
from pathlib import Path

from ..errors import ForgeError
from ..paths import PATCHES, rel

REVIEW_SECTIONS = ("Why", "What", "Risk", "Evidence", "Rule check")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    index: int          # 1-based within its file
    old_start: int
    old_len: int
    header: str


@dataclass
class FilePatch:
    old: str
    new: str
    created: bool = False
    deleted: bool = False
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    name: str
    path: Path
    subject: str
    body: str
    files: list[FilePatch]

    def sections(self) -> dict[str, str]:
        """Review-record sections: a line 'Why:' (etc.) starts a section that runs to the next heading."""
        out: dict[str, list[str]] = {}
        cur = None
        pat = re.compile(r"^(%s):\s*(.*)$" % "|".join(re.escape(s) for s in REVIEW_SECTIONS), re.I)
        for line in self.body.splitlines():
            m = pat.match(line)
            if m:
                cur = next(s for s in REVIEW_SECTIONS if s.lower() == m.group(1).lower())
                out.setdefault(cur, [])
                if m.group(2).strip():
                    out[cur].append(m.group(2).strip())
            elif cur:
                out[cur].append(line)
        return {k: "\n".join(v).strip() for k, v in out.items()}

    def touched(self) -> list[str]:
        return sorted({p for f in self.files for p in (f.old, f.new) if p != "/dev/null"})


def _decode_subject(s: str) -> str:
    try:
        s = str(make_header(decode_header(s)))
    except Exception:
        pass
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", s).strip()


def parse(path: Path, name: str | None = None) -> Patch:
    text = Path(path).read_text(errors="replace")
    lines = text.splitlines()
    name = name or Path(path).name
    # header: mbox "From <sha> <date>", then RFC-822 headers until a blank line
    subject = None
    if not lines or not lines[0].startswith("From "):
        raise ForgeError(f"{rel(path)}: not a git format-patch file (no 'From <commit>' first line)",
                         hint="create patches with `make patches-refresh` from build/vllm commits")
    i = 1
    while i < len(lines) and lines[i].strip():
        if lines[i].startswith("Subject:"):
            subject = lines[i][len("Subject:"):].strip()
            while i + 1 < len(lines) and lines[i + 1].startswith((" ", "\t")):
                i += 1
                subject += " " + lines[i].strip()
        i += 1
    if subject is None:
        raise ForgeError(f"{rel(path)}: no Subject: header")
    body_lines = []
    i += 1
    while i < len(lines) and lines[i] != "---" and not lines[i].startswith("diff --git "):
        body_lines.append(lines[i])
        i += 1
    files: list[FilePatch] = []
    cur: FilePatch | None = None
    for line in lines[i:]:
        if line.startswith("diff --git "):
            m = re.match(r"diff --git a/(.*) b/(.*)$", line)
            cur = FilePatch(old=m.group(1), new=m.group(2)) if m else FilePatch(old="?", new="?")
            files.append(cur)
        elif cur is not None:
            if line.startswith("new file mode"):
                cur.created = True
            elif line.startswith("deleted file mode"):
                cur.deleted = True
            elif (m := _HUNK.match(line)):
                cur.hunks.append(Hunk(len(cur.hunks) + 1, int(m.group(1)), int(m.group(2) or 1), line))
    return Patch(name=name, path=Path(path), subject=_decode_subject(subject),
                 body="\n".join(body_lines).strip(), files=files)


def diff_paths(path: Path) -> list[str]:
    """Every file path a patch or plain diff names (its `diff --git` lines and the ---/+++ headers
    outside hunks, without the a/ b/ prefixes), whatever else the file holds."""
    found, lines = set(), Path(path).read_text(errors="replace").splitlines()
    old_left = new_left = 0                      # lines of the current hunk still to come
    for i, line in enumerate(lines):
        if old_left > 0 or new_left > 0:
            old_left -= line[:1] in (" ", "-", "")
            new_left -= line[:1] in (" ", "+", "")
            continue
        if (m := _HUNK.match(line)):
            old_left, new_left = int(m.group(2) or 1), int(m.group(4) or 1)
        elif (m := re.match(r"diff --git a/(.*) b/(.*)$", line)):
            found |= {m.group(1), m.group(2)}
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            for header in (line, lines[i + 1]):
                name = header[4:].split("\t", 1)[0].strip()
                if name != "/dev/null":
                    found.add(re.sub(r"^[ab]/", "", name))
    return sorted(found)


def read_series(patches_dir: Path = PATCHES) -> list[str]:
    """Names in patches/series, in order; comments (#) and blank lines ignored. Each must exist."""
    series = patches_dir / "series"
    if not series.is_file():
        return []
    names = []
    for n, raw in enumerate(series.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not (patches_dir / line).is_file():
            raise ForgeError(f"{rel(series)}:{n}: names '{line}' but {rel(patches_dir / line)} does not exist",
                             hint="fix the name, or restore the file (git checkout patches/)")
        if line in names:
            raise ForgeError(f"{rel(series)}:{n}: '{line}' is listed twice")
        names.append(line)
    return names


def hunk_for(patch: Patch, file: str, line: int | None) -> str:
    """Human description of the hunk of `patch` in `file` that starts at old line `line`."""
    for f in patch.files:
        if file in (f.old, f.new):
            if line is not None:
                for h in f.hunks:
                    if h.old_start == line:
                        return f"hunk #{h.index} ({h.header.split('@@')[1].strip()})"
                near = min(f.hunks, key=lambda h: abs(h.old_start - line), default=None)
                if near:
                    return f"hunk #{near.index} ({near.header.split('@@')[1].strip()})"
            return f"{len(f.hunks)} hunk(s)"
    return "?"
