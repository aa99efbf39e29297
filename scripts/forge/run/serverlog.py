"""What a server's log says: the known causes of a failed start (`diagnose`) and the KV cache each
engine reported (`kv_cache_report`: vLLM's "GPU KV cache size: N tokens" line, one per data-parallel
rank; ranks that report unequal caches are flagged in the run's record)."""

from __future__ import annotations

import re

SCORED_PORT = 8001        # the start script's --port (serve.LOCKED_PORT)

# (pattern in the server log, likely cause, what to do)
KNOWN_FAILURES = [
    (r"out of memory|OutOfMemoryError|No available memory for the cache blocks|"
     r"insufficient memory|larger than the available KV cache memory",
     "the card ran out of memory (weights + KV cache + graphs do not fit)",
     "check that no other process holds the card; lower --gpu-memory-utilization in the profile"),
    (r"[Aa]ddress already in use|Errno 98",
     f"port {SCORED_PORT} is already in use",
     "stop the other server (`forge stop`, or find it with `ss -ltnp | grep 8001`)"),
    (r"unrecognized arguments|error: argument |invalid choice",
     "the server rejected an option of the command (unknown argument or value)",
     "the installed vLLM may not be our patched build: check `pip show vllm`, or fix the profile"),
    (r"config\.json|Repo id must|is not a local folder|HFValidationError|No such file or directory|"
     r"does not appear to have a file named|Can't load tokenizer|Unrecognized model",
     "the model directory is missing or incomplete",
     "pass --model (MODEL=) a directory with config.json, the tokenizer and the weights"),
    (r"Unable to find image|pull access denied|No such image",
     "the image is not present on this machine",
     "load or build the image (`make image`), or pass the right IMAGE"),
    (r"permission denied.*docker\.sock|Cannot connect to the Docker daemon",
     "docker is not usable by this user",
     "start the docker daemon or add the user to the docker group"),
    (r"ModuleNotFoundError|ImportError",
     "a Python module is missing in the server's environment",
     "install our vLLM wheel with its dependencies, or use the image"),
]


def diagnose(log_text: str) -> list[tuple[str, str]]:
    found = []
    for pat, cause, fix in KNOWN_FAILURES:
        if re.search(pat, log_text):
            found.append((cause, fix))
    return found


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
KV_LINE = "GPU KV cache size"
# vLLM's f"{tokens:,}": digits, grouped by three after the first comma
_KV = re.compile(KV_LINE + r": (\d{1,3}(?:,\d{3})+|\d+) tokens")
_RANK = re.compile(r"\((?:EngineCore|DPEngineCoreActor)_DP(\d+) pid=\d+\)")


def kv_cache_sizes(log_text: str) -> dict[int, int]:
    """{data-parallel rank: KV cache tokens} from vLLM's "GPU KV cache size: N tokens" lines; a line
    without a `(EngineCore_DP<r> pid=…)` prefix is rank 0 (one engine). A rank that reports twice (a
    restart within one log) counts with its last report."""
    out: dict[int, int] = {}
    for line in _ANSI.sub("", log_text).splitlines():
        m = _KV.search(line)
        if not m:
            continue
        r = _RANK.search(line)
        out[int(r.group(1)) if r else 0] = int(m.group(1).replace(",", ""))
    return out


def kv_cache_unread(log_text: str) -> list[str]:
    """The lines that say "GPU KV cache size" but not as vLLM writes it ("GPU KV cache size: 28,224 tokens"):
    a damaged or edited log, whose count kv_cache_sizes does not read."""
    return [line.strip() for line in _ANSI.sub("", log_text).splitlines() if KV_LINE in line and not _KV.search(line)]


_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def kv_capacity_tokens(log_text: str) -> int | None:
    """Tokens of requests the server's KV cache holds at once, summed over its data-parallel ranks: each
    rank's "Maximum concurrency for L tokens per request: Cx" line as C x L (vLLM's C counts the blocks of a
    max-length request in every KV cache group, a hybrid model's fixed per-request state included, so B
    requests of T <= L tokens need more than C x L tokens' worth when B x T exceeds it); a rank that reports
    twice counts with its last report; None when no rank reported it."""
    per: dict[int, float] = {}
    for line in _ANSI.sub("", log_text).splitlines():
        m = _CONCURRENCY.search(line)
        if not m:
            continue
        r = _RANK.search(line)
        per[int(r.group(1)) if r else 0] = int(m.group(1).replace(",", "")) * float(m.group(2))
    return int(sum(per.values())) if per else None


def kv_cache_report(log_text: str, data_parallel_size: int = 1) -> dict:
    """The KV cache the server's ranks reported: {tokens: {rank: N}, equal, flag}. `flag` (None when
    all is well) says when data-parallel ranks report unequal caches (the rank with the smaller one
    preempts first: a cold start gave 24,304 against 28,224 tokens in public reports; a restart
    evened them) or when fewer ranks reported than the server has."""
    sizes = kv_cache_sizes(log_text)
    tokens = {str(r): n for r, n in sorted(sizes.items())}
    equal = len(set(sizes.values())) <= 1
    flag = None
    if not equal:
        shown = ", ".join(f"DP{r} {n:,}" for r, n in sorted(sizes.items()))
        flag = (f"unequal KV caches across data-parallel ranks ({shown} tokens): the smaller rank preempts first; "
                "restart the server and check that the ranks even out")
    elif data_parallel_size > 1 and len(sizes) < data_parallel_size:
        flag = f"{len(sizes)} of {data_parallel_size} data-parallel ranks reported a KV cache size"
    return {"tokens": tokens, "equal": equal, "flag": flag}
