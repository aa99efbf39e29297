"""`forge sweep --round final`: a search over the final round's configurations, per tier.

For each tier: every candidate of the space (final_space: topology x KV dtype x max-num-seqs x
max-num-batched-tokens x gpu-memory-utilization x client concurrency), and beside each point whose
concurrency would preempt the candidate at the capacity planner's max-num-seqs for the tier (how many
of its largest requests one replica's KV cache holds at once: one card's cache holds few 16-32K
requests, and vLLM admits the concurrency and preempts by recompute otherwise), is ranked by the
finals' time model (forge.model.finals.rank_configurations, through final_space's Ranker interface); the best
--top N are served one after the other (forge serve --round final with a profile the sweep writes for
the candidate: --base-profile plus the candidate's values), benchmarked with the finals' client at the
candidate's concurrency and scored against the baseline tier with the SLA (final_pick); the server is
stopped after each, unless the next differs from it only in the client's concurrency: those run one after the
other on one server start (final_serve). The baseline is --baseline RUN (a final-round run at the finals' baseline
configuration, e.g. upstream: its recorded values are checked, final_baseline), or the sweep measures one
itself with --baseline-profile P at the round's baseline settings, one run per tier.

Each configuration is its own run folder, reports/runs/<sweep>-<tier>-<candidate>; the sweep's record is
reports/sweeps/<sweep>/sweep.json (the space, the ranking with the model's predictions, each
configuration's outcome). A rerun with --sweep-id resumes: a configuration with a tier score (or one
recorded as failed to start) is not run again; one interrupted mid-benchmark resumes its run (the record
and the tier scores kept are checked first, final_resume). The
winner per tier goes to the tier-environment file (final_pick). With --harness (a GPU machine, random
weights) the servers are the GPU harness's (final_harness)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .. import options, paths, ui
from ..contest import profiles, rounds
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..model import capacity, costs, finals
from ..model.shape import load_shape
from . import bench, bench_data, final_harness, final_pick, final_resume, final_serve, final_space, runs, serve, synth
from .final_space import Candidate, Ranked

SPACE_OPTIONS = final_space.SPACE_OPTIONS
BUILDS = {"best-public": costs.BEST_PUBLIC_BUILD, "upstream": costs.UPSTREAM}
# the final round's defaults; applied in cmd_final, not by the parser: the preliminary's sweep refuses each of
# these options when typed at all, its default value included
DEFAULT_TOP, DEFAULT_BASE_PROFILE, DEFAULT_BUILD = 3, "contest", "best-public"


def sweeps_root() -> Path:
    return runs.runs_root().parent / "sweeps"


def check_build(build: str) -> None:
    if build not in BUILDS:
        raise ForgeError(f"--model-build {build!r}: not a build the model knows", hint=f"builds: {', '.join(BUILDS)}")


def launchers(vllm_cmd: str | None, client: str | None) -> None:
    """--vllm and --client (or $FORGE_BENCH_CLIENT) split as a shell splits them: an unbalanced quote is
    refused before a sweep writes its record or starts a server, not when its first server or client starts."""
    if vllm_cmd is not None:
        serve.native_launcher(vllm_cmd)
    bench.client_launcher(client)


def model_ranker(contest: dict, rnd: rounds.Round, build: str = DEFAULT_BUILD, link: str = "pcie") -> final_space.Ranker:
    """The finals' time model as a Ranker: each tier's requests are the contest workload's (prompt,
    output) pairs, as many as the round sends, outputs ending at end-of-text (capped at the round's
    output length); the finals' baseline is modelled on the same requests."""
    check_build(build)
    workload = synth.load_workload(contest)

    def rank(tier: str, cands: list[Candidate]) -> list[Ranked]:
        tc = rnd.client(tier)
        pairs = [tuple(x) for x in workload["tiers"][tier]["requests"]]
        reqs = finals.tier_requests(pairs, tc.num_prompts or len(pairs), outputs="eos", output_len=tc.output_len)
        by_cfg = {finals.Config(c.tensor_parallel_size, c.data_parallel_size, c.max_num_seqs, c.max_num_batched_tokens,
                                c.gpu_memory_utilization, c.concurrency, c.kv_dtype, c.planned): c for c in cands}
        ranked = finals.rank_configurations(tier, list(by_cfg), reqs, BUILDS[build], link=link)
        keep = ("tok_s", "ttft_p99_ms", "tpot_p99_ms", "preemptions", "failed", "sla_ok", "lift", "starts")
        return [Ranked(by_cfg[cfg], {k: p.get(k) for k in keep}, "; ".join(p.get("why") or []) or "within the SLA")
                for cfg, p in ranked]
    return rank


