"""The final round's shape on a GPU machine (`forge e2e-gpu --round final`): the finals' client
(every request at the tier's concurrency, `--request-rate inf`, 1024 output tokens each) over the
official prompt lengths, and the server's KV cache sized as a card of the contest holds it.

The final is scored under load: at concurrency 10 the number of requests a server holds at once, and
whether it preempts, depends on its KV cache in tokens, not on the card. `--kv-cache-memory-bytes`
gives every server the KV cache a DCU card would have (the capacity planner, `forge plan`, prints the
bytes for a topology and KV dtype); each server then runs in the DCU's regime on a larger GPU. Two
such servers fit one H200 side by side, and the tiers are still run one profile at a time, so they
never compete for the GPU while measured.

Preemptions are read from each server's Prometheus counter (`vllm:num_preemptions_total`) before
and after a tier."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from .. import options
from ..contest import rounds
from ..errors import ForgeError
from ..run import synth
from ..run.gpu_harness import LARGEST_CARD, sizing_changes

ROUNDS = ("preliminary", "final")
FINAL_OUTPUT_LEN = 1024            # the finals' --custom-output-len (a forced length: --ignore-eos)
FINAL_CONCURRENCY = 10             # the finals' baseline client concurrency, every tier
# what --capacity may set for one profile's server: the final round's unlocked capacity options that a
# server of the side-by-side harness can take alone (--gpu-memory-utilization is the harness's, for all)
CAPACITY_OPTIONS = ("--max-num-seqs", "--max-num-batched-tokens")
PREEMPT_METRIC = re.compile(r"^vllm:num_preemptions(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+]+)\s*$", re.M)


def client_changes(concurrency: int, output_len: int = FINAL_OUTPUT_LEN) -> list[dict]:
    """The finals' client in place of the preliminary's options, each change with its reason."""
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or not 1 <= concurrency <= 256:
        raise ForgeError(f"--concurrency {concurrency!r}: the finals' client runs 1 to 256 requests at once",
                         hint="the finals' baseline runs 10 per tier")
    return [
        {"args": ["--max-concurrency", str(concurrency)],
         "why": f"the final round's client: {concurrency} requests at once per tier (the preliminary's is 1)"},
        {"args": ["--request-rate", "inf"],
         "why": "the final round's arrival model: every request is sent at once, the concurrency bounds them"},
        {"args": ["--custom-output-len", str(output_len)],
         "why": f"the final round's client asks {output_len} tokens of every request"},
        {"args": ["--ignore-eos"],
         "why": "random weights end a reply anywhere; every request then runs to the finals' output length"},
    ]


def workload_pairs(contest: dict, tier: str, n: int, output_len: int = FINAL_OUTPUT_LEN) -> list[tuple[int, int]]:
    """n official prompt lengths of the tier (configs/workload.yaml, evenly spaced as the preliminary's
    harness picks them), each with the finals' output length."""
    workload = synth.load_workload(contest)
    return [(p, output_len) for p, _ in synth.stratified(workload["tiers"][tier]["requests"], n)]


