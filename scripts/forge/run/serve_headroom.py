"""What `forge serve` says of a final-round start above 0.95 whose --max-num-seqs the memory left outside
vLLM's budget may not hold (scripts/forge/model/headroom.py: the runtime's allowance, a margin, the
CUDA-graph pool): said, not refused, as the allowance is a judgement and the card is the test.

The card is the smallest the server will see, as its management tool reports it: nvidia-smi's cards are
priced with the GPU machine's measured graph pool; hy-smi's or rocm-smi's, or a dry run's, or where no tool
answers, as a DCU card (the pool derived from the organizers' command running there). The fix names the
variable that gave each value (the tier's own or the round's, as `forge serve` took it) and the largest
--max-num-seqs that fits."""

from __future__ import annotations

import os

from .. import ui
from ..contest import rounds
from ..contest.cards import card_memory, ranks_cards
from ..model import capacity as capacity_mod
from ..model import headroom as headroom_mod
from ..model.shape import load_shape, served_kv_dtype


def _var(rendered: dict, rnd: rounds.Round, key: str) -> str:
    """The variable a team sets for `key` on this tier: the one that gave the value, else the tier's own."""
    src = rendered["sources"].get(key, "")
    if src.startswith("env "):
        return src[len("env "):]
    return rounds.env_names(next(u for u in rnd.unlocked if u.key == key), rendered["tier"])[0]


def say_headroom(rendered: dict, rnd: rounds.Round, probe: bool = True) -> None:
    """Warn where `rendered` (profiles.render_round's) starts above the baseline utilization with needs its
    card's outside memory does not hold; `probe`: ask the card's tool (not on a dry run)."""
    s = rendered.get("settings")
    if not s or s["gpu_memory_utilization"] <= headroom_mod.BASELINE_UTILIZATION:
        return
    seen = card_memory({**os.environ, **rendered["env"]}) if probe else None
    shape = load_shape()
    # nvidia-smi's cards: the GPU machine's measured pool; any other tool's, or none: a DCU card's
    name = "h200" if seen and seen[0] and seen[1].startswith("nvidia-smi") else "dcu"
    cards = ranks_cards(seen, s["tensor_parallel_size"] * s["data_parallel_size"]) if seen else []
    memory = min(cards) if cards else capacity_mod.CARDS["dcu"].memory_bytes
    where = f"{seen[1]}: {memory / headroom_mod.GiB:.1f} GiB" if cards else "a DCU card"
    per_entry = capacity_mod.graph_pool_per_entry(shape, name)
    blocks = capacity_mod.capacity(shape, kv_dtype=served_kv_dtype(rendered["engine_args"]) or "bf16",
                                   utilization=s["gpu_memory_utilization"],
                                   max_num_batched_tokens=s["max_num_batched_tokens"]).num_blocks
    h = headroom_mod.headroom(memory, s["gpu_memory_utilization"], s["max_num_seqs"],
                              s["max_num_batched_tokens"], per_entry=per_entry, tp=s["tensor_parallel_size"],
                              num_blocks=blocks)
    if h.fits:
        return
    util_var = _var(rendered, rnd, "gpu_memory_utilization")
    fix = (f"set {_var(rendered, rnd, 'max_num_seqs')} to {h.max_seqs} or less, or " if h.max_seqs else "set ")
    ui.warn(f"tier {rendered['tier']} ({where}): {h.why()}; the server may fail to start, or to run a prefill "
            f"once its CUDA graphs are captured: {fix}{util_var} to {headroom_mod.BASELINE_UTILIZATION:g} or less")