def model_planner(contest: dict, rnd: rounds.Round, tier: str, card: str = "dcu") -> Callable[[Candidate], int | None]:
    """The capacity planner's max-num-seqs for a candidate on `tier` (capacity.planned_seqs: the tier's
    prompts + the round's output length, the candidate's topology, KV dtype, utilization and batched
    tokens on `card`); None where its concurrency would not preempt."""
    prompts = [p for p, _ in synth.load_workload(contest)["tiers"][tier]["requests"]]
    output_len, shape = rnd.client(tier).output_len, load_shape()

    def planned(c: Candidate) -> int | None:
        return capacity.planned_seqs(shape, c.tensor_parallel_size, c.data_parallel_size, prompts, output_len,
                                     c.concurrency, kv_dtype=c.kv_dtype, card_name=card,
                                     utilization=c.gpu_memory_utilization,
                                     max_num_batched_tokens=c.max_num_batched_tokens)
    return planned


def _refuse_env_overrides(rnd: rounds.Round, tiers: list[str]) -> None:
    """The sweep sets each configuration's values itself: a start-script variable in the environment
    would override them (rounds.tier_settings reads the environment first), and one mistyped
    (MAX_NUM_SEQS_4_8k) is refused by every server's start: both before the sweep's record is written."""
    try:
        rounds.refuse_mistyped(rnd, os.environ, "the final round's sweep")
    except ForgeError as e:
        raise ForgeError(e.message, hint="unset it for the sweep (the sweep sets each configuration's values)") from None
    for u in rnd.unlocked:
        for var in (u.env, *(f"{u.env}_{t.replace('-', '_').upper()}" for t in tiers)):
            if os.environ.get(var, "") != "":
                raise ForgeError(f"{var} is set in the environment; it would override every configuration's "
                                 f"{u.option}", hint=f"unset {var} for the sweep (the sweep sets it per configuration)")
    for t in tiers:
        var = rnd.client(t).concurrency_env
        if var and os.environ.get(var, "") != "":
            raise ForgeError(f"{var} is set in the environment; it would override every configuration's client "
                             f"concurrency for {t}", hint=f"unset {var} for the sweep (the sweep sets it per configuration)")


def _refuse_short_cards(rnd: rounds.Round, cands: list[Candidate], baseline_profile: str | None) -> None:
    """The card check every server start makes (rounds.check_cards), made once for the widest start of the
    sweep before its record is written: a machine without the cards is refused before any ranking or folder."""
    starts = [rounds.Settings(**c.settings_values()) for c in cands]
    if baseline_profile:
        starts.append(rnd.baseline)
    widest = max(starts, key=lambda st: st.cards)
    rounds.check_cards(rnd, widest, rounds.visible_cards(os.environ), where="sweep")


