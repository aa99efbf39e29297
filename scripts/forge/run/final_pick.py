"""What `forge sweep --round final` measures a configuration by, and what it keeps: one tier's score
against the final round's baseline with the SLA (the preliminary's formula and limits, per tier), and
the winner per tier written as the submission's per-tier environment (the tier-environment file).

A configuration's tier score (`tier-score.json` in its run folder; its presence marks the
configuration finished): lift = tok/s / baseline tok/s - 1, the tier's formula score weight x (floor +
gain x (1 - exp(-rate x lift))), zeroed when its TTFT P99 exceeds ratio x the baseline tier's, when its
TPOT P99 exceeds ratio x the baseline's pooled TPOT P99 (the tier's own P99 when the baseline run does
not hold every tier: the sweep serves one tier at a time, so the pooled value of the submission is
checked by `forge score --round final` over the three tiers), or when completion is below the minimum.

The tier-environment file (default reports/final-round/tier-environment.json; `forge report` and
`forge submission --round final --tier-env FILE` list it): {"round", "tiers": {tier: {"environment":
the start script's variables and the tier's CONCURRENCY_<tier>, "engine_options": what the profile adds
(--kv-cache-dtype), "settings", "max_num_seqs_planned" (the max-num-seqs is the capacity planner's), "profile",
"run", "sweep", "tok_s", "lift", "score", "baseline", "harness" (true or false: a harness sweep's winner is
never shipped)}}}; "tok_s", "lift" and "score" are finite numbers where given, and each environment value is
taken as written (one with spaces around it, or an empty one, is refused: the finals' script would get it so).
Written atomically; a tier recorded there by another sweep is replaced only with --force."""

from __future__ import annotations

from pathlib import Path

from .. import options, paths, records
from ..contest import rounds
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..model.finals import finite
from . import final_baseline, results, runs, score
from .final_space import KV_DTYPES, Candidate

TIER_SCORE = "tier-score.json"


def tier_env_path(arg: str | None = None) -> Path:
    """The tier-environment file: `arg`, else final-round/tier-environment.json beside the runs folder
    (reports/ by default)."""
    return Path(arg) if arg else runs.runs_root().parent / "final-round" / "tier-environment.json"


def baseline_tiers(run: Path, contest: dict, round_name: str, tiers: list[str]) -> dict:
    """{tier: {tok_s, ttft_p99_ms, tpot_limit_base_ms, tpot_from}} of a baseline run of `round_name`
    holding every tier in `tiers`; a run of another round, one missing a tier, or one not served and measured
    at the round's baseline configuration (final_baseline) is refused."""
    loaded = score.load_run(run, contest, partial=True)
    if loaded["round"] != round_name:
        raise ForgeError(f"baseline run {run.name} was measured in the {loaded['round']} round; the sweep is of the "
                         f"{round_name} round: a run is scored only against a baseline of its own round",
                         hint=f"give a baseline run of the {round_name} round (bench-all-tiers --round {round_name})")
    missing = [t for t in tiers if t not in loaded["tiers"]]
    if missing:
        raise ForgeError(f"baseline run {run.name} has no result for tier(s) {', '.join(missing)}",
                         hint=f"finish it: forge bench-all-tiers --round {round_name} --run-id {run.name}")
    if round_name != rounds.DEFAULT_ROUND:
        final_baseline.check_run(run, rounds.load_round(contest, round_name), tiers, loaded["harness"])
    pooled = loaded["tpot_p99_pooled_ms"]
    out = {}
    for t in tiers:
        m = loaded["tiers"][t]
        m = {**m, "harness": loaded["harness"]}
        if not results.finite_positive(m["tok_s"]):
            raise ForgeError(f"baseline run {run.name}: tier {t} has {m['tok_s']} tok/s; a baseline must serve the tier",
                             hint="give a baseline run whose tiers completed")
        out[t] = {"tok_s": m["tok_s"], "ttft_p99_ms": m["ttft_p99_ms"],
                  "tpot_base_ms": pooled if pooled is not None else m["tpot_p99_ms"],
                  "tpot_from": "pooled over the baseline's tiers" if pooled is not None else f"tier {t} alone",
                  "run": str(run), "harness": m["harness"]}
    return out


