"""A tier's time before it is measured, for the end-to-end run's deadline: the requests at guessed rates
with the requests in flight that the client and the server allow, or what a profile of the same tier
took in an earlier invocation of the folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .. import options
from ..run import runs
from .servers import plan

if TYPE_CHECKING:
    from .session import Run

CLIENT_TURN_S = 5.0       # a tier's client overhead over the requests themselves (start, dataset, JSON)
# before a tier's first measurement: a request's time at these rates (the H200 under the default
# compilation config: ~15 ms per output token, prefill well above 4000 tokens/s)
GUESS_TPOT_S = 0.025
GUESS_PREFILL_TOKENS_S = 4000.0
# at N requests in flight (the final round's client) a decode step serves N requests at once but reads
# more KV and multiplies larger GEMMs, and each request's prefill waits behind the others': the tier's
# requests take their serial time over N, times 1 + this x N x (mean prompt / GUESS_PROMPT_SCALE) **
# GUESS_PROMPT_EXPONENT (longer prompts: more KV per step, longer prefills to wait behind). Fitted to every
# recorded final-round tier that did not preempt (reports/e2e, H100 and H200, 4 to 10 in flight, 4-8K to
# 16-32K): the guess is 1.14-1.68x the measured time. A flat 0.1 x N held 1.13-1.74x until an int8 16-32K tier
# at 8 in flight measured 1.07x (2026-12-07-h100-final-16-32k-int8-same-run); no flat value held both it and
# 4-8K at 10 in flight inside 1.1-1.8x.
GUESS_SLOWDOWN_PER_REQUEST = 0.12
GUESS_PROMPT_SCALE = 16384.0
GUESS_PROMPT_EXPONENT = 0.3
GUESS_PROMPT_FITTED = (4096.0, 32768.0)   # the tiers' prompts: outside them the prompt term has no data behind it


def batch_slowdown(n: int, mean_prompt: float = GUESS_PROMPT_SCALE) -> float:
    """The serial time over `n` requests in flight of `mean_prompt` tokens is multiplied by this (1 at one at
    a time)."""
    if n <= 1:
        return 1.0
    return 1.0 + GUESS_SLOWDOWN_PER_REQUEST * n * (max(mean_prompt, 1.0) / GUESS_PROMPT_SCALE) ** GUESS_PROMPT_EXPONENT


def guess_s(requests: list[list[int]], warmups: int, inflight: int = 1) -> float:
    """A (tier, profile)'s time before it was ever measured: its requests at the guessed rates, `inflight`
    of them at once (batch_slowdown), and the client's warm-ups (the first request again; vLLM's client
    sends them together, at most its concurrency at once, so `inflight` of them per round). A server that
    preempts takes longer: the first measured tier's time over its guess scales the later tiers' guesses."""
    one = [i / GUESS_PREFILL_TOKENS_S + o * GUESS_TPOT_S for i, o in requests]
    n = max(1, min(inflight, len(one)))
    mean_prompt = sum(i for i, _ in requests) / len(requests) if requests else GUESS_PROMPT_SCALE
    mean_prompt = min(max(mean_prompt, GUESS_PROMPT_FITTED[0]), GUESS_PROMPT_FITTED[1])
    body = sum(one) / n * batch_slowdown(n, mean_prompt)
    rounds = -(-warmups // max(1, inflight))
    return CLIENT_TURN_S + body + rounds * (one[0] if one else 0.0)


def inflight(client_argv: list[str], server_argv: list[str]) -> int:
    """Requests a tier keeps in flight: the client's --max-concurrency, capped by the server's
    --max-num-seqs (each as the last occurrence the parsers keep)."""
    conc = options.last_int(client_argv, "--max-concurrency") or 1
    seqs = options.last_int(server_argv, "--max-num-seqs")
    return min(conc, seqs) if seqs else conc


def warmups(contest_h: dict) -> int:
    opts = {o[0]: o[1:] for o in contest_h["client"]["options"]}
    return int((opts.get("--num-warmups") or ["0"])[0])


def profile_guesses(run: Run, model: Path, tname: str, names: list[str]) -> dict[str, float]:
    """Each profile's guessed time for tier `tname` before it was measured (guess_s at the requests in
    flight that its server's --max-num-seqs and the client's concurrency allow)."""
    client_argv = [x for o in run.contest_h["client"]["options"] for x in o]
    return {name: guess_s(run.summary["datasets"][tname]["requests"], warmups(run.contest_h),
                          inflight(client_argv, plan(run, model, name)["launch"])) for name in names}


def kept_estimate(run: Run, tname: str, kept: list[str]) -> float | None:
    """What a (tier, profile) kept from an earlier invocation took, scaled to the client's warm-ups: the
    best guess for the tier's other profiles (the largest, over the kept ones that completed)."""
    n = run.summary["datasets"][tname]["num_prompts"]
    est = None
    for name in kept:
        res = runs.read_json(runs.result_path(run.run_dir(name, create=False), tname))
        if res.get("completed") and isinstance(res.get("duration"), (int, float)):
            est = max(est or 0.0, res["duration"] * (n + warmups(run.contest_h)) / n + CLIENT_TURN_S)
    return est
