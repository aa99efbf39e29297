"""The measured rounds of an end-to-end run: the harness's client options, the same synthetic
prompts for every profile, rounds of (tier, profile) interleaved under a deadline, resuming a folder's
finished rounds, merging each profile's rounds into one run folder, and the same-run proxy scores."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ForgeError
from ..hashing import sha256_file
from ..run import bench, runs, score, synth
from ..run import contest as contest_mod
from .client import client_runner
from .servers import guarded

if TYPE_CHECKING:
    from .session import Run

CLIENT_TURN_S = 5.0       # a tier's client overhead over the bench's own duration (start, dataset, JSON)
FAULT_NEED_S = 40.0       # client start, a request cut after a few seconds, two failed tiers
DEFAULT_TIER_ORDER = ["16-32K", "8-16K", "4-8K"]   # the largest expected change first


# --- merging rounds ----------------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    return score.percentile(values, q) if values else None


def merge_results(parts: list[dict]) -> dict:
    """One tier result from several `vllm bench serve` results of the same tier (one per round):
    per-request lists concatenated, counts and durations summed, throughput and percentiles
    recomputed (at concurrency 1 the rounds are back to back, so tok/s = tokens / summed duration)."""
    if not parts:
        raise ForgeError("no tier results to merge")
    lists = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "start_times")
    out: dict = {"forge_merged_rounds": len(parts)}
    for k in lists:
        if all(k in p for p in parts):
            out[k] = [x for p in parts for x in p[k]]
    for k in ("completed", "failed", "num_prompts", "total_input_tokens", "total_output_tokens", "duration"):
        out[k] = sum(p.get(k) or 0 for p in parts)
    dur = out["duration"]
    out["output_throughput"] = out["total_output_tokens"] / dur if dur > 0 else 0.0
    out["request_throughput"] = out["completed"] / dur if dur > 0 else 0.0
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / dur if dur > 0 else 0.0
    ok = [i for i, e in enumerate(out.get("errors") or []) if not e] if "errors" in out else []
    ttfts_ms = [1000.0 * out["ttfts"][i] for i in ok] if "ttfts" in out else []
    tpots = score.request_tpots_ms(out) or []
    for name, vals in (("ttft", ttfts_ms), ("tpot", tpots)):
        for q in (50, 95, 99):
            out[f"p{q}_{name}_ms"] = _pct(vals, q)
        out[f"mean_{name}_ms"] = sum(vals) / len(vals) if vals else None
    synth_notes = [p["forge_synthesized"] for p in parts if p.get("forge_synthesized")]
    if synth_notes:
        out["forge_synthesized"] = "; ".join(synth_notes)
    return out


def harness_contest(contest: dict, fixed_output: int | None = None) -> dict:
    """The contest's client options with the harness's two time savers: no warm-up requests and no
    initial test request (each costs a full request per tier; the servers are warmed once, before
    any tier). Output lengths: each prompt's own (the contest workload, --custom-output-len -1) or
    `fixed_output` tokens for every request; end-of-text is ignored either way (random weights)."""
    c = json.loads(json.dumps(contest))
    opts = []
    for o in c["client"]["options"]:
        if o[0] == "--num-warmups":
            o = ["--num-warmups", "0"]
        elif o[0] == "--custom-output-len":
            o = ["--custom-output-len", str(fixed_output) if fixed_output else "-1"]
        opts.append(o)
    opts.append(["--ignore-eos"])
    opts.append(["--ready-check-timeout-sec", "0"])
    c["client"]["options"] = opts
    return c


def harness_args(h: dict, extra: list[str]) -> list[str]:
    out = [x for a in h["server_args"] for x in a]
    out += ["--gpu-memory-utilization", str(h["gpu_memory_utilization"])]
    if h.get("kv_cache_memory_bytes"):
        out += ["--kv-cache-memory-bytes", str(h["kv_cache_memory_bytes"])]
    return out + extra


def build_datasets(run: Run, model: Path, n: int) -> dict[str, list[Path]]:
    """The same synthetic prompts for every profile: per tier, one file per round (one prompt each).
    By default n requests of the contest workload (configs/workload.yaml; evenly spaced by output
    length), each with its own output length; with --fixed-output, prompts across the tier's range."""
    ddir = run.out / "datasets"
    per_round: dict[str, list[Path]] = {}
    fixed = run.args.fixed_output
    workload = None if fixed else synth.load_workload(run.contest)
    for t in run.contest["tiers"]:
        full = ddir / f"{t['name']}.jsonl"
        if fixed:
            info = synth.build_tier(model, t, n, full)
        else:
            pairs = synth.stratified(workload["tiers"][t["name"]]["requests"], n)
            info = synth.build_workload_tier(model, t["name"], pairs, full)
            info["requests"] = [list(x) for x in pairs]
        lines = full.read_text().splitlines()
        per_round[t["name"]] = []
        for r, line in enumerate(lines, 1):
            p = ddir / f"r{r}" / f"{t['name']}.jsonl"
            p.parent.mkdir(exist_ok=True)
            p.write_text(line + "\n")
            per_round[t["name"]].append(p)
        run.summary.setdefault("datasets", {})[t["name"]] = {
            "prompt_tokens": info["prompt_tokens"], "seed": info["seed"],
            "shape": f"{fixed} output tokens per request" if fixed else "contest workload (configs/workload.yaml)",
            **({"requests": info["requests"]} if not fixed else {})}
    return per_round



