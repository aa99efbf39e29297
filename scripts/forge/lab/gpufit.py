"""Whether the servers of an end-to-end run fit the GPU they share, checked before anything is written or
started (forge.lab.preflight): the card's total memory as its management tool reports it (nvidia-smi,
hy-smi or rocm-smi, the tools `device_name` reads), and for every server the share vLLM gives it
(--gpu-memory-utilization of that total) and what it puts there (its weights per rank, the capacity
planner's figure, and the fixed KV cache of --kv-cache-memory-bytes).

vLLM does not hold a fixed KV cache to the share ("This does not respect the gpu_memory_utilization
config", vllm/v1/worker/gpu_worker.py): a cache larger than the share leaves the weights allocates past it,
into the memory of the server beside it, and fails minutes later. Two checks, per GPU the servers share
(each server puts one rank on each of the first tensor x data-parallel visible cards, so the first card
holds a rank of every server):
  - the shares fit the card: servers x utilization <= 1 (vLLM checks a server's share against the free
    memory only at its own start, and servers that start at once all see the card empty);
  - each server's KV cache fits its share: kv bytes <= floor(total x utilization) - weights per rank.
The memory a server needs beyond these (activations, CUDA graphs, the runtime: about 1 GiB on an H200) is
not counted: the check refuses only what cannot fit. A machine whose tool does not answer is not checked.
Also here: whether a batch profile's requests fit such a fixed KV cache at once (`kv_holds_batch`). The
cards' memory (`card_memory`) is read by forge.contest.cards.
"""

from __future__ import annotations

import math
from pathlib import Path

from .. import options
from ..contest.cards import SMI, card_memory  # noqa: F401  (gpufit's API since before they moved)
from ..errors import ForgeError
from ..model import capacity as capacity_mod
from ..model import shape as shape_mod


def check_fit(launches: dict[str, list[str]], utilization: float, kv_bytes: int | None, model: Path,
              memory: tuple[list[int], str] | None) -> dict:
    """Refuse servers (`launches`: each one's command line, all on the same cards) that the GPU cannot hold
    side by side; returns what was checked, for the run's record."""
    if memory is None:
        return {"checked": False, "why": "no nvidia-smi, hy-smi or rocm-smi answered: the GPU's memory unknown"}
    totals, source = memory
    n = len(launches)
    ranks = {name: (options.last_int(a, "--tensor-parallel-size", "-tp") or 1, options.last_int(a, "--data-parallel-size", "-dp") or 1)
             for name, a in launches.items()}
    cards = max(tp * dp for tp, dp in ranks.values())
    if len(totals) < cards:
        return {"checked": False, "why": f"{len(totals)} card(s) visible ({source}), the servers use {cards}: "
                                         "the cards' own check refuses that"}
    total = min(totals[:cards])
    rec = {"checked": True, "source": source, "card_bytes": total, "servers": n, "utilization": utilization,
           "kv_cache_memory_bytes": kv_bytes}
    who = f"{n} servers side by side ({', '.join(launches)})" if n > 1 else f"the {next(iter(launches))} server"
    if n * utilization > 1 + 1e-9:
        most = math.floor(100 / n) / 100
        raise ForgeError(f"--gpu-memory-utilization {utilization:g}: {who} each take that share of the GPU, "
                         f"{n * utilization:.2f} of its {total:,} bytes ({source}) in all",
                         hint=f"give --gpu-memory-utilization {most:g} or less, or fewer --profiles")
    if not kv_bytes:
        return rec
    share = math.floor(total * utilization)
    try:
        shape = shape_mod.load_shape(model)
    except ForgeError:                    # a model the planner does not model: the share alone
        shape = None
    rec["per_server"] = {}
    for name, argv in launches.items():
        tp = ranks[name][0]
        weights = shape.weight_bytes_per_rank(tp, vision="--language-model-only" not in argv) if shape else 0
        room = share - weights
        rec["per_server"][name] = {"tp": tp, "weights_bytes": weights, "kv_room_bytes": room}
        if kv_bytes > room:
            held = (f"and its weights take {weights:,} bytes per rank (TP{tp}, the capacity planner's figure)"
                    if shape else "(its weights not counted: the planner does not model this model)")
            raise ForgeError(f"--kv-cache-memory-bytes {kv_bytes:,}: {who} each get --gpu-memory-utilization "
                             f"{utilization:g} of the GPU's {total:,} bytes ({source}), {share:,} bytes, {held}; "
                             f"{max(room, 0):,} bytes are left for {name}'s KV cache",
                             hint=(f"give --kv-cache-memory-bytes {room} or less, or " if room >= 1 << 28 else "give ")
                             + f"a larger --gpu-memory-utilization (at most {math.floor(100 / n) / 100:g} for {n} "
                               f"server{'s' if n > 1 else ''}), or fewer --profiles")
    return rec


def kv_holds_batch(argv: list[str], kv_bytes: int | None, model: Path, tokens: int, decode_steps: int, batch: int,
                   who: str) -> dict | None:
    """A batch profile's B requests of `tokens` + `decode_steps` tokens against a fixed KV cache, in the
    capacity planner's blocks (every group's: a request holds attention blocks for its tokens and one GDN
    block per group), the requests split evenly over the data-parallel ranks: refused where they never fit
    at once (they would wait for each other and never decode together). Where the cache is sized by vLLM
    (no --kv-cache-memory-bytes), its KV dtype or the model is one the planner does not know, the server's
    log is read instead once it runs (batch_profile.refuse_unfit); returns what was checked, or None."""
    kv_dtype = shape_mod.served_kv_dtype(argv)
    if not kv_bytes or kv_dtype is None:
        return None
    try:
        shape = shape_mod.load_shape(model)
        tp = options.last_int(argv, "--tensor-parallel-size", "-tp") or 1
        cap = capacity_mod.capacity(shape, tp=tp, kv_dtype=kv_dtype, kv_cache_memory_bytes=kv_bytes)
    except ForgeError:
        return None
    dp = options.last_int(argv, "--data-parallel-size", "-dp") or 1
    per_rank = math.ceil(batch / dp)
    need = per_rank * cap.blocks_for(tokens + decode_steps)
    if need > cap.usable_blocks:
        raise ForgeError(f"--profile-batch {batch} --profile-prefill {tokens} --profile-decode {decode_steps}: "
                         f"{who}'s KV cache (--kv-cache-memory-bytes {kv_bytes}, {kv_dtype}, TP{tp}) holds "
                         f"{cap.usable_blocks} blocks of {cap.block_size} tokens (the capacity planner's count), and "
                         f"{per_rank} requests of {tokens} + {decode_steps} tokens"
                         + (" per data-parallel rank" if dp > 1 else "") + f" need {need}: they never decode "
                         "together", hint="lower --profile-batch or --profile-prefill, or give the servers a larger "
                                          "KV cache (--kv-cache-memory-bytes)")
    return {"blocks_needed": need, "usable_blocks": cap.usable_blocks}