def tier_score(contest: dict, rdir: Path, tier: str, base: dict) -> dict:
    """One configuration's tier against the baseline tier (see the module's docstring)."""
    sc = contest["scoring"]
    t = next(x for x in contest["tiers"] if x["name"] == tier)
    loaded = score.load_run(rdir, contest, partial=True)
    if tier not in loaded["tiers"]:
        raise ForgeError(f"run {rdir.name}: tier {tier} has no result", hint="the configuration's benchmark did not finish")
    if loaded["harness"] != bool(base.get("harness")):
        raise ForgeError(f"run {rdir.name} is {'a' if loaded['harness'] else 'not a'} harness run (random weights, "
                         f"end-of-text ignored) and the baseline {base['run']} is {'' if base.get('harness') else 'not '}"
                         "one: a run is scored only against a baseline measured like it",
                         hint="measure both with --harness, or both without")
    m = loaded["tiers"][tier]
    lift, s = score.tier_score(sc, t["weight"], m["tok_s"], base["tok_s"])
    reasons = []
    ttft_lim = sc["ttft_p99_max_ratio"] * base["ttft_p99_ms"] if base.get("ttft_p99_ms") else None
    if ttft_lim is not None and (m["ttft_p99_ms"] is None or m["ttft_p99_ms"] > ttft_lim):
        reasons.append(f"TTFT P99 {m['ttft_p99_ms'] or 0:.0f} ms > {ttft_lim:.0f} ms")
    tpot_lim = sc["tpot_p99_max_ratio"] * base["tpot_base_ms"] if base.get("tpot_base_ms") else None
    if tpot_lim is not None and (m["tpot_p99_ms"] is None or m["tpot_p99_ms"] > tpot_lim):
        reasons.append(f"TPOT P99 {m['tpot_p99_ms'] or 0:.2f} ms > {tpot_lim:.2f} ms ({base['tpot_from']})")
    if m["completion"] < sc["min_completion"]:
        reasons.append(f"completion {100 * m['completion']:.1f} % < {100 * sc['min_completion']:.0f} %")
    return {"tier": tier, "tok_s": m["tok_s"], "baseline_tok_s": base["tok_s"], "lift": lift, "weight": t["weight"],
            "formula_score": s, "contribution": 0.0 if reasons else s, "zeroed_by": reasons,
            "ttft_p99_ms": m["ttft_p99_ms"], "ttft_p99_limit_ms": ttft_lim, "tpot_p99_ms": m["tpot_p99_ms"],
            "tpot_p99_limit_ms": tpot_lim, "completed": m["completed"], "failed": m["failed"],
            "baseline": base["run"], "run": str(rdir), "harness": loaded["harness"]}


