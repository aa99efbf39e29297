"""`forge bench-all-tiers`: the contest's three tiers through vLLM's own client (`vllm bench serve`)
with the contest's options, one result file per tier in reports/runs/<run-id>/, resumable."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

from .. import options, paths, proc, ui
from ..contest import rules as contest_mod
from ..contest import unread
from ..contest.profiles import loopback_env
from ..errors import ForgeError
from . import bench_data, final_client, runs, serve, server_record
from .runs import result_path, set_aside_failed, tier_done

CLIENT_ENV = "FORGE_BENCH_CLIENT"
failed_result = runs.failed_result   # the result of a tier the server could not serve


def client_launcher(arg: str | None) -> list[str]:
    """How to start vLLM's CLI for `bench serve`: --client, $FORGE_BENCH_CLIENT, `vllm` on PATH,
    or this Python's vllm module."""
    if arg is not None:
        return proc.split_command(arg, "--client")
    if os.environ.get(CLIENT_ENV):
        return proc.split_command(os.environ[CLIENT_ENV], CLIENT_ENV)
    if shutil.which("vllm"):
        return ["vllm"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def python_of(launcher: list[str]) -> str | None:
    """The interpreter behind a launcher: `python -m ...` or a console script's #! line."""
    exe = shutil.which(launcher[0]) or launcher[0]
    if "python" in Path(exe).name:
        return exe
    try:
        first = Path(exe).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    return first[2:].strip().split()[0] if first.startswith("#!") else None


def client_args(contest: dict, *, dataset: Path, num_prompts: int, model: str, host: str, port: int,
                result_dir: Path, result_name: str, per_request_output: bool = False,
                ignore_eos: bool = False, overrides: dict[str, str] | None = None) -> list[str]:
    """`bench serve` with the contest's client options, `overrides` ({option: value}: a round's
    client, final_client.tier_plan) replacing theirs. per_request_output: each dataset line's
    `output_tokens` is its cap (--custom-output-len -1, the contest workload); ignore_eos: every
    request runs to that length (a harness run: random weights)."""
    out = ["bench", "serve"]
    for opt in contest["client"]["options"]:
        if overrides and opt[0] in overrides:
            opt = [opt[0], overrides[opt[0]]]
        if per_request_output and opt[0] == "--custom-output-len":
            opt = ["--custom-output-len", "-1"]
        out += opt
    if ignore_eos:
        out.append("--ignore-eos")
    out += ["--dataset-path", str(dataset), "--num-prompts", str(num_prompts),
            "--model", model, "--served-model-name", contest["server"]["served_model_name"],
            "--host", host, "--port", str(port),
            "--result-dir", str(result_dir), "--result-filename", result_name]
    return out


CLIENT_TAIL = 4          # the client's last arguments (--result-dir DIR --result-filename FILE): this run's alone


def _stop_stale_client(manifest: dict) -> None:
    """Stop the client an interrupted run left running, and only it: the process the manifest names
    must be of this boot, have its recorded start time, end its command line with the client's
    recorded arguments and lead its recorded process group. A record that does not hold is dropped
    with a warning and nothing is signalled (its pid names another process now)."""
    c = manifest.pop("client_running", None)
    if not c:
        return
    if not (isinstance(c, dict) and all(type(c.get(k)) is int and c[k] > 0 for k in ("pid", "pgid"))
            and isinstance(c.get("start_time"), (str, type(None)))):
        ui.warn(f"the manifest's client_running record is malformed ({str(c)[:80]}); nothing was signalled")
        return
    why = proc.recorded_process(c["pid"], c["pgid"], c["start_time"], c.get("boot_id"), list(c.get("argv_tail") or []))
    if why == proc.GONE:
        return
    if why:
        ui.warn(f"the manifest names a client left running (pid {c['pid']}), but that process is not it ({why}); "
                "nothing was signalled")
        return
    ui.warn(f"stopping a client left running by an interrupted run (pid {c['pid']})")
    proc.stop_group(c["pgid"], grace_s=10)


def run_tier(contest: dict, tier: dict, ds: dict, *, launcher: list[str], model: str, host: str, port: int,
             rdir: Path, manifest: dict, health_url: str, poll_s: float = 15.0, runner=None,
             ignore_eos: bool = False, env: dict[str, str] | None = None) -> str:
    """One tier through vLLM's client. `runner(argv, log) -> exit code`, when given, runs the client
    invocation `argv` (from "bench serve" on) itself, e.g. in a long-lived client process. `env` is
    added to a fresh client's environment."""
    name = tier["name"]
    final = result_path(rdir, name)
    partial = rdir / f"{name}.client.json"
    log = rdir / f"{name}.client.log"
    for p in (partial,):
        if p.exists():
            p.unlink()
    if not serve.health_ok(health_url):
        ui.warn(f"tier {name}: the server does not answer {health_url}; its requests are recorded as failed")
        runs.write_json(final, runs.failed_result(contest, name, ds["num_prompts"], f"server not reachable at {health_url}"))
        return "server-down"
    argv = client_args(contest, dataset=Path(ds["path"]), num_prompts=ds["num_prompts"], model=model,
                       host=host, port=port, result_dir=rdir, result_name=partial.name,
                       per_request_output=bool(ds.get("requests")), ignore_eos=ignore_eos,
                       overrides=tier.get("client"))
    cmd = launcher + argv
    manifest.setdefault("client_commands", {})[name] = proc.fmt(cmd)
    if runner is not None:
        runs.write_json(rdir / "manifest.json", manifest)
        rc = runner(argv, log)
        return _tier_outcome(contest, name, ds, rc, partial, final, log, rdir, health_url)
    p = proc.start(cmd, log=log, env={**(env or {}), **loopback_env()}, what="vllm bench serve",
                   hint="install vLLM (our wheel) or pass --client",
                   die_with_parent=True)   # a client whose forge was killed writes a result no one moves into place
    manifest["client_running"] = {"pid": p.pid, "pgid": os.getpgid(p.pid),
                                  "start_time": proc.process_start_time(p.pid), "boot_id": proc.boot_id(),
                                  "argv_tail": [str(a) for a in cmd[-CLIENT_TAIL:]], "tier": name}
    runs.write_json(rdir / "manifest.json", manifest)
    t0 = last = time.monotonic()
    try:
        while p.poll() is None:
            time.sleep(0.2)
            if time.monotonic() - last >= poll_s:
                last = time.monotonic()
                ui.info(f"tier {name}: running {last - t0:.0f}s (log: {paths.rel(log)})")
    except BaseException:
        proc.stop_group(manifest["client_running"]["pgid"], grace_s=5)
        manifest.pop("client_running", None)
        runs.write_json(rdir / "manifest.json", manifest)
        raise
    manifest.pop("client_running", None)
    return _tier_outcome(contest, name, ds, p.returncode, partial, final, log, rdir, health_url)


def _tier_outcome(contest: dict, name: str, ds: dict, rc: int, partial: Path, final: Path, log: Path, rdir: Path,
                  health_url: str) -> str:
    if rc == 0 and partial.is_file():
        os.replace(partial, final)
        return "done"
    if not serve.health_ok(health_url):
        ui.warn(f"tier {name}: the client failed and the server is gone; its requests are recorded as failed")
        runs.write_json(final, runs.failed_result(contest, name, ds["num_prompts"],
                                             f"server died; client exit {rc}"))
        return "server-died"
    raise ForgeError(f"tier {name}: vllm bench serve failed (exit {rc}) while the server is up\n"
                     f"--- last lines of {paths.rel(log)} ---\n{proc.tail(log, 25)}",
                     hint="finished tiers are kept; fix the cause and rerun with --run-id " + rdir.name)


def no_server_error(health: str, port: int, st: dict | None, given_port: bool) -> ForgeError:
    """Why nothing answers `health`: no server at all, or one on another port."""
    other = server_record.running_server() if given_port else None
    if other and other.get("port") != port:
        return ForgeError(f"no server answers {health}: the server `forge serve` started listens on port "
                          f"{other['port']}, not {port}",
                          hint=f"drop --port (or use --port {other['port']})")
    if st:
        return ForgeError(f"the server `forge serve` started (profile {st.get('profile')}, pid {st.get('pid')}) does "
                          f"not answer {health}", hint="see its server.log; make stop && make serve")
    return ForgeError(f"no server answers {health}: nothing to benchmark"
                      + ("" if given_port else f" (no server started by forge serve; port {port} is the default)"),
                      hint="start one with make serve PROFILE=... MODEL=..., or give the port it listens on "
                           "(--port N)")


def run_tiers(*, profile: str | None = None, run_id: str | None = None, model: str | None = None,
              data_dir: str | None = None, tiers: list[str] | None = None, num_prompts: int | None = None,
              client: str | None = None, port: int | None = None, progress_every: float = 30.0,
              keep_failed: bool = False, harness: bool = False, contest: dict | None = None,
              round_name: str | None = None, concurrency: dict[str, int] | None = None,
              client_env: dict[str, str] | None = None) -> Path:
    """Run the contest's tiers (or the named ones) against the running server and return the run
    folder. With no `port`, the server `forge serve` started (else the locked port). A run id that
    exists is resumed: finished tiers are kept, tiers with failed requests run again unless
    `keep_failed`. `round_name` picks the round's client (final_client; default the preliminary's),
    `concurrency` ({tier: n}) a final-round tier's concurrency; `client_env` is added to the client's
    environment (a GPU harness's site folder, gpu_harness.site_env). Raises ForgeError (exit code 1) when a
    tier has failed requests."""
    contest = contest or contest_mod.load_contest()
    rnd = final_client.check_round(contest, round_name)
    # the command line is checked before a server is asked; only tiers run read their CONCURRENCY_<tier>:
    # without --tiers those are known once the server is (a final-round server runs its own tier)
    chosen, plan = contest["tiers"], None
    if tiers is not None:
        unknown = [w for w in tiers if w not in contest_mod.tier_names(contest)]
        if unknown or not tiers:
            raise ForgeError(f"unknown tier(s) {', '.join(unknown)}" if unknown else "--tiers names no tier",
                             hint=f"tiers: {', '.join(contest_mod.tier_names(contest))}")
        chosen, plan = final_client.tier_plan(contest, rnd, [t for t in chosen if t["name"] in tiers],
                                              num_prompts=num_prompts, concurrency=concurrency)
    if run_id is not None:
        runs.check_run_id(run_id)
    if profile is not None:
        paths.plain_name(profile, "--profile")      # a label that becomes part of a new run id
    client_launcher(client)
    st = server_record.running_server() if port is None else None
    host = contest["server"]["host"]
    given_port = port is not None
    port = port or (st["port"] if st else serve.LOCKED_PORT)
    health = f"http://{host}:{port}{contest['server']['health_path']}"
    if not serve.health_ok(health):
        raise no_server_error(health, port, st, given_port)
    if st and profile and profile != st["profile"]:
        ui.warn(f"the running server uses profile {st['profile']}, not {profile}; recording {st['profile']}")
    profile = (st or {}).get("profile") or profile
    model = model or (st or {}).get("model") or os.environ.get("MODEL") or None
    if not model:
        raise ForgeError("no model directory for the client's tokenizer",
                         hint="pass --model DIR (or MODEL=DIR), or start the server with forge serve")
    run_id = run_id or (st or {}).get("run_id") or runs.new_run_id(profile)
    rdir = runs.run_dir(run_id, create=False)
    # the server forge serve started (else the run's record of one) measures in its round, on its tier
    rec = Path(st["run_dir"]) / "serve.json" if st and st.get("run_dir") else rdir / "serve.json"
    own, conc, whence = final_client.for_server(rnd, runs.read_json(rec) if rec.is_file() else None, tiers)
    if own != tiers or (conc and not concurrency):
        if tiers is None:
            ui.info(f"the server answering now was started for tier {own[0]}: the {rnd.name} round's client runs it")
        chosen, plan = final_client.tier_plan(contest, rnd, [t for t in contest["tiers"] if t["name"] in own],
                                              num_prompts=num_prompts, concurrency=concurrency or conc,
                                              **({} if concurrency else {"concurrency_from": whence}))
    elif plan is None:
        chosen, plan = final_client.tier_plan(contest, rnd, chosen, num_prompts=num_prompts, concurrency=concurrency)
    created = not rdir.exists()
    rdir = runs.run_dir(run_id)
    try:
        _bench_in(contest, st, host, port, health, profile, model, run_id, rdir, chosen,
                  data_dir=data_dir or os.environ.get("DATA_DIR") or None, num_prompts=num_prompts,
                  client=client, progress_every=progress_every, keep_failed=keep_failed, harness=harness,
                  plan=plan, client_env=client_env)
    except BaseException:
        # an early error leaves no empty run folder behind; what the run made (the client log an
        # error points at, built datasets, the manifest) stays for the rerun
        if created:
            runs.prune_empty(rdir)
        raise
    return rdir


def cmd_bench(args) -> int:
    contest = contest_mod.load_contest()
    tiers = options.tier_items(args.tiers, contest_mod.tier_names(contest))
    note = unread.unread_note(contest, args.round, "client", "add --round final, make bench-all-tiers ROUND=final, "
                              "to run the final round's client")
    if note:
        ui.warn(note)
    print(run_tiers(profile=args.profile, run_id=args.run_id, model=args.model, data_dir=args.data_dir, tiers=tiers,
                    num_prompts=args.num_prompts, client=args.client, port=args.port, contest=contest,
                    progress_every=args.progress_every, keep_failed=args.keep_failed, harness=args.harness,
                    round_name=args.round))
    return 0


def _bench_in(contest: dict, st: dict | None, host: str, port: int, health: str, profile: str | None,
              model: str, run_id: str, rdir: Path, tiers: list[dict], *, data_dir: str | None,
              num_prompts: int | None, client: str | None, progress_every: float, keep_failed: bool,
              harness: bool, plan: dict, client_env: dict[str, str] | None = None) -> None:
    mpath = rdir / "manifest.json"
    manifest = runs.read_json(mpath) if mpath.is_file() else {}
    final_client.check_resume(manifest, plan, run_id, [t["name"] for t in tiers if tier_done(rdir, t["name"])], rdir)
    # one run, one profile: a resume measures with the profile its tiers and server record have
    again = f"start a new run (omit --run-id, or give a new one), or resume {run_id} with a server of the " \
            f"profile it was measured with: forge serve --profile {{prior}} --run-id {run_id}"
    runs.refuse_other_profile(rdir, profile, "the server answering now runs", hint=again)
    serve_json = rdir / "serve.json"
    srv = runs.read_json(serve_json) if serve_json.is_file() else None
    if profile and isinstance(srv, dict) and srv.get("profile") not in (None, profile):
        raise ForgeError(f"run {run_id}: its server record {paths.rel(serve_json)} is of profile {srv['profile']}; "
                         f"the server answering now runs profile {profile}", hint=again.format(prior=srv["profile"]))
    _stop_stale_client(manifest)
    launcher = client_launcher(client)
    if isinstance(srv, dict) and srv.get("tier"):
        # the final round starts a server per tier: each tier's own record, beside the latest one's
        prior = manifest.get("servers_by_tier") or {}
        if not isinstance(prior, dict):
            raise ForgeError(f"{paths.rel(mpath)}: key 'servers_by_tier' is {type(prior).__name__}, not a mapping of "
                             "tier to server record", hint="restore the file, or start a new run (omit --run-id)")
        manifest["servers_by_tier"] = {**prior, srv["tier"]: srv}
    manifest.update({
        "run_id": run_id, "profile": profile, "created": manifest.get("created") or runs.now_iso(),
        "updated": runs.now_iso(), "git": runs.git_commit(),
        "server": srv if srv is not None else {"host": host, "port": port, "started_by_forge": False},
        "scored_port": port == serve.LOCKED_PORT, "model": str(model), "device": runs.device_info(),
        "client": proc.fmt(launcher + ["bench", "serve"]),
    })
    if manifest.get("harness") is not None and manifest["harness"] != harness:
        raise ForgeError(f"run {run_id} was started {'with' if manifest['harness'] else 'without'} --harness",
                         hint="resume it the same way, or start a new run (omit --run-id)")
    manifest["harness"] = harness
    if "vllm" not in manifest:
        manifest["vllm"] = runs.vllm_provenance(python_of(launcher), env=client_env)
    manifest["datasets"] = bench_data.datasets(contest, tiers, data_dir, model, rdir, num_prompts, manifest,
                                              save=lambda: runs.write_json(mpath, manifest))
    manifest.setdefault("tiers", {})
    final_client.record(manifest, plan, [t["name"] for t in tiers if not tier_done(rdir, t["name"], keep_failed)])
    runs.write_json(mpath, manifest)

    def on_term(signum, frame):             # ends as Ctrl-C does; the command exits 128 + 15, as other verbs do
        raise proc.Terminated(signum)
    old = signal.signal(signal.SIGTERM, on_term)
    failures: dict[str, str] = {}
    try:
        for i, t in enumerate(tiers, 1):
            name = t["name"]
            if tier_done(rdir, name, keep_failed=keep_failed):
                prev = runs.read_json(result_path(rdir, name))
                if runs.record_kept_tier(manifest, name, prev):
                    runs.write_json(mpath, manifest)
                ui.info(f"tier {name} ({i}/{len(tiers)}): already done in run {run_id}; kept"
                        + (f" with its {prev.get('failed')} failed request(s) (--keep-failed)" if prev.get("failed") else ""))
                continue
            aside = set_aside_failed(rdir, name)
            if manifest["tiers"].pop(name, None) is not None:
                runs.write_json(mpath, manifest)   # the record of a result no longer there
            if aside:
                ui.info(f"tier {name}: the earlier result is not a complete one (failed requests, or unreadable); "
                        f"set aside as {paths.rel(aside)} and run again (--keep-failed keeps one with failed requests)")
            ds = manifest["datasets"][name]
            with ui.step(f"tier {name} ({i}/{len(tiers)}): {ds['num_prompts']} {ds['kind']} prompts"):
                t0 = time.monotonic()
                status = run_tier(contest, t, ds, launcher=launcher, model=str(model), host=host, port=port,
                                  rdir=rdir, manifest=manifest, health_url=health, poll_s=progress_every,
                                  ignore_eos=harness, env=client_env)
                res = runs.read_json(result_path(rdir, name))
                manifest["tiers"][name] = runs.tier_record(status, res, round(time.monotonic() - t0, 1))
                runs.write_json(mpath, manifest)
                ui.info(f"tier {name}: {res.get('output_throughput', 0):.2f} output tok/s, "
                        f"{res.get('completed')} completed, {res.get('failed')} failed")
                if status == "server-down":
                    failures[name] = f"the server stopped answering {health} before the tier"
                elif status == "server-died":
                    failures[name] = f"the server died during the tier (no answer at {health})"
                elif res.get("failed"):
                    err = next((e for e in res.get("errors") or [] if e), "")
                    failures[name] = f"{res['failed']} of {res['failed'] + res.get('completed', 0)} requests failed" \
                                     + (f" (first error: {str(err).strip().splitlines()[-1][:200]})" if err else "")
    finally:
        signal.signal(signal.SIGTERM, old)
    if failures:
        raise ForgeError(f"run {run_id}: {len(failures)} of {len(tiers)} tier(s) have failed requests:\n"
                         + "\n".join(f"  {n}: {why}" for n, why in failures.items()),
                         hint=f"fix the server and rerun with --run-id {run_id} (make bench-all-tiers RUN={run_id}): "
                              "tiers with failed requests run again; --keep-failed keeps them", exit_code=1)


def register(sub) -> None:
    p = sub.add_parser("bench-all-tiers", help="run the contest's tiers with `vllm bench serve` against the server",
                       description="For each tier, run vLLM's own benchmark client with the contest's options "
                                   "(configs/contest.yaml client.options) on the official tier file in DATA_DIR, "
                                   "or on the contest's request shape (configs/workload.yaml): one synthetic prompt "
                                   "per (input_len, output_len) pair of the official DCU run, exactly input_len "
                                   "tokens of the model's tokenizer, each with its own output length "
                                   "(--custom-output-len -1; end-of-text honoured unless --harness). "
                                   "Results go to reports/runs/<run-id>/<tier>.json with manifest.json. Rerunning "
                                   "with the same --run-id keeps finished tiers and runs the rest; a tier with "
                                   "failed requests runs again unless --keep-failed. Exits 1 when a tier has "
                                   "failed requests, 2 when no server answers.")
    p.add_argument("--profile", default=None, help="profile label when the server was not started by forge serve")
    p.add_argument("--run-id", help="run to write or resume (default: the running server's run, else a new one)")
    p.add_argument("--model", help="model directory for the tokenizer (default: the running server's, or $MODEL)")
    p.add_argument("--data-dir", help="folder with the official tier files (default: $DATA_DIR)")
    p.add_argument("--tiers", help="comma-separated subset of tiers (default: all; in the final round, against a "
                                   "server forge serve started for a tier: that tier, and no other)")
    p.add_argument("--num-prompts", type=options.count_upto(bench_data.MOST_PROMPTS, bench_data.MOST_PROMPTS_WHAT),
                   help=f"prompts per tier, 1 to {bench_data.MOST_PROMPTS:,} (default: every official prompt with DATA_DIR, else every request of "
                        "configs/workload.yaml; fewer: a subset evenly spaced by output length)")
    p.add_argument("--harness", action="store_true",
                   help="the server runs random weights (a GPU machine's harness): end-of-text is ignored so "
                        "each request produces its output length, and the run is marked harness (scored only "
                        "against harness runs)")
    p.add_argument("--client", help="command that runs vLLM's CLI (default: $FORGE_BENCH_CLIENT, `vllm`, or "
                                    "this Python's vllm module); `bench serve ...` is appended")
    p.add_argument("--port", type=options.port, default=None,
                   help="server port when not started by forge serve (default: the running server's, else 8001)")
    p.add_argument("--progress-every", type=options.number_in(0, 86400, "seconds", "30", True), default=30.0, help="seconds between progress lines")
    p.add_argument("--round", default=None,
                   help="the round whose client runs (default: the preliminary's, one request at a time at rate "
                        "1); final: per tier --max-concurrency (CONCURRENCY_4_8K, CONCURRENCY_8_16K, "
                        "CONCURRENCY_16_32K, else the round's 10), --request-rate inf, 1024 outputs, 80 / 70 / 60 "
                        "requests (--num-prompts overrides them and is recorded as a difference), 2 warm-ups; "
                        "the manifest records the round and each tier's settings, and a run of another round "
                        "is not resumed. A server forge serve started is measured in its own round only; in the "
                        "final round its tier's CONCURRENCY_<tier>, when unset now, is the one its start took from "
                        "the profile or the environment")
    p.add_argument("--keep-failed", action="store_true",
                   help="on resume, keep tiers whose result has failed requests (default: set them aside in "
                        "failed/ and run them again)")
    p.set_defaults(func=cmd_bench)