def round_identity(run: Run, dataset: Path) -> dict:
    """What makes two results of one (round, tier) comparable across invocations of one folder."""
    return {"dataset_sha256": sha256_file(dataset), **run.identity}


def kept_round(run: Run, rdir: Path, tname: str, ident: dict) -> bool:
    """A finished round from an earlier invocation is kept when it was measured (not recorded as
    failed for a missing server) with the same prompts, bundle, server arguments and device."""
    if not runs.tier_done(rdir, tname, keep_failed=True):
        return False
    if runs.read_json(runs.result_path(rdir, tname)).get("forge_synthesized"):
        return False
    idf = rdir / f"{tname}.identity.json"
    prev = runs.read_json(idf) if idf.is_file() else None
    if prev != ident:
        words = {"dataset_sha256": "prompts", "bundle_wheel_sha256": "bundle", "server_args": "server arguments",
                 "device": "device"}
        diff = sorted(words.get(k, k) for k in set(ident) | set(prev or {}) if (prev or {}).get(k) != ident.get(k))
        raise ForgeError(f"{rdir}: an earlier invocation ran tier {tname} on other {', '.join(diff) or 'settings'}",
                         hint="give a new --out folder, or the same bundle, --num-prompts and server arguments")
    return True


def check_resume(run: Run, names: list[str], datasets: dict[str, list[Path]]) -> None:
    """Refuse, before any server starts, a folder whose finished rounds are not comparable."""
    for name in names:
        for tname, files in datasets.items():
            for r, ds in enumerate(files, 1):
                kept_round(run, run.run_dir(name, create=False) / "rounds" / f"r{r}", tname, round_identity(run, ds))


def fully_kept(run: Run, name: str, datasets: dict[str, list[Path]]) -> bool:
    """Every round of every tier this invocation runs is kept from an earlier invocation: the
    profile needs no server (a folder can then be extended one profile at a time, the reference
    measured once, when the GPU holds fewer servers than the run has profiles)."""
    order = [t for t in (run.args.tier_order or DEFAULT_TIER_ORDER) if t in datasets]
    return bool(order) and all(
        kept_round(run, run.run_dir(name, create=False) / "rounds" / f"r{r}", t, round_identity(run, ds))
        for t in order for r, ds in enumerate(datasets[t], 1))


def rounds_reserve(args, summary: dict, live: list[str]) -> float:
    """Seconds the tier rounds leave before the deadline: --reserve-s, plus the fault check's need
    while it is still to run (not --no-fault, not kept from an earlier invocation, reference up)."""
    pending = not args.no_fault and not summary.get("fault") and summary.get("reference") in live
    return args.reserve_s + (FAULT_NEED_S if pending else 0.0)


