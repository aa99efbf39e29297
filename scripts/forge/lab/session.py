"""One end-to-end run's state (`Run`): its arguments checked up front, the deadline, the results
folder and summary.json (kept across invocations of one folder), the servers and the client worker."""

from __future__ import annotations

import datetime as dt
import re
import shlex
import sys
import threading
import time
from pathlib import Path

from .. import options, paths, ui
from ..contest import profiles, rounds
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..run import archive, runs, synth
from ..run.gpu_harness import DEFAULT_SITE
from . import final_round, gpu_bundle
from .packing import check_triton_source, pack
from .summary import render_summary


class Run:
    """What one invocation of `forge e2e-gpu` knows and keeps. Every attribute is set here; the
    steps read and update them, nothing outside adds others."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline_s
        self.tier_failures: list[tuple[str, str, str]] = []   # (tier, profile, error): client runs that failed
        self.contest = contest_mod.load_contest()
        self.h = final_round.apply_to_harness(
            gpu_bundle.harness_config(Path(args.harness) if args.harness else None), args)
        # what the arguments name is checked before anything is created, installed or started
        hint = "name profiles of configs/serve/ by their names, e.g. fast-int8,upstream"
        # an empty item ("fast,,upstream") is refused as one; it was "'' is '' is not a name (empty or not text)"
        self.names = options.comma_items(args.profiles, "--profiles", hint) if args.profiles else list(self.h["profiles"])
        twice = sorted({n for n in self.names if self.names.count(n) > 1})
        if twice:                         # one server, port and run folder per name: a second would share them
            raise ForgeError(f"--profiles {','.join(self.names)}: {', '.join(twice)} given twice",
                             hint="name each profile once")
        for n in self.names:                # each becomes the folder runs/<name> of the results
            if paths.name_problem(n):
                raise ForgeError(f"--profiles {args.profiles}: {n!r} is {paths.name_problem(n)}", hint=hint)
        self.ref = args.reference or ("upstream" if "upstream" in self.names else self.names[-1])
        if self.ref not in self.names:
            raise ForgeError(f"the reference profile {self.ref} is not among the profiles {self.names}",
                             hint="add it to --profiles")
        # --finals-servers: every profile rendered as the final round's start script renders it (its
        # topology, on as many GPUs as that needs; one server for every tier, with the settings of the
        # first tier run); otherwise the preliminary's one-card server, under the finals' client or not
        self.rnd = rounds.load_round(self.contest, "final") if args.finals_servers else None
        if args.tier_order is not None:     # "16-32K," was "no tier named ''"
            args.tier_order = options.comma_items(",".join(args.tier_order), "--tier-order",
                                                  f"name tiers from: {', '.join(contest_mod.tier_names(self.contest))}")
        self.serve_tier = ((args.tier_order or [None])[0] or self.rnd.tier_order[0]) if self.rnd else None
        self.profiles = {n: profiles.load_profile(n, self.contest, rnd=self.rnd) for n in self.names}
        # with --finals-servers, checked against the values each server's start script renders for its tier
        served = ({n: profiles.render_round(p, self.rnd.model_placeholder, self.contest, self.rnd, self.serve_tier)
                   for n, p in self.profiles.items()} if self.rnd and getattr(args, "capacity", None) else None)
        self.capacity = final_round.capacity_changes(self.contest, getattr(args, "capacity", None), self.names,
                                                     args.round, served)
        known = contest_mod.tier_names(self.contest)
        unknown = [t for t in (args.tier_order or []) if t not in known]
        if unknown:
            raise ForgeError(f"--tier-order {','.join(args.tier_order)}: no tier named {', '.join(map(repr, unknown))} "
                             "in configs/contest.yaml", hint=f"name tiers from: {', '.join(known)}")
        for opt, v in (("--deadline-s", args.deadline_s), ("--reserve-s", args.reserve_s),
                       ("--start-guess-s", getattr(args, "start_guess_s", 0.0))):
            if v < 0 or (opt == "--deadline-s" and v == 0):
                raise ForgeError(f"{opt} {v:g}: seconds cannot be {'negative' if v < 0 else 'zero'}",
                                 hint=f"give {opt} {'more than 0' if opt == '--deadline-s' else '0 or more'} seconds")
        if args.bundle:
            gpu_bundle.bundle_manifest(Path(args.bundle))
        if args.model and not Path(args.model).is_dir():      # found when the prompts were made, the folder written
            raise ForgeError(f"--model {args.model}: no such folder", hint="pass --model (or MODEL=) with the served "
                                                                         "model's directory")
        self.extra = check_values(args, self.names)   # the extra server arguments, split as a shell does
        check_extra_rules(self.contest, self.extra, args.round)
        self.out = Path(args.out) if args.out else default_out()
        if args.pack and paths.inside(Path(args.pack), self.out):
            # rewritten after every step from the folder's files, it held its own earlier copy, growing each time
            raise ForgeError(f"--pack {args.pack}: inside the results folder {self.out}, which the archive packs; "
                             "each rewrite would hold the one before", hint=f"give --pack outside it, e.g. --pack "
                                                                           f"{self.out.parent / (self.out.name + '.tgz')}")
        earlier = sorted(self.out.glob("runs/*/rounds"))
        if earlier:
            raise ForgeError(f"{self.out}: a folder of an earlier harness ({earlier[0].relative_to(self.out)}: one "
                             "prompt per round, without warm-ups); its tiers cannot be resumed with the organizers' "
                             "client", hint="give a new --out folder")
        # the folder itself is made by open(), once every check has passed (preflight.prepare)
        self.summary: dict = {"started": runs.now_iso(), "command": " ".join(["forge e2e-gpu", *sys.argv[2:]]),
                              "git": runs.git_commit(), "steps": [], "skipped": [], "harness": {}}
        self.servers: dict[str, dict] = {}
        self.lock = threading.RLock()     # the warm-up thread reports steps too
        self.runs_root = self.out / "runs"  # the profiles' run folders (not the project's reports/runs)
        self.vllm_cmd: str = args.vllm or f"{sys.executable} -m vllm.entrypoints.cli.main"
        self.triton_cache: str | None = args.triton_cache or (
            "/tmp/forge-triton" if (args.triton_cache_from or args.triton_cache_pack) else None)
        for opt, what, v in (("--triton-cache", "the Triton cache", args.triton_cache),
                             ("--site", "the installed bundle", getattr(args, "site", None))):
            if v and paths.inside(Path(v), self.out, or_equal=True):
                # --pack and pack-run pack the results folder whole (pack-run then removes what it packed)
                named = f"{v} ({opt}'s default)" if opt == "--site" and v == DEFAULT_SITE else v
                raise ForgeError(f"{opt} {named}: inside the results folder {self.out}, which --pack and pack-run pack "
                                 f"whole; the run's archive would hold {what}", hint=f"give {opt} a folder beside "
                                 f"it, e.g. {opt} {paths.resolved(self.out).parent / (self.out.name + '-' + opt[2:])}")
        if args.triton_cache_pack and self.triton_cache:
            check_pack_outside_cache(args.triton_cache_pack, self.triton_cache, given=bool(args.triton_cache))
        self.child_env: dict[str, str] = {}   # what the servers, the client and probes get on top of ours
        self.hargs: list[str] = []        # the harness's server arguments, after the profile's checked ones
        self.identity: dict = {}          # what makes tiers of two invocations comparable
        self.contest_h: dict = {}         # the contest with the client the harness runs (tiers.harness_contest)
        self.client_options: list = []    # that client's options (part of each tier's identity)
        self.client_line = ""             # that client's command line, per-tier values named
        self.worker = None                # the long-lived bench client (client.ClientWorker)
        self.worker_thread: threading.Thread | None = None
        self.worker_failed = False
        self.final: tuple | None = None   # (profiles, scores, reference) once the run has ended
        prev_path = self.out / "summary.json"
        if prev_path.is_file():
            # resuming this folder: keep what earlier invocations did (finished tiers are kept too)
            prev = runs.read_json(prev_path)
            earlier = prev.pop("earlier_invocations", [])
            self.summary["earlier_invocations"] = earlier + [
                {k: prev.get(k) for k in ("started", "command", "seconds", "steps", "skipped", "server_facts",
                                          "server_errors", "error", "git", "bundle", "versions", "servers_left_up")}]
            for k in ("plumbing", "fault"):
                if prev.get(k) and prev[k].get("ok"):
                    # where it ran first: an invocation that kept it passes the first one's start on
                    self.summary[k] = {**prev[k], "from_earlier_invocation":
                                       prev[k].get("from_earlier_invocation") or prev.get("started")}

    def open(self) -> None:
        """Create the results folder (and its logs/): after every check that can refuse the invocation,
        so a refusal leaves nothing behind and a folder being resumed as it was."""
        (self.out / "logs").mkdir(parents=True, exist_ok=True)

    def run_dir(self, name: str, create: bool = True) -> Path:
        return runs.run_dir(name, create=create, root=self.runs_root)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, **detail) -> None:
        with self.lock:
            rec = {"step": name, "at_s": round(time.monotonic() - self.t0, 1), **detail}
            self.summary["steps"].append(rec)
            ui.info(f"e2e [{rec['at_s']:.0f}s, {self.left():.0f}s left]: {name}")
            self.save()

    def save(self) -> None:
        """summary.json and summary.md as they stand, and the pack: after every step, so a run cut
        short by the machine's limit still returns them."""
        with self.lock:
            runs.write_json(self.out / "summary.json", self.summary)
            names, scored, ref = self.final or (
                self.summary.get("profiles") or [], {}, self.summary.get("reference") or "upstream")
            try:
                (self.out / "summary.md").write_text(render_summary(self, names, scored, ref))
            except Exception as e:        # the summary must never stop the run
                ui.warn(f"summary.md not written: {type(e).__name__}: {e}")
            if self.args.pack:
                try:
                    pack(self.out, Path(self.args.pack), self.servers)
                except OSError as e:
                    ui.warn(f"pack not written: {e}")