def capacity_changes(contest: dict, specs: list[str] | None, names: list[str], round_name: str,
                     served: dict[str, dict] | None = None) -> dict[str, list[dict]]:
    """--capacity PROFILE:OPTION=VALUE[,OPTION=VALUE]: one profile's server with its own value of a capacity
    option the final round leaves to the team per tier (e.g. the product's --max-num-seqs at which the
    capacity planner says the tier's requests stay resident), each checked within the round's bounds and
    together with the server's other values: the round's baseline (the preliminary's one-card server has
    them), or with --finals-servers `served`'s (each profile's rendered start script: its settings, their
    sources and its tier); returns {profile: [{"args", "why"}]}."""
    if not specs:
        return {}
    if round_name != "final":
        raise ForgeError("--capacity: the capacity options are the team's only in the final round",
                         hint="add --round final")
    rnd = rounds.load_round(contest, "final")
    out: dict[str, list[dict]] = {}
    for spec in specs:
        name, sep, rest = spec.partition(":")
        if not sep or not rest.strip():
            raise ForgeError(f"--capacity {spec!r}: expected PROFILE:OPTION=VALUE[,OPTION=VALUE]",
                             hint="e.g. --capacity contest:max-num-seqs=4")
        if name not in names:
            raise ForgeError(f"--capacity {spec!r}: {name!r} is not among this run's profiles ({', '.join(names)})",
                             hint="name a profile given to --profiles")
        for item in rest.split(","):
            if not item.strip():        # "p:max-num-seqs=4," or "p:,x=1": a comma too many, as other lists say it
                raise ForgeError(f"--capacity {spec!r}: an empty item (a comma too many)",
                                 hint=f"e.g. --capacity {name}:max-num-seqs=4,max-num-batched-tokens=2048")
            key, eq, val = item.partition("=")
            opt = "--" + key.strip().lstrip("-")
            if not eq or opt not in CAPACITY_OPTIONS:
                raise ForgeError(f"--capacity {spec!r}: {item.strip()!r} is not one of "
                                 f"{', '.join(o[2:] + '=N' for o in CAPACITY_OPTIONS)}",
                                 hint=f"e.g. --capacity {name}:max-num-seqs=4 (--gpu-memory-utilization and "
                                      "--kv-cache-memory-bytes size every server alike)")
            if any(c["args"][0] == opt for c in out.get(name, [])):
                raise ForgeError(f"--capacity: {opt} given twice for {name}", hint="give each option once per profile")
            text = val.strip()
            plain = options.parse_whole(text)
            if options.unplain(text):
                # "+4", "04": what the final round's variables refuse (MAX_NUM_SEQS=+64, 064), said as they say it
                raise ForgeError(f"--capacity {spec!r}: {opt[2:]}={text}: {options.unplain(text)} before the "
                                 "number, which the final round's variables refuse too",
                                 hint=f"write the plain number, e.g. --capacity {name}:{opt[2:]}={plain if plain > 0 else 4}")
            try:
                v = rounds.check_value(rnd, opt, text, f"--capacity {spec}")
            except ForgeError as e:       # the round's hint names the start script's variable, not this option
                u = rnd.unlocked_option(opt)
                example = int(min(max(4, u.min), u.max)) if u and u.min is not None else 4
                raise ForgeError(e.message, hint=f"give {opt[2:]} a value within the round's bounds in --capacity "
                                                 f"(e.g. {name}:{opt[2:]}={example})") from None
            out.setdefault(name, []).append({
                "args": [opt, str(v)],
                "why": f"{name}'s server alone (--capacity): the final round leaves {opt} to the team per tier; "
                       "this run gives it that value"})
    for name, changes in out.items():
        # together (vLLM refuses fewer batched tokens than sequences); the one not given is the server's own
        got = {c["args"][0][2:].replace("-", "_"): int(c["args"][1]) for c in changes}
        if served is None:
            rounds.check_settings(rnd, got, where=f"--capacity {name} (with the round's baseline for the option not "
                                                  "given)" if len(got) == 1 else f"--capacity {name}")
        else:           # the finals' start script gave it the environment's or the profile's value, not the baseline's
            r = served[name]
            rounds.check_settings(rnd, {**r["settings"], **got},
                                  sources={**r["sources"], **dict.fromkeys(got, "--capacity")},
                                  where=f"--capacity {name} (with the other values of its --finals-servers server, "
                                        f"tier {r['tier']})")
    return out


def capacity_args(changes: dict[str, list[dict]], name: str) -> list[str]:
    """The server arguments --capacity adds to one profile's server (after the harness's, so they win)."""
    return [x for c in changes.get(name, []) for x in c["args"]]


