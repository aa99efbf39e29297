"""The capacity planner: the KV cache vLLM 0.18.1 will report for a topology, KV dtype, card and
--gpu-memory-utilization, how many of a tier's requests (prompt + output) stay resident at once,
whether the tier's concurrency will preempt, and the planned --max-num-seqs that keeps them resident
where it would (`planned_max_num_seqs`, `planned_seqs`).

Memory, as vLLM's worker and engine core compute it (v1/worker/gpu_worker.py determine_available_memory,
v1/core/kv_cache_utils.py get_kv_cache_config_from_groups and _report_kv_cache_config):
  available = card memory x utilization - weights per rank - the rest of the profile run's peak
  num_blocks = available // page // group_size                 (group_size 16: 16 tensors)
  reported   = num_blocks // groups x block                    (4 groups: "GPU KV cache size: N tokens")
  usable     = num_blocks - 1                                  (BlockPool keeps one null block)
  a request of T tokens holds cdiv(T, block) blocks of the attention group and one block in each of
  the 3 GDN groups (mamba_cache_mode none: the GDN block is max-model-len tokens long).
The reported count divides the pool by the 4 groups as if each used blocks like attention; the GDN
groups take one block per request, so the attention group may hold up to ~4x the reported tokens:
residency is counted in blocks, never from the reported tokens.

The rest of the peak (activations, the sampler's dummy batch, the runtime's own memory) is
`fixed + activation_bytes_per_token x max-num-batched-tokens`: the per-token part from the model's
shape (the MLP's gate_up output and its activation, four hidden-size buffers), the fixed part fitted to
the public DCU figure (28,224 tokens at TP1 / 0.95: 144-147 blocks, the middle taken) and checked
against the independent public TP2 figure (268,128 tokens) in the tests. `--kv-cache-memory-bytes`
replaces `available` (vLLM skips the profile then): `kv_memory_for` gives the value that makes another
card report a DCU card's blocks exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import ForgeError
from . import headroom as room_mod
from .headroom import BASELINE_UTILIZATION
from .shape import Shape, cdiv, kv_dtype_bytes

GiB = 1 << 30
MAX_MODEL_LEN = 32_768                    # locked in both rounds; the GDN block's length (mamba_block_size)
ACT_BASE_TOKENS = 4096                    # the organizers' --max-num-batched-tokens, where the fit was made


@dataclass(frozen=True)
class Card:
    name: str
    memory_bytes: int                     # what the runtime reports as the device's total memory
    note: str
    # one measured point (tp, utilization, KV dtype, reported tokens) the fixed part of the non-KV peak
    # is fitted to on this card; None: the DCU's public figure
    fitted_to: tuple | None = None
    language_model_only: bool = False     # how the servers of the fit ran (no vision tower loaded)


# The H200 of the GPU machine, measured 2026-12-04 (reports/plan/2026-12-04-h200-kv-check): the
# runtime's total memory (torch.cuda.mem_get_info) and vLLM's report at TP1, 0.90, bf16, with the
# harness's --language-model-only; the same servers at 0.95 reported 656,496 tokens with int8 and (2026-12-06)
# 333,200 with bf16 (the checks).
H200_MEMORY = 150_109_880_320
H200_FIT = (1, 0.90, "bf16", 304_976)

CARDS = {
    "dcu": Card("dcu", 64 * GiB, "Hygon BW-series DCU (gfx936), 64 GiB (contest-facts: ~64 GB; 0.95 of it "
                                 "leaves 28,224 tokens beside the weights, which only 64 GiB allows)"),
    "h200": Card("h200", H200_MEMORY, "NVIDIA H200 of the GPU machine: 150,109,880,320 bytes as the runtime "
                                      "reports them; its non-KV peak fitted to vLLM's report at TP1 / 0.90 / bf16 "
                                      "(304,976 tokens), servers of the GPU harness (--language-model-only)",
                 fitted_to=H200_FIT, language_model_only=True),
}

# The public figures (contest-facts "The final round"): (tp, utilization, reported tokens).
PUBLIC_DCU = {"tp1": (1, 0.95, 28_224), "tp2": (2, 0.95, 268_128)}


def card(name: str) -> Card:
    if name not in CARDS:
        raise ForgeError(f"card {name!r} is not one the planner knows", hint=f"--card {' | '.join(CARDS)}")
    return CARDS[name]


def activation_bytes_per_token(shape: Shape, tp: int) -> int:
    return 2 * (3 * shape.intermediate // tp + 4 * shape.hidden)


def _rest(shape: Shape, tp: int, fixed: int, mnbt: int) -> int:
    return fixed + activation_bytes_per_token(shape, tp) * mnbt


def fitted_fixed_overhead(shape: Shape, card_name: str = "dcu") -> int:
    """The fixed part of the non-KV peak that puts a card's fitted point in the middle of the block
    counts that report its tokens: the DCU's public TP1 bf16 figure at 0.95 (28,224 tokens), or the
    card's own measured point (`Card.fitted_to`)."""
    c = card(card_name)
    tp, util, kv_dtype, tokens = c.fitted_to or (*PUBLIC_DCU["tp1"][:2], "bf16", PUBLIC_DCU["tp1"][2])
    size, groups = shape.groups()[0], sum(shape.groups()[1:])
    block, page = shape.block_size(tp, kv_dtype), shape.page_bytes(tp, kv_dtype)
    lo = tokens // block * groups                       # the smallest num_blocks reporting `tokens`
    middle = lo + (groups - 1) / 2                      # lo .. lo + groups - 1 all report it
    kv = (middle + 0.5) * size * page
    requested = math.floor(c.memory_bytes * util)
    weights = shape.weight_bytes_per_rank(tp, vision=not c.language_model_only)
    return int(requested - weights - _rest(shape, tp, 0, ACT_BASE_TOKENS) - kv)


