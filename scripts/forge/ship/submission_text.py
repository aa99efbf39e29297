"""Review-record text as the submission's documents quote it: whole sentences and whole blocks
(paragraphs, list items), and only references the submission repository can resolve.

A patch's review record is written for this project: it cites design notes, tests, benchmark
scripts and recorded runs that the submission (the vendor's vLLM tree, our kernel files, one commit
per patch) does not carry. `References` knows what the submission holds: the folders of the vLLM
tree (configs/upstream.yaml, the vendor scope), every file the series touches and the kernel
overlay's destinations; an overlay source (kernels/csrc/forge_gemv.cu) is renamed to where the
submission has it (csrc/forge/forge_gemv.cu). `clean` drops, from a parenthesis, the items
(separated by '; ') that cite anything else, and drops a sentence that still does; a block left
without a sentence is dropped. Nothing is cut mid-sentence.
"""

from __future__ import annotations

import re

from .. import config, paths

# a word that ends with a period without ending the sentence
ABBREVIATIONS = frozenset({"e.g", "i.e", "vs", "cf", "etc", "approx", "resp", "incl", "no", "fig"})
_PATHLIKE = re.compile(r"(?<![\w/.*-])([\w.*-]+(?:/[\w.*-]*)+)")
_ISSUE = re.compile(r"\bissues?\s+#?\d+(?:\s*(?:,|and)\s*#?\d+)*|(?<![\w&#])#\d+\b", re.I)
_EXT = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,5}$")
_OPEN, _CLOSE = "([{", ")]}"


def _depth_walk(text: str):
    """(index, char, depth before the char) over text; brackets of any kind count alike."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in _CLOSE:
            depth = max(0, depth - 1)
        yield i, ch, depth
        if ch in _OPEN:
            depth += 1


def sentences(text: str) -> list[str]:
    """One paragraph's sentences: a split after '.', '!' or '?' followed by white space, outside
    brackets, and not after an abbreviation (e.g., vs.)."""
    out, start = [], 0
    for i, ch, depth in _depth_walk(text):
        if ch not in ".!?" or depth or i + 1 >= len(text) or not text[i + 1].isspace():
            continue
        word = re.search(r"([\w.]+)$", text[start:i])
        if ch == "." and word and word.group(1).lower() in ABBREVIATIONS:
            continue
        out.append(text[start:i + 1].strip())
        start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def blocks(text: str) -> list[tuple[str, str]]:
    """A review section's blocks: ("item", text) for a list item ("- " or "* ", with its wrapped
    lines), ("para", text) for a paragraph; each block's lines joined into one line."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        s = line.strip()
        if not s:
            if out:
                out.append(("gap", []))
            continue
        m = re.match(r"^[-*]\s+(.*)$", s)
        if m:
            out.append(("item", [m.group(1)]))
        elif out and (out[-1][0] == "para" or out[-1][0] == "item" and line[:1].isspace()):
            out[-1][1].append(s)            # a paragraph's next line, or an item's indented one
        else:
            out.append(("para", [s]))
    return [(kind, " ".join(lines)) for kind, lines in out if kind != "gap"]


class References:
    """Which path-like words of a text name something the submission repository holds."""

    def __init__(self, overlay: list[dict], touched: list[str], roots: list[str], own_roots: list[str]):
        self.renamed = {e["src"]: e["dst"] for e in overlay if "*" not in e["src"]}
        self.files = sorted(set(touched) | {e["dst"] for e in overlay})
        self.roots = set(roots)
        self.known_roots = self.roots | set(own_roots)

    @classmethod
    def of_this_series(cls, overlay: list[dict], touched: list[str]) -> References:
        scope = (config.upstream().get("vendor") or {}).get("scope") or {"files": [], "folders": ["vllm", "csrc"]}
        own = [p.name for p in paths.ROOT.iterdir() if not p.name.startswith(".")] + ["design", "build", "dist"]
        return cls(overlay, touched, scope["folders"] + scope["files"], own)

    def is_path(self, word: str) -> bool:
        word = word.rstrip(".")
        return bool(_EXT.search(word) or word.endswith("/") or word.split("/", 1)[0] in self.known_roots)

    def holds(self, word: str) -> bool:
        """A path-like word the submission resolves: under a folder of the vLLM tree, or a file the
        series or the overlay puts there, named from its root or relative to a folder of it."""
        w = word.rstrip(".")
        if w.split("/", 1)[0] in self.roots:
            return True
        return any(f.endswith("/" + w.rstrip("/")) or f.startswith(w) and w.endswith("/") for f in self.files)

    def dangling(self, text: str) -> list[str]:
        """The references of `text` to something the submission does not hold (paths, issue numbers)."""
        bad = [m.group(0) for m in _ISSUE.finditer(text)]
        bad += [w for w in _PATHLIKE.findall(text) if self.is_path(w) and not self.holds(w)]
        return bad

    def rename(self, text: str) -> str:
        """Overlay sources named as the submission has them."""
        def sub(m: re.Match) -> str:
            w = m.group(1)
            core = w.rstrip(".")
            return self.renamed.get(core, core) + w[len(core):]
        return _PATHLIKE.sub(sub, text)

    def _drop_items(self, group: str) -> str | None:
        """A bracketed group's content without its '; '-separated items that dangle; None if none stay."""
        items, start = [], 0
        for i, ch, depth in _depth_walk(group):
            if ch == ";" and depth == 0:
                items.append(group[start:i])
                start = i + 1
        items.append(group[start:])
        kept = [x.strip() for x in items if not self.dangling(x)]
        return "; ".join(kept) if kept else None

    def clean_sentence(self, s: str) -> str | None:
        """The sentence with its dangling bracketed items removed; None if it still dangles."""
        while True:
            spans, open_at = [], None
            for i, ch, depth in _depth_walk(s):
                if ch in _OPEN and depth == 0:
                    open_at = i
                elif ch in _CLOSE and depth == 0 and open_at is not None:
                    spans.append((open_at, i))
                    open_at = None
            hit = next(((a, b) for a, b in spans if self.dangling(s[a + 1:b])), None)
            if hit is None:
                break
            a, b = hit
            inner = self._drop_items(s[a + 1:b])
            s = (s[:a] + s[a] + inner + s[b:]) if inner else (s[:a].rstrip() + s[b + 1:])
        return None if self.dangling(s) else s

    def clean(self, text: str) -> list[tuple[str, str]]:
        """A review section as blocks of whole sentences that dangle nowhere."""
        out = []
        for kind, block in blocks(self.rename(text)):
            kept = [c for c in (self.clean_sentence(s) for s in sentences(block)) if c]
            if kept:
                out.append((kind, " ".join(kept)))
        return out


def first_sentences(blocks_: list[tuple[str, str]], budget: int = 420) -> str:
    """The first block's whole sentences, as many as fit in `budget` characters (at least one)."""
    if not blocks_:
        return ""
    short = ""
    for s in sentences(blocks_[0][1]):
        if short and len(short) + 1 + len(s) > budget:
            break
        short = f"{short} {s}".strip()
    return short


def markdown(blocks_: list[tuple[str, str]]) -> list[str]:
    """Blocks as markdown lines: list items together, a blank line around paragraphs."""
    out: list[str] = []
    prev = None
    for kind, text in blocks_:
        if out and not (kind == "item" and prev == "item"):
            out.append("")
        out.append(f"- {text}" if kind == "item" else text)
        prev = kind
    return out


