"""The measured tiers of an end-to-end run: the organizers' client with the harness's recorded
changes (harness/gpu/harness.yaml `client_args`), the same synthetic prompts for every profile, one
`vllm bench serve` invocation per (tier, profile) over all of the tier's prompts (as the organizers'
run_throughput.sh runs a tier), tiers in order and the profiles one after the other within a tier,
under a deadline; a finished (tier, profile) of an earlier invocation of the folder is kept; each
profile's run folder and the same-run proxy scores."""

from __future__ import annotations

import functools
import json
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import paths
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..hashing import sha256_file
from ..run import bench, runs, score, synth
from ..run.gpu_harness import change_args, server_differences
from ..run.serve import LOCKED_PORT
from . import final_round
from .client import client_runner
from .servers import guarded, last_error, not_up_error
from .tierguess import kept_estimate, profile_guesses

if TYPE_CHECKING:
    from .session import Run

FAULT_NEED_S = 40.0       # client start, a request cut after a few seconds, two failed tiers
DEFAULT_TIER_ORDER = ["16-32K", "8-16K", "4-8K"]   # the largest expected change first
# the options the tool fills in per tier (contest.yaml client.per_tier) and where the result goes
FILLED_IN = ("--dataset-path", "--num-prompts", "--model", "--served-model-name", "--tokenizer", "--host",
             "--port", "--result-dir", "--result-filename")


# --- what differs from the organizers' command --------------------------------------------------------

def apply_changes(options: list[list[str]], changes: list[list[str]]) -> list[list[str]]:
    """The organizers' options with each change: an option they set takes the change's value(s) in
    its place, one they do not set is appended."""
    out = [list(o) for o in options]
    for ch in changes:
        i = next((k for k, o in enumerate(out) if o[0] == ch[0]), None)
        if i is None:
            out.append(list(ch))
        else:
            out[i] = list(ch)
    return out


def client_changes(h: dict, fixed_output: int | None = None) -> list[dict]:
    """harness.yaml's client changes, each {"args", "why"}; --fixed-output N replaces the per-request
    output lengths."""
    out = [dict(c) for c in h["client_args"]]
    if fixed_output:
        out = [c for c in out if c["args"][0] != "--custom-output-len"]
        out.insert(0, {"args": ["--custom-output-len", str(fixed_output)],
                       "why": f"--fixed-output {fixed_output}: every request asks for {fixed_output} output tokens "
                              "(prompts across each tier's range instead of the official pairs)"})
    return out


def harness_contest(contest: dict, h: dict, fixed_output: int | None = None) -> dict:
    """The contest with the client the harness runs: the organizers' options with the recorded changes."""
    c = json.loads(json.dumps(contest))
    c["client"]["options"] = apply_changes(c["client"]["options"],
                                           [x["args"] for x in client_changes(h, fixed_output)])
    return c


def harness_args(h: dict, extra: list[str]) -> list[str]:
    """What the harness appends to every profile's checked server command."""
    out = change_args(h["server_args"])
    side = h["side_by_side"]
    out += ["--gpu-memory-utilization", str(side["gpu_memory_utilization"])]
    if side.get("kv_cache_memory_bytes"):
        out += ["--kv-cache-memory-bytes", str(side["kv_cache_memory_bytes"])]
    return out + extra


def differences(h: dict, extra: list[str], fixed_output: int | None = None, profile_prefill: int | None = None,
                ports: dict[str, int] | None = None, profile_batch: int = 1) -> list[dict]:
    """Every difference between what the harness runs and the organizers' command, with its reason:
    from harness.yaml, and from this invocation's own options (`ports`: each profile's server port)."""
    side = h["side_by_side"]
    out = server_differences(h["server_args"])
    for name, port in (ports or {}).items():
        if port != LOCKED_PORT:
            out.append({"side": "server", "args": ["--port", str(port)],
                        "why": f"{name}'s server: servers side by side on one machine, each profile on its own port "
                               "(the first on --first-port, the others after it)"})
    out.append({"side": "server", "args": ["--gpu-memory-utilization", str(side["gpu_memory_utilization"])],
                "why": side["why"]})
    if side.get("kv_cache_memory_bytes"):
        out.append({"side": "server", "args": ["--kv-cache-memory-bytes", str(side["kv_cache_memory_bytes"])],
                    "why": side.get("kv_why") or "a fixed KV cache per server skips vLLM's memory profiling, which would count the other "
                           "server's allocations as its own; both servers then start at the same time"})
    if extra:
        out.append({"side": "server", "args": list(extra), "why": "given to this run (--server-arg, --server-args)"})
    if profile_prefill:
        out.append({"side": "server", "args": ["--profiler-config", "<torch profiler, idle until asked>"],
                    "why": f"--profile-prefill {profile_prefill}: one prefill per server under the torch profiler "
                           "after the tiers" if profile_batch <= 1 else
                           f"--profile-prefill {profile_prefill} --profile-batch {profile_batch}: {profile_batch} "
                           "requests of that length at once per server, their decode steps under the torch "
                           "profiler after the tiers"})
    out += [{"side": "client", **c} for c in client_changes(h, fixed_output)]
    return out