@dataclass(frozen=True)
class Capacity:
    tp: int
    kv_dtype: str
    card: str
    utilization: float
    max_num_batched_tokens: int
    weights_bytes: int
    rest_bytes: int                 # the non-KV peak beside the weights
    kv_bytes: int                   # available for the KV cache
    block_size: int
    page_bytes: int
    group_size: int
    attn_groups: int
    gdn_groups: int
    num_blocks: int
    reported_tokens: int            # vLLM's "GPU KV cache size: N tokens"
    usable_blocks: int
    max_model_len: int = MAX_MODEL_LEN

    def blocks_for(self, tokens: int) -> int:
        """Blocks one request of `tokens` tokens holds (all groups)."""
        return cdiv(tokens, self.block_size) * self.attn_groups + self.gdn_groups * cdiv(tokens, self.max_model_len)

    def resident(self, lengths: list[int]) -> int:
        """How many of these requests (taken in the given order) fit at once."""
        used = n = 0
        for t in lengths:
            used += self.blocks_for(t)
            if used > self.usable_blocks:
                break
            n += 1
        return n

    def kv_memory_for(self) -> int:
        """--kv-cache-memory-bytes that gives exactly this card's num_blocks on any card."""
        return self.num_blocks * self.group_size * self.page_bytes

    def as_dict(self) -> dict:
        return asdict(self)


