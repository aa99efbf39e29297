"""The memory a --gpu-memory-utilization leaves outside vLLM's budget, and whether it holds what vLLM
0.18.1 puts there while it serves: the question a utilization above the round's baseline (0.95) must
answer before it is searched, served or shipped.

vLLM sizes the KV cache inside `utilization x the card's memory` (v1/worker/gpu_worker.py
determine_available_memory: the weights, the profile run's peak and the runtime's non-torch growth are
counted in it). Not counted:
  - the runtime's own context, present before the worker's first memory snapshot (vLLM refuses to start
    when the free memory then is below the budget: v1/worker/utils.py request_memory); at TP2 also the
    communicators' buffers, set up before the snapshot as well;
  - the CUDA-graph pool. Graphs are captured after the KV cache is allocated; vLLM's estimate of the
    pool, which could count it inside the budget, is 0 on ROCm ("Skip on ROCm/HIP") and opt-in on CUDA.
    Before capturing, vLLM empties the allocator's cache (gpu_model_runner.py capture_model), so the pool
    may also take the profile run's activation memory, inside the budget: the server then starts, and a
    prefill larger than the captured batches finds that memory gone. So the pool is held to the memory
    outside the budget, which is what running, not only starting, needs.
The pool grows with the largest captured batch: the largest default capture size within 2 x
max-num-seqs, 512 and max-num-batched-tokens (config/vllm.py), and, for a model with GDN (Mamba) layers
under FULL graphs (the default), within the KV cache's blocks (compilation.py
adjust_cudagraph_sizes_for_mamba_cache: a DCU card's 146 blocks at TP1 / 0.95 cap 256 at 144).

The needs, per rank: an allowance for the runtime's context (`CONTEXT_ALLOWANCE`, 1 GiB: no public
figure gives the DCU runtime's), a margin (`MARGIN`, 150 MiB, the buffer vLLM's own suggestion of a KV
size keeps for what its profile underestimates), and the graph pool at the configuration's capture size,
at a cost per captured batch entry:
  - on a DCU card, derived from what is known to run there: the organizers' command (TP1, --max-num-seqs
    128, 4096 batched tokens, 0.95) serves the preliminary on the card, so its pool (144 entries) fits
    what 0.95 leaves beside the allowance and the margin: (3.2 - 1 - 0.146) GiB / 144 = 0.0143 GiB per
    entry at most, given the allowance holds the card's context (a smaller context leaves the pool more,
    but then the need of a small pool is smaller by more than its share grows);
  - on the GPU machine's cards, their own measurements (`GRAPH_POOL_MEASURED`: vLLM's "Graph capturing
    finished ..., took X GiB", one server on the card): the largest GiB per entry, 0.044 (6.33 GiB at 144).
    The DCU's is less than a third of that, or the organizers' command would not run there.
What the derivation rests on, unmeasured on the card (the first DCU server log with "Capping ... to N" and
"Graph capturing finished ..., took X GiB" should join GRAPH_POOL_MEASURED): (a) the organizers' image
captures as vLLM 0.18.1 does (full decode graphs, the GDN cap: 144 entries; fewer would make 0.0143 GiB no
bound); (b) what our build adds outside the budget (the split-KV decode's workspaces, allocated after the
KV cache: tens of MiB) fits the margin; (c) what the organizers' pool may have borrowed that grows with
--max-num-seqs (the profile's sampler rows, freed before capture) is small beside the margin. The linear
cost overstates small pools (the GPU machine's 0.14 / 0.24 / 6.33 GiB at 8 / 16 / 144 entries grow faster
than linearly), which errs on the safe side.

At or below the baseline's utilization a configuration is taken as running (the organizers' command does);
that reaches a little past the command itself: below 1536 batched tokens with --max-num-seqs 76 or more the
cache's blocks let vLLM capture 152 entries, more than the 144 the derivation saw.
Above it, TP1 only: a TP2 server's communicators add to the context by an amount no figure gives, and a
TP2 cache holds every tier at 0.95, so nothing is to be gained there. The allowance is a judgement, not a
measurement: the sweep on the card is the check.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import ForgeError

GiB = 1 << 30
MiB = 1 << 20
MAX_CAPTURE = 512                   # vLLM 0.18.1's largest default capture size
CONTEXT_ALLOWANCE = 1 * GiB         # the runtime's context before the first snapshot: an allowance (see above)
MARGIN = 150 * MiB                  # as the buffer of vLLM's own KV-size suggestion (gpu_worker.py)
BASELINE_UTILIZATION = 0.95         # the organizers' command (both rounds): runs on the card
BASELINE_SEQS, BASELINE_BATCHED = 128, 4096

# (report folder under reports/e2e, capture size as run, GiB the graph pool took), one server on the GPU machine,
# vLLM's default compilation config; tests/unit/test_headroom.py reads each back from its server log.
GRAPH_POOL_MEASURED = (
    ("2026-12-07-h100-final-16-32k-16-requests", 8, 0.14),
    ("2026-12-06-h100-final-8-16k-sequential", 8, 0.15),
    ("2026-12-07-h100-final-16-32k-16-requests", 16, 0.24),
    ("2026-12-05-h100-final-4-8k-upstream-only", 144, 6.33),
)
MEASURED_PER_ENTRY = max(gib * GiB / size for _, size, gib in GRAPH_POOL_MEASURED)


def capture_sizes(limit: int) -> list[int]:
    """vLLM 0.18.1's default capture sizes up to `limit` (config/vllm.py: 1, 2, 4, then steps of 8 below
    256, then steps of 16)."""
    sizes = [i for i in (1, 2, 4) if i <= limit] + list(range(8, min(limit + 1, 256), 8))
    return sizes + (list(range(256, limit + 1, 16)) if limit >= 256 else [])


def capture_size(max_num_seqs: int, max_num_batched_tokens: int = MAX_CAPTURE, num_blocks: int | None = None) -> int:
    """The largest batch vLLM 0.18.1 captures a graph for under the default compilation config: the largest
    capture size within 2 x max-num-seqs, 512 and max-num-batched-tokens (seqs 5 -> 8, 128 -> 256) and,
    given the KV cache's `num_blocks`, within them (the GDN layers' cap; 0: no graph at all)."""
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ForgeError(f"--max-num-seqs {max_num_seqs}, --max-num-batched-tokens {max_num_batched_tokens}: "
                         "each must be at least 1")
    sizes = capture_sizes(min(2 * max_num_seqs, MAX_CAPTURE, max_num_batched_tokens))
    if num_blocks is not None:
        sizes = [s for s in sizes if s <= num_blocks]
    return sizes[-1] if sizes else 0


def derived_per_entry(memory_bytes: int, baseline_blocks: int) -> float:
    """The graph pool's cost per captured entry on a card where the organizers' command runs (TP1,
    BASELINE_SEQS, BASELINE_BATCHED, BASELINE_UTILIZATION, whose KV cache has `baseline_blocks`): what that
    utilization leaves beside the allowance and the margin, over that command's capture size."""
    size = capture_size(BASELINE_SEQS, BASELINE_BATCHED, baseline_blocks)
    return (int(memory_bytes * (1 - BASELINE_UTILIZATION)) - CONTEXT_ALLOWANCE - MARGIN) / size


