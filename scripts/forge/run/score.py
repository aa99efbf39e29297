"""`forge score`: the contest's formula over a benchmark run (or what-if tok/s) against a baseline.

Per tier: lift = tok_s / baseline_tok_s - 1; score = weight * (floor + gain * (1 - exp(-rate * lift))),
zero when the tier's TTFT P99 exceeds ratio x the baseline's, when the pooled TPOT P99 exceeds
ratio x the baseline's, or when completion is below min_completion. The total is multiplied by the
accuracy factor when both the run and the baseline have accuracy results.

A tier below its baseline follows the same formula (not clamped; configs/contest.yaml
scoring.below_baseline). What-if tok/s must be finite and positive. A recorded score file is never
replaced without --force. A harness run (random weights on a GPU machine, manifest `harness: true`)
is labelled as such in every score and is scored only against another harness run, never against a
baseline measured on the DCU."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import options, paths, records, ui
from ..contest import rules as contest_mod
from ..errors import ForgeError
from . import final_baseline, final_client, results, runs
from .archive import no_result
from .results import check_result, finite_positive, output_drift, read_result, request_tpots_ms  # noqa: F401
from .score_doc import HARNESS_LABEL, chart, print_run, print_what_if, render_md

# --- metrics from `vllm bench serve` result files ----------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """numpy's default (linear) percentile, as `vllm bench serve` computes its own."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def tier_metrics(res: dict, file: str) -> dict:
    check_result(res, file)            # load_run reads it with read_result; callers with a dict check here
    total = res["completed"] + res["failed"]
    return {
        "tok_s": float(res["output_throughput"]),
        "ttft_p99_ms": res.get("p99_ttft_ms") if res["completed"] else None,
        "tpot_p99_ms": res.get("p99_tpot_ms") if res["completed"] else None,
        "completed": res["completed"], "failed": res["failed"],
        "completion": res["completed"] / total if total else 0.0,
        "tpots_ms": request_tpots_ms(res),
        "output_lens": res.get("output_lens"),
        "synthesized": res.get("forge_synthesized"),
    }


def load_run(run: Path, contest: dict, partial: bool = False) -> dict:
    """{tiers: {name: metrics}, tpot_p99_pooled_ms, accuracy, manifest, missing}. A tier without a
    result is an error, or with partial=True listed in `missing` (no pooled TPOT then)."""
    tiers = {}
    missing = []
    for name in contest_mod.tier_names(contest):
        p = run / f"{name}.json"
        if not p.is_file():
            if partial:
                missing.append(name)
                continue
            raise no_result(run, name, contest_mod.tier_names(contest))
        tiers[name] = tier_metrics(read_result(p), str(p))
    pooled = None                              # pooled over all tiers: none while one is missing
    if not missing and all(t["tpots_ms"] is not None for t in tiers.values()):
        pooled = percentile([x for t in tiers.values() for x in t["tpots_ms"]], 99)
    elif not missing:
        vals = [t["tpot_p99_ms"] for t in tiers.values() if t["tpot_p99_ms"] is not None]
        pooled = max(vals) if vals else None
    acc = read_accuracy(run / "accuracy.json") if (run / "accuracy.json").is_file() else None
    man = _read_object(run / "manifest.json") if (run / "manifest.json").is_file() else {}
    for key in ("harness", "scored_port"):        # flags the score reads: a "yes" would hide its warning
        v = man.get(key)
        if v is not None and not isinstance(v, bool):
            raise ForgeError(f"{run / 'manifest.json'}: key '{key}' is {repr(v)[:60]}, expected true or false",
                             hint="manifest.json is damaged; restore it from a copy of the run or rerun the step "
                                  "that wrote it")
    return {"tiers": tiers, "tpot_p99_pooled_ms": pooled, "accuracy": acc,
            "manifest": man, "path": str(run), "missing": missing, "harness": bool(man.get("harness")),
            "round": final_client.run_round(man, str(run / "manifest.json"))}


