"""Facts read from a server's log (attention block size, KV cache size and how many max-length
requests it holds, torch.compile and graph capture times, error lines) and the trimmed copy of a log
that goes into a results pack."""

from __future__ import annotations

import re
from pathlib import Path

LOG_FACTS = {
    "attention_block_size": r"[Ss]etting attention block size to (\d+) tokens",
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "kv_cache_dtype": r"kv_cache_dtype=(\w+)",
    "max_concurrency": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
    "compile_s": r"torch.compile took ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
}


# logged as errors by vLLM but expected in the harness (the flash-attention probe; no extension shipped)
HARMLESS_LOG_LINES = ("Cannot use FA version",)


def log_facts(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.is_file() else ""
    out = {}
    for k, pat in LOG_FACTS.items():
        m = re.search(pat, text)
        if m:
            out[k] = m.group(1).replace(",", "")
    errs = [ln for ln in text.splitlines()
            if (re.search(r"Traceback|\bERROR\b", ln) or re.match(r"\s*[\w.]+(Error|Exception)\b", ln))
            and not any(h in ln for h in HARMLESS_LOG_LINES)]
    out["error_lines"] = errs[:10]
    return out


def trim_log(src: Path, dst: Path, head: int = 150, tail: int = 250) -> None:
    lines = src.read_text(errors="replace").splitlines() if src.is_file() else []
    if len(lines) > head + tail:
        lines = lines[:head] + [f"... [{len(lines) - head - tail} lines trimmed by forge e2e-gpu] ..."] + lines[-tail:]
    dst.write_text("\n".join(lines) + "\n")
