"""vLLM v1's scheduler (0.18.1, vllm/v1/core/sched/scheduler.py `schedule`, FCFS, no prefix caching,
no speculative tokens) stepped iteration by iteration against the hybrid model's block pool, with a
client at a fixed concurrency and every request sent at once (`--request-rate inf`).

Each step, as vLLM does it:
1. the running requests first, in order: each gets min(its remaining tokens, the token budget left)
   (a decode request 1, a prefill the next chunk: chunked prefill); its blocks are allocated for
   computed + new tokens; when the pool is short, the last running request is preempted (its blocks
   freed, its computed tokens dropped: recompute) and put at the front of the waiting queue, until the
   allocation succeeds or the request itself was preempted (then the step takes no more requests);
2. only when nothing was preempted this step: waiting requests in order while the budget lasts and
   fewer than max-num-seqs run: each gets min(its tokens, the budget left) if its blocks fit, else
   the admission stops;
3. the step's time from its items (costs.StepCost); a request whose computed tokens reach its tokens
   samples one token at the step's end (its first: TTFT); at its output length it finishes and frees
   its blocks, and the client sends the next request at once.
A request's tokens are prompt + generated, so a preempted request re-prefills both when it resumes.
Blocks per request: cdiv(tokens, block) in the attention group plus one per GDN group (capacity.py).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..errors import ForgeError
from .capacity import Capacity
from .shape import cdiv


@dataclass
class Req:
    rid: int
    prompt: int
    target: int                 # output tokens it will generate (1024 forced, or its own end-of-text)
    sent: float = 0.0
    out: int = 0
    computed: int = 0
    attn_blocks: int = 0
    holds: bool = False         # holds its GDN blocks
    first: float | None = None
    done: float | None = None
    preemptions: int = 0
    failed: bool = False

    @property
    def tokens(self) -> int:
        return self.prompt + self.out


class Engine:
    """One scheduler and its block pool (one server: a TP group, or one DP replica)."""

    def __init__(self, cap: Capacity, max_num_seqs: int, max_num_batched_tokens: int,
                 cost: Callable[[list[tuple[int, int]]], float]):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ForgeError("max-num-seqs and max-num-batched-tokens must be at least 1")
        self.cap, self.max_seqs, self.budget, self.cost = cap, max_num_seqs, max_num_batched_tokens, cost
        self.free = cap.usable_blocks
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.steps = self.preemptions = 0
        self.busy_s = 0.0

    def _need(self, r: Req, n: int) -> int:
        need = cdiv(r.computed + n, self.cap.block_size) * self.cap.attn_groups - r.attn_blocks
        return max(need, 0) + (0 if r.holds else self.cap.gdn_groups)

    def _take(self, r: Req, n: int) -> None:
        need = self._need(r, n)
        self.free -= need
        r.attn_blocks = cdiv(r.computed + n, self.cap.block_size) * self.cap.attn_groups
        r.holds = True

    def _release(self, r: Req) -> None:
        self.free += r.attn_blocks + (self.cap.gdn_groups if r.holds else 0)
        r.attn_blocks, r.holds = 0, False

    def schedule(self) -> list[tuple[Req, int]]:
        budget, items, preempted = self.budget, [], False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.tokens - r.computed, budget, self.cap.max_model_len - 1 - r.computed)
            if n <= 0:
                i += 1
                continue
            ok = True
            while self._need(r, n) > self.free:
                victim = self.running.pop()
                self._release(victim)
                victim.computed = 0
                victim.preemptions += 1
                self.preemptions += 1
                self.waiting.appendleft(victim)
                preempted = True
                if victim is r:
                    ok = False
                    break
            if not ok:
                break
            self._take(r, n)
            items.append((r, n))
            budget -= n
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
                r = self.waiting[0]
                n = min(r.tokens - r.computed, budget)
                if self._need(r, n) > self.free:
                    break
                self.waiting.popleft()
                self._take(r, n)
                self.running.append(r)
                items.append((r, n))
                budget -= n
        return items

    def step(self, now: float) -> tuple[float, list[Req]]:
        """Schedule and run one step from `now`: (its end, the requests it finished). A waiting request
        that can never fit (more blocks than the pool) fails at once, as vLLM refuses it."""
        items = self.schedule()
        if not items:
            if self.running or not self.waiting:
                raise ForgeError("the scheduler model stalled (nothing scheduled with requests running)")
            r = self.waiting[0]
            if self._need(r, min(r.tokens - r.computed, self.budget)) > self.cap.usable_blocks:
                self.waiting.popleft()
                r.failed, r.done = True, now
                return now, [r]
            return now, []              # the step preempted its only request; it is admitted again next
        dt = self.cost([(n, r.computed) for r, n in items])
        end = now + dt
        self.steps += 1
        self.busy_s += dt
        finished = []
        for r, n in items:
            r.computed += n
            if r.computed >= r.tokens:
                r.out += 1
                if r.first is None:
                    r.first = end
                if r.out >= r.target:
                    r.done = end
                    self._release(r)
                    self.running.remove(r)
                    finished.append(r)
        return end, finished

    def idle(self) -> bool:
        return not self.running and not self.waiting


def serve(engine: Engine, requests: list[tuple[int, int]], concurrency: int, arrival_delay: float = 0.0) -> list[Req]:
    """The client at `concurrency` with every request at once: the first `concurrency` sent at 0, each
    next one when one finishes; a request reaches the scheduler `arrival_delay` after it is sent."""
    if concurrency < 1:
        raise ForgeError(f"concurrency {concurrency}: must be at least 1")
    reqs = [Req(i, p, o) for i, (p, o) in enumerate(requests)]
    todo = deque(reqs)
    arrivals: list[tuple[float, int, Req]] = []

    def send(t: float) -> None:
        r = todo.popleft()
        r.sent = t
        heapq.heappush(arrivals, (t + arrival_delay, r.rid, r))

    for _ in range(min(concurrency, len(todo))):
        send(0.0)
    now = 0.0
    while arrivals or not engine.idle():
        while arrivals and arrivals[0][0] <= now:
            engine.waiting.append(heapq.heappop(arrivals)[2])
        if engine.idle():
            now = arrivals[0][0]
            continue
        now, finished = engine.step(now)
        for _ in finished:
            if todo:
                send(now)
    return reqs