def read_accuracy(path: Path) -> dict[str, float]:
    """The task scores of an accuracy result (`forge accuracy`'s accuracy.json: {"scores": {task: score}}),
    as score and accuracy --a/--b read it: a JSON object whose 'scores' maps each task to a finite
    number >= 0; anything else is an error naming the file and the key."""
    scores = _read_object(path).get("scores")
    if not (isinstance(scores, dict) and all(map(results.number, scores.values()))):
        bad = next((f"'scores.{k}' is {repr(v)[:40]}" for k, v in scores.items() if not results.number(v)), None) \
            if isinstance(scores, dict) else None
        raise ForgeError(f"{path}: key {bad or repr('scores') + ' is ' + repr(scores)[:60]}, expected a mapping of "
                         "task to a finite number >= 0",
                         hint="accuracy.json is damaged; restore it from a copy of the run or rerun forge accuracy "
                              "for it (--force)")
    return {k: float(v) for k, v in scores.items()}


def _read_object(path: Path) -> dict:
    d = runs.read_json(path)
    if not isinstance(d, dict):
        raise ForgeError(f"{path}: expected a JSON object, got {json.dumps(d)[:40]}",
                         hint="the file is damaged; restore it from a copy of the run or rerun the step that wrote it")
    return d


def baseline_from_config(contest: dict, name: str | None = None, round_name: str = final_client.PRELIMINARY) -> dict:
    """A named baseline set (default: baselines.default for the preliminary, the round's own set for a
    later round) of round `round_name`; SLA values it lacks come from its `sla_from` set. A set of
    another round, or one whose tok/s were not published, is refused."""
    sets = contest["baselines"]["sets"]
    if name is None and round_name != final_client.PRELIMINARY:
        name = next((n for n, x in sets.items() if x["round"] == round_name), None)
        if name is None:
            raise ForgeError(f"configs/contest.yaml baselines.sets has no set of the {round_name} round",
                             hint="score against a baseline run of that round: --baseline RUN")
    name = name or contest["baselines"]["default"]
    if name not in sets:
        raise ForgeError(f"baseline {name!r} is not in configs/contest.yaml baselines.sets",
                         hint=f"sets: {', '.join(sorted(sets))}")
    s = sets[name]
    if s["round"] != round_name:
        raise ForgeError(f"baseline set {name!r} is of the {s['round']} round; this score is of the {round_name} "
                         "round: a score is taken only against a baseline of its own round",
                         hint=f"pick a set of the {round_name} round, or --baseline RUN (a run of that round); a "
                              f"score of the {s['round']} round is asked with --round {s['round']}")
    unpublished = [t for t, v in s["tok_s"].items() if v is None]
    if unpublished:
        raise ForgeError(f"baseline set {name!r} ({round_name} round): its tok/s were not published "
                         f"({', '.join(unpublished)}; configs/contest.yaml baselines.sets.{name}.source)",
                         hint=f"score against a same-run upstream run at the {round_name} round's baseline "
                              f"configuration: --baseline RUN (make score ROUND={round_name} BASELINE=<run>)")
    sla = sets[s["sla_from"]] if s.get("sla_from") else s
    tiers = {}
    for t in contest_mod.tier_names(contest):
        ttft = s["ttft_p99_ms"][t] if s["ttft_p99_ms"][t] is not None else sla["ttft_p99_ms"][t]
        tiers[t] = {"tok_s": s["tok_s"][t], "ttft_p99_ms": ttft, "output_lens": None}
    tpot = s["tpot_p99_ms"] if s["tpot_p99_ms"] is not None else sla["tpot_p99_ms"]
    source = s["source"] + (f"; SLA limits from set {s['sla_from']!r}" if s.get("sla_from") else "")
    return {"label": f"{name} (configs/contest.yaml)", "source": source, "tiers": tiers,
            "tpot_p99_pooled_ms": tpot, "accuracy": s["accuracy"] or None, "harness": False, "dcu": True,
            "round": round_name}