# server options the harness gives each server itself: an extra one would win over it (the last one given
# wins in vLLM) and the harness would then wait on, measure or record another server than it started
HARNESS_OWNED = {
    "--port": ("the first profile's on --first-port, the others after it", "give --first-port instead"),
    "--host": ("the client reaches them on this machine", "leave it out"),
    "--served-model-name": ("the organizers' command names the model", "leave it out"),
    "--model": ("--model, or the bundle's model", "give e2e-gpu's --model instead"),
    "--gpu-memory-utilization": ("harness.yaml's side-by-side share, recorded as a difference",
                                 "give e2e-gpu's --gpu-memory-utilization instead"),
    "--kv-cache-memory-bytes": ("harness.yaml's side-by-side size, recorded as a difference",
                                "give e2e-gpu's --kv-cache-memory-bytes (and --kv-why) instead"),
}


def check_values(args, names: list[str]) -> list[str]:
    """The options that name ports, tiers, files and folders, checked before the results folder is made
    (each found only after it before: a server on port 70000, a tier measured twice, a pack that is a
    folder, a Triton cache that is a file); returns the extra server arguments (--server-arg, then
    --server-args split as a shell does)."""
    twice = sorted({t for t in (args.tier_order or []) if args.tier_order.count(t) > 1})
    if twice:
        raise ForgeError(f"--tier-order {','.join(args.tier_order)}: {', '.join(twice)} given twice",
                         hint="name each tier once (a finished tier is kept, not measured again)")
    last = args.first_port + len(names) - 1
    if last > 65535:
        raise ForgeError(f"--first-port {args.first_port}: the {len(names)} profiles' servers take ports "
                         f"{args.first_port}-{last}, past 65535", hint=f"give --first-port {65536 - len(names)} or lower")
    if not args.bundle and not args.model:
        raise ForgeError("--model is needed when no --bundle is given",
                         hint="pass --model with the served model's directory, or --bundle with the one `make "
                              "gpu-bundle` built")
    try:
        extra = [*(args.server_arg or []), *shlex.split(args.server_args or "")]
    except ValueError as e:
        raise ForgeError(f"--server-args {args.server_args!r}: {e} (it is split as a shell splits it)",
                         hint="close the quote, or give each argument as its own --server-arg=...") from None
    for a in extra:
        owner = HARNESS_OWNED.get(a.split("=", 1)[0].replace("_", "-"))
        if a.startswith("--") and owner:       # after the harness's own: the last one given wins in vLLM
            raise ForgeError(f"--server-arg/--server-args {a}: the harness sets it for each server ({owner[0]})",
                             hint=owner[1])
    if args.model and not any((Path(args.model) / f).is_file() for f in ("tokenizer.json", *synth.Tok.OTHER_FILES)):
        raise ForgeError(f"--model {args.model}: no tokenizer (tokenizer.json is missing, and so are "
                         f"{', '.join(synth.Tok.OTHER_FILES)}); the tiers' prompts are made with it",
                         hint="pass --model with the served model's directory, which holds tokenizer.json")
    if args.model and not (Path(args.model) / "config.json").is_file():      # each server's start refused it
        raise ForgeError(f"--model {args.model}: no config.json (the servers read the model's shapes from it)",
                         hint="pass --model with the served model's directory, which holds config.json")
    if args.out and archive.is_packed(Path(args.out)):      # resuming it would write beside its raw.tgz
        raise ForgeError(f"--out {args.out}: a packed record (its files are in {archive.ARCHIVE}); this run would "
                         "start afresh beside the archive", hint=f"forge unpack-run {args.out} to resume it, or give "
                                                                  "a new --out folder")
    for opt in ("out", "pack", "triton_cache", "triton_cache_pack"):
        if getattr(args, opt):
            paths.outside_sources(getattr(args, opt), "--" + opt.replace("_", "-"))
    if args.pack:
        pk = Path(args.pack)
        if pk.is_dir():
            raise ForgeError(f"--pack {args.pack}: a folder, where the results' archive is written as one file",
                             hint=f"give a file name, e.g. --pack {pk / 'e2e.tgz'}")
        paths.target_folder(str(pk.parent), "--pack's folder")
    for opt in ("out", "triton_cache", "triton_cache_pack", "triton_cache_from"):
        if getattr(args, opt) is not None:
            paths.target_folder(getattr(args, opt), "--" + opt.replace("_", "-"))
    if args.triton_cache_from:
        check_triton_source(Path(args.triton_cache_from))
    return extra