def sweep_final(tiers: list[str] | None, *, model: str | None, top: int = DEFAULT_TOP, sweep_id: str | None = None,
                baseline: str | None = None, baseline_profile: str | None = None,
                base_profile: str = DEFAULT_BASE_PROFILE, space_args: dict | None = None,
                ranker: Callable | None = None, model_build: str = DEFAULT_BUILD,
                tier_env: str | None = None, force: bool = False, image: str | None = None,
                vllm_cmd: str | None = None, data_dir: str | None = None, num_prompts: int | None = None,
                client: str | None = None, port: int | None = None, timeout: float = 1800,
                shm_size: str = "64g", harness: bool = False, site: str | None = None,
                kv_cache_memory_bytes: int | str | None = None, kv_why: str | None = None) -> dict:
    """The search (see the module's docstring). Returns the sweep's record."""
    contest = contest_mod.load_contest()
    rnd = rounds.load_round(contest, "final")
    # everything the command line says is checked before a server starts
    tiers = list(rnd.tier_order) if tiers is None else list(tiers)      # [] (--tiers ','): refused below
    bad = [t for t in tiers if t not in rnd.tier_order]
    if bad or not tiers:               # "--tiers ," names none (it read as a tier called "none")
        raise ForgeError(f"--tiers: {', '.join(bad)} not a tier of the final round" if bad else "--tiers names no tier",
                         hint=f"tiers: {', '.join(rnd.tier_order)}")
    twice = sorted({t for t in tiers if tiers.count(t) > 1})
    if twice:
        raise ForgeError(f"--tiers: {', '.join(twice)} given twice", hint="name each tier once")
    if top < 1:
        raise ForgeError(f"--top {top}: at least one configuration per tier is served", hint=f"--top {DEFAULT_TOP}")
    if baseline and baseline_profile:
        raise ForgeError("--baseline and --baseline-profile both given; give one: --baseline RUN takes a measured "
                         "baseline, --baseline-profile P measures one in the sweep",
                         hint=f"drop --baseline-profile {baseline_profile} to score against run {baseline}, or drop "
                              "--baseline to measure the baseline")
    if not baseline and not baseline_profile:
        raise ForgeError("the final round's baseline figures are unpublished: give --baseline RUN (a final-round run "
                         "at the finals' baseline configuration) or --baseline-profile P (the sweep measures it), one",
                         hint="e.g. --baseline-profile upstream (same-run upstream at TP2, 128 / 4096 / 0.95, "
                              "concurrency 10)")
    model = model or os.environ.get("MODEL") or None
    if not model:
        raise ForgeError("no model directory given", hint="pass --model DIR (make sweep MODEL=DIR)")
    cands = final_space.space(rnd, **(space_args or {}))
    if ranker is None:
        check_build(model_build)
    launchers(vllm_cmd, client)
    if not harness:                     # a harness sweep refuses --image itself (its servers run in this Python)
        serve.check_image(image)
    hs = final_harness.servers(harness, site=site, kv_cache_memory_bytes=kv_cache_memory_bytes, kv_why=kv_why,
                               image=image, cands=cands, baseline=rnd.baseline.as_dict())
    for name in (base_profile, *([baseline_profile] if baseline_profile else [])):
        paths.plain_name(name, "profile")
        profiles.load_profile(name, contest, rnd=rnd)      # there and valid, before the sweep is written
    sweep_id = runs.check_run_id(sweep_id) if sweep_id else runs.new_run_id("final-sweep", root=sweeps_root())
    data_dir = data_dir or os.environ.get("DATA_DIR") or None         # as bench-all-tiers reads it
    bench_data.check_data_dir(data_dir, [t for t in contest["tiers"] if t["name"] in tiers])
    _refuse_env_overrides(rnd, tiers)
    out_file = final_pick.tier_env_path(tier_env)
    final_pick.refuse_recorded(out_file, tiers, sweep_id, force)
    base_run = runs.resolve_run(baseline) if baseline else None
    if base_run:            # the cache a harness sweep gives its servers on purpose first, then the values
        final_harness.check_baseline_run(hs, base_run, rnd.baseline.as_dict())
    base_metrics = final_pick.baseline_tiers(base_run, contest, "final", tiers) if base_run else None
    if base_metrics and any(m["harness"] != harness for m in base_metrics.values()):
        raise ForgeError(f"baseline run {base_run.name} is {'' if not harness else 'not '}a harness run (random "
                         f"weights); this sweep is {'' if harness else 'not '}one: a run is scored only against a "
                         "baseline measured like it", hint="give a baseline run measured like the sweep (--harness)")
    sdir = sweeps_root() / sweep_id
    record = {"round": "final", "space": final_space.canonical_space(rnd, space_args or {}), "top": top,
              "base_profile": base_profile, "baseline": str(base_run) if base_run else None,
              "baseline_profile": baseline_profile, "num_prompts": num_prompts, "model_build": model_build,
              "harness": harness, **final_harness.record(hs, rnd.baseline.as_dict())}
    if not Path(model).is_dir():
        raise ForgeError(f"--model {model}: no such folder", hint="pass --model DIR (make sweep MODEL=DIR)")
    if not (Path(model) / "config.json").is_file():
        raise ForgeError(f"--model {model}: no config.json there, so no server can load it",
                         hint="pass the model's folder (the one holding config.json), e.g. build/gpu-bundle/model")
    st = final_resume.state(sdir, sweep_id, record, rnd)
    final_resume.check_scores(st, sweep_id, tiers, top)
    _refuse_short_cards(rnd, cands, baseline_profile)     # the machine last: the inputs' own refusals first
    rank = ranker or model_ranker(contest, rnd, model_build)
    kw = dict(model=model, image=image, vllm_cmd=vllm_cmd, port=port, timeout=timeout, shm_size=shm_size,
              data_dir=data_dir, num_prompts=num_prompts, client=client, harness=harness)
    save = lambda: runs.write_json(sdir / "sweep.json", st)          # noqa: E731
    sdir.mkdir(parents=True, exist_ok=True)
    ui.info(f"sweep {sweep_id}: {len(cands)} configurations per tier, the best {top} served (resume: --sweep-id {sweep_id})")
    winners = {}
    for tier in tiers:
        ts = st["tiers"].setdefault(tier, {})
        if "ranking" not in ts:
            tier_cands = final_space.with_planned(rnd, cands, model_planner(contest, rnd, tier))
            with ui.step(f"tier {tier}: ranking {len(tier_cands)} configurations with the finals' time model "
                         f"({sum(c.planned for c in tier_cands)} at the planner's max-num-seqs)"):
                ranked = final_space.rank(rank, tier, tier_cands)
            distinct, same = final_space.distinct(ranked)
            ts["ranking"] = [{"key": r.candidate.key, "label": r.candidate.label, "candidate": r.candidate.as_dict(),
                              "predicted": r.predicted,
                              "why": r.why, "same_prediction": same[r.candidate.key]}
                             for r in distinct[:max(top, 10)]]
            save()
        if base_metrics is None or tier not in base_metrics:
            bid = f"{sweep_id}-{tier}-baseline"
            values = rnd.baseline.as_dict()
            prof = final_space.write_profile(sdir, f"{tier}-baseline",
                                  final_space.profile_text(baseline_profile, rnd, tier, values, None, "the finals' baseline"))
            with ui.step(f"tier {tier}: the baseline ({baseline_profile} at the finals' baseline configuration)"):
                how = final_serve.measure(prof, tier, bid, values["concurrency"], kw, contest,
                                          final_harness.for_config(hs, values, "bf16"))
            if how != "measured":
                raise ForgeError(f"tier {tier}: the baseline server did not start ({how})",
                                 hint="fix it (see the run's server.log), then rerun with --sweep-id " + sweep_id)
            base_metrics = {**(base_metrics or {}),
                            **final_pick.baseline_tiers(runs.run_dir(bid, create=False), contest, "final", [tier])}
            ts["baseline_run"] = bid
            save()
        scored, kept = [], None
        todo = final_serve.grouped(ts["ranking"][:top])      # one server's configurations one after the other
        try:
            for n, (i, r) in enumerate(todo):
                cand = Candidate(**{k: r["candidate"][k] for k in r["candidate"]})
                run_id = f"{sweep_id}-{tier}-{cand.key}"
                rdir = runs.run_dir(run_id, create=False)
                res_file = final_resume.score_file(sweep_id, tier, cand.key)
                if r.get("outcome", "").startswith("failed to start"):
                    ui.info(f"tier {tier} {i}/{top}: {cand.label}: {r['outcome']} (recorded; not retried)")
                    continue
                if not res_file.is_file():
                    prof = final_space.write_profile(sdir, f"{tier}-{cand.key}", final_space.profile_text(
                        base_profile, rnd, tier, cand.settings_values(), final_space.KV_DTYPES[cand.kv_dtype],
                        "a sweep candidate"))
                    nxt = todo[n + 1][1] if n + 1 < len(todo) else None
                    keep = bool(nxt) and final_serve.server_key(nxt["candidate"]) == final_serve.server_key(r["candidate"]) \
                        and not nxt.get("outcome", "").startswith("failed to start") \
                        and not final_resume.score_file(sweep_id, tier, nxt["key"]).is_file()
                    if r["predicted"].get("starts") is False:      # a narrow space: nothing better to serve
                        ui.warn(f"tier {tier} {i}/{top}: {cand.label}: the model predicts it would not run ({r.get('why', '')}); "
                                "served all the same, as the search space holds nothing better")
                    with ui.step(f"tier {tier} {i}/{top}: {cand.label} (predicted {r['predicted'].get('tok_s') or 0:.1f} tok/s)"):
                        r["run"] = run_id
                        r["outcome"] = final_serve.measure(
                            prof, tier, run_id, cand.concurrency, kw, contest,
                            final_harness.for_config(hs, cand.settings_values(), cand.kv_dtype), kept=kept, keep=keep)
                        kept = run_id if keep and r["outcome"] == "measured" else None
                        save()
                        if r["outcome"] != "measured":
                            r.update(tok_s=None, score=None, zeroed_by=None)
                            save()
                            continue
                        runs.write_json(res_file, final_pick.tier_score(contest, rdir, tier, base_metrics[tier]))
                else:
                    ui.info(f"tier {tier} {i}/{top}: {cand.label}: already measured in run {run_id}; kept")
                res = final_pick.read_tier_score(res_file, tier)
                r.update(run=run_id, outcome="measured", tok_s=res["tok_s"], score=res["contribution"],
                         zeroed_by=res["zeroed_by"])
                save()
                scored.append((cand, run_id, res))
        finally:                # a server kept for a next configuration that never ran
            if kept:
                serve.stop_running_server()
        best = final_pick.winner(scored)
        if best is None:
            ui.warn(f"tier {tier}: " + ("no served configuration stayed within the SLA" if scored else
                                        "no configuration was measured (each failed to start)") + "; no winner recorded")
            ts["winner"] = None
        else:
            cand, run_id, res = best
            winners[tier] = final_pick.entry(rnd, tier, cand, run_id, sweep_id, res,
                                             f"{base_profile} + {cand.key}")
            ts["winner"] = {"key": cand.key, "run": run_id}
        save()
    if winners:
        final_pick.write_winners(out_file, "final", winners, sweep_id, force)
        ui.info(f"wrote the winners of {', '.join(winners)} to {paths.rel(out_file)}")
    st["tier_env_file"] = str(out_file)
    st["updated"] = runs.now_iso()
    save()
    return st


