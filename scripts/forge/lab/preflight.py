"""What `forge e2e-gpu` settles before it writes or starts anything (`prepare`): the bundle verified, the
client and the differences from the organizers' command, the tiers' prompts built aside, a folder being
resumed found comparable, the servers to start and to reuse, the deadline able to hold a tier (also where
every server is reused and none starts), a profile the servers can serve (one request or a batch), the
servers fitting the GPU they share (forge.lab.gpufit), their ports free and the commands of the servers
and the client runnable here (forge.lab.launch_check), and the bundle's wheels installed. Only then is the
results folder made and the prompts moved into it: a refusal (a ForgeError: one line naming the option and
its fix, exit code 2) leaves nothing new on disk, and a folder being resumed as it was."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import options, ui
from ..errors import ForgeError
from ..run import bench
from ..run.gpu_harness import site_env
from . import batch_profile, final_round, gpu_bundle, gpufit, launch_check, prefill_profile, stacks
from .install import install_bundle
from .servers import check_cards, plan, port_of, reusable
from .session import device_name
from .tiers import (
    build_datasets,
    check_resume,
    client_line,
    differences,
    fully_kept,
    harness_args,
    harness_contest,
    shortest_tier_need,
    tier_order,
    tiers_reserve,
)

if TYPE_CHECKING:
    from .session import Run


@dataclass
class Prepared:
    model: Path
    site: Path | None
    datasets: dict[str, Path]     # in the results folder's datasets/
    kept: list[str]               # profiles whose every tier an earlier invocation measured: no server


def _client(run: Run, model: Path) -> None:
    """The client the tiers run, and its command line as the manifests record it."""
    run.contest_h = harness_contest(run.contest, run.h, run.args.fixed_output)
    run.client_options = run.contest_h["client"]["options"]
    argv = bench.client_args(run.contest_h, dataset=Path("<tier>.jsonl"), num_prompts=0, model=str(model),
                             host="", port=0, result_dir=Path(), result_name="")
    run.client_line = client_line(argv)


def some_tier_fits(run: Run, model: Path, names: list[str], datasets: dict[str, Path], to_start: list[str]) -> None:
    """Before servers start: refuse a run whose deadline cannot hold their start and even the shortest
    tier still to measure (they would start, every tier be skipped, and they be stopped again); with
    --keep-servers they are started all the same, for the next invocation to reuse. Where every server
    is reused (`to_start` empty: left up by an earlier invocation) no start is counted, and the shortest
    tier and the reserve must still fit: refused with or without --keep-servers (nothing would start)."""
    shortest = shortest_tier_need(run, model, names, datasets)
    if shortest is None:
        return
    tname, todo, guess = shortest
    reserve = tiers_reserve(run.args, run.summary, names)
    start = run.args.start_guess_s if to_start else 0.0
    need = start + guess + reserve
    if run.left() >= need:
        return
    first = (f"starting {', '.join(to_start)} (~{start:.0f} s) then " if to_start else
             "every server reused (left up by an earlier invocation, no start counted), ")
    why = (f"{run.left():.0f} s left of --deadline-s {run.args.deadline_s:g}, and {first}the shortest tier left, "
           f"{tname}, for {', '.join(todo)} (~{guess:.0f} s, guessed) with the {reserve:.0f} s reserve need ~{need:.0f} s")
    if not to_start:
        raise ForgeError(f"{why}: no tier would be measured",
                         hint="raise --deadline-s or lower --num-prompts; the servers left up stay up for the next "
                              "invocation (--stop-servers stops them)")
    if run.args.keep_servers:
        ui.warn(f"{why}: the servers start for the next invocation (--keep-servers), and this one may measure no tier")
        return
    raise ForgeError(f"{why}: no tier would be measured",
                     hint="raise --deadline-s or lower --num-prompts, or add --keep-servers to start the servers "
                          "now for the next invocation to reuse")


def servers_fit(run: Run, model: Path, on_gpu: list[str], memory: tuple[list[int], str] | None) -> None:
    """The servers that will be up together (`on_gpu`: started now or reused), from the commands they run:
    a batch profile each can decode at once, and their memory on the GPU they share (`memory`:
    gpufit.card_memory's answer)."""
    launches = {n: [str(a) for a in plan(run, model, n)["launch"]] for n in on_gpu}
    args, side = run.args, run.h["side_by_side"]
    if args.profile_prefill and args.profile_batch > 1:
        for n, argv in launches.items():
            batch_profile.refuse_by_args(argv, args.profile_prefill, args.profile_decode, args.profile_batch,
                                         who=f"the {n} server")
            gpufit.kv_holds_batch(argv, side.get("kv_cache_memory_bytes"), model, args.profile_prefill,
                                  args.profile_decode, args.profile_batch, who=f"the {n} server")
    elif args.profile_prefill:
        for n, argv in launches.items():
            prefill_profile.refuse_by_args(argv, args.profile_prefill, args.profile_decode, who=f"the {n} server")
    run.summary["gpu_fit"] = gpufit.check_fit(launches, side["gpu_memory_utilization"],
                                              side.get("kv_cache_memory_bytes"), model, memory)


def fixed_output_fits(run: Run, launches: dict[str, list[str]], tiers: list[str]) -> None:
    """--fixed-output N asks N tokens of every prompt: each tier run must hold its longest prompt (as the client
    counts it, the chat template applied) and N within each server's --max-model-len (the 16-32K tier's prompts
    run up to 31,744 tokens, 32,768 less the contest's 1024 outputs). vLLM refused every request past it once
    the servers had started, each recorded as failed."""
    n = run.args.fixed_output
    if not n:
        return
    for name, argv in launches.items():
        limit = options.last_int(argv, "--max-model-len")
        if limit is None:               # the model's own length: no contest tier reaches it
            continue
        for t in tiers:
            longest = max(run.summary["datasets"][t]["prompt_tokens"])
            if longest + n > limit:
                raise ForgeError(f"--fixed-output {n}: tier {t}'s longest prompt ({longest} tokens) and {n} output "
                                 f"tokens are past the {name} server's --max-model-len {limit}; vLLM refuses such a "
                                 "request", hint=f"give --fixed-output {max(limit - longest, 1)} or less, or leave {t} "
                                                 "out of --tier-order")


def prepare(run: Run) -> Prepared:
    """Everything that can refuse the invocation, in order, then the results folder (run.open())."""
    args, names = run.args, run.names
    site = wheel_sha = man = None
    if args.bundle:
        bundle = Path(args.bundle)
        man = gpu_bundle.verify_bundle(bundle)
        site = Path(args.site)
        wheel_sha = man["files"][f"wheels/{man['vllm_wheel']}"]["sha256"]
        run.summary["bundle"] = {"version": man["version"], "wheel": man["vllm_wheel"], "wheel_sha256": wheel_sha,
                                 "forge": man.get("forge")}
        model = Path(args.model) if args.model else bundle / "model"
    else:
        model = Path(args.model)          # check_values refused a run with neither
    # the bundle's site folder; with --stack-every the sampler's folder before it (it samples only the servers,
    # whose environment alone sets FORGE_STACK_EVERY)
    run.child_env = stacks.process_env(site_env(site), args.stack_every)
    run.hargs = harness_args(run.h, run.extra)
    run.identity = {"bundle_wheel_sha256": wheel_sha, "server_args": run.hargs, "device": device_name(),
                    **({"capacity": {n: final_round.capacity_args(run.capacity, n) for n in run.capacity}}
                       if run.capacity else {})}
    _client(run, model)
    run.summary["differences"] = differences(run.h, run.extra, args.fixed_output, args.profile_prefill,
                                             ports={n: port_of(run, n) for n in names},
                                             profile_batch=args.profile_batch)
    run.summary["differences"] += [{"side": "server", **c} for n in names for c in run.capacity.get(n, [])]
    if args.stack_every:
        run.summary["differences"].append({
            "side": "server", "args": [f"FORGE_STACK_EVERY={args.stack_every:g}", "PYTHONPATH=harness/gpu/stacks:..."],
            "why": f"--stack-every: each server process writes its threads' stacks every {args.stack_every:g} s "
                   "(a sampler thread in each; a late sample: the process held) for stacks.json"})
    if run.rnd is not None:
        run.summary["differences"].append({
            "side": "server", "args": [f"<the {run.rnd.name} round's start script, tier {run.serve_tier}'s settings>"],
            "why": f"--finals-servers: each profile's server renders the {run.rnd.name} round's start script (its "
                   f"topology and capacity values for tier {run.serve_tier}); one server serves every tier of the "
                   "run, where the finals start one per tier"})
    aside = Path(tempfile.mkdtemp(prefix="forge-e2e-prompts-"))
    try:
        # the prompts are built aside: a folder being resumed is compared with them before anything is written
        built = build_datasets(run, model, args.num_prompts, ddir=aside)
        fixed_output_fits(run, {n: [str(a) for a in plan(run, model, n)["launch"]] for n in names},
                          tier_order(run, built))
        check_resume(run, names, built)
        up, left_ports = reusable(run, model)   # servers an earlier invocation left up; this one reuses `up`
        kept = [n for n in names if fully_kept(run, n, built)]
        to_start = [n for n in names if n not in kept and n not in up]
        for n in to_start:                # found at each start before, after the results folder was written
            check_cards(run, model, n)
        some_tier_fits(run, model, names, built, to_start)     # also where every server is reused
        on_gpu = [n for n in names if n in up or n in to_start]
        memory = gpufit.card_memory() if on_gpu else None
        if on_gpu:
            servers_fit(run, model, on_gpu, memory)
        # each found at the start of a server or a tier before, once the results folder was written
        launch_check.check_ports(run, to_start, left_ports)
        gpu = launch_check.check_commands(run, to_start, bool(on_gpu), memory)
        if gpu:
            run.summary["gpu_fit"]["cards"] = gpu
        if man is not None:
            install_bundle(Path(args.bundle), site, man)
        run.open()
        ddir = run.out / "datasets"
        ddir.mkdir(exist_ok=True)
        datasets = {}
        for t, p in built.items():
            shutil.copyfile(p, ddir / p.name)
            datasets[t] = ddir / p.name
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return Prepared(model=model, site=site, datasets=datasets, kept=kept)
