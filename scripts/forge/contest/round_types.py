"""The types of forge.contest.rounds (re-exported there, which is where to import them from): one
round (`Round`), an option it unlocks with its bounds (`Unlocked`), its client for one tier
(`TierClient`) and one tier's configuration (`Settings`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..errors import ForgeError
from . import rules as contest_mod


def _num(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


@dataclass(frozen=True)
class Unlocked:
    key: str                     # a Settings field
    option: str                  # the engine option it fills
    env: str                     # the start script's variable
    type: str                    # "int" | "float"
    choices: tuple | None
    min: float | None
    max: float | None
    rule: str
    names_ours: bool             # the variable's name is ours (the finals' own is unpublished)

    def bounds(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        return f"{_num(self.min)}..{_num(self.max)}"


@dataclass(frozen=True)
class TierClient:
    tier: str
    concurrency: int
    request_rate: float          # requests per second; inf: every request at once
    output_len: int
    num_prompts: int | None      # None: every prompt of the tier file
    warmups: int
    concurrency_env: str | None  # the client's variable for this tier's concurrency (None: locked)


@dataclass(frozen=True)
class Settings:
    tensor_parallel_size: int
    data_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    concurrency: int

    @property
    def cards(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Round:
    name: str
    source: str
    cards: int
    command: str
    model_placeholder: str
    organizers_rule: str
    unlocked: tuple[Unlocked, ...]
    topologies: tuple[tuple[int, int], ...]
    allowed_options: tuple[dict, ...]
    clients: Mapping[str, TierClient]
    baseline: Settings
    tier_order: tuple[str, ...]
    concurrency_bounds: tuple[int, int, str] | None   # (min, max, rule); None: concurrency is locked

    def client(self, tier: str) -> TierClient:
        if tier not in self.clients:
            raise ForgeError(f"tier {tier!r} is not a tier of the {self.name} round",
                             hint=f"tiers: {', '.join(self.tier_order)}")
        return self.clients[tier]

    def unlocked_option(self, option: str) -> Unlocked | None:
        base = contest_mod.option_base(option)
        return next((u for u in self.unlocked if u.option == base), None)