def add_arguments(s) -> None:
    """The final round's options of `forge sweep` (compare.register adds them to the verb)."""
    s.add_argument("--round", default=None,
                   help="final: the search over the final round's configurations per tier (see below); default: the "
                        "preliminary's sweep over PROFILES")
    s.add_argument("--tiers", help="final: comma-separated tiers to search (default: all three)")
    s.add_argument("--top", type=int, default=None, help="final: how many of the model's best configurations are served "
                                                      f"per tier (default {DEFAULT_TOP})")
    s.add_argument("--sweep-id", help="final: the sweep to write or resume (default: a new one; printed at the start)")
    s.add_argument("--baseline", help="final: a final-round run at the finals' baseline configuration (same-run "
                                      "upstream) holding the searched tiers; its recorded server values and each "
                                      "tier's client concurrency are checked against it (TP2, 128 / 4096 / 0.95, "
                                      "concurrency 10); not with --baseline-profile")
    s.add_argument("--baseline-profile", help="final: measure the baseline in the sweep: this profile at the round's "
                                              "baseline settings, one run per tier (e.g. upstream)")
    s.add_argument("--base-profile", default=None, help="final: the profile every candidate extends (default: "
                                                              f"{DEFAULT_BASE_PROFILE}, the submission)")
    for opt, default in (("--topologies", "every topology of the round, configs/contest.yaml"),
                         *((f"--{k.replace('_', '-')}", ",".join(f"{v:g}" for v in vals) if k != "kv_dtypes"
                            else ",".join(vals)) for k, vals in final_space.DEFAULTS.items())):
        more = ("; beside them, per tier, the capacity planner's where the concurrency would preempt (how many of "
                "the tier's largest requests one replica's KV cache holds: forge plan's 'planned seqs')"
                if opt == "--max-num-seqs" else "")
        s.add_argument(opt, help=f"final: comma-separated values of the search space (default {default}){more}")
    s.add_argument("--model-build", default=None,
                   help=f"final: the build the time model prices the candidates with ({', '.join(BUILDS)}; default "
                        f"{DEFAULT_BUILD})")
    s.add_argument("--tier-env", help="final: the tier-environment file the winners go to (default "
                                      "reports/final-round/tier-environment.json)")
    s.add_argument("--force", action="store_true", help="final: replace a tier's winner another sweep recorded")
    final_harness.add_arguments(s)