def bench_rounds(run: Run, names: list[str], model: Path, datasets: dict[str, list[Path]]) -> dict:
    """Rounds of (tier, profile) pairs, interleaved; returns {profile: {tier: {round: result file}}}.
    A (round, tier) is started for every profile or for none, so the profiles are compared on the
    same prompts."""
    contest_h = harness_contest(run.contest, run.args.fixed_output)
    tiers = {t["name"]: t for t in run.contest["tiers"]}
    order = [t for t in (run.args.tier_order or DEFAULT_TIER_ORDER) if t in tiers]
    launcher = bench.client_launcher(run.args.client)
    runner = client_runner(run)
    done: dict[str, dict[str, dict[int, Path]]] = {n: {t: {} for t in order} for n in names}
    est = {t: None for t in order}
    reserve = rounds_reserve(run.args, run.summary, names)
    n_rounds = max(len(v) for v in datasets.values())
    for r in range(1, n_rounds + 1):
        for tname in order:
            ident = round_identity(run, datasets[tname][r - 1])
            todo = []
            for name in names:
                rdir = run.run_dir(name) / "rounds" / f"r{r}"
                rdir.mkdir(parents=True, exist_ok=True)
                if kept_round(run, rdir, tname, ident):
                    done[name][tname][r] = runs.result_path(rdir, tname)
                    # what a served round took then is the best guess for this tier's later rounds
                    kept = runs.read_json(done[name][tname][r])
                    if kept.get("completed") and not kept.get("failed") and \
                            isinstance(kept.get("duration"), (int, float)):
                        est[tname] = max(est[tname] or 0.0, kept["duration"] + CLIENT_TURN_S)
                    run.step(f"round {r} tier {tname} {name}: kept from an earlier invocation")
                else:
                    todo.append((name, rdir))
            if not todo:
                continue
            # before a tier's first measurement (here or in a kept round): 1024 tokens at ~25 ms, the
            # prefill, the client's turn
            guess = (est[tname] or (30.0 + tiers[tname]["prompt_tokens"][1] / 4000.0)) * len(todo)
            if run.left() - reserve < guess:
                run.summary["skipped"].append(f"round {r} tier {tname} ({', '.join(n for n, _ in todo)}): "
                                              f"{run.left():.0f}s left, needs ~{guess:.0f}s + {reserve:.0f}s reserve")
                continue
            for name, rdir in todo:
                st = run.servers[name]
                runs.write_json(rdir / f"{tname}.identity.json", ident)
                man = {"run_id": f"{name}-r{r}", "profile": name, "round": r, **run.identity}
                ds = {"kind": "synthetic", "path": str(datasets[tname][r - 1]), "num_prompts": 1}
                t = time.monotonic()
                status = guarded(run, name, functools.partial(
                    bench.run_tier, contest_h, tiers[tname], ds, launcher=launcher, model=str(model), host=st["host"],
                    port=st["port"], rdir=rdir, manifest=man, poll_s=30, runner=runner, env=run.child_env,
                    health_url=f"http://{st['host']}:{st['port']}{st['health']}"))
                took = time.monotonic() - t
                if status is None:
                    continue
                est[tname] = max(est[tname] or 0.0, took)
                res = runs.read_json(runs.result_path(rdir, tname))
                done[name][tname][r] = runs.result_path(rdir, tname)
                run.step(f"round {r} tier {tname} {name}: {res.get('output_throughput', 0):.2f} tok/s",
                         status=status, seconds=round(took, 1), completed=res.get("completed"),
                         failed=res.get("failed"), ttft_ms=res.get("p99_ttft_ms"), tpot_ms=res.get("p99_tpot_ms"))
    return done


def finish_runs(run: Run, names: list[str], done: dict) -> dict[str, Path]:
    """Merge each profile's rounds into reports-style run folders (one <tier>.json per tier), over the
    rounds every profile has for that tier: the profiles' figures then cover the same prompts."""
    out = {}
    for name in names:
        rdir = run.run_dir(name)
        used = {}
        for tname in done[name]:
            common = sorted(set.intersection(*(set(done[n][tname]) for n in names)))
            used[tname] = common
            final = runs.result_path(rdir, tname)
            if common:
                runs.write_json(final, merge_results([runs.read_json(done[name][tname][r]) for r in common]))
            elif final.is_file():
                final.unlink()            # a merge from an earlier invocation that no longer holds
            extra = sorted(set(done[name][tname]) - set(common))
            if extra:
                run.summary["skipped"].append(f"{name} tier {tname}: round(s) {extra} left out of the merge "
                                              "(not every profile has them)")
        st = run.servers.get(name, {})
        prev = runs.read_json(rdir / "manifest.json") if (rdir / "manifest.json").is_file() else {}
        runs.write_json(rdir / "manifest.json", {
            "run_id": name, "profile": name, "harness": True, "model": st.get("model") or prev.get("model"),
            "server": runs.read_json(rdir / "serve.json") if (rdir / "serve.json").is_file() else None,
            "git": runs.git_commit(), "device": runs.device_info(), **run.identity,
            "client": "vllm bench serve (contest options; --num-warmups 0, --ready-check-timeout-sec 0)",
            "rounds": {t: [f"rounds/r{r}/{t}.json" for r in used[t]] for t in used}})
        out[name] = rdir
    return out


def scores(run: Run, run_dirs: dict[str, Path], ref: str) -> dict:
    tiers = contest_mod.tier_names(run.contest)
    complete_runs = {n: d for n, d in run_dirs.items() if all(runs.result_path(d, t).is_file() for t in tiers)}
    out = {}
    if ref not in complete_runs:
        run.summary["score_note"] = f"no proxy score: the reference {ref} lacks a result for some tier"
        return out
    base = score.baseline_from_run(complete_runs[ref], run.contest)
    base["label"] = f"{ref} measured in this run (H200 proxy: {ref} = 60.0)"
    dead = [t for t, m in base["tiers"].items() if not m["tok_s"] > 0]
    if dead:
        run.summary["score_note"] = (f"no proxy score: the reference {ref} served nothing in tier(s) "
                                     f"{', '.join(dead)} (see its server log)")
        return out
    for name, d in complete_runs.items():
        loaded = score.load_run(d, run.contest)
        drift = score.output_drift(loaded, base) if name != ref else None
        # this run's own folders, re-merged from its rounds on every invocation: their scores are redone
        out[name], _ = score.write_report(run.contest, d, loaded, base, drift, shown=str(d.relative_to(run.out)),
                                          force=True)
    return out
