"""What `forge sweep --round final --sweep-id ID` resumes from, checked before anything is written or started:
the sweep's record (reports/sweeps/<ID>/sweep.json: the same space and settings, its own id, its tiers'
rankings as the sweep wrote them) and the tier score of every configuration it measured (tier-score.json,
final_pick.read_tier_score). A damaged or edited record is refused naming the file and key, never a
traceback, and never a winner picked from it."""

from __future__ import annotations

from pathlib import Path

from .. import paths
from ..contest import rounds
from ..errors import ForgeError
from ..model.finals import finite
from . import final_pick, final_space, runs

RESTORE = "restore it, or start a new sweep (omit --sweep-id)"


def state(sdir: Path, sweep_id: str, record: dict, rnd: rounds.Round) -> dict:
    """The sweep's record: a new one, or the recorded one when it was started with the same space and
    settings (a resume); another space under the same id, or a record of another sweep, is refused."""
    sj = sdir / "sweep.json"
    if not sj.is_file():
        if sdir.exists() and (not sdir.is_dir() or any(sdir.iterdir())):      # its files would be replaced
            raise ForgeError(f"{paths.rel(sdir)}: holds files but no sweep record (sweep.json)",
                             hint="give another --sweep-id (or omit it for a new one), or move that folder away")
        return {"sweep": sweep_id, **record, "tiers": {}, "created": runs.now_iso()}
    st = runs.read_json(sj)
    if not isinstance(st, dict):
        raise ForgeError(f"{paths.rel(sj)}: not a sweep record", hint=RESTORE)
    if st.get("sweep") != sweep_id:          # resumed under its folder's id, its winners recorded under the other
        raise ForgeError(f"{paths.rel(sj)}: key 'sweep': {st.get('sweep')!r:.60} is not the id of its folder "
                         f"({sweep_id})", hint=RESTORE)
    check_space(st.get("space"), record["space"], sj, sweep_id, rnd)
    diff = [k for k in record if k != "space" and st.get(k) != record[k]]
    if diff:
        raise ForgeError(f"sweep {sweep_id} was started with other {', '.join(diff)} ({paths.rel(sj)})",
                         hint="resume it with the same options, or start a new sweep (omit --sweep-id)")
    check_tiers(st, sj, rnd)
    return st


def recorded_space(space, sj: Path, rnd: rounds.Round) -> dict:
    """The space a record holds, canonical (final_space.canonical_space): as this tool writes it, or as the
    options' text (None: the default), as the sweep recorded it before; a damaged one is refused naming its key."""
    if not isinstance(space, dict) or sorted(space) != sorted(final_space.SPACE_OPTIONS):
        raise ForgeError(f"{paths.rel(sj)}: key 'space': not the sweep's space "
                         f"({', '.join(final_space.SPACE_OPTIONS)})", hint=RESTORE)
    out = {}
    for k, v in space.items():
        if isinstance(v, list):
            out[k] = v
            continue
        try:
            if v is not None and not isinstance(v, str):
                raise ForgeError(f"{v!r:.60} is neither a list of values nor the option's text")
            out[k] = final_space.canonical(k, final_space.option_values(rnd, k, v, repeats=True))
        except ForgeError as e:
            raise ForgeError(f"{paths.rel(sj)}: key 'space.{k}': {e.message}", hint=RESTORE) from None
    return out


def check_space(space, now: dict, sj: Path, sweep_id: str, rnd: rounds.Round) -> None:
    """A resume searches the space the sweep was started with, however its options are written (the values
    compared, not the text: a default left out or given, tp2 or tp2dp1, 0.9 or 0.90, in any order); another space
    is refused naming each option that differs and what the record holds."""
    was = recorded_space(space, sj, rnd)
    diff = [k for k in final_space.SPACE_OPTIONS if was[k] != now[k]]
    if diff:
        named = {k: f"{final_space.option_name(k)} {final_space.space_text(was[k])}" for k in diff}
        raise ForgeError(f"sweep {sweep_id} was started with another space ({paths.rel(sj)}): "
                         + "; ".join(f"{named[k]} in its record, {final_space.space_text(now[k])} now" for k in diff),
                         hint=f"resume it with the same values ({' '.join(named.values())}), or start a new sweep "
                              "(omit --sweep-id)")


def check_tiers(st: dict, sj: Path, rnd: rounds.Round) -> None:
    """A resumed record's tiers as the sweep reads them: a damaged or edited one is named, never a traceback,
    and a configuration it holds is served only as the round allows."""
    def bad(key: str, what: str) -> ForgeError:
        return ForgeError(f"{paths.rel(sj)}: key '{key}': {what}", hint=RESTORE)
    if not isinstance(st.get("tiers"), dict):
        raise bad("tiers", "expected an object, tier -> its record")
    for tier, ts in st["tiers"].items():
        if tier not in rnd.tier_order or not isinstance(ts, dict) or not isinstance(ts.get("ranking", []), list) \
                or not isinstance(ts.get("winner") or {}, dict):
            raise bad(f"tiers.{tier}", "not a tier of the final round with its ranking (a list) and winner")
        for i, r in enumerate(ts.get("ranking", [])):
            key = f"tiers.{tier}.ranking[{i}]"
            ok = isinstance(r, dict) and isinstance(r.get("predicted"), dict)
            measured, predicted = ([r.get("tok_s"), r.get("score")], r["predicted"].get("tok_s")) if ok else ([], None)
            if not ok or any(v is not None and not finite(v) for v in measured) \
                    or (predicted is not None and (isinstance(predicted, bool) or not isinstance(predicted, (int, float)))) \
                    or not isinstance(r.get("outcome", ""), str):
                raise bad(key, "not a ranked configuration (candidate, predicted, outcome, tok/s, score)")
            cand = final_space.from_record(rnd, r.get("candidate"), f"{paths.rel(sj)}: key '{key}.candidate'")
            if r.get("key") != cand.key:
                raise bad(f"{key}.key", f"{r.get('key')!r} is not its configuration's name ({cand.key})")


def score_file(sweep_id: str, tier: str, key: str) -> Path:
    """A configuration's tier score: tier-score.json in its run folder, reports/runs/<sweep>-<tier>-<key>."""
    return runs.run_dir(f"{sweep_id}-{tier}-{key}", create=False) / final_pick.TIER_SCORE


def check_scores(st: dict, sweep_id: str, tiers: list[str], top: int) -> None:
    """Every tier score a resume would keep (the served configurations of `tiers`), read and checked before a
    server starts: one damaged after its measurement is refused naming it (final_pick.read_tier_score)."""
    for tier in tiers:
        for r in st["tiers"].get(tier, {}).get("ranking", [])[:top]:
            f = score_file(sweep_id, tier, r["key"])
            if not str(r.get("outcome", "")).startswith("failed to start") and f.is_file():
                final_pick.read_tier_score(f, tier)