def capacity(shape: Shape, tp: int = 1, kv_dtype: str = "bf16", card_name: str = "dcu", utilization: float = 0.95,
             max_num_batched_tokens: int = ACT_BASE_TOKENS, fixed_overhead: int | None = None,
             kv_cache_memory_bytes: int | None = None) -> Capacity:
    """One rank's KV cache (every rank of a TP group holds the same blocks; a DP replica is a TP1
    server of its own)."""
    kv_dtype_bytes(kv_dtype)
    if not 0 < utilization <= 1:
        raise ForgeError(f"--gpu-memory-utilization {utilization}: must be in (0, 1]", hint="e.g. 0.95")
    if max_num_batched_tokens < 1:
        raise ForgeError(f"--max-num-batched-tokens {max_num_batched_tokens}: must be at least 1")
    c = card(card_name)
    weights = shape.weight_bytes_per_rank(tp, vision=not c.language_model_only)
    fixed = fitted_fixed_overhead(shape, card_name) if fixed_overhead is None else fixed_overhead
    rest = _rest(shape, tp, fixed, max_num_batched_tokens)
    if kv_cache_memory_bytes is not None:
        kv = kv_cache_memory_bytes
    else:
        kv = math.floor(c.memory_bytes * utilization) - weights - rest
    size, attn_groups, gdn_groups = shape.groups()
    block, page = shape.block_size(tp, kv_dtype), shape.page_bytes(tp, kv_dtype)
    num_blocks = max(0, kv // page // size)
    groups = attn_groups + gdn_groups
    return Capacity(tp=tp, kv_dtype=kv_dtype, card=c.name, utilization=utilization,
                    max_num_batched_tokens=max_num_batched_tokens, weights_bytes=weights, rest_bytes=rest,
                    kv_bytes=kv, block_size=block, page_bytes=page, group_size=size, attn_groups=attn_groups,
                    gdn_groups=gdn_groups, num_blocks=num_blocks,
                    reported_tokens=num_blocks // groups * min(block, MAX_MODEL_LEN),
                    usable_blocks=max(0, num_blocks - 1))


def graph_pool_per_entry(shape: Shape, card_name: str = "dcu") -> float:
    """The CUDA-graph pool's bytes per captured batch entry on a card (model/headroom.py): on the DCU card,
    derived from the organizers' command running there at TP1 / 0.95 with this planner's blocks; on the
    GPU machine's cards, their measured envelope."""
    if card(card_name).fitted_to is not None:
        return room_mod.MEASURED_PER_ENTRY
    base = capacity(shape, card_name=card_name, utilization=BASELINE_UTILIZATION,
                    max_num_batched_tokens=room_mod.BASELINE_BATCHED)
    return room_mod.derived_per_entry(card(card_name).memory_bytes, base.num_blocks)


def room(shape: Shape, cap: Capacity, max_num_seqs: int) -> room_mod.Headroom:
    """What `cap`'s utilization leaves outside vLLM's budget on its card, and whether it holds the runtime,
    the margin and the graph pool of `max_num_seqs` (model/headroom.py)."""
    return room_mod.headroom(card(cap.card).memory_bytes, cap.utilization, max_num_seqs, cap.max_num_batched_tokens,
                             per_entry=graph_pool_per_entry(shape, cap.card), tp=cap.tp, num_blocks=cap.num_blocks)


def tier_fit(cap: Capacity, prompts: list[int], output_len: int, concurrency: int) -> dict:
    """How a tier's requests (prompt + output_len tokens each) fit one server of `cap` at
    `concurrency` requests in flight: resident counts for its largest and its median request, and
    `preempt`: "no" when the `concurrency` largest fit together, "yes" when even the smallest do not,
    else "possible"."""
    if concurrency < 1:
        raise ForgeError(f"concurrency {concurrency}: must be at least 1")
    lens = sorted(p + output_len for p in prompts)
    if not lens:
        raise ForgeError("a tier needs at least one request")
    k = min(concurrency, len(lens))
    worst = sum(cap.blocks_for(t) for t in lens[-k:])
    best = sum(cap.blocks_for(t) for t in lens[:k])
    largest, median = lens[-1], lens[len(lens) // 2]
    per = {"largest": cap.usable_blocks // cap.blocks_for(largest), "median": cap.usable_blocks // cap.blocks_for(median)}
    preempt = "no" if worst <= cap.usable_blocks else ("yes" if best > cap.usable_blocks else "possible")
    fits_one = cap.blocks_for(largest) <= cap.usable_blocks
    fit = {"concurrency": concurrency, "largest_tokens": largest, "median_tokens": median,
           "blocks_largest": cap.blocks_for(largest), "resident_largest": per["largest"],
           "resident_median": per["median"], "blocks_needed_worst": worst, "blocks_needed_best": best,
           "usable_blocks": cap.usable_blocks, "preempt": preempt if fits_one else "never fits"}
    return {**fit, "planned_max_num_seqs": planned_max_num_seqs(fit)}


def planned_max_num_seqs(fit: dict) -> int | None:
    """The --max-num-seqs that keeps a tier's requests resident, from `tier_fit`'s counts: the number
    of its largest requests that fit the cache at once, where the concurrency would preempt (vLLM
    admits up to max-num-seqs requests and, when their blocks run out, preempts by recompute: a cap at
    the resident count runs fewer at once and none is dropped); None where nothing preempts (no cap
    needed) or where even one request never fits (no cap helps)."""
    r = fit["resident_largest"]
    return r if fit["preempt"] in ("yes", "possible") and 1 <= r < fit["concurrency"] else None


def topology_fit(shape: Shape, tp: int, dp: int, prompts: list[int], output_len: int, concurrency: int,
                 **kw) -> dict:
    """A topology's capacity and fit: DP replicas are independent servers of tp ranks each, every one
    with ceil(concurrency / dp) requests in flight (vLLM's data-parallel balancer keeps them even)."""
    cap = capacity(shape, tp=tp, **kw)
    per = math.ceil(concurrency / dp)
    return {"tp": tp, "dp": dp, "capacity": cap.as_dict(), "per_replica_concurrency": per,
            "fit": tier_fit(cap, prompts, output_len, per)}


def planned_seqs(shape: Shape, tp: int, dp: int, prompts: list[int], output_len: int, concurrency: int,
                 **kw) -> int | None:
    """The planned --max-num-seqs of one configuration (tp, dp; `kw`: kv_dtype, card_name,
    utilization, max_num_batched_tokens as `capacity` takes them) for a tier's prompts at the client's
    `concurrency`: `planned_max_num_seqs` of one replica (each DP replica is its own scheduler with its
    own cache and --max-num-seqs); None when no cap is needed.

    Above the baseline's utilization a cap is needed even where nothing preempts: the memory outside vLLM's
    budget holds the CUDA-graph pool of a small --max-num-seqs only (model/headroom.py). Where nothing
    preempts, the cap is what the replica's cache holds of the tier's largest, up to the client's whole
    concurrency, not just a replica's share: vLLM's data-parallel balancer deals requests on load figures a
    moment old, so a replica can be sent more than its share for a while, and a cap at the share would queue
    them beside a replica with room. No cap is above what that memory holds. None: no cap needed (at or below the baseline), or none runs (that memory holds no
    --max-num-seqs, or TP2, not modelled above the baseline): the configuration is then ranked as not
    starting."""
    r = topology_fit(shape, tp, dp, prompts, output_len, concurrency, **kw)
    n = r["fit"]["planned_max_num_seqs"]
    if kw.get("utilization", BASELINE_UTILIZATION) <= BASELINE_UTILIZATION:
        return n
    most = room(shape, Capacity(**r["capacity"]), 1).max_seqs
    n = min(concurrency, r["fit"]["resident_largest"]) if n is None else n
    return min(n, most) if most else None