def baseline_from_run(run: Path, contest: dict) -> dict:
    r = load_run(run, contest)
    return {"label": f"run {run.name}" + (" (harness)" if r["harness"] else ""), "source": str(run),
            "tiers": r["tiers"], "tpot_p99_pooled_ms": r["tpot_p99_pooled_ms"], "accuracy": r["accuracy"],
            "harness": r["harness"], "dcu": None, "round": r["round"]}


def check_pairing(run: dict, base: dict, run_label: str, option: str = "--baseline") -> None:
    """A harness run is scored only against a harness baseline, and a real run never against one; a
    run only against a baseline of its own round. `option` gives the baseline run (compare's --reference)."""
    ra, rb = run.get("round") or final_client.PRELIMINARY, base.get("round") or final_client.PRELIMINARY
    if ra != rb:
        raise ForgeError(f"{run_label} is of the {ra} round; the baseline {base['label']} is of the {rb} round: "
                         "a run is scored only against a baseline of its own round",
                         hint=f"give a baseline run of the {ra} round ({option} RUN)")
    if run.get("harness") and not base.get("harness"):
        raise ForgeError(f"{run_label} is a harness run (random weights on a GPU machine); its tok/s say nothing "
                         f"about the DCU, so scoring it against {base['label']} is refused",
                         hint=f"score it against the same run's reference profile: {option} <harness run folder>")
    if base.get("harness") and not run.get("harness"):
        raise ForgeError(f"the baseline {base['label']} is a harness run (random weights on a GPU machine); "
                         f"{run_label} is not", hint="score against a baseline measured like the run")


# --- the formula ---------------------------------------------------------------------------------

def tier_score(sc: dict, weight: float, tok_s: float, base_tok_s: float) -> tuple[float, float]:
    if not finite_positive(base_tok_s):
        raise ForgeError(f"baseline tok/s must be finite and positive, got {base_tok_s}")
    if not (finite_positive(tok_s) or tok_s == 0):
        raise ForgeError(f"tok/s must be a finite number >= 0, got {tok_s}")
    lift = tok_s / base_tok_s - 1.0
    return lift, weight * (sc["floor"] + sc["gain"] * (1.0 - math.exp(-sc["rate"] * lift)))


def accuracy_factor(sc: dict, ours: dict | None, base: dict | None) -> dict:
    if not ours or not base:
        missing = " and ".join(x for x, have in (("the run", ours), ("the baseline", base)) if not have)
        return {"factor": 1.0, "applied": False, "note": f"no accuracy results for {missing}"}
    common = sorted(set(ours) & set(base))
    if not common:
        return {"factor": 1.0, "applied": False, "note": "run and baseline share no accuracy task"}
    mo = sum(ours[t] for t in common) / len(common)
    mb = sum(base[t] for t in common) / len(common)
    loss = (mb - mo) / mb if mb else 0.0
    factor = 0.0
    for step in sc["accuracy_factor"]:
        if loss <= step["max_loss"]:
            factor = step["factor"]
            break
    return {"factor": factor, "applied": True, "relative_loss": loss, "tasks": common,
            "per_task_change": {t: (ours[t] - base[t]) / base[t] if base[t] else 0.0 for t in common},
            "run_mean": mo, "baseline_mean": mb}