def read_tier_score(path: Path, tier: str) -> dict:
    """A configuration's tier score (tier_score's record, `tier-score.json`), checked as the sweep reads it on
    a resume: an object of `tier`, its tok/s, lift and contribution finite numbers (tok/s and contribution
    >= 0), what zeroed it a list of reasons, its baseline a run. A damaged one is refused naming the file
    and key: a NaN (or a negative tok/s) was picked as the winner and written into the tier-environment file."""
    d = runs.read_json(path)
    hint = (f"delete it: the resume scores the configuration again from its result ({tier}.json beside it; delete "
            "that too to measure it again), or start a new sweep (omit --sweep-id)")
    if not isinstance(d, dict):
        raise ForgeError(f"{paths.rel(path)}: a JSON {type(d).__name__}, not a tier score (an object)", hint=hint)
    # a negative tok/s or contribution (no measurement gives one) was picked as the winner and written out
    at_least_0 = lambda v: finite(v) and v >= 0             # noqa: E731
    checks = (("tier", lambda v: v == tier, f"the tier {tier!r}"), ("tok_s", at_least_0, "a finite number >= 0"),
              ("lift", finite, "a finite number"), ("contribution", at_least_0, "a finite number >= 0"),
              ("zeroed_by", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of reasons"),
              ("baseline", lambda v: isinstance(v, str) and v != "", "the baseline run"),
              ("harness", lambda v: isinstance(v, bool), "true or false"))
    for key, ok, want in checks:
        if key not in d:
            raise ForgeError(f"{paths.rel(path)}: key '{key}' is missing", hint=hint)
        if not ok(d[key]):
            raise ForgeError(f"{paths.rel(path)}: key '{key}': {d[key]!r:.60} is not {want}", hint=hint)
    return d


def winner(scored: list[tuple[Candidate, str, dict]]) -> tuple[Candidate, str, dict] | None:
    """The best configuration of a tier: within the SLA, highest contribution, then tok/s; None when
    none is within it."""
    ok = [x for x in scored if not x[2]["zeroed_by"]]
    return max(ok, key=lambda x: (x[2]["contribution"], x[2]["tok_s"])) if ok else None


def unmeasured(st: dict, tiers: list[str]) -> ForgeError | None:
    """The sweep's failure (exit 1) where a searched tier has no configuration measured, each one served having
    failed to start (recorded, and not retried by a resume): each with its error and its server log; None
    where every tier measured one at least (no winner within the SLA is a result: the baseline's values stay)."""
    bad: dict[str, list[str]] = {}
    for t in tiers:
        served = (st["tiers"].get(t) or {}).get("ranking", [])[:st["top"]]
        if served and not any(r.get("outcome") == "measured" for r in served):
            bad[t] = [f"{r['key']} {r.get('outcome') or 'not served'}" + (
                f" (its log: {paths.rel(runs.run_dir(r['run'], create=False) / 'server.log')})" if r.get("run") else "")
                for r in served]
    if not bad:
        return None
    return ForgeError(f"sweep {st['sweep']} measured no configuration of tier(s) {', '.join(bad)}: "
                      + "; ".join(f"tier {t}: {', '.join(x)}" for t, x in bad.items()),
                      hint="read the server logs named and fix the cause, then start a new sweep (omit --sweep-id): "
                           f"sweep {st['sweep']} keeps these configurations as failed to start and does not retry "
                           "them", exit_code=1)


def entry(rnd: rounds.Round, tier: str, cand: Candidate, run_id: str, sweep_id: str, res: dict, profile: str) -> dict:
    bad = [k for k in ("tok_s", "lift", "contribution") if not finite(res.get(k))]
    if bad:                     # the tier-environment file's reader refuses it: never written
        raise ForgeError(f"run {run_id}: tier {tier}'s {', '.join(bad)} {res.get(bad[0])!r:.40} is not a finite number",
                         hint=f"delete its {TIER_SCORE}: a resume scores the configuration again from its result")
    settings = rounds.check_settings(rnd, cand.settings_values(), where=f"candidate {cand.key}")
    kv = KV_DTYPES[cand.kv_dtype]
    return {"environment": rounds.tier_env(rnd, tier, settings),
            "engine_options": {"--kv-cache-dtype": kv} if kv else {},
            "kv_dtype": cand.kv_dtype, "settings": settings.as_dict(), "max_num_seqs_planned": cand.planned,
            "profile": profile, "run": run_id,
            "sweep": sweep_id, "tok_s": res["tok_s"], "lift": res["lift"], "score": res["contribution"],
            "baseline": res["baseline"], "harness": bool(res.get("harness"))}


def read_tier_env(path: Path) -> dict:
    """The tier-environment file, checked: {"round", "tiers": {tier: {"environment": {VAR: value}, ...}}}."""
    d = runs.read_json(path)
    ok = isinstance(d, dict) and isinstance(d.get("tiers"), dict) and all(
        isinstance(e, dict) and isinstance(e.get("environment"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in e["environment"].items())
        for e in d["tiers"].values())
    if not ok:
        raise ForgeError(f"{paths.rel(path)}: not a tier-environment file ({{\"round\", \"tiers\": {{tier: "
                         "{\"environment\": {VAR: value}}}}})",
                         hint="give the file forge sweep --round final wrote, or restore it")
    if d.get("round") != "final":     # the environment of another round (or of none) was shipped as the finals'
        raise ForgeError(f"{paths.rel(path)}: key 'round': {d.get('round')!r}, not the final round's tier environment",
                         hint="give the file forge sweep --round final wrote (its 'round' is \"final\"), or restore it")
    # what the submission ships as the team's environment per tier is what the finals' script and client take
    rnd = rounds.load_round(contest_mod.load_contest(), "final")
    kv = sorted(v for v in KV_DTYPES.values() if v)
    for tier, e in d["tiers"].items():
        where = f"{paths.rel(path)}: key 'tiers.{tier}"
        if tier not in rnd.tier_order:
            raise ForgeError(f"{where}': not a tier of the final round", hint=f"tiers: {', '.join(rnd.tier_order)}")
        want = sorted({u.env for u in rnd.unlocked} | {rnd.client(tier).concurrency_env})
        if sorted(e["environment"]) != want:
            raise ForgeError(f"{where}.environment': sets {', '.join(sorted(e['environment'])) or 'nothing'}; the finals' "
                             f"start script and client read {', '.join(want)}", hint="give each of them, and no other")
        for var, v in e["environment"].items():
            # the bounds read a value stripped, as in the process environment, and an empty one as unset; the
            # file's value is shipped as written (MAX_NUM_SEQS=' 32', GPU_MEMORY_UTILIZATION=''): refused, as
            # the file's other keys are taken only as the sweep writes them
            if not v or v != v.strip():
                raise ForgeError(f"{where}.environment.{var}': {v!r:.60} is "
                                 + ("empty" if not v.strip() else "not the value alone (spaces around it)")
                                 + ": the finals' start script and client would get it as written",
                                 hint=f"write {var}'s value alone"
                                      + (f", e.g. {v.strip()!r:.40}" if v.strip() else "")
                                      + ", as forge sweep --round final writes it; or move the file away (or give another --tier-env) and run the sweep again")
        try:
            rounds.tier_settings(rnd, tier, environ=e["environment"], where=f"{where}.environment'")
        except ForgeError as err:
            raise ForgeError(err.message, hint="forge sweep --round final writes values within the round's bounds; "
                                               "restore the file, or move it away (or give another --tier-env) and run the sweep again") from None
        for k in ("sweep", "run"):       # shipped in ENVIRONMENT.md: None printed, a line break ended its list
            why = paths.name_problem(e.get(k))
            if why:
                raise ForgeError(f"{where}.{k}': {why}", hint=f"forge sweep --round final writes the winner's {k} id; "
                                                              "restore the file, or move it away (or give another "
                                                              "--tier-env) and run the sweep again")
        if "harness" in e and not isinstance(e["harness"], bool):   # "no" read as a harness winner, 0 as a DCU one
            raise ForgeError(f"{where}.harness': {e['harness']!r:.60} is not true or false",
                             hint="forge sweep --round final writes true (a harness sweep) or false; restore the file")
        for k in ("tok_s", "lift", "score"):       # ENVIRONMENT.md printed a NaN tok/s as "nan output tok/s"
            v = e.get(k)
            if v is not None and not finite(v):
                raise ForgeError(f"{where}.{k}': {v!r:.60} is not a finite number",
                                 hint="forge sweep --round final writes the winner's measured numbers; restore the file, "
                                      "or move the file away (or give another --tier-env) and run the sweep again")
        opts = e.get("engine_options") or {}
        if not isinstance(opts, dict) or any(k != "--kv-cache-dtype" or v not in kv for k, v in opts.items()):
            raise ForgeError(f"{where}.engine_options': {opts!r:.120} is not an option the sweep adds",
                             hint=f"the sweep adds only --kv-cache-dtype ({', '.join(kv)}); restore the file")
    return d


def refuse_recorded(path: Path, tiers: list[str], sweep_id: str, force: bool) -> None:
    """Refuse (before anything runs) to replace a tier another sweep recorded in `path`, unless force, and
    a `path` the winners cannot be written to (a folder, or below a file): found at the end of a sweep,
    it would have cost every measurement's results file."""
    force = options.forced(force)     # FORCE=1, as the refusal says (FORCE=yes refused, not read as no)
    paths.outside_sources(path, "--tier-env")        # the winners were written among the tool's sources
    above = next((a for a in (path, *path.parents) if a.exists()), None)
    if (path.exists() and not path.is_file()) or (above not in (None, path) and not above.is_dir()):
        raise ForgeError(f"--tier-env {path}: the winners are written to a JSON file there, and "
                         f"{above} is {'a folder' if above == path else 'not a folder'}",
                         hint="give a file's path, e.g. --tier-env reports/final-round/tier-environment.json")
    if not path.is_file():
        return
    d = read_tier_env(path)           # read even with force: the winners are added to it at the end
    if force:
        return
    taken = [t for t in tiers if t in d["tiers"] and d["tiers"][t].get("sweep") != sweep_id]
    if taken:
        e = d["tiers"][taken[0]]
        records.guard_recorded(paths.rel(path), f"a recorded winner of tier {taken[0]} (sweep {e.get('sweep')}, run "
                               f"{e.get('run')})", doing="this sweep", force=force,
                               hint="give --tier-env FILE to write another file")


def write_winners(path: Path, round_name: str, winners: dict[str, dict], sweep_id: str, force: bool) -> None:
    """Add each tier's winner to the tier-environment file, atomically (FORCE=1 read by refuse_recorded)."""
    refuse_recorded(path, list(winners), sweep_id, force)
    d = read_tier_env(path) if path.is_file() else {"round": round_name, "tiers": {}}
    if d.get("round") != round_name:
        raise ForgeError(f"{paths.rel(path)} holds the {d.get('round')} round's environment, not the {round_name} round's",
                         hint="give another file with --tier-env")
    d["tiers"].update(winners)
    d["written_by"] = "forge sweep --round " + round_name
    d["updated"] = runs.now_iso()
    path.parent.mkdir(parents=True, exist_ok=True)
    runs.write_json(path, d)
