"""`forge compare`: per-tier deltas between two sets of runs, with a noise band from repeated runs;
`forge sweep`: serve -> bench-all-tiers -> score -> stop for several profiles back to back."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from .. import options, ui
from ..contest import profiles as profiles_mod
from ..contest import rounds
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..hashing import sha256_bytes
from . import bench, bench_data, final_baseline, final_sweep, runs, score, serve

NOISE_PCT_MIN = 0.1     # --noise-pct's least: a tenth of a percent


def _folders(paths: list[str], side: str) -> list[Path]:
    """A side's run folders, each once: a folder given twice would count as two repeats and shrink the
    noise band to nothing."""
    if not paths:
        raise ForgeError(f"side {side} has no run", hint="forge compare --a RUN [RUN...] --b RUN [RUN...] "
                                                         "(make compare A=<run> B=<run>)")
    seen: dict[Path, str] = {}
    for p in paths:
        d = runs.resolve_run(p).resolve()
        if d in seen:
            raise ForgeError(f"side {side}: {p} and {seen[d]} are the same run folder ({d}); a repeat is another run",
                             hint="give each run once; repeats are separate runs of the same profile")
        seen[d] = p
    return list(seen)


def _copies(sides: dict[str, list[Path]], contest: dict) -> None:
    """Refuse a run counted twice by content: a `cp -r` copy of a run (or a run sharing a tier's
    result with another) is the same measurement, not a repeat, and would shrink the noise band to
    nothing, or, across sides, compare a run with itself. Tier results are compared as parsed JSON,
    so a re-indented copy counts too."""
    seen: dict[str, tuple[str, Path]] = {}
    for side, folders in sides.items():
        for d in folders:
            for name in contest_mod.tier_names(contest):
                f = d / f"{name}.json"
                if not f.is_file():
                    continue
                key = sha256_bytes(json.dumps(runs.read_json(f), sort_keys=True).encode())
                if key in seen and seen[key][1] != d:
                    other_side, other = seen[key]
                    if other_side == side:
                        raise ForgeError(f"side {side}: {f} holds the same result as {other / f.name}: a copy of one "
                                         "run is the same measurement, not a repeat",
                                         hint="give each measured run once; repeats are separate runs of the same "
                                              "profile (forge sweep --repeat N)")
                    raise ForgeError(f"{f} (side {side}) holds the same result as {other / f.name} (side {other_side}): "
                                     "a run compared with its own copy shows no difference",
                                     hint="side A and side B are different runs (e.g. two profiles)")
                seen.setdefault(key, (side, d))


def _side(folders: list[Path], contest: dict) -> list[dict]:
    side = [score.load_run(d, contest, partial=True) for d in folders]
    for r in side:
        if not r["tiers"]:
            raise ForgeError(f"{r['path']}: no tier results (<tier>.json) in this run folder",
                             hint="give a run folder that bench-all-tiers (or e2e-gpu) wrote")
    return side


def one_round(all_runs: list[dict]) -> None:
    """Runs of different rounds were measured by different clients (the preliminary's one request at a time
    over the tier file, the final round's requests at its concurrency): their deltas say nothing of the build."""
    first = {}
    for r in all_runs:
        first.setdefault(r["round"], r["path"])
    if len(first) > 1:
        (ra, pa), (rb, pb) = list(first.items())[:2]
        raise ForgeError(f"run {pa} is of the {ra} round and run {pb} of the {rb} round: the rounds' clients send "
                         "other requests at another concurrency, so their tok/s and latencies are not comparable",
                         hint="compare runs of one round per call (forge score --round ROUND scores each)")


def _metric_rows(contest: dict, side: list[dict], base: dict | None, score_key: str) -> dict[str, list[float | None]]:
    rows: dict[str, list] = {}
    for r in side:
        for name, m in r["tiers"].items():
            rows.setdefault(f"{name} tok/s", []).append(m["tok_s"])
            rows.setdefault(f"{name} TTFT P99 ms", []).append(m["ttft_p99_ms"])
            # per tier too: a final-round run is often one tier (each its own server), so it has no pooled row
            rows.setdefault(f"{name} TPOT P99 ms", []).append(m["tpot_p99_ms"])
        if r["missing"]:                 # pooled TPOT and score need every tier: rows from complete runs only
            continue
        rows.setdefault("pooled TPOT P99 ms", []).append(r["tpot_p99_pooled_ms"])
        if base is not None:
            rows.setdefault(score_key, []).append(score.score(contest, r, base)["total"])
    return rows


def _same_run_reference(r: dict) -> Path | None:
    """The reference profile's folder beside a run of an e2e results folder (<results>/runs/<profile>,
    the reference named in <results>/summary.json), or None."""
    p = Path(r["path"]).resolve()
    summary = p.parent.parent / "summary.json"
    if p.parent.name != "runs" or not summary.is_file():
        return None
    try:
        ref = runs.read_json(summary).get("reference")
    except (ForgeError, AttributeError):
        return None
    return p.parent / ref if isinstance(ref, str) and ref and (p.parent / ref).is_dir() else None


def score_baseline(contest: dict, all_runs: list[dict], reference: dict | None = None) -> tuple[dict | None, str]:
    """The baseline every run may be scored against, as `forge score` pairs them (a harness run only
    against a harness run, a real run never against one): `reference` when given (a refused pairing
    is an error), else the default set, else for harness runs their results' common reference run.
    Returns (baseline, row name) or (None, why there is no score row)."""
    if reference is not None:
        for r in all_runs:
            score.check_pairing(r, reference, f"run {r['path']}", "--reference")
        return reference, "score (reference run)"
    if any(r.get("round", "preliminary") != "preliminary" for r in all_runs):
        return None, "score (a later round's runs are scored only against a baseline run of their round: --reference RUN)"
    harness = [r for r in all_runs if r["harness"]]
    if not harness:
        return score.baseline_from_config(contest), "score (default baseline)"
    why = ("score (harness runs, random weights on a GPU machine, are scored only against a harness reference; "
           "pass --reference <the same run's reference folder>)")
    if len(harness) < len(all_runs):
        return None, "score (harness and DCU runs share no baseline; compare one kind per call)"
    refs = {_same_run_reference(r) for r in all_runs}
    if len(refs) != 1 or None in refs:
        return None, why
    try:
        return score.baseline_from_run(refs.pop(), contest), "score (reference run)"
    except ForgeError:
        return None, why


def delta(a: list[float], b: list[float], noise_pct: float) -> dict:
    """Mean difference b - a and its noise band: twice the standard error of the difference when
    either side has repeats (the side with repeats stands in for the other), else noise_pct of a."""
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    sa = statistics.stdev(a) if len(a) > 1 else None
    sb = statistics.stdev(b) if len(b) > 1 else None
    if sa is None and sb is None:
        band = abs(ma) * noise_pct / 100.0
        how = f"assumed {noise_pct:g} % (one run per side)"
    else:
        sa = sa if sa is not None else sb
        sb = sb if sb is not None else sa
        band = 2.0 * math.sqrt(sa ** 2 / len(a) + sb ** 2 / len(b))
        how = f"2 × std. error from {len(a)}+{len(b)} runs"
    d = mb - ma
    return {"a": ma, "b": mb, "delta": d, "rel": d / ma if ma else None, "band": band, "band_from": how,
            "within_noise": abs(d) <= band, "n_a": len(a), "n_b": len(b)}


def compare(contest: dict, a_runs: list[dict], b_runs: list[dict], noise_pct: float,
            uncompared: list[str] | None = None, reference: dict | None = None) -> dict:
    """Per metric, the delta of side B against side A; metrics without a value on one side are
    appended to `uncompared` (as 'metric (no run on side X)', or '(no value on either side)'), as is the score when the runs may not
    be scored against one baseline (score_baseline). The score's delta names its baseline."""
    base, score_key = score_baseline(contest, [*a_runs, *b_runs], reference)
    if base is None and uncompared is not None:
        uncompared.append(score_key)
    ra, rb = _metric_rows(contest, a_runs, base, score_key), _metric_rows(contest, b_runs, base, score_key)
    out = {}
    for key in dict.fromkeys([*ra, *rb]):
        av = [x for x in ra.get(key, []) if x is not None]
        bv = [x for x in rb.get(key, []) if x is not None]
        if av and bv:
            out[key] = delta(av, bv, noise_pct)
            if key == score_key:
                out[key]["baseline"] = base["label"]
        elif uncompared is not None:
            uncompared.append(f"{key} (no value on either side)" if not (av or bv) else
                              f"{key} (no run on side {'A' if not av else 'B'})")
    return out


def common_tiers(a_runs: list[dict], b_runs: list[dict]) -> list[str]:
    """The tiers both sides have a result for; none is an error (there is nothing to compare)."""
    have = [{t for r in side for t in r["tiers"]} for side in (a_runs, b_runs)]
    both = [t for t in have[0] if t in have[1]]
    if not both:
        raise ForgeError(f"side A ({', '.join(sorted(have[0]))}) and side B ({', '.join(sorted(have[1]))}) have no "
                         "tier in common: there is nothing to compare",
                         hint="compare runs that measured the same tiers (finish a run with forge bench-all-tiers "
                              "--run-id RUN)")
    return both


def cmd_compare(args) -> int:
    contest = contest_mod.load_contest()
    skipped: list[str] = []
    a, b = _folders(args.a, "A"), _folders(args.b, "B")
    both = [d for d in a if d in b]
    if both:
        raise ForgeError(f"{both[0]} is on both sides: a run compared with itself shows no difference",
                         hint="side A and side B are different runs (e.g. two profiles)")
    _copies({"A": a, "B": b}, contest)
    ref = None
    if args.reference:              # a final-round reference as score takes one: at the finals' baseline values
        ref = score.baseline_from_run(runs.resolve_run(args.reference), contest)
        final_baseline.check_scored(runs.resolve_run(args.reference), ref, contest)
    side_a, side_b = _side(a, contest), _side(b, contest)
    one_round(side_a + side_b)
    common_tiers(side_a, side_b)
    res = compare(contest, side_a, side_b, args.noise_pct, skipped, ref)
    print(f"{'metric':<26} {'A':>10} {'B':>10} {'B-A':>10} {'rel':>8} {'band':>9} {'runs':>5}  verdict")
    for key, d in res.items():
        rel = f"{100 * d['rel']:+.1f}%" if d["rel"] is not None else "—"
        verdict = "within noise" if d["within_noise"] else ("B higher" if d["delta"] > 0 else "B lower")
        n = f"{d['n_a']}+{d['n_b']}"
        print(f"{key:<26} {d['a']:>10.2f} {d['b']:>10.2f} {d['delta']:>+10.2f} {rel:>8} {d['band']:>9.2f} {n:>5}"
              f"  {verdict}")
    for key, d in res.items():
        if "baseline" in d and key != "score (default baseline)":
            print(f"score baseline: {d['baseline']}")
    bands = {d["band_from"] for d in res.values()}
    print(f"noise band: {'; '.join(sorted(bands))}")
    if skipped:
        print(f"not compared: {'; '.join(skipped)}")
    return 0


def sweep(profiles: list[str], *, model: str | None = None, image: str | None = None,
          data_dir: str | None = None, num_prompts: int | None = None, repeat: int = 1, timeout: float = 1800,
          shm_size: str = "64g", vllm_cmd: str | None = None, client: str | None = None,
          port: int | None = None) -> list[tuple[str, str, dict]]:
    """For each profile in turn (the whole list `repeat` times): start its server, run every tier,
    stop the server and score the run. Returns (profile, run id, score) per run."""
    if not profiles:
        raise ForgeError("no profiles given", hint="forge sweep upstream contest (make sweep PROFILES=\"upstream contest\")")
    if repeat < 1:
        raise ForgeError(f"--repeat {repeat}: the list must run at least once",
                         hint="--repeat 1 (the default) runs each profile once; 3 gives a noise estimate")
    contest = contest_mod.load_contest()
    # a typo fails before the first server starts; a profile given as a path is named by its file
    names = {prof: profiles_mod.load_profile(prof, contest)["name"] for prof in profiles}
    final_sweep.launchers(vllm_cmd, client)          # a quote left open fails before the first server starts
    serve.check_image(image)                          # a missing image too
    results = []
    total = len(profiles) * repeat
    for i, prof in enumerate(profiles * repeat, 1):
        with ui.step(f"sweep {i}/{total}: profile {prof}"):
            run_id = runs.new_run_id(names[prof], f"-r{i}" if repeat > 1 else "")
            serve.serve_profile(prof, model, image=image, vllm_cmd=vllm_cmd, port=port, run_id=run_id,
                                timeout=timeout, shm_size=shm_size, contest=contest)
            try:
                bench.run_tiers(profile=names[prof], run_id=run_id, model=model, data_dir=data_dir,
                                num_prompts=num_prompts, client=client, port=port, contest=contest)
            finally:
                serve.stop_running_server()
            res, _ = score.score_run(run_id, contest=contest)
            results.append((names[prof], run_id, res))
    return results


def cmd_sweep(args) -> int:
    if args.round not in (None, "preliminary"):
        rounds.load_round(contest_mod.load_contest(), args.round)      # an unknown round is refused by name
        return final_sweep.cmd_final(args)
    final_sweep.refuse_final_options(args)
    results = sweep(args.profiles, model=args.model, image=args.image, data_dir=args.data_dir,
                    num_prompts=args.num_prompts, repeat=args.repeat, timeout=args.timeout,
                    shm_size=args.shm_size, vllm_cmd=args.vllm, client=args.client, port=args.port)
    print(f"{'profile':<14} {'run':<36} {'score':>6}  tok/s per tier")
    for prof, run_id, s in results:
        tiers = " / ".join(f"{t['tok_s']:.2f}" for t in s["tiers"].values())
        print(f"{prof:<14} {run_id:<36} {s['display']:>6}  {tiers}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("compare", help="per-tier deltas between runs A and B, with a noise band",
                       description="Compare tok/s, TTFT P99 and TPOT P99 per tier, and the pooled TPOT P99 and score "
                                   "(complete runs only), between two sets of runs. Several runs per side give a "
                                   "measured noise band (2 × standard error); one run per side uses --noise-pct. The score uses forge score's pairing: a "
                                   "harness run only against a harness reference (--reference, or the one its e2e "
                                   "results name), a DCU run against the default baseline set or --reference. "
                                   "Every run compared is of one round (its manifest's): the rounds' clients differ.")
    p.add_argument("--a", nargs="+", default=[], help="run folder(s) or id(s) of side A, each once")
    p.add_argument("--b", nargs="+", default=[], help="run folder(s) or id(s) of side B, each once")
    # below a tenth of a percent the band is no band (1e-300 % was taken: under the table's two decimals, every
    # difference "B higher" or "B lower"); no run-to-run noise of a served benchmark is that small
    p.add_argument("--noise-pct", type=options.number_in(NOISE_PCT_MIN, 100, "a percentage", "--noise-pct 3"),
                   default=3.0, help="assumed run-to-run noise in %% when neither side has repeats (default 3; "
                                     f"{NOISE_PCT_MIN:g} to 100)")
    p.add_argument("--reference", help="score both sides against this run (a harness run's same-run reference, "
                                       "found beside e2e results by default) instead of the default baseline set; "
                                       "a final-round run only where served at the finals' baseline configuration, "
                                       "as forge score --round final --baseline takes one")
    p.set_defaults(func=cmd_compare)
    s = sub.add_parser("sweep", help="serve, bench all tiers, score and stop for each profile in turn",
                       description="For each profile: forge serve, forge bench-all-tiers, forge score, forge stop. "
                                   "Prints one line per run at the end. With --round final: a search per tier over "
                                   "topology x KV dtype x max-num-seqs x max-num-batched-tokens x "
                                   "gpu-memory-utilization x client concurrency; the finals' time model ranks the "
                                   "space, the best --top N are served (forge serve --round final), benchmarked with "
                                   "the finals' client and scored against the baseline (--baseline RUN or "
                                   "--baseline-profile P) with the SLA, each in its own run folder; --sweep-id resumes "
                                   "(a finished configuration is not rerun); the winner per tier goes to the "
                                   "tier-environment file (reports/final-round/tier-environment.json) that forge report "
                                   "and forge submission --round final --tier-env list. With --harness, on a GPU "
                                   "machine without the real weights: every server gets harness/gpu/harness.yaml's "
                                   "server_args (recorded with their reasons) and the bundle `forge e2e-gpu "
                                   "--install-only` installed in --site.")
    s.add_argument("profiles", nargs="*", help="profiles (configs/serve/<name>.yaml)")
    s.add_argument("--model", help="model directory (default: $MODEL)")
    s.add_argument("--image", help="container image (default: $IMAGE; else the installed wheel)")
    s.add_argument("--data-dir", help="official tier files (default: $DATA_DIR; else synthetic)")
    s.add_argument("--num-prompts", type=options.count_upto(bench_data.MOST_PROMPTS, bench_data.MOST_PROMPTS_WHAT),
                   help=f"prompts per tier, 1 to {bench_data.MOST_PROMPTS:,} (default: configs/contest.yaml)")
    s.add_argument("--repeat", type=options.whole_in(1, None, "a repeat count"), default=1,
                   help="run the whole list this many times, at least 1 (noise estimate)")
    s.add_argument("--timeout", type=options.number_in(0, 7 * 86400, "seconds", "1800", lo_open=True), default=1800,
                   help="seconds to wait for each server's /health")
    s.add_argument("--shm-size", default="64g", type=options.shm_size,
                   help="container shared memory (default 64g; a whole number with an optional unit b, k, m or g)")
    s.add_argument("--vllm", help="how to start vLLM natively (see forge serve --help)")
    s.add_argument("--client", help="how to start vLLM's CLI for the client (see forge bench-all-tiers --help)")
    s.add_argument("--port", type=options.port, default=None, help="testing only: a port other than the locked 8001")
    final_sweep.add_arguments(s)
    s.set_defaults(func=cmd_sweep)
