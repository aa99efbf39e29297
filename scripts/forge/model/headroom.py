"""The memory a --gpu-memory-utilization leaves outside vLLM's budget, and whether it holds what vLLM
0.18.1 puts there: the question a utilization above the round's baseline (0.95) must answer before it is
searched, served or shipped.

vLLM sizes the KV cache inside `utilization x the card's memory` (v1/worker/gpu_worker.py
determine_available_memory: weights, the profile run's peak and the runtime's non-torch growth are
counted in it). Two things are not:
  - the runtime's own context, present before the worker's first memory snapshot: vLLM refuses to start
    when the free memory then is below the requested budget (v1/worker/utils.py request_memory);
  - the CUDA-graph pool. Graphs are captured after the KV cache is allocated, from the memory outside
    the budget; vLLM's estimate of the pool, which could count it inside, is 0 on ROCm
    (determine_available_memory: "Skip on ROCm/HIP") and opt-in elsewhere. The pool grows with the
    largest captured batch, min(2 x max-num-seqs, 512) under the default compilation config.
So `(1 - utilization) x memory` has to hold the context, the graph pool at the configuration's capture
size and vLLM's own margin for what its profile underestimates (150 MiB, gpu_worker.py).

What is known and what is assumed:
  - At or below the round's baseline utilization the configuration is taken as starting: the
    organizers' own command (TP1, --max-num-seqs 128, 0.95) starts on the DCU card.
  - Above it, the graph pool is priced from the GPU machine's measurements (`GRAPH_POOL_MEASURED`, vLLM's
    "Graph capturing finished in N secs, took X GiB", one server on the card): their largest GiB per
    captured batch entry, an upper envelope. The DCU's pool is smaller: at capture size 256 the GPU
    machine's 6.33 GiB would not fit the 3.2 GiB the organizers' command leaves, and that command starts.
  - The context is an allowance (`CONTEXT_ALLOWANCE`), not a measurement: no public figure gives the
    DCU runtime's. The sweep on the card is the check; this model only keeps out what cannot fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import ForgeError

GiB = 1 << 30
MiB = 1 << 20
MAX_CAPTURE = 512                   # vLLM 0.18.1's default largest captured batch: at most 2 x max-num-seqs and 512
CONTEXT_ALLOWANCE = 1 * GiB         # the runtime's context before the first snapshot: an allowance (see above)
VLLM_MARGIN = 150 * MiB             # gpu_worker.py: "memory profiling may slightly underestimate" (its buffer)
BASELINE_UTILIZATION = 0.95         # the organizers' command (both rounds): known to start on the card

# (report folder under reports/e2e, capture size, GiB the graph pool took), one server on the GPU machine,
# vLLM's default compilation config; tests/unit/test_headroom.py reads each back from its server log.
GRAPH_POOL_MEASURED = (
    ("2026-12-07-h100-final-16-32k-16-requests", 8, 0.14),
    ("2026-12-06-h100-final-8-16k-sequential", 8, 0.15),
    ("2026-12-07-h100-final-16-32k-16-requests", 16, 0.24),
    ("2026-12-05-h100-final-4-8k-upstream-only", 256, 6.33),
)
# the upper envelope: the largest measured GiB per captured batch entry
GRAPH_POOL_PER_ENTRY = max(gib * GiB / size for _, size, gib in GRAPH_POOL_MEASURED)


def capture_sizes(limit: int) -> list[int]:
    """vLLM 0.18.1's default capture sizes up to `limit` (config/vllm.py: 1, 2, 4, then steps of 8 below
    256, then steps of 16)."""
    sizes = [i for i in (1, 2, 4) if i <= limit] + list(range(8, min(limit + 1, 256), 8))
    return sizes + (list(range(256, limit + 1, 16)) if limit >= 256 else [])


def capture_size(max_num_seqs: int, max_num_batched_tokens: int = MAX_CAPTURE) -> int:
    """The largest batch vLLM 0.18.1 captures a graph for under the default compilation config: the
    largest capture size within 2 x max-num-seqs, 512 and max-num-batched-tokens (seqs 5 -> 8, 128 -> 256)."""
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ForgeError(f"--max-num-seqs {max_num_seqs}, --max-num-batched-tokens {max_num_batched_tokens}: "
                         "each must be at least 1")
    return capture_sizes(min(2 * max_num_seqs, MAX_CAPTURE, max_num_batched_tokens))[-1]


def graph_pool_bytes(max_num_seqs: int, max_num_batched_tokens: int = MAX_CAPTURE) -> int:
    return int(GRAPH_POOL_PER_ENTRY * capture_size(max_num_seqs, max_num_batched_tokens))


@dataclass(frozen=True)
class Headroom:
    utilization: float
    max_num_seqs: int
    outside_bytes: int              # (1 - utilization) x the card's memory
    needed_bytes: int               # context allowance + graph pool + vLLM's margin
    graph_pool_bytes: int
    known_good: bool                # at or below the baseline utilization: the organizers' command starts there
    fits: bool
    max_seqs: int                   # the largest --max-num-seqs up to 256 whose needs fit here (0: none)

    def why(self) -> str:
        """One line: why the configuration is taken or kept out."""
        out = f"{self.outside_bytes / GiB:.2f} GiB outside vLLM's budget at utilization {self.utilization:g}"
        if self.known_good:
            return f"{out}: at or below {BASELINE_UTILIZATION:g}, where the organizers' command starts"
        need = (f"the runtime's context (an allowance of {CONTEXT_ALLOWANCE / GiB:.2f} GiB), the graph pool "
                f"at --max-num-seqs {self.max_num_seqs} ({self.graph_pool_bytes / GiB:.2f} GiB) and vLLM's "
                f"{VLLM_MARGIN // MiB} MiB margin: {self.needed_bytes / GiB:.2f} GiB")
        if self.fits:
            return f"{out} holds {need}"
        cap = f"--max-num-seqs {self.max_seqs} at most" if self.max_seqs else "no --max-num-seqs"
        return f"{out} does not hold {need} ({cap} fits there)"

    def as_dict(self) -> dict:
        return asdict(self)


def headroom(memory_bytes: int, utilization: float, max_num_seqs: int,
             max_num_batched_tokens: int = MAX_CAPTURE) -> Headroom:
    """Whether `utilization` leaves a card of `memory_bytes` room for what vLLM puts outside its budget
    at `max_num_seqs` (see the module's docstring)."""
    if not 0 < utilization <= 1:
        raise ForgeError(f"--gpu-memory-utilization {utilization}: must be in (0, 1]", hint="e.g. 0.95")
    outside = int(memory_bytes * (1 - utilization))
    pool = graph_pool_bytes(max_num_seqs, max_num_batched_tokens)
    need = CONTEXT_ALLOWANCE + VLLM_MARGIN + pool
    known = utilization <= BASELINE_UTILIZATION
    spare = outside - CONTEXT_ALLOWANCE - VLLM_MARGIN
    max_seqs = next((s for s in range(MAX_CAPTURE // 2, 0, -1)
                     if GRAPH_POOL_PER_ENTRY * capture_size(s, max_num_batched_tokens) <= spare), 0)
    return Headroom(utilization=utilization, max_num_seqs=max_num_seqs, outside_bytes=outside, needed_bytes=need,
                    graph_pool_bytes=pool, known_good=known, fits=known or outside >= need, max_seqs=max_seqs)