def preemptions(host: str, port: int, timeout: float = 5.0) -> float | None:
    """The server's preemption count so far (vLLM's Prometheus counter); None when it cannot be read."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{host}:{port}/metrics", timeout=timeout) as r:
            text = r.read(8 << 20).decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    found = PREEMPT_METRIC.findall(text)
    return sum(float(x) for x in found) if found else None


def apply_to_harness(h: dict, args) -> dict:
    """harness.yaml's settings as this invocation runs them: with --round final the finals' client in
    place of `client_args`' options it sets (their others kept), and the sizing options in place of
    `side_by_side`'s values."""
    if args.finals_servers and args.round != "final":
        raise ForgeError("--finals-servers: the final round's servers are measured with its client",
                         hint="add --round final")
    if getattr(args, "round", "preliminary") == "final":
        if args.fixed_output:
            raise ForgeError("--fixed-output and --round final: the final round fixes the output length itself "
                             f"({FINAL_OUTPUT_LEN} tokens per request)", hint="leave out --fixed-output")
        final = client_changes(FINAL_CONCURRENCY if args.concurrency is None else args.concurrency)
        # harness.yaml's changes the finals' client does not make itself stay (the request body's special tokens)
        h["client_args"] = final + [c for c in h["client_args"] if c["args"][0] not in {f["args"][0] for f in final}]
    elif args.concurrency is not None:
        raise ForgeError(f"--concurrency {args.concurrency}: the preliminary's client runs one request at a time",
                         hint="add --round final")
    side = dict(h["side_by_side"])
    for ch in sizing_changes(args.kv_cache_memory_bytes, args.gpu_memory_utilization, args.kv_why):
        key = ch["args"][0][2:].replace("-", "_")
        side[key] = int(ch["args"][1]) if key == "kv_cache_memory_bytes" else float(ch["args"][1])
        if key == "kv_cache_memory_bytes":
            side["kv_why"] = ch["why"]
        else:       # harness.yaml's reason is its own 0.44's (two servers side by side); this one is the run's
            side["why"] = f"{ch['why']}; the organizers' server has the card to itself (0.95)"
    h["side_by_side"] = side
    return h


def register_options(p) -> None:
    """e2e-gpu's options for the final round's shape."""
    p.add_argument("--round", choices=ROUNDS, default="preliminary",
                   help="final: the finals' client (--concurrency requests at once, --request-rate inf, "
                        f"{FINAL_OUTPUT_LEN} output tokens each, end-of-text ignored) over the official prompt "
                        "lengths; the preliminary (default): one request at a time, each its official output length")
    p.add_argument("--finals-servers", action="store_true",
                   help="with --round final: render every profile as the finals' start script does (its topology: "
                        "TP2 or DP2 on two GPUs, the finals' baseline for a profile that sets none, e.g. upstream; "
                        "its cards checked before anything starts); one server serves every tier, with the "
                        "settings of the first tier run. Without it: the preliminary's one-card server (TP1)")
    p.add_argument("--concurrency", type=int, metavar="N",
                   help=f"with --round final: requests at once in every tier (default {FINAL_CONCURRENCY}, the "
                        "finals' baseline)")
    p.add_argument("--kv-cache-memory-bytes", type=int, metavar="BYTES",
                   help="every server's KV cache in bytes, in place of harness.yaml's side-by-side 5 GiB (`forge plan` "
                        "prints what a DCU card holds at a topology and KV dtype): 256 MiB up to the memory of the "
                        f"largest card the capacity planner knows ({LARGEST_CARD.name}: {LARGEST_CARD.memory_bytes} "
                        "bytes); before anything is written or started, each server's cache must also fit its "
                        "--gpu-memory-utilization share of the GPU beside its weights (the GPU's memory as "
                        "nvidia-smi, hy-smi or rocm-smi reports it)")
    p.add_argument("--kv-why", metavar="TEXT", help="why the KV cache has that size, for the run's record")
    p.add_argument("--capacity", action="append", metavar="PROFILE:OPTION=VALUE",
                   help="with --round final: one profile's server with its own max-num-seqs or "
                        "max-num-batched-tokens (repeatable; e.g. contest:max-num-seqs=4, the planner's resident "
                        "requests of the tier), checked within the final round's bounds and recorded as a difference")
    p.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                   help="every server's share of the GPU, 0.05 to 0.99, in place of harness.yaml's side-by-side "
                        "0.44; the servers side by side must fit the GPU (servers x F at most 1), checked before "
                        "anything is written")