@dataclass(frozen=True)
class Headroom:
    utilization: float
    tp: int
    max_num_seqs: int
    outside_bytes: int              # (1 - utilization) x the card's memory
    needed_bytes: int               # allowance + margin + graph pool
    graph_pool_bytes: int
    per_entry_bytes: float
    known_good: bool                # at or below the baseline utilization: the organizers' command runs there
    fits: bool
    max_seqs: int                   # the largest --max-num-seqs (up to 256) whose needs fit here; 0: none

    def why(self) -> str:
        """One line: why the configuration is taken or kept out."""
        out = f"{self.outside_bytes / GiB:.2f} GiB outside vLLM's budget at utilization {self.utilization:g}"
        if self.known_good:
            return f"{out}: at or below {BASELINE_UTILIZATION:g}, where the organizers' command runs"
        if self.tp > 1:
            return (f"{out} at TP{self.tp}: above {BASELINE_UTILIZATION:g} only TP1 is modelled (the communicators' "
                    f"buffers add to the runtime's context by an amount no figure gives)")
        need = (f"the runtime's context (an allowance of {CONTEXT_ALLOWANCE / GiB:.2f} GiB), the graph pool at "
                f"--max-num-seqs {self.max_num_seqs} ({self.graph_pool_bytes / GiB:.2f} GiB) and a {MARGIN // MiB} "
                f"MiB margin: {self.needed_bytes / GiB:.2f} GiB")
        if self.fits:
            return f"{out} holds {need}"
        cap = f"--max-num-seqs {self.max_seqs} at most" if self.max_seqs else "no --max-num-seqs"
        return f"{out} does not hold {need} ({cap} fits there)"

    def as_dict(self) -> dict:
        return asdict(self)


def headroom(memory_bytes: int, utilization: float, max_num_seqs: int, max_num_batched_tokens: int = MAX_CAPTURE,
             *, per_entry: float, tp: int = 1, num_blocks: int | None = None) -> Headroom:
    """Whether `utilization` leaves a card of `memory_bytes` room for what vLLM puts outside its budget at
    `max_num_seqs` (see the module's docstring); `per_entry`: the graph pool's bytes per captured entry on
    the card (derived_per_entry or MEASURED_PER_ENTRY); `num_blocks`: the KV cache's, for the GDN cap."""
    if not 0 < utilization <= 1:
        raise ForgeError(f"--gpu-memory-utilization {utilization}: must be in (0, 1]", hint="e.g. 0.95")
    outside = int(memory_bytes * (1 - utilization))
    spare = outside - CONTEXT_ALLOWANCE - MARGIN
    pool = int(per_entry * capture_size(max_num_seqs, max_num_batched_tokens, num_blocks))
    known = utilization <= BASELINE_UTILIZATION
    max_seqs = 0 if tp > 1 and not known else next(
        (s for s in range(MAX_CAPTURE // 2, 0, -1)
         if per_entry * capture_size(s, max_num_batched_tokens, num_blocks) <= spare), 0)
    fits = known or (tp == 1 and pool <= spare)
    return Headroom(utilization=utilization, tp=tp, max_num_seqs=max_num_seqs, outside_bytes=outside,
                    needed_bytes=CONTEXT_ALLOWANCE + MARGIN + pool, graph_pool_bytes=pool, per_entry_bytes=per_entry,
                    known_good=known, fits=fits, max_seqs=max_seqs)