def check_pack_outside_cache(pack: str, cache: str, given: bool) -> None:
    """--triton-cache-pack's parts are written among the files they pack where the folder is the Triton cache or
    lies in it: each pack held the one before, and the cache grew by its own archive every run."""
    if paths.inside(Path(pack), Path(cache), or_equal=True):
        named = f"--triton-cache {cache}" if given else f"{cache} (--triton-cache's default)"
        raise ForgeError(f"--triton-cache-pack {pack}: in the Triton cache it packs, {named}; each pack would hold "
                         "the one before", hint="give --triton-cache-pack a folder outside it, e.g. --triton-cache-pack "
                                                f"{paths.resolved(Path(cache)).parent / 'triton-pack'}")


def check_extra_rules(contest: dict, extra: list[str], round_name: str | None) -> None:
    """An extra server argument may try what the harness measures beside the contest's command, never what the
    rules forbid or what the start scripts set: a forbidden option (speculative decoding, weight quantization,
    the scheduler's options, in any spelling), an option of the organizers' command (the last one given wins in
    vLLM, so it would change the command under test), or a setting the final round opens per tier (given
    through --capacity or --finals-servers, where it is checked within the round's bounds; in the preliminary
    the scheduler's options are forbidden)."""
    opened = {u.option: u for u in rounds.load_round(contest, "final").unlocked} if round_name == "final" else {}
    for a in extra:
        if not a.startswith("-") or a == "-" or a[1:2].isdigit():
            continue                      # a value, not an option
        base = contest_mod.option_base(a)
        if base in opened:
            u = opened[base]
            how = (f"--capacity PROFILE:{u.option[2:]}=N (checked within the final round's bounds)"
                   if u.option in final_round.CAPACITY_OPTIONS else "--finals-servers (the final round's start script "
                                                              "renders the topology, each rank on a card of its own)")
            raise ForgeError(f"--server-arg/--server-args {a}: {u.option} is a setting the final round opens per "
                             f"tier (rule '{u.rule}'); an extra argument would pass it unchecked", hint=f"give {how}")
        kind, entry = contest_mod.lookup_option(contest, a)
        if kind == "forbidden":
            raise ForgeError(f"--server-arg/--server-args {a}: forbidden by the contest rules: "
                             f"\"{contest_mod.rule_text(contest, entry['rule'])}\" (rule '{entry['rule']}')",
                             hint="leave it out: the harness measures what the contest allows")
        if kind == "organizers":
            raise ForgeError(f"--server-arg/--server-args {a}: the organizers' start script sets {entry['option']}; "
                             f"given again it would win over it (rule '{entry['rule']}')",
                             hint="leave it out: the harness measures the organizers' command")


def default_out() -> Path:
    slug = re.sub(r"[^a-z0-9]+", "", device_name().lower().replace("nvidia", "")) or "device"
    return paths.REPORTS / "e2e" / f"{dt.date.today().isoformat()}-{slug[:16]}"


def device_name() -> str:
    dev = runs.device_info()
    for tool in ("nvidia-smi", "hy-smi", "rocm-smi"):
        if dev.get(tool):
            return dev[tool].strip().splitlines()[0].split(",")[0].strip()
    return "cpu"