def score(contest: dict, run: dict, base: dict) -> dict:
    sc = contest["scoring"]
    tiers_out = {}
    pooled = run.get("tpot_p99_pooled_ms")
    bpooled = base.get("tpot_p99_pooled_ms")
    tpot_limit = sc["tpot_p99_max_ratio"] * bpooled if bpooled else None
    tpot_ok = None if tpot_limit is None or pooled is None else pooled <= tpot_limit
    if tpot_limit is not None and pooled is None:
        # a run where no request completed has no TPOT and breaches; a what-if has no counts at all
        tpot_ok = False if all(t.get("completed") == 0 for t in run["tiers"].values()) else None
    total = 0.0
    for t in contest["tiers"]:
        name = t["name"]
        m = run["tiers"][name]
        b = base["tiers"][name]
        if not finite_positive(b["tok_s"]):
            f = Path(str(base.get("source"))) / f"{name}.json"      # a baseline run's result file
            raise ForgeError(f"baseline {base['label']}: tier {name} has {b['tok_s']} tok/s"
                             + (f" ({paths.rel(f)})" if f.is_file() else "") + "; a baseline must serve every tier",
                             hint="give a baseline run (or set) with output tok/s > 0 in every tier")
        lift, s = tier_score(sc, t["weight"], m["tok_s"], b["tok_s"])
        ttft_limit = sc["ttft_p99_max_ratio"] * b["ttft_p99_ms"] if b.get("ttft_p99_ms") else None
        ttft = m.get("ttft_p99_ms")
        ttft_ok = None if ttft_limit is None or ttft is None else ttft <= ttft_limit
        completion = m.get("completion", 1.0)
        comp_ok = completion >= sc["min_completion"]
        reasons = []
        if ttft_ok is False:
            reasons.append(f"TTFT P99 {ttft:.0f} ms > {ttft_limit:.0f} ms")
        if tpot_ok is False:
            reasons.append(f"pooled TPOT P99 {pooled:.2f} ms > {tpot_limit:.2f} ms" if pooled is not None
                           else "no TPOT (no request completed)")
        if not comp_ok:
            reasons.append(f"completion {100 * completion:.1f} % < {100 * sc['min_completion']:.0f} %")
        contribution = 0.0 if reasons else s
        total += contribution
        tiers_out[name] = {
            "weight": t["weight"], "tok_s": m["tok_s"], "baseline_tok_s": b["tok_s"], "lift": lift,
            "formula_score": s, "contribution": contribution, "zeroed_by": reasons,
            "ttft_p99_ms": ttft, "ttft_p99_limit_ms": ttft_limit, "ttft_ok": ttft_ok,
            "completion": completion, "completion_ok": comp_ok,
            "completed": m.get("completed"), "failed": m.get("failed"),
            "tpot_p99_ms": m.get("tpot_p99_ms"),
        }
    acc = accuracy_factor(sc, run.get("accuracy"), base.get("accuracy"))
    final = total * acc["factor"]
    dec = sc["display_decimals"]
    shown = math.floor(final * 10 ** dec + 1e-9) / 10 ** dec
    unchecked = [n for n, t in tiers_out.items() if t["ttft_ok"] is None]
    return {"total": final, "total_before_accuracy": total, "display": f"{shown:.{dec}f}",
            "tiers": tiers_out, "tpot_p99_pooled_ms": pooled, "tpot_p99_limit_ms": tpot_limit, "tpot_ok": tpot_ok,
            "accuracy": acc, "baseline": {"label": base["label"], "source": base.get("source"),
                                          "harness": bool(base.get("harness"))},
            "harness": bool(run.get("harness")), "kind": HARNESS_LABEL if run.get("harness") else "run",
            "round": run.get("round") or final_client.PRELIMINARY,
            "below_baseline": sc["below_baseline"],
            "unchecked": {"ttft_tiers": unchecked, "tpot": tpot_ok is None}}


