"""The final round's variables a preliminary server or client does not read: named when set, so a team
that exported its per-tier environment and forgot `--round final` sees that its values were not taken."""

from __future__ import annotations

import os
from typing import Mapping

from .rounds import DEFAULT_ROUND, ROUNDS, env_names, load_round


def unread_variables(contest: dict, environ: Mapping[str, str] | None = None) -> list[str]:
    """The other rounds' variables (unlocked options, their per-tier forms, the tiers' concurrency) set
    in `environ`: a preliminary server and client read none of them, so a caller says so."""
    environ = os.environ if environ is None else environ
    names = set()
    for rnd in (load_round(contest, n) for n in ROUNDS if n != DEFAULT_ROUND and n in (contest.get("rounds") or {})):
        for tier in rnd.tier_order:
            names.update(v for u in rnd.unlocked for v in env_names(u, tier))
            names.add(rnd.client(tier).concurrency_env or "")
    return sorted(n for n in names if n and environ.get(n, "") != "")


def unread_note(contest: dict, round_name: str | None, who: str, how: str) -> str | None:
    """What a preliminary `who` (its server, its client) says of the final round's variables set in the
    environment, which it does not read (None: none set, or not the preliminary); `how`: the option that
    reads them."""
    if (round_name or DEFAULT_ROUND) != DEFAULT_ROUND:
        return None
    unread = unread_variables(contest)
    return (f"{', '.join(unread)} set: the final round's variables; the {DEFAULT_ROUND} round's {who} reads none of "
            f"them ({how})") if unread else None
