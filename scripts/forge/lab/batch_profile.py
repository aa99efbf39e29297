"""Where a decode step's time goes with several requests decoding at once: B requests started together
on a harness server, the torch profiler run once every one of them decodes, and the decode steps of
all B (no prefill chunk beside them) summed per step by kernel and group (full attention, GDN, GEMM,
the rest), as `e2e-gpu --profile-decode` does for one request.

On the GPU machine (`forge e2e-gpu --profile-prefill TOKENS --profile-decode STEPS --profile-batch B`):
after the tiers, B fresh prompts of TOKENS tokens each are sent at once, streamed (each request's
output long enough to still be running at the end: the server's max-model-len less the prompt); once
each has its first token, /start_profile, STEPS more tokens per request, /stop_profile, and the
requests are closed (vLLM aborts them). The trace's steps are those of forge.lab.trace_digest; only
the steps that decoded exactly B requests and prefilled none are counted, the others are counted
apart by kind. A batch the server cannot decode at once (over its --max-num-seqs, or its KV cache as its
log gives it) is refused before any request is sent. Written to <run>/batch-profile/<profile>-b<B>.json with the requests' contexts; `forge
prefill-profile RUN...` renders them beside the prefill profiles."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import options, paths
from ..errors import ForgeError
from ..run import runs, serverlog, synth
from .client import TokenStream, get_text, post_empty
from .profiler import new_trace, trace_dir, traces_now
from .trace_digest import ORDER, batch_digest, by_category, category, decode_summary

if TYPE_CHECKING:
    from .session import Run

SUBDIR = "batch-profile"
MAX_BATCH = 64
PROMPT_SLACK = 64            # tokens kept under max-model-len: a synthetic prompt is TOKENS give or take a few
HEADROOM = 256               # output tokens beyond the profiled steps (tokens decoded while the others prefill)
WAIT_S = 900.0               # for the B first tokens, and again for the profiled steps
RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
KV_ROUNDING = 1.05           # the log's concurrency is rounded (2 decimals, whole blocks): refuse only beyond it


# --- on the GPU machine -----------------------------------------------------------------------------

def model_len(base: str) -> int:
    """The served model's max-model-len, as the server's /v1/models gives it."""
    try:
        n = json.loads(get_text(f"{base}/v1/models", timeout=30))["data"][0]["max_model_len"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ForgeError(f"{base}/v1/models: no max_model_len ({type(e).__name__}: {e})") from None
    if not isinstance(n, int) or n < 1:
        raise ForgeError(f"{base}/v1/models: max_model_len {n!r} is not a token count")
    return n


def running(base: str) -> float | None:
    """Requests the server is running (vLLM's /metrics), or None where it does not say."""
    try:
        found = RUNNING.findall(get_text(f"{base}/metrics", timeout=10))
    except ForgeError:
        return None
    return sum(float(x) for x in found) if found else None


def refuse_by_args(argv: list[str], tokens: int, decode_steps: int, batch: int, who: str = "the server") -> None:
    """What a server's command line alone refuses (checked again before any server starts, from the command
    each would run: forge.lab.preflight): more requests than its --max-num-seqs (per data-parallel rank), or
    a --max-model-len that leaves a request of `tokens` no room for the profiled steps."""
    dp = options.last_int(argv, "--data-parallel-size", "-dp") or 1
    seqs = options.last_int(argv, "--max-num-seqs")
    if seqs is not None and batch > seqs * dp:
        raise ForgeError(f"--profile-batch {batch}: {who} runs at most {seqs * dp} requests at once "
                         f"(--max-num-seqs {seqs}" + (f" on each of {dp} data-parallel ranks" if dp > 1 else "")
                         + f"), so {batch} never decode together", hint=f"give --profile-batch {seqs * dp} or less")
    limit = options.last_int(argv, "--max-model-len")
    if limit is not None and limit - tokens - PROMPT_SLACK < decode_steps + HEADROOM:
        raise ForgeError(f"--profile-prefill {tokens} --profile-decode {decode_steps}: {who}'s --max-model-len "
                         f"{limit} leaves each request {max(limit - tokens - PROMPT_SLACK, 0)} output tokens, and the "
                         f"profile needs {decode_steps} + {HEADROOM}", hint="lower --profile-prefill or --profile-decode")


def refuse_unfit(st: dict, tokens: int, decode_steps: int, batch: int) -> None:
    """Before any request is sent: refuse a batch the server cannot decode at once, which would otherwise be
    found out only when a request that ran alone ends (minutes of the GPU machine): more requests than its
    --max-num-seqs (per data-parallel rank), or more prompt and profiled tokens than its KV cache holds (the
    server log's "Maximum concurrency for L tokens per request: Cx", C x L tokens per rank:
    serverlog.kv_capacity_tokens). What the server does not say is not checked."""
    refuse_by_args([str(a) for a in (st.get("server_args") or st.get("cmdline") or [])], tokens, decode_steps,
                   batch)
    log = Path(st["log"]) if st.get("log") else None
    held = serverlog.kv_capacity_tokens(log.read_text(errors="replace")) if log and log.is_file() else None
    need = batch * (tokens + decode_steps)
    if held is not None and need > held * KV_ROUNDING:
        raise ForgeError(f"--profile-batch {batch} --profile-prefill {tokens} --profile-decode {decode_steps}: the "
                         f"server's KV cache holds about {held:,} tokens of requests at once (its log's maximum "
                         f"concurrency), and {batch} requests of {tokens} + {decode_steps} tokens need {need:,}: they "
                         "would never decode together", hint="lower --profile-batch or --profile-prefill, or give "
                                                              "the servers a larger KV cache (--kv-cache-memory-bytes)")


def _wait(streams: list[TokenStream], done, what: str, wait_s: float, poll_s: float) -> None:
    """Until done(i, stream) holds for every stream; a stream that failed, or ended before, is an error."""
    end = time.monotonic() + wait_s
    b = len(streams)
    while True:
        for i, s in enumerate(streams):
            if s.error:
                raise ForgeError(f"batch profile, request {i + 1} of {b}: {s.error}")
            if s.ended and not done(i, s):
                raise ForgeError(f"batch profile, request {i + 1} of {b} ended (finish: {s.finish}, {s.tokens} "
                                 f"tokens) before {what}", hint="see the server log")
        if all(done(i, s) for i, s in enumerate(streams)):
            return
        if time.monotonic() > end:
            raise ForgeError(f"batch profile: not {what} after {wait_s:.0f} s (tokens per request so far: "
                             f"{[s.tokens for s in streams]})",
                             hint="the server may not hold the requests at once (its --max-num-seqs or KV cache): "
                                  "lower --profile-batch or --profile-prefill")
        time.sleep(poll_s)


def capture(run: Run, name: str, model: Path, tokens: int, decode_steps: int, batch: int, *,
            wait_s: float = WAIT_S, poll_s: float = 0.02) -> dict:
    st = run.servers[name]
    base = f"http://{st['host']}:{st['port']}"
    tdir = trace_dir(run.out, name)
    tdir.mkdir(parents=True, exist_ok=True)
    limit = model_len(base)
    room = limit - tokens - PROMPT_SLACK
    if room < decode_steps + HEADROOM:
        raise ForgeError(f"--profile-prefill {tokens} --profile-decode {decode_steps}: the server's max-model-len "
                         f"{limit} leaves each request {max(room, 0)} output tokens, and the profile needs "
                         f"{decode_steps} + {HEADROOM}", hint="lower --profile-prefill or --profile-decode")
    refuse_unfit(st, tokens, decode_steps, batch)
    prompts = [synth.synthetic_prompt(model, tokens, f"profile-batch{batch}-{i}-{tokens}") for i in range(batch)]
    streams = [TokenStream(st, p, room, timeout=wait_s) for p in prompts]
    for s in streams:                     # all at once, as the client sends a tier's requests
        s.start()
    try:
        _wait(streams, lambda i, s: s.tokens >= 1, "every request's first token", wait_s, poll_s)
        if any(s.ended for s in streams):
            raise ForgeError(f"batch profile: a request ended before the last of the {batch} had its first token",
                             hint="the server did not hold the requests at once: lower --profile-batch or "
                                  "--profile-prefill")
        at_first = [s.tokens for s in streams]
        before = traces_now(tdir)
        post_empty(f"{base}/start_profile", timeout=120)
        at_start = [s.tokens for s in streams]
        try:
            _wait(streams, lambda i, s: s.tokens - at_start[i] >= decode_steps,
                  f"{decode_steps} tokens more per request under the profiler", wait_s, poll_s)
        finally:
            post_empty(f"{base}/stop_profile", timeout=900)
        at_stop = [s.tokens for s in streams]
    finally:
        for s in streams:                 # closed: the server aborts them (the next profile's GPU is idle)
            s.stop()
        idle = _wait_idle(base)
    trace = new_trace(tdir, before)
    dig = batch_digest(trace, batch)
    served = [s.prompt_tokens or tokens for s in streams]
    dig.update(profile=name, prompt_tokens=tokens, decode_steps_asked=decode_steps, max_tokens=room,
               requests=[{"prompt_tokens": p, "first_token_s": round(s.first_token_s or 0.0, 3), "tokens_at_first": a,
                          "tokens_at_start": b, "tokens_at_stop": c}
                         for p, s, a, b, c in zip(served, streams, at_first, at_start, at_stop)],
               contexts_at_start=[p + b for p, b in zip(served, at_start)],
               contexts_at_stop=[p + c for p, c in zip(served, at_stop)], server_idle_after_close=idle,
               trace=trace.name, trace_mib=round(trace.stat().st_size / 2**20, 1), recorded=runs.now_iso())
    (run.out / SUBDIR).mkdir(exist_ok=True)
    runs.write_json(run.out / SUBDIR / f"{name}-b{batch}.json", dig)
    r = summarise(dig)
    dig["headline"] = {"batch": batch, "decode_steps": r["steps"], "contexts": f"{r['contexts'][0]}-{r['contexts'][1]}",
                       "gpu_period_ms": r["gpu_period_ms_median"], "gpu_busy_ms": r["gpu_busy_ms"],
                       **{k.replace(" ", "_") + "_ms": v for k, v in r["categories_ms"].items()}}
    return dig


def _wait_idle(base: str, wait_s: float = 60) -> bool | None:
    """Whether the server ran no request any more within `wait_s` of the streams' close (None: its
    /metrics does not say)."""
    end = time.monotonic() + wait_s
    while True:
        n = running(base)
        if n is None or n == 0:
            return None if n is None else True
        if time.monotonic() > end:
            return False
        time.sleep(0.5)


# --- here: the document -----------------------------------------------------------------------------

def summarise(d: dict) -> dict:
    """One batch profile per decode step: decode_summary()'s figures, the median GPU period, the
    contexts the requests had while profiled, and the kernels outside the steps per step of the trace."""
    ds = decode_summary(d["decode_steps"])
    per = sorted(d.get("gpu_period_ms") or [])
    n_all = max(1, d.get("steps_in_trace") or len(d["decode_steps"]))
    out_ms = by_category(d["outside"]["kernels"])
    ctx = [*d.get("contexts_at_start", []), *d.get("contexts_at_stop", [])] or [d.get("prompt_tokens", 0)]
    return {"batch": d["batch"], "prompt_tokens": d.get("prompt_tokens"), "contexts": [min(ctx), max(ctx)],
            "decode_steps_asked": d.get("decode_steps_asked"), "steps_in_trace": d.get("steps_in_trace"),
            "excluded": d["excluded"], **ds,
            "gpu_period_ms_median": round(per[len(per) // 2], 3) if per else None,
            "outside_ms_per_step": round(sum(out_ms.values()) / n_all, 3),
            "outside_top": [{"name": k, "category": category(k), "us_per_step": round(us / n_all, 1)}
                            for k, (_, us) in sorted(d["outside"]["kernels"].items(), key=lambda kv: -kv[1][1])[:5]]}


def has_profiles(folder: Path) -> bool:
    return any((Path(folder) / SUBDIR).glob("*.json"))


def load(folders: list[Path], labels: list[Path]) -> dict[str, dict]:
    """The batch profiles of results folders ({<profile>-b<B>: summary}, each with its source path as
    the user named the folder); a folder without any is skipped."""
    found: dict[str, dict] = {}
    for f, label in zip(folders, labels):
        for p in sorted((Path(f) / SUBDIR).glob("*.json")):
            named = paths.rel(Path(label) / SUBDIR / p.name)
            try:
                d = runs.read_json(p)
            except ForgeError as e:
                raise ForgeError(f"{named}: {e.message}", hint=e.hint) from None
            if not isinstance(d, dict) or not {"batch", "decode_steps", "profile", "excluded", "outside"} <= set(d):
                raise ForgeError(f"{named}: not a batch profile (no batch/decode_steps/profile)")
            found[f"{d['profile']}-b{d['batch']}"] = {"profile": d["profile"], **summarise(d), "source": named}
    return found


def render_lines(res: dict[str, dict]) -> list[str]:
    """The document's section on decode steps at a batch (empty without batch profiles)."""
    if not res:
        return []
    L = ["", "## Decode steps at a batch (every request decoding, none prefilling)", "",
         "B fresh prompts started together on a warm server; once each had its first token, the torch profiler "
         "ran while each request generated the asked steps. Counted: the steps that decoded exactly B requests "
         "and prefilled none (vLLM's `execute_context_0(0)_generation_B(T)`); left out and counted apart: steps "
         "with a prefill chunk beside decoding requests (mixed), prefill-only steps, decode steps at another "
         "batch. Contexts: each request's prompt plus its output tokens while profiled (smallest to largest). "
         "GPU period: from one counted step's first kernel to the next one's (the step with the gaps between "
         "steps; the profiler slows the host side); GPU span: a step's first kernel to its last; both medians. "
         "Kernel times are means per counted step; outside: kernels launched outside the steps' annotations "
         "(sampling among them), per step of the trace.", "",
         "| profile | batch | contexts | steps counted (asked) | left out: mixed / prefill / other batch | "
         "GPU period ms | GPU span ms | CPU ms | GPU busy ms | " + " | ".join(f"{c} ms" for c in ORDER)
         + " | outside ms |", "|---|---|---|---|---|---|---|---|---|" + "---|" * len(ORDER) + "---|"]
    for r in res.values():
        ex = r["excluded"]
        other = sum(ex["decode_other_batch"].values())
        per = f"{r['gpu_period_ms_median']:.3f}" if r.get("gpu_period_ms_median") is not None else "—"
        L.append(f"| {r['profile']} | {r['batch']} | {r['contexts'][0]}-{r['contexts'][1]} | {r['steps']} "
                 f"({r.get('decode_steps_asked') or '—'}) | {ex['mixed']} / {ex['prefill']} / {other} | {per} | "
                 f"{r['gpu_span_ms_median']:.3f} | {r['cpu_ms_median']:.3f} | {r['gpu_busy_ms']:.3f} | "
                 + " | ".join(f"{r['categories_ms'][c]:.3f}" for c in ORDER) + f" | {r['outside_ms_per_step']:.3f} |")
    for key, r in res.items():
        L += ["", f"### {key}: largest kernels per decode step at batch {r['batch']}", "",
              "| kernel | group | launches | µs |", "|---|---|---|---|"]
        L += [f"| `{k['name'][:90]}` | {k['category']} | {k['launches']:g} | {k['us']:.1f} |" for k in r["top_kernels"]]
        if r["outside_top"]:
            L += ["", "Outside the steps, per step of the trace: " + ", ".join(
                f"`{k['name'][:60]}` {k['us_per_step']:.1f} µs" for k in r["outside_top"])]
    return L