def refuse_final_options(args) -> None:
    """The preliminary's sweep (over PROFILES) takes none of the final round's options."""
    given = [o for o, v in (("--tiers", args.tiers), ("--sweep-id", args.sweep_id), ("--baseline", args.baseline),
                            ("--baseline-profile", args.baseline_profile), ("--tier-env", args.tier_env),
                            ("--force", args.force), ("--top", args.top is not None), *final_harness.given(args),
                            ("--base-profile", args.base_profile), ("--model-build", args.model_build),
                            *((f"--{k.replace('_', '-')}", getattr(args, k)) for k in SPACE_OPTIONS)) if v]
    if given:
        raise ForgeError(f"{', '.join(given)}: the final round's search options; the preliminary's sweep runs PROFILES",
                         hint="add --round final (make sweep ROUND=final), or drop them")


def cmd_final(args) -> int:
    if args.profiles:
        raise ForgeError(f"sweep --round final searches configurations; profiles given ({' '.join(args.profiles)})",
                         hint="drop the profiles; --base-profile names the one the candidates extend")
    if args.repeat != 1:
        raise ForgeError("--repeat goes with the preliminary's sweep; the final round's serves each configuration once",
                         hint="drop --repeat")
    space_args = {k: getattr(args, k) for k in SPACE_OPTIONS if getattr(args, k) is not None}
    tiers = options.tier_items(args.tiers, contest_mod.tier_names(contest_mod.load_contest()))
    st = sweep_final(tiers, model=args.model, top=DEFAULT_TOP if args.top is None else args.top, sweep_id=args.sweep_id,
                     baseline=args.baseline, baseline_profile=args.baseline_profile,
                     base_profile=args.base_profile or DEFAULT_BASE_PROFILE, space_args=space_args,
                     model_build=args.model_build or DEFAULT_BUILD, tier_env=args.tier_env, force=args.force,
                     image=args.image,
                     vllm_cmd=args.vllm, data_dir=args.data_dir, num_prompts=args.num_prompts, client=args.client,
                     port=args.port, timeout=args.timeout, shm_size=args.shm_size, harness=args.harness,
                     site=args.site, kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_why=args.kv_why)
    print(f"{'tier':<8} {'configuration':<50} {'run':<64} {'tok/s':>8} {'score':>7}  verdict")
    for tier, ts in st["tiers"].items():
        win = (ts.get("winner") or {}).get("key")
        for r in ts["ranking"][:st["top"]]:
            verdict = ("winner" if r["key"] == win else "; ".join(r.get("zeroed_by") or []) or
                       (r.get("outcome") if r.get("outcome") != "measured" else "within the SLA"))
            tok = f"{r['tok_s']:.2f}" if r.get("tok_s") is not None else "-"
            sc = f"{r['score']:.2f}" if r.get("score") is not None else "-"
            conf = r["key"] + (" (planned)" if r["candidate"].get("planned") else "")
            print(f"{tier:<8} {conf:<50} {r.get('run') or '-':<64} {tok:>8} {sc:>7}  {verdict}")
    won = any(ts.get("winner") for ts in st["tiers"].values())
    print(f"sweep {st['sweep']}; winners: {st['tier_env_file'] if won else 'none recorded'}")
    failure = final_pick.unmeasured(st, tiers or list(st["tiers"]))
    if failure:                     # every configuration served failed to start: nothing measured, not a result
        raise failure
    return 0