def write_report(contest: dict, rpath: Path, run: dict, base: dict, drift: dict | None,
                 shown: str | None = None, force: bool = False) -> tuple[dict, bool]:
    """Score a loaded run and write score.json, score.md and score.png into its folder; returns the
    result and whether the chart was drawn. A score already recorded there is replaced only with
    force=True."""
    check_pairing(run, base, f"run {rpath.name}")
    old = rpath / "score.json"
    if old.is_file() and not force:
        try:
            prev = runs.read_json(old)
            was = f" ({prev.get('display')} against {prev.get('baseline', {}).get('label')})"
        except (ForgeError, AttributeError):
            was = ""
        records.guard_recorded(f"run {rpath.name}", f"a recorded score{was} ({paths.rel(old)})", doing="scoring it",
                               force=force, hint="score a copy of the run")
    res = score(contest, run, base)
    res["run"] = str(rpath)
    res["output_drift"] = drift
    if run["manifest"].get("scored_port") is False:
        res["note"] = "the server did not listen on the locked port 8001 (testing run)"
        ui.warn(f"run {rpath.name}: {res['note']}")
    res["requests_note"] = final_client.fewer_requests(contest, run)      # a run of --num-prompts below the round's
    if res["requests_note"]:
        ui.warn(f"run {rpath.name}: {res['requests_note']}")
    # score.json, the recorded score, comes last: a failure before it leaves no recorded score (a
    # replaced one is removed first), so a rerun is never blocked by half a report
    old.unlink(missing_ok=True)
    paths.write_atomic(rpath / "score.md", render_md(res, shown or str(rpath), drift))
    drew = chart(res, rpath / "score.png")
    if not drew:
        (rpath / "score.png").unlink(missing_ok=True)       # an earlier score's chart would disagree
    runs.write_json(rpath / "score.json", res)
    return res, drew


def parse_tok_s(text: str, names: list[str]) -> list[float]:
    """What-if tok/s, one finite positive number per tier."""
    return list(contest_mod.per_tier_values(
        text, "--tok-s", names, "tok/s", hint="e.g. --tok-s 15.97,14.44,11.04 (make score TOK_S=15.97,14.44,11.04); "
                                              "a tier that served nothing has no what-if: score the run itself (--run)").values())


def score_run(run: "str | Path", *, baseline: "str | Path | None" = None, baseline_name: str | None = None,
              force: bool = False, contest: dict | None = None, round_name: str | None = None) -> tuple[dict, bool]:
    """Score a recorded run (a folder or a run id) against a baseline run or a configured baseline
    set, and write score.json, score.md and score.png into it. Returns the result and whether the
    chart was drawn. A score already recorded there is replaced only with force=True. `round_name`,
    when given, must be the run's round (its manifest's); the baseline must be of that round."""
    contest = contest or contest_mod.load_contest()
    if baseline and baseline_name:
        raise ForgeError("both --baseline (a run) and --baseline-name (a configured set) given; pick one",
                         hint="make score ... BASELINE=<run> or BASELINE_NAME=<set>")
    if round_name is not None:
        final_client.check_round(contest, round_name)
    rpath = runs.resolve_run(str(run))
    loaded = load_run(rpath, contest)
    if round_name is not None and round_name != loaded["round"]:
        whence = (f"{paths.rel(rpath / 'manifest.json')} round" if "round" in loaded["manifest"] else
                  "no round recorded in its manifest.json: a run recorded before rounds is of the preliminary")
        raise ForgeError(f"run {rpath.name} was measured in the {loaded['round']} round, not the {round_name} round "
                         f"({whence})", hint=f"score it with --round {loaded['round']}")
    drift = None
    if baseline:
        bpath = runs.resolve_run(str(baseline))
        if bpath.resolve() == rpath.resolve():
            raise ForgeError(f"run {run} and baseline {baseline} are the same run folder ({rpath.resolve()}): a run "
                             "scored against itself shows no difference",
                             hint="score against another run (--baseline RUN), or a configured set (--baseline-name)")
        base = baseline_from_run(bpath, contest)
        check_pairing(loaded, base, f"run {rpath.name}")
        final_baseline.check_scored(bpath, base, contest)    # a weaker baseline would raise every lift
        drift = output_drift(loaded, base)
    else:
        base = baseline_from_config(contest, baseline_name, loaded["round"])
    return write_report(contest, rpath, loaded, base, drift, force=force)


