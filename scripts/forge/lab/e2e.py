"""`forge e2e-gpu`: the end-to-end run on a GPU machine, from the bundle `make gpu-bundle` built.

One invocation: verify and install the bundle (harness build of the patched vLLM, extra wheels, model
directory), start each profile's server through the same code as `forge serve`: the organizers' full
command (configs/contest.yaml, vLLM's default compilation config included) with the profile's
environment, plus only what a GPU machine without the real weights needs (harness/gpu/harness.yaml
`server_args` and `side_by_side`, each recorded with its reason), all servers side by side on the one
GPU, then:
  1. warm each server (the first request compiles the Triton kernels; not measured);
  2. plumbing check: greedy completions of the same prompts from the first profile and from the
     reference profile (same random weights), compared token by token and by first-token logprobs;
  3. the contest's tiers through the organizers' client (`vllm bench serve --backend openai-chat
     --endpoint /v1/chat/completions`, temperature 0, two warm-up requests), changed only as
     harness.yaml `client_args` says (each request's official output length, end-of-text ignored:
     the weights are random): one invocation per (tier, profile) over all the tier's prompts, tiers in
     order and the profiles one after the other within a tier, while the deadline allows;
     a finished (tier, profile) of an earlier invocation of the folder is kept, and a profile whose
     every tier is kept gets no server, so a run can be extended one profile at a time beside a
     reference measured once (two servers fit one GPU), or the reference added to a profile measured
     alone where one server fits (another profile's --capacity leaves a profile's tiers kept); with
     --profile-prefill, one long prefill per server under the torch profiler afterwards (with
     --profile-decode, and that many decode steps; with --profile-batch B, B such requests at once
     and their decode steps at batch B instead);
  4. fault check, once every tier is measured: the reference server is killed in the middle of a tier
     (one prompt per tier); the client records the failed request and the score marks the tier failed;
  5. a proxy score of every profile against the reference measured in the same run (reference =
     60.0; needs every tier), each request's TPOT saving beside the kernel benchmark's prediction
     (decode.{md,json}, as `forge e2e-decode`), and summary.{md,json} with the differences from the
     organizers' command (with --stack-every, where each server process's main thread was: stacks.json).
Servers left up by an earlier invocation of the folder (--keep-servers) are reused when they run the
same command and answer /health, so a run longer than one command resumes without starting them
again. Results land in --out (default reports/e2e/<date>-<device>/); --pack FILE rewrites a .tar.gz of
it after every step, so a run cut short still returns what it finished.
Nothing is written or started before every check that can refuse the invocation has passed: the options, the
model folder (its config.json and tokenizer), the bundle and its install, a folder being resumed, the
deadline, a profile (--profile-prefill, one request or a batch) the servers' command lines allow, the servers'
memory on the GPU they share (the card's total as nvidia-smi, hy-smi or rocm-smi reports it: servers x
--gpu-memory-utilization at most 1, and each server's --kv-cache-memory-bytes within its share beside its
weights per rank; where none of these tools answers, the memory is not checked and the run's summary says so),
the servers' ports free, and the commands the servers and the client run (--vllm, --client: their program
there; where it is vLLM's own CLI, vLLM installed for its Python unless the bundle installs it, and for the
servers a GPU it sees: where no card tool answers, torch's device count in that Python); a refusal
(exit code 2) leaves no results folder, and one being resumed as it was. A run exits 1 (its results kept)
where its plumbing check fails, where a profile's server never came up (nothing was measured on it, so
nothing is compared against it; the error line names the server, its error and its log), or where a
(tier, profile) failed: its client failed, or its server died during the tier or was gone when it began
(its requests are recorded as failed and scored so; the line names each, its error and its logs; the next
invocation of the same --out runs only what is missing). While it runs, the card's own tool (nvidia-smi,
hy-smi or rocm-smi) samples the GPU every 5 s into logs/gpu-monitor.log: utilization, power, memory and the
processes on the card, clocks and temperature too with nvidia-smi and rocm-smi (forge.lab.gpumon).
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
import time
from pathlib import Path

from .. import options, paths, proc, ui
from ..errors import ForgeError
from ..run import serve, synth
from ..run.bench_data import MOST_PROMPTS, MOST_PROMPTS_WHAT
from ..run.gpu_harness import DEFAULT_SITE
from . import batch_profile, e2e_decode, final_round, gpu_bundle, gpumon, prefill_profile, preflight, stacks
from .client import client_runner
from .fault import fault_check
from .install import install_only, versions
from .packing import TRITON_MANIFEST, TRITON_PART_MIB, pack_triton_cache, seed_triton_cache
from .plumbing import PLUMBING_PROMPT_TOKENS, plumbing
from .serverlog import log_facts
from .servers import adopt_or_stop, guarded, not_up_error, start_all, stop_all, stop_left_servers
from .session import Run
from .tiers import (
    DEFAULT_TIER_ORDER,
    FAULT_NEED_S,
    bench_tiers,
    finish_runs,
    run_failure,
    scores,
)

FIRST_PORT = serve.LOCKED_PORT
# the servers' start and warm-up side by side on one GPU, before any tier (measured on an H200 with an
# empty Triton cache: two servers ready in 253 s and warm at 344 s)
GUESS_START_S = 345.0
MAX_PROFILE_DECODE = 512             # decode steps in one profiled request (a trace grows ~1 MiB per 10 steps)


# what --install-only and --stop-servers use; the verb's every other option is the run's
ALONE_USES = {"install_only": ("bundle", "site", "install_only", "func"), "stop_servers": ("out", "stop_servers", "func")}
ALONE_DOES = {"install_only": "installs the bundle into --site and exits",
              "stop_servers": "stops the servers an earlier invocation left up in --out and exits (a run without "
                              "--keep-servers stops its own at its end)"}


def refuse_alone_extras(args, parser: argparse.ArgumentParser, flag: str) -> None:
    """--install-only and --stop-servers each do one thing and exit: an option of the run given a value other
    than its default (the parser's own defaults, so an option added later is covered) would be ignored, and
    is refused by name."""
    defaults = vars(parser.parse_args([]))
    given = [f"--{k.replace('_', '-')}" for k, v in defaults.items()
             if k not in ALONE_USES[flag] and getattr(args, k, v) != v]
    if given:
        name = "--" + flag.replace("_", "-")
        raise ForgeError(f"{name} {ALONE_DOES[flag]}, so {', '.join(given)} would be ignored; run without {name} "
                         "to run with them", hint=f"or drop them to use {name} alone")


def cmd_e2e(args, parser: argparse.ArgumentParser) -> int:
    if args.stop_servers:
        refuse_alone_extras(args, parser, "stop_servers")
        if not args.out:
            raise ForgeError("--stop-servers needs --out: the results folder whose servers to stop",
                             hint="give the --out of the invocation that left them up (--keep-servers)")
        n = stop_left_servers(Path(args.out))
        ui.info(f"{n} server(s) stopped" if n else f"no server of {args.out} is up; nothing to stop")
        return 0
    if args.install_only:
        refuse_alone_extras(args, parser, "install_only")
        return install_only(args.bundle, Path(args.site))
    if args.profile_decode and not args.profile_prefill:
        raise ForgeError(f"--profile-decode {args.profile_decode} profiles the decode steps of the request that "
                         "--profile-prefill sends, and none is sent without it",
                         hint="add --profile-prefill TOKENS (the prompt's length)")
    if args.profile_batch > 1 and not (args.profile_prefill and args.profile_decode):
        raise ForgeError(f"--profile-batch {args.profile_batch} profiles the decode steps of {args.profile_batch} "
                         "requests of --profile-prefill TOKENS tokens each, --profile-decode STEPS of them, and "
                         + ("neither is given" if not (args.profile_prefill or args.profile_decode) else
                            f"--profile-{'decode' if args.profile_prefill else 'prefill'} is not given"),
                         hint="add --profile-prefill TOKENS --profile-decode STEPS (e.g. --profile-prefill 20000 "
                              "--profile-decode 64)")
    run = Run(args)
    names, ref = run.names, run.ref
    # every check that can refuse the invocation, then the results folder (nothing is written before)
    prep = preflight.prepare(run)
    model, site, datasets = prep.model, prep.site, prep.datasets
    run.summary["client"] = run.client_line
    run.summary["harness"] = {"server_args": run.hargs, "env": {"VLLM_LOGGING_LEVEL": "INFO", **(
        {"TRITON_CACHE_DIR": run.triton_cache} if run.triton_cache else {})}}
    if args.triton_cache_from:
        seeded = seed_triton_cache(Path(args.triton_cache_from), Path(run.triton_cache))
        run.summary["triton_cache"] = {"seeded": seeded}
        run.step("Triton cache seeded" if "skipped" not in seeded else "Triton cache not seeded", **seeded)

    def record_versions():
        v = versions(sys.executable, run.child_env)
        with run.lock:
            run.summary["versions"] = v
    vt = threading.Thread(target=record_versions, daemon=True)
    vt.start()
    run.summary["profiles"] = names
    run.summary["reference"] = ref
    run.step("bundle installed" if site else "using the installed vLLM", model=str(model))
    scored: dict = {}
    not_up: list[str] = []                # profiles whose server this invocation started and that never came up
    failed: ForgeError | None = None
    keep = args.keep_servers
    # the card beside the run (other processes, clocks): logs/gpu-monitor.log
    monitor = gpumon.Monitor(run.out / "logs" / "gpu-monitor.log")
    monitor.start()
    run.summary["gpu_monitor"] = monitor.record()

    def on_term(signum, frame):            # a machine's time limit: end like an interrupt (exit 128 + 15)
        raise proc.Terminated(signum)
    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        run.step("synthetic tier prompts built", prompts_per_tier=args.num_prompts)
        # servers left up by an earlier invocation: reused when they run this invocation's command
        adopted = adopt_or_stop(run, model)
        # import vLLM's client while the servers start (about 20 s on a GPU machine)
        run.worker_thread = threading.Thread(target=guarded, args=(run, "client", client_runner, run), daemon=True)
        run.worker_thread.start()
        kept = prep.kept
        if kept:
            run.step("every tier kept from an earlier invocation: no server started", profiles=kept)
        # a server found reusable before may have gone since: started now (the checks counted it as up)
        to_start = [n for n in names if n not in kept and n not in adopted]
        started = start_all(run, model, to_start) if to_start else []
        live = [n for n in names if n in adopted or n in started]
        not_up = [n for n in to_start if n not in started]
        # --keep-servers: a server still starting when the deadline came is left up for the next invocation
        # (the documented start-them-now run), not a server that failed
        starting = [n for n in not_up if keep and n in run.servers and runs_alive(run.servers[n])]
        if starting:
            run.summary["skipped"].append(f"servers still starting at the deadline, left up for the next "
                                          f"invocation (--keep-servers): {', '.join(starting)}")
            not_up = [n for n in not_up if n not in starting]
        if not_up and not live:
            raise not_up_error(run, not_up)
        if not_up:
            run.summary["skipped"].append(f"profiles whose server did not come up: {', '.join(not_up)}")
        measured = [n for n in names if n in live or n in kept]
        if run.summary.get("plumbing"):
            run.step("plumbing check: kept from an earlier invocation")
        elif not args.no_plumbing and names[0] != ref and names[0] in live and ref in live:
            prompts = [synth.synthetic_prompt(model, n, f"plumbing{n}") for n in PLUMBING_PROMPT_TOKENS]
            pl = guarded(run, names[0], plumbing, run.servers[names[0]], run.servers[ref], prompts, run.left)
            if pl is not None:
                run.summary["plumbing"] = pl
                run.step("plumbing check", verdict=pl["verdict"])
        done = bench_tiers(run, measured, model, datasets)
        if args.profile_prefill and args.profile_batch > 1:
            for name in live:
                prof = guarded(run, name, batch_profile.capture, run, name, model, args.profile_prefill,
                               args.profile_decode, args.profile_batch)
                if prof is not None:
                    run.step(f"batch profile {name}", **prof["headline"])
        elif args.profile_prefill:
            for name in live:
                prof = guarded(run, name, prefill_profile.capture, run, name, model, args.profile_prefill,
                               args.profile_decode)
                if prof is not None:
                    run.step(f"prefill profile {name}", **prof["headline"])
        run_dirs = finish_runs(run, measured, done)
        scored = scores(run, run_dirs, ref)
        run.summary["scores"] = {n: {"display": r["display"], "total": r["total"], "harness": r["harness"],
                                     "tiers": {t: {"tok_s": v["tok_s"], "lift": v["lift"]} for t, v in r["tiers"].items()}}
                                 for n, r in scored.items()}
        run.step("scored", scores={n: r["display"] for n, r in scored.items()})
        if any(done.values()) and Path(args.kernel_bench).is_file():
            # the decode saving against the kernel benchmark's prediction, also for a run of some tiers
            try:
                e2e_decode.write(run.out, bench_path=Path(args.kernel_bench), reference=ref)
                run.step("decode saving against the kernel benchmark: decode.md")
            except (ForgeError, OSError, KeyError, ValueError) as e:
                ui.warn(f"decode.md not written: {type(e).__name__}: {e}")
        left = [f"{t} {n}" for t in datasets for n in names if t not in done.get(n, {})]
        if run.summary.get("fault"):
            run.step("fault check: kept from an earlier invocation")
        elif args.no_fault or ref not in live:
            pass
        elif left:
            # it kills the reference: only once no tier is left for a later invocation to measure on it
            run.summary["skipped"].append(f"fault check: postponed until every tier is measured (left: "
                                          f"{', '.join(left)})")
        elif run.left() >= FAULT_NEED_S:
            fc = guarded(run, ref, fault_check, run, ref, model, datasets)
            if fc is not None:
                run.summary["fault"] = fc
                run.step("fault check", ok=fc["ok"])
        else:
            run.summary["skipped"].append(f"fault check: {run.left():.0f}s left, needs ~{FAULT_NEED_S:.0f}s")
        failed = run_failure(run, not_up)
        if failed is not None:
            run.summary["error"] = failed.message
    except (ForgeError, KeyboardInterrupt) as e:
        run.summary["error"] = getattr(e, "message", None) or "interrupted (SIGTERM or Ctrl-C)"
        raise
    finally:
        signal.signal(signal.SIGTERM, old_term)
        monitor.stop()
        run.summary["gpu_monitor"] = monitor.record()
        if keep:
            up = {n: {"pid": st["pid"], "port": st["port"]} for n, st in run.servers.items()
                  if runs_alive(st)}
            run.summary["servers_left_up"] = up
            if up:
                ui.info("servers left up (--keep-servers): " + ", ".join(f"{n} pid {v['pid']} port {v['port']}"
                                                                         for n, v in up.items())
                        + f"; the next `forge e2e-gpu --out {run.out}` with the same settings reuses them, "
                          "one without --keep-servers stops them at its end, and --stop-servers stops them now")
        else:
            stop_all(run.servers, run.out)
        if run.worker is not None:
            run.worker.close()
        vt.join(timeout=10)
        for name, st in run.servers.items():
            run.summary.setdefault("server_facts", {})[name] = log_facts(Path(st["log"]))
        run.summary["seconds"] = round(time.monotonic() - run.t0, 1)
        run.final = (names, scored, ref)
        try:                                   # after the servers stopped (with --keep-servers: the samples so far)
            stacks.settle(run.out, args.stack_every)
        except (OSError, ValueError) as e:
            ui.warn(f"stacks.json not settled: {type(e).__name__}: {e}")
        run.save()
        if args.triton_cache_pack and run.triton_cache and Path(run.triton_cache).is_dir():
            try:                               # after the results are saved: packing only saves time later
                packed = pack_triton_cache(Path(run.triton_cache), Path(args.triton_cache_pack))
                run.summary.setdefault("triton_cache", {})["packed"] = packed
                ui.info(f"Triton cache packed: {packed['mib']} MiB in {packed['parts']} parts under {packed['to']}")
                run.save()
            except Exception as e:
                ui.warn(f"Triton cache not packed: {type(e).__name__}: {e}")
        ui.info(f"results: {run.out}")
    if failed is not None:                # it ran, and a profile of it measured nothing: not a success
        raise failed
    return 0 if not run.summary.get("plumbing") or run.summary["plumbing"]["ok"] else 1


def runs_alive(st: dict) -> bool:
    return bool(st.get("start_time")) and proc.process_start_time(st["pid"]) == st["start_time"]


def register(sub) -> None:
    p = sub.add_parser("e2e-gpu", help="the end-to-end run on a GPU machine (serve, bench, plumbing, fault, score)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=str(gpu_bundle.BUNDLE),
                   help="the bundle from `make gpu-bundle` (default build/gpu-bundle); '' uses the installed vLLM")
    p.add_argument("--site", type=options.nonempty("--site"), default=DEFAULT_SITE,
                   help=f"where the bundle's wheels are installed (default {DEFAULT_SITE}); the install replaces "
                        "the folder whole, so a folder holding anything but an earlier install is refused; the new install is "
                        "written beside it (.SITE.forge-new, in the same parent folder) and swapped in once pip "
                        "succeeds, so a failed install leaves an earlier one as it was")
    p.add_argument("--install-only", action="store_true",
                   help="verify the bundle, install its wheels into --site and exit (nothing else runs; prints the "
                        "site and the bundle's model directory): what `forge sweep --round final --harness` needs; it uses only "
                        "--bundle and --site, and any other option set to other than its default is refused")
    p.add_argument("--harness", type=options.nonempty("--harness"), help="harness settings (default: harness/gpu/harness.yaml)")
    p.add_argument("--model", type=options.nonempty("--model"), help="model directory (default: the bundle's)")
    p.add_argument("--profiles", type=options.nonempty("--profiles"), help="comma-separated profiles (default: harness/gpu/harness.yaml profiles)")
    p.add_argument("--reference", type=options.nonempty("--reference"), help="the profile scored as 60.0 (default: upstream)")
    p.add_argument("--num-prompts", type=options.count_upto(MOST_PROMPTS, MOST_PROMPTS_WHAT), default=6,
                   help=f"prompts per tier (default 6, at most {MOST_PROMPTS:,}), all in one client invocation per (tier, profile): requests "
                        "of the contest workload (configs/workload.yaml) evenly spaced by output length")
    p.add_argument("--fixed-output", type=options.count, metavar="N",
                   help="instead of the contest workload, prompts across each tier's range with N output tokens "
                        "each (the earlier runs used 1024); each tier run must hold its longest prompt and N within the "
                        "servers' --max-model-len (32768; 16-32K's prompts run up to 31744 tokens)")
    p.add_argument("--tier-order", type=lambda s: s.split(","),
                   help="tiers in the order they run; tiers not named are not run (default: "
                        + ",".join(DEFAULT_TIER_ORDER) + ")")
    p.add_argument("--deadline-s", type=float, default=560.0,
                   help="start no (tier, profile) that would not end before this many seconds (default 560); "
                        "what is left runs in the next invocation of the same --out")
    p.add_argument("--start-guess-s", type=float, default=GUESS_START_S,
                   help=f"the servers' start and warm-up as guessed before any tier (default {GUESS_START_S:.0f}: "
                        "two side by side on an H200, empty Triton cache): a deadline that cannot hold it, the "
                        "shortest tier still to measure and the reserve is refused before any server starts "
                        "(with --keep-servers they start all the same, for the next invocation); where every "
                        "server is reused (left up by --keep-servers) no start is counted, and a deadline that "
                        "cannot hold that tier and the reserve is refused")
    p.add_argument("--reserve-s", type=float, default=15.0,
                   help="seconds kept after the tiers for stopping the servers and writing the reports "
                        f"(default 15; {FAULT_NEED_S:.0f} s more while the fault check is still to run)")
    p.add_argument("--out", type=options.nonempty("--out"), help="results folder (default: reports/e2e/<date>-<device>/)")
    p.add_argument("--pack", type=options.nonempty("--pack"), help="also keep a .tar.gz of the results here (outside --out), rewritten after every step")
    p.add_argument("--vllm", type=options.nonempty("--vllm"), help="how to start vLLM (default: this Python's vllm.entrypoints.cli.main)")
    p.add_argument("--client", type=options.nonempty("--client"), help="command that runs vLLM's CLI for `bench serve` (default: as forge bench-all-tiers)")
    p.add_argument("--server-arg", action="append", type=options.nonempty("--server-arg"),
                   help="one more server argument (repeatable; write --server-arg=--opt for options); an "
                        "option the contest's rules forbid, one the organizers' command sets, and in the final "
                        "round a setting it opens per tier (give those through --capacity or --finals-servers) "
                        "are refused, citing the rule")
    p.add_argument("--server-args", help="more server arguments as one shell-quoted string, checked as "
                                         "--server-arg, e.g. --server-args='--enforce-eager'")
    p.add_argument("--triton-cache", type=options.nonempty("--triton-cache"), help="TRITON_CACHE_DIR shared by the servers (default /tmp/forge-triton "
                                          "when --triton-cache-from or --triton-cache-pack is given)")
    p.add_argument("--triton-cache-from", metavar="DIR", type=options.nonempty("--triton-cache-from"),
                   help="seed the Triton cache from the parts an earlier run wrote with --triton-cache-pack "
                        "(DIR/triton-cache.json and its parts): a fresh machine then skips the kernel compiles "
                        "that run made")
    p.add_argument("--triton-cache-pack", metavar="DIR", type=options.nonempty("--triton-cache-pack"),
                   help="at the end, write the Triton cache to DIR/triton-cache.tgz.NN in parts of at most "
                        f"{TRITON_PART_MIB} MiB plus DIR/{TRITON_MANIFEST}, for --triton-cache-from on the "
                        "next machine (DIR outside the cache)")
    p.add_argument("--first-port", type=options.port, default=FIRST_PORT,
                   help=f"port of the first profile's server; the others follow (default {FIRST_PORT})")
    p.add_argument("--fault-delay-s", type=options.number_in(0, 600, "seconds", "3"), default=3.0, help="seconds into the request before the kill")
    p.add_argument("--client-per-tier", action="store_true",
                   help="start a fresh `vllm bench serve` per tier instead of one client process for all")
    p.add_argument("--kernel-bench", type=options.nonempty("--kernel-bench"), default=str(e2e_decode.DEFAULT_BENCH), metavar="FILE",
                   help="kernel benchmark JSON for decode.md's predicted saving (default "
                        f"{paths.rel(e2e_decode.DEFAULT_BENCH)}; no decode.md when the file is missing)")
    p.add_argument("--profile-prefill", type=options.count, metavar="TOKENS",
                   help="after the tiers, profile one TOKENS-token prefill on each server with the torch "
                        "profiler (servers get --profiler-config; the trace's kernels are summed by name per "
                        "forward step into prefill-profile/<profile>.json; render with `forge prefill-profile`)")
    p.add_argument("--profile-decode", type=options.count_upto(MAX_PROFILE_DECODE, "the decode steps one trace holds"),
                   default=0, metavar="STEPS",
                   help="with --profile-prefill: the profiled request then generates STEPS tokens more (at most "
                        f"{MAX_PROFILE_DECODE}), and their decode steps are summed the same way, per step (with "
                        "--profile-batch B: STEPS more tokens of each of the B requests)")
    p.add_argument("--profile-batch", type=options.count_upto(batch_profile.MAX_BATCH, "the requests one batch "
                                                                                       "profile starts"),
                   default=1, metavar="B",
                   help="with --profile-prefill and --profile-decode: instead of one request, start B of TOKENS "
                        "tokens each at once (fresh prompts), and once every one has its first token profile "
                        "STEPS decode steps of all B; only the steps that decode exactly B requests and prefill "
                        f"none are summed, per step, into batch-profile/<profile>-b<B>.json (1 to "
                        f"{batch_profile.MAX_BATCH}; default 1: the one-request profile)")
    p.add_argument("--keep-servers", action="store_true",
                   help="leave the servers up at the end (also when interrupted): the next invocation of the same "
                        "--out with the same settings reuses them instead of starting new ones (without this "
                        "option an invocation stops them at its end)")
    p.add_argument("--stop-servers", action="store_true",
                   help="only stop the servers an earlier invocation of --out left up (--keep-servers), then exit; "
                        "any other option set to other than its default is refused (a run stops its own "
                        "servers at its end)")
    final_round.register_options(p)
    stacks.register_options(p)
    p.add_argument("--no-plumbing", action="store_true")
    p.add_argument("--no-fault", action="store_true")
    p.set_defaults(func=functools.partial(cmd_e2e, parser=p))
