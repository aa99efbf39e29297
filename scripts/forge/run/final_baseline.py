"""A run taken as the finals' baseline (`forge score --round final --baseline RUN`, `forge sweep --round final
--baseline RUN`): it must have been served and measured at the final round's baseline configuration,
configs/contest.yaml rounds.final.baseline (TP2/DP1, --max-num-seqs 128, --max-num-batched-tokens 4096,
--gpu-memory-utilization 0.95, the client at concurrency 10 in every tier). A weaker baseline would raise
every lift, score and picked winner.

What is read, per tier: the server's values and their sources as `forge serve --round final` recorded them
(the manifest's `servers_by_tier`, else the run's serve.json), and the concurrency the finals' client ran
(the tier's result, `max_concurrency`, with the manifest's `client_settings` naming where it came from). A
run whose server values are not recorded (a server forge did not start) is refused: nothing says it was the
baseline. Not read: a harness run's server arguments (harness_args: random weights, a fixed KV cache, the
side-by-side sizing, e2e-gpu's --capacity), which the harness sets on purpose and records with their
reasons; under `sweep --harness --kv-cache-memory-bytes dcu` the baseline's cache bytes are checked apart
(final_harness.check_baseline_run). A harness run whose server is the preliminary's one-card server
(`forge e2e-gpu --round final` without --finals-servers) has no final-round values to compare; its client's
concurrency is still checked. The profile (upstream, the normal path) is not checked: it is not one of the
baseline configuration's values, and `sweep --baseline-profile P` measures any profile at them."""

from __future__ import annotations

import re
from pathlib import Path

from .. import paths
from ..contest import rounds
from ..errors import ForgeError
from . import runs

WHERE = "configs/contest.yaml rounds.final.baseline"
_NONE = object()        # a value the record does not hold (None: vLLM's client ran without a concurrency limit)


def _object(path: Path) -> dict | None:
    """A record of the run read as an object (None where the file is absent); a damaged one is refused."""
    if not path.is_file():
        return None
    d = runs.read_json(path)
    if not isinstance(d, dict):
        raise ForgeError(f"{paths.rel(path)}: not a JSON object", hint="restore it from a copy of the run")
    return d


def _server(man: dict, serve: dict | None, tier: str) -> dict | None:
    by_tier = man.get("servers_by_tier")
    srv = by_tier.get(tier) if isinstance(by_tier, dict) else None
    return srv if isinstance(srv, dict) else serve


def _shown(v, key: str, want) -> str:
    """A recorded value as the refusal names it: a value of another type than the baseline's as the record
    holds it (128.0, '128', true: shown as 128 it would read as the baseline's own), null as unlimited only
    for the client's concurrency (vLLM's client without a limit)."""
    if v is _NONE:
        return "not recorded"
    if v is None:
        return "unlimited" if key == "concurrency" else "null"
    return f"{v:g}" if type(v) is type(want) else f"{v!r:.40}"


def differences(run: Path, rnd: rounds.Round, tiers: list[str], harness: bool) -> tuple[list[str], list[str], list[str]]:
    """(each value that differs from the baseline's, as 'OPTION GOT (SOURCE; the baseline's WANT) in tier(s)
    T', the sources those values came from, the tiers whose server values are not recorded)."""
    want = rnd.baseline.as_dict()
    man = _object(run / "manifest.json") or {}
    serve = _object(run / "serve.json")
    cs_all = man.get("client_settings") if isinstance(man.get("client_settings"), dict) else {}
    client = cs_all.get("tiers") if isinstance(cs_all.get("tiers"), dict) else {}
    names = {**{u.key: u.option for u in rnd.unlocked}, "concurrency": "client concurrency"}
    found: dict[tuple[str, str, str], list[str]] = {}
    unrecorded = []
    for t in tiers:
        got: dict = {}
        srv = _server(man, serve, t)
        settings, sources = (srv or {}).get("settings"), (srv or {}).get("sources")
        sources = sources if isinstance(sources, dict) else {}
        if isinstance(settings, dict):
            got = {k: (settings.get(k, _NONE), sources.get(k)) for k in names if k != "concurrency"}
        elif not harness:
            unrecorded.append(t)
        res = _object(run / f"{t}.json") or {}
        cs = client.get(t) if isinstance(client.get(t), dict) else {}
        got["concurrency"] = (res["max_concurrency"] if "max_concurrency" in res else cs.get("max_concurrency", _NONE),
                              cs.get("concurrency_from") or f"{t}.json max_concurrency")
        for k, (v, src) in got.items():
            if type(v) is not type(want[k]) or v != want[k]:
                found.setdefault((k, _shown(v, k, want[k]), src if isinstance(src, str) else "source not recorded"), []).append(t)
    diffs = [f"{names[k]} {v} ({src}; the baseline's {want[k]:g}) in {'tier' if len(ts) == 1 else 'tiers'} "
             f"{', '.join(ts)}" for (k, v, src), ts in found.items()]
    return diffs, sorted({src for _, _, src in found}), unrecorded


def check_run(run: Path, rnd: rounds.Round, tiers: list[str], harness: bool) -> None:
    """Refuse a final-round baseline run not served and measured at the finals' baseline configuration
    (see the module's docstring), before anything is written."""
    diffs, sources, unrecorded = differences(run, rnd, tiers, harness)
    if diffs:
        env = sorted({v for src in sources for v in re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", src)})
        raise ForgeError(f"baseline run {run.name} was not served at the finals' baseline configuration ({WHERE}): "
                         + "; ".join(diffs),
                         hint=(f"unset {', '.join(env)} and " if env else "")
                         + "measure the baseline at the round's baseline values (forge serve --round final --profile "
                           "upstream --tier T, then bench-all-tiers --round final, per tier), or let the sweep "
                           "measure it (--baseline-profile upstream)")
    if unrecorded:
        raise ForgeError(f"baseline run {run.name}: no record of its server's values for tier(s) {', '.join(unrecorded)} "
                         f"(its manifest's servers_by_tier and serve.json hold no final-round settings), so nothing "
                         f"says it was served at the finals' baseline configuration ({WHERE})",
                         hint="measure the baseline with a server forge starts: forge serve --round final --profile "
                              "upstream --tier T, then bench-all-tiers --round final, per tier")


def check_scored(run: Path, base: dict, contest: dict) -> None:
    """`forge score`'s baseline run (`base`: score.baseline_from_run's), checked where it is of a later round
    than the preliminary (whose baseline configuration is locked), over every tier."""
    if base.get("round") not in (None, rounds.DEFAULT_ROUND):
        rnd = rounds.load_round(contest, base["round"])
        check_run(run, rnd, list(rnd.tier_order), bool(base.get("harness")))