def cmd_score(args) -> int:
    contest = contest_mod.load_contest()
    options.forced(args.force)                 # FORCE=yes is refused, even where nothing is replaced
    names = contest_mod.tier_names(contest)
    if args.tok_s and args.run:
        raise ForgeError("both --run and --tok-s given: score a recorded run or what-if tok/s, not both",
                         hint="make score RUN=... or make score TOK_S=a,b,c")
    if args.baseline and args.baseline_name:
        raise ForgeError("both --baseline (a run) and --baseline-name (a configured set) given; pick one",
                         hint="make score ... BASELINE=<run> or BASELINE_NAME=<set>")
    if args.tok_s:                       # a what-if is printed, never recorded: a --force would be ignored
        options.idle_force(args.force, "with --tok-s", "a what-if score is printed only; to record a score, score a "
                                                       "run (--run RUN --force)")
        rnd = final_client.check_round(contest, args.round).name
        vals = parse_tok_s(args.tok_s, names)
        base = (baseline_from_run(runs.resolve_run(args.baseline), contest) if args.baseline
                else baseline_from_config(contest, args.baseline_name, rnd))
        run = {"tiers": {n: {"tok_s": v, "completion": 1.0} for n, v in zip(names, vals)}, "round": rnd}
        if args.round is None and base.get("round") not in (None, rnd):      # the round was not given: say so
            raise ForgeError(f"--baseline {args.baseline} is a run of the {base['round']} round; the what-if tok/s "
                             f"are scored in the {rnd} round (--round left out), and only against a baseline of it",
                             hint=f"add --round {base['round']} (make score ROUND={base['round']}) to score them "
                                  f"against it, or give a baseline run of the {rnd} round")
        check_pairing(run, base, "the what-if tok/s")
        if args.baseline:
            final_baseline.check_scored(runs.resolve_run(args.baseline), base, contest)
        print_what_if(score(contest, run, base), base)
        return 0
    if not args.run:
        raise ForgeError("nothing to score", hint="pass --run DIR (make score RUN=...) or --tok-s a,b,c")
    res, drew = score_run(args.run, baseline=args.baseline, baseline_name=args.baseline_name,
                          force=options.forced(args.force), contest=contest, round_name=args.round)
    print_run(res, drew)
    return 0


def register(sub) -> None:
    p = sub.add_parser("score", help="the contest score of a run (or of what-if tok/s) against a baseline",
                       description="Apply the contest formula (configs/contest.yaml scoring) to a run's tier results. "
                                   "Writes score.json, score.md and score.png into the run folder; a score already "
                                   "recorded there is replaced only with --force. A harness run (random weights) "
                                   "is scored only against a harness baseline run.")
    p.add_argument("--run", help="run folder or run id under reports/runs/")
    p.add_argument("--baseline", help="a baseline run folder (its tok/s, TTFT/TPOT P99, output lengths, accuracy)")
    p.add_argument("--baseline-name", help="a baseline set from configs/contest.yaml (default: baselines.default; "
                                           "e.g. team, official)")
    p.add_argument("--tok-s", help="what-if: comma-separated finite positive tok/s per tier, scored against the "
                                   "baseline (a set, or --baseline RUN's tok/s)")
    p.add_argument("--round", default=None,
                   help="the round the run was measured in (default: the one its manifest records; given, it must "
                        "match). final: the preliminary's formula and SLA checks against a baseline of the final "
                        "round: its figures are unpublished (configs/contest.yaml baselines.sets.final), so give "
                        "--baseline RUN, a same-run upstream run at the finals' baseline configuration (its server "
                        "values as forge serve recorded them per tier, and each tier's client concurrency, are checked "
                        "against configs/contest.yaml rounds.final.baseline; a harness run's own server arguments are "
                        "not); a run is never scored against a baseline of another round")
    p.add_argument("--force", action="store_true", help="replace a score already recorded in the run folder (with "
                                                        "--run; a what-if records nothing, so it takes no --force)")
    p.set_defaults(func=cmd_score)