def client_line(argv: list[str]) -> str:
    """What a tier's client ran, its per-tier values named rather than given."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in FILLED_IN:
            out += [a, f"<{a[2:]}>"]
            i += 2
            continue
        out.append(shlex.quote(a))
        i += 1
    return "vllm " + " ".join(out)


# --- the prompts --------------------------------------------------------------------------------------

def build_datasets(run: Run, model: Path, n: int, ddir: Path | None = None) -> dict[str, Path]:
    """The same synthetic prompts for every profile: one file per tier with n prompts. By default n
    requests of the contest workload (configs/workload.yaml; evenly spaced by output length), each
    with its own output length; with --fixed-output, prompts across the tier's range. Written to `ddir`
    (default: the results folder's datasets/)."""
    ddir = ddir or run.out / "datasets"
    out: dict[str, Path] = {}
    fixed = run.args.fixed_output
    workload = None if fixed or run.args.round == "final" else synth.load_workload(run.contest)
    for t in run.contest["tiers"]:
        full = ddir / f"{t['name']}.jsonl"
        if run.args.round == "final":
            pairs = final_round.workload_pairs(run.contest, t["name"], n)
            info = synth.build_workload_tier(model, t["name"], pairs, full)
            reqs = [list(x) for x in pairs]
        elif fixed:
            info = synth.build_tier(model, t, n, full)
            reqs = [[t["prompt_tokens"][1], fixed]] * n
        else:
            pairs = synth.stratified(workload["tiers"][t["name"]]["requests"], n)
            info = synth.build_workload_tier(model, t["name"], pairs, full)
            reqs = [list(x) for x in pairs]
        out[t["name"]] = full
        run.summary.setdefault("datasets", {})[t["name"]] = {
            "prompt_tokens": info["prompt_tokens"], "seed": info["seed"], "num_prompts": n,
            "shape": (f"official prompt lengths (configs/workload.yaml), {final_round.FINAL_OUTPUT_LEN} output tokens "
                      "each (the final round)" if run.args.round == "final" else
                      f"{fixed} output tokens per request" if fixed else "contest workload (configs/workload.yaml)"),
            "requests": reqs}
    return out


def fault_datasets(run: Run, datasets: dict[str, Path]) -> dict[str, Path]:
    """One prompt per tier (each tier's first) for the fault check."""
    out = {}
    for name, path in datasets.items():
        p = run.out / "datasets" / "fault" / f"{name}.jsonl"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(path.read_text().splitlines()[0] + "\n")
        out[name] = p
    return out


# --- resuming a folder ----------------------------------------------------------------------------------

def tier_identity(run: Run, dataset: Path) -> dict:
    """What makes two results of one (tier, profile) comparable across invocations of one folder."""
    return {"dataset_sha256": sha256_file(dataset), "client_options": run.client_options, **run.identity}


def _own_capacity(ident, name: str):
    """The identity with `name`'s capacity options alone: another profile's --capacity measured nothing here."""
    if not isinstance(ident, dict) or not isinstance(ident.get("capacity"), dict):
        return ident
    own = {k: v for k, v in ident["capacity"].items() if k == name}
    return {k: v for k, v in ident.items() if k != "capacity"} | ({"capacity": own} if own else {})


def kept_tier(run: Run, rdir: Path, tname: str, ident: dict) -> bool:
    """A finished (tier, profile) from an earlier invocation is kept when it was measured (not
    recorded as failed for a missing server) with the same prompts, client, bundle, server arguments
    and device."""
    if not runs.tier_done(rdir, tname, keep_failed=True):
        return False
    if runs.read_json(runs.result_path(rdir, tname)).get("forge_synthesized"):
        return False
    idf = rdir / f"{tname}.identity.json"
    if not idf.is_file():
        raise ForgeError(f"{rdir}: tier {tname} has a result but no record of what measured it ({idf.name}): a "
                         "folder of an earlier harness (one prompt per round) or not an e2e-gpu folder",
                         hint="give a new --out folder")
    prev, ident = (_own_capacity(x, rdir.name) for x in (runs.read_json(idf), ident))
    if prev != ident:
        words = {"dataset_sha256": "prompts", "client_options": "client options", "bundle_wheel_sha256": "bundle",
                 "server_args": "server arguments", "device": "device"}
        diff = sorted(words.get(k, k) for k in set(ident) | set(prev) if prev.get(k) != ident.get(k))
        raise ForgeError(f"{rdir}: an earlier invocation ran tier {tname} on other {', '.join(diff) or 'settings'}",
                         hint="give a new --out folder, or the same bundle, --num-prompts and server arguments")
    return True


def check_resume(run: Run, names: list[str], datasets: dict[str, Path]) -> None:
    """Refuse, before any server starts, a folder whose finished tiers are not comparable."""
    for name in names:
        for tname, ds in datasets.items():
            kept_tier(run, run.run_dir(name, create=False), tname, tier_identity(run, ds))


def tier_order(run: Run, datasets: dict) -> list[str]:
    return [t for t in (run.args.tier_order or DEFAULT_TIER_ORDER) if t in datasets]


def fully_kept(run: Run, name: str, datasets: dict[str, Path]) -> bool:
    """Every tier this invocation runs is kept from an earlier invocation for this profile: it needs
    no server (a folder can then be extended one profile at a time, the reference measured once, when
    the GPU holds fewer servers than the run has profiles)."""
    order = tier_order(run, datasets)
    return bool(order) and all(kept_tier(run, run.run_dir(name, create=False), t, tier_identity(run, datasets[t]))
                               for t in order)


def tiers_reserve(args, summary: dict, live: list[str]) -> float:
    """Seconds the tiers leave before the deadline: --reserve-s, plus the fault check's need while it
    is still to run (not --no-fault, not kept from an earlier invocation, reference up)."""
    pending = not args.no_fault and not summary.get("fault") and summary.get("reference") in live
    return args.reserve_s + (FAULT_NEED_S if pending else 0.0)


def shortest_tier_need(run: Run, model: Path, names: list[str], datasets: dict[str, Path]) -> tuple[str, list[str], float] | None:
    """Of the tiers with profiles still to measure, the one guessed shortest (bench_tiers skips a tier
    that does not fit and tries the next): its name, those profiles and its guessed seconds, as
    bench_tiers guesses them before measuring anything."""
    best = None
    for tname in tier_order(run, datasets):
        ident = tier_identity(run, datasets[tname])
        todo = [n for n in names if not kept_tier(run, run.run_dir(n, create=False), tname, ident)]
        if todo:
            est = kept_estimate(run, tname, [n for n in names if n not in todo])
            guess = sum(est or g for g in profile_guesses(run, model, tname, todo).values())
            if best is None or guess < best[2]:
                best = (tname, todo, guess)
    return best


# --- the tiers ------------------------------------------------------------------------------------------

def bench_tiers(run: Run, names: list[str], model: Path, datasets: dict[str, Path]) -> dict[str, dict[str, Path]]:
    """One client invocation per (tier, profile), tiers in order and the profiles one after the other
    within a tier; returns {profile: {tier: result file}}. A tier is started for all its profiles still
    to measure or for none, so the profiles of a tier are measured back to back."""
    contest_h = run.contest_h
    tiers = {t["name"]: t for t in run.contest["tiers"]}
    order = tier_order(run, datasets)
    launcher = bench.client_launcher(run.args.client)
    runner = client_runner(run)
    done: dict[str, dict[str, Path]] = {n: {} for n in names}
    reserve = tiers_reserve(run.args, run.summary, names)
    scale = None                  # measured time over the guess, the largest of this invocation's tiers
    for tname in order:
        ident = tier_identity(run, datasets[tname])
        n = run.summary["datasets"][tname]["num_prompts"]
        todo = []
        for name in names:
            rdir = run.run_dir(name)
            if kept_tier(run, rdir, tname, ident):
                done[name][tname] = runs.result_path(rdir, tname)
                run.step(f"tier {tname} {name}: kept from an earlier invocation")
            else:
                todo.append((name, rdir))
        if not todo:
            continue
        # what a served (tier, profile) took then is the best guess for the other profile's
        est = kept_estimate(run, tname, [name for name in names if tname in done[name]])
        firsts = profile_guesses(run, model, tname, [name for name, _ in todo])
        guess = sum(est or firsts[name] * (scale or 1.0) for name, _ in todo)
        if run.left() - reserve < guess:
            run.summary["skipped"].append(f"tier {tname} ({', '.join(n for n, _ in todo)}): "
                                          f"{run.left():.0f}s left, needs ~{guess:.0f}s + {reserve:.0f}s reserve")
            continue
        for name, rdir in todo:
            st = run.servers[name]
            runs.write_json(rdir / f"{tname}.identity.json", ident)
            # the run's manifest as it stands: the client adds this tier's exact command line to it
            mpath = rdir / "manifest.json"
            man = {**(runs.read_json(mpath) if mpath.is_file() else {}), "run_id": name, "profile": name,
                   "harness": True, **run.identity}
            ds = {"kind": "synthetic", "path": str(datasets[tname]), "num_prompts": n}
            pre0 = final_round.preemptions(st["host"], st["port"])
            t = time.monotonic()
            status = guarded(run, name, functools.partial(
                bench.run_tier, contest_h, tiers[tname], ds, launcher=launcher, model=str(model), host=st["host"],
                port=st["port"], rdir=rdir, manifest=man, poll_s=30, runner=runner, env=run.child_env,
                health_url=f"http://{st['host']}:{st['port']}{st['health']}"))
            took = time.monotonic() - t
            if status is None:
                # the client's run of this (tier, profile) failed: the error is in server_errors, its output
                # in the tier's client log; the run fails at its end (tier_failure_error)
                run.tier_failures.append((tname, name, last_error(run, name)))
                continue
            if status in SERVER_GONE:
                # the tier is recorded with every request failed (scored so), and the run fails at its end
                log = f"; its log: {paths.rel(Path(st['log']))}" if st.get("log") else ""
                run.tier_failures.append((tname, name, SERVER_GONE[status] + log))
            scale = max(scale or 0.0, took / firsts[name])
            res = runs.read_json(runs.result_path(rdir, tname))
            done[name][tname] = runs.result_path(rdir, tname)
            pre1 = final_round.preemptions(st["host"], st["port"])
            preempted = pre1 - pre0 if pre0 is not None and pre1 is not None else None
            run.summary.setdefault("preemptions", {}).setdefault(name, {})[tname] = preempted
            run.step(f"tier {tname} {name}: {res.get('output_throughput', 0):.2f} tok/s",
                     status=status, seconds=round(took, 1), completed=res.get("completed"), preemptions=preempted,
                     failed=res.get("failed"), ttft_ms=res.get("p99_ttft_ms"), tpot_ms=res.get("p99_tpot_ms"))
    return done


# a tier whose server went away (bench.run_tier's status): its requests are recorded as failed
SERVER_GONE = {"server-died": "its server died during the tier (every request of the tier is recorded as failed)",
               "server-down": "its server was not answering when the tier began (every request of the tier is "
                              "recorded as failed)"}


def run_failure(run: Run, not_up: list[str]) -> ForgeError | None:
    """What failed the run (exit 1) once it measured what it could: servers of `not_up` that never came up,
    then the (tier, profile)s whose client failed or whose server went away (run.tier_failures); None where
    nothing did."""
    errs = ([not_up_error(run, not_up)] if not_up else []) + \
        ([tier_failure_error(run, run.tier_failures)] if run.tier_failures else [])
    if len(errs) < 2:
        return errs[0] if errs else None
    return ForgeError(f"{errs[0].message}; and {errs[1].message}", hint=errs[0].hint, exit_code=1)


def tier_failure_error(run: Run, failures: list[tuple[str, str, str]]) -> ForgeError:
    """The run's failure (exit 1: it ran, and failed) where some (tier, profile)s failed in this invocation
    (the client failed, or the server went away): each one's error (as recorded when it failed) and its
    client log."""
    def one(tname: str, name: str, err: str) -> str:
        log = run.run_dir(name, create=False) / f"{tname}.client.log"
        return (f"tier {tname} of {name}: {err}"
                + (f"; its client log: {paths.rel(log)}" if log.is_file() else ""))
    return ForgeError(f"{len(failures)} (tier, profile) run(s) failed and are not measured: "
                      + "; ".join(one(*f) for f in failures),
                      hint=f"read the logs named, fix the cause and run the same --out again ({paths.rel(run.out)}): "
                           "the tiers measured are kept and only the failed ones run; summary.json server_errors "
                           "has each error whole", exit_code=1)


def finish_runs(run: Run, names: list[str], done: dict) -> dict[str, Path]:
    """Each profile's run folder as `forge score` reads it: its tier results and a manifest that says
    what ran (server record, client command line, identity)."""
    out = {}
    for name in names:
        rdir = run.run_dir(name)
        st = run.servers.get(name, {})
        mpath = rdir / "manifest.json"
        prev = runs.read_json(mpath) if mpath.is_file() else {}
        serve_json = rdir / "serve.json"
        commands = {t: c for t, c in (prev.get("client_commands") or {}).items() if t in done[name]}
        runs.write_json(mpath, {
            "run_id": name, "profile": name, "harness": True, "model": st.get("model") or prev.get("model"),
            "round": run.args.round,          # whose client measured the tiers (forge score --round takes it)
            "server": runs.read_json(serve_json) if serve_json.is_file() else None,
            "git": runs.git_commit(), "device": runs.device_info(), **run.identity,
            "client": run.client_line, "client_commands": commands,
            "differences": run.summary.get("differences"),
            "tiers": sorted(done[name], key=contest_mod.tier_names(run.contest).index)})
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
        # this run's own folders, rewritten on every invocation: their scores are redone
        out[name], _ = score.write_report(run.contest, d, loaded, base, drift, shown=str(d.relative_to(run.out)),
                                          force=True)
    return out
