"""The finals' time model: one tier served under the finals' client for one configuration, and a
configuration space ranked per tier.

A configuration (`Config`): topology (tp, dp), KV dtype, max-num-seqs, max-num-batched-tokens,
gpu-memory-utilization and the client's concurrency. `simulate_tier` serves a tier's requests
[(prompt, output tokens)] with vLLM v1's scheduler stepped iteration by iteration (sched.py) on the
capacity the planner gives (capacity.py), each step priced by costs.StepCost for a `Build` (the speed-ups
of the DCU time model's components). DP2 is two independent replicas, each a TP1 server with its own
KV cache, the requests dealt to them in turn and the concurrency split evenly (vLLM's data-parallel
balancer keeps the in-flight counts even). The result: output tok/s (total output tokens over the
time from the first request sent to the last one done, as `vllm bench serve` reports it), mean and P99
TTFT and TPOT (per request (end - first token) / (outputs - 1)), preemptions, failed requests.

The stable interface the search (`sweep --round final`) calls:

    rank_configurations(tier, space, requests, build, baseline, *, shape=None, card="dcu", link="pcie")
        -> list[(Config, prediction)]

`space` is a list of Config or a mapping of lists (keys: topology [(tp, dp)], kv_dtype, max_num_seqs,
max_num_batched_tokens, gpu_memory_utilization, concurrency) whose product is taken; `baseline` holds
the SLA's limits' bases for the tier ({"ttft_p99_ms", "tpot_p99_ms"}: the finals' baseline's, see
`baseline_metrics`). Ranked: configurations inside the SLA (TTFT P99 and TPOT P99 at most `sla_ratio`
x the baseline's, nothing failed) first, then by output tok/s, highest first; each prediction carries
`sla_ok` and `why` (the limit it breaks). The contest formula grows with tok/s, so within the SLA this
order is the score's order; the score itself is the caller's (run/score.py's formula).

    with_planned(space, prompts, output_len) -> list[Config]

adds to a space, per (topology, KV dtype, batched tokens, utilization, concurrency) where the tier's
concurrency would preempt, the configuration at the capacity planner's --max-num-seqs (`planned`:
how many of the tier's largest requests one replica's cache holds at once; labelled "seqs N
(planned)"): vLLM admits up to max-num-seqs requests and preempts by recompute when their blocks run
out, so a search over 16..128 alone never finds the cap that keeps a long tier resident.

    pick(predictions, limits) -> prediction

takes the one to serve: the highest tok/s with PICK_MARGIN headroom under both SLA limits (else inside
them, else the fastest), and within PICK_TIE of that tok/s the one using the least of its limits.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

from ..errors import ForgeError
from .capacity import capacity, planned_seqs, room
from .costs import LINKS, UPSTREAM, Build, StepCost
from .sched import Engine, serve
from .shape import Shape, load_shape

SLA_RATIO = 1.5
OUTPUT_LEN = 1024
PICK_MARGIN = 0.10     # headroom kept under each SLA limit when picking: the model's TTFT P99 ran 22-33 % under the
PICK_TIE = 0.01        # public DP2 figures; within 1 % of the best tok/s, the most headroom is taken


@dataclass(frozen=True)
class Config:
    tp: int
    dp: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    concurrency: int
    kv_dtype: str = "bf16"
    planned: bool = False           # max_num_seqs is the capacity planner's (`with_planned`)

    def label(self) -> str:
        seqs = f"{self.max_num_seqs}{' (planned)' if self.planned else ''}"
        return (f"TP{self.tp}/DP{self.dp} {self.kv_dtype} seqs {seqs} batched "
                f"{self.max_num_batched_tokens} util {self.gpu_memory_utilization:g} c{self.concurrency}")

    def as_dict(self) -> dict:
        return asdict(self)


# The finals' baseline configuration (contest-facts "The final round"; configs/contest.yaml rounds.final).
FINALS_BASELINE = Config(tp=2, dp=1, max_num_seqs=128, max_num_batched_tokens=4096, gpu_memory_utilization=0.95,
                         concurrency=10)


def percentile(values: list[float], q: float) -> float | None:
    """numpy's default (linear) percentile, as vLLM's client computes its P99."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def tier_requests(pairs: list[tuple[int, int]], n: int, outputs: str = "forced",
                  output_len: int = OUTPUT_LEN) -> list[tuple[int, int]]:
    """n requests of a tier from its (prompt, output) pairs in order, repeated when n is larger;
    outputs "forced": every request generates output_len tokens; "eos": its own length, capped."""
    if not pairs or n < 1:
        raise ForgeError("a tier needs at least one request")
    if outputs not in ("forced", "eos"):
        raise ForgeError(f"outputs {outputs!r}: forced or eos")
    picked = [pairs[i % len(pairs)] for i in range(n)]
    return [(p, output_len if outputs == "forced" else max(1, min(o, output_len))) for p, o in picked]


def simulate_tier(cfg: Config, requests: list[tuple[int, int]], build: Build = UPSTREAM, *,
                  shape: Shape | None = None, card: str = "dcu", link: str = "pcie",
                  fixed_overhead: int | None = None) -> dict:
    """One tier under the finals' client for one configuration (see the module's docstring)."""
    shape = shape or load_shape()
    shape.check_tp(cfg.tp)
    if cfg.dp < 1 or cfg.concurrency < 1:
        raise ForgeError(f"{cfg.label()}: data parallel size and concurrency must be at least 1")
    if link not in LINKS:
        raise ForgeError(f"link {link!r} is not one the model knows", hint=f"one of {', '.join(LINKS)}")
    cap = capacity(shape, tp=cfg.tp, kv_dtype=cfg.kv_dtype, card_name=card, utilization=cfg.gpu_memory_utilization,
                   max_num_batched_tokens=cfg.max_num_batched_tokens, fixed_overhead=fixed_overhead)
    fits = room(shape, cap, cfg.max_num_seqs)
    cost = StepCost(build, shape, tp=cfg.tp, kv_dtype=cfg.kv_dtype, link=LINKS[link])
    done, engines = [], []
    for r in range(cfg.dp):
        conc = cfg.concurrency // cfg.dp + (1 if r < cfg.concurrency % cfg.dp else 0)
        share = requests[r::cfg.dp]
        if not share:
            continue
        if conc < 1:
            raise ForgeError(f"{cfg.label()}: concurrency {cfg.concurrency} leaves a DP replica without requests")
        eng = Engine(cap, cfg.max_num_seqs, cfg.max_num_batched_tokens, cost)
        engines.append(eng)
        done += serve(eng, share, conc, cost.arrival_delay())
    ok = [r for r in done if not r.failed]
    out = sum(r.out for r in ok)
    end = max((r.done for r in done), default=0.0)
    ttft = [(r.first - r.sent) * 1000 for r in ok]
    tpot = [(r.done - r.first) / (r.out - 1) * 1000 for r in ok if r.out > 1]
    return {"config": cfg.as_dict(), "label": cfg.label(), "build": build.name, "card": card, "link": link,
            "requests": len(requests), "completed": len(ok), "failed": len(done) - len(ok),
            "output_tokens": out, "duration_s": end, "tok_s": out / end if end > 0 else 0.0,
            "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else None, "ttft_p99_ms": percentile(ttft, 99),
            "tpot_mean_ms": sum(tpot) / len(tpot) if tpot else None, "tpot_p99_ms": percentile(tpot, 99),
            "preemptions": sum(e.preemptions for e in engines), "steps": sum(e.steps for e in engines),
            "kv_reported_tokens": cap.reported_tokens, "kv_blocks": cap.num_blocks, "block_size": cap.block_size,
            "starts": fits.fits, "headroom": fits.why()}


def baseline_metrics(requests: list[tuple[int, int]], **kw) -> dict:
    """The finals' baseline (upstream vLLM at FINALS_BASELINE) on a tier's requests: what the SLA's
    limits and the lift are measured against where no measured baseline exists."""
    return simulate_tier(FINALS_BASELINE, requests, UPSTREAM, **kw)


def expand_space(space: Iterable[Config] | Mapping[str, list]) -> list[Config]:
    if not isinstance(space, Mapping):
        out = list(space)
        if not all(isinstance(c, Config) for c in out):
            raise ForgeError("a configuration space is a list of Config or a mapping of lists")
        return out
    keys = ("topology", "kv_dtype", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "concurrency")
    unknown = sorted(set(space) - set(keys))
    if unknown:
        raise ForgeError(f"configuration space: unknown key(s) {', '.join(unknown)}", hint=f"keys: {', '.join(keys)}")
    base = FINALS_BASELINE
    vals = [list(space.get("topology", [(base.tp, base.dp)])), list(space.get("kv_dtype", ["bf16"])),
            list(space.get("max_num_seqs", [base.max_num_seqs])),
            list(space.get("max_num_batched_tokens", [base.max_num_batched_tokens])),
            list(space.get("gpu_memory_utilization", [base.gpu_memory_utilization])),
            list(space.get("concurrency", [base.concurrency]))]
    return [Config(tp=int(t[0]), dp=int(t[1]), kv_dtype=k, max_num_seqs=s, max_num_batched_tokens=b,
                   gpu_memory_utilization=u, concurrency=c)
            for t, k, s, b, u, c in itertools.product(*vals)]


def planned_config(cfg: Config, prompts: list[int], output_len: int = OUTPUT_LEN, *, shape: Shape | None = None,
                   card: str = "dcu") -> Config | None:
    """`cfg` with the capacity planner's --max-num-seqs (capacity.planned_seqs: the tier's largest
    requests one replica's cache holds at once, where the concurrency per replica would preempt), marked
    planned; None where no cap is needed."""
    n = planned_seqs(shape or load_shape(), cfg.tp, cfg.dp, list(prompts), output_len, cfg.concurrency,
                     kv_dtype=cfg.kv_dtype, card_name=card, utilization=cfg.gpu_memory_utilization,
                     max_num_batched_tokens=cfg.max_num_batched_tokens)
    return None if n is None else dataclasses.replace(cfg, max_num_seqs=n, planned=True)


def with_planned(space: Iterable[Config] | Mapping[str, list], prompts: list[int], output_len: int = OUTPUT_LEN, *,
                 shape: Shape | None = None, card: str = "dcu") -> list[Config]:
    """The space's configurations and, per (topology, KV dtype, batched tokens, utilization,
    concurrency), one more at the planner's --max-num-seqs where the concurrency would preempt (vLLM
    admits up to max-num-seqs requests; one card's cache holds few long ones, and the rest are
    preempted by recompute). A configuration of the space with that value already is marked planned
    instead of repeated."""
    shape = shape or load_shape()
    out = {dataclasses.replace(c, planned=False): c for c in expand_space(space)}
    for c in list(out.values()):
        p = planned_config(c, prompts, output_len, shape=shape, card=card)
        if p is not None:
            out[dataclasses.replace(p, planned=False)] = p
    return list(out.values())


def finite(v) -> bool:
    """A metric that is a number the SLA can be held to (not NaN, not infinite, not missing text)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def sla_check(pred: dict, baseline: Mapping, ratio: float = SLA_RATIO) -> list[str]:
    """The SLA limits `pred` breaks, [] for none. A tok/s, P99 or limit that is no finite number breaks
    it: a time past the float range is no time (inf - inf is NaN, and NaN > limit is false)."""
    why = []
    if pred.get("starts") is False:
        why.append(f"would not start: {pred.get('headroom')}")
    if pred["failed"]:
        why.append(f"{pred['failed']} request(s) never fit the KV cache")
    if not finite(pred.get("tok_s")):
        why.append(f"tok/s {pred.get('tok_s')!r} is no finite number")
    for key, name in (("ttft_p99_ms", "TTFT P99"), ("tpot_p99_ms", "TPOT P99")):
        lim, v = baseline.get(key), pred.get(key)
        if v is not None and not finite(v):
            why.append(f"{name} {v!r} ms is no finite time")
        elif lim is not None and not finite(lim):
            why.append(f"the baseline's {name} {lim!r} ms is no finite time")
        elif lim and v is not None and v > ratio * lim:
            why.append(f"{name} {v:.0f} ms > {ratio:g} x baseline {lim:.0f} ms")
    return why


def rank_key(p: dict) -> tuple:
    """Inside the SLA first, then the most tok/s; a tok/s that is no number last (it does not sort), and after
    everything a configuration that would not start (the sweep serves the top of the ranking, SLA or not); of
    two alike, the lower utilization first (more memory left outside vLLM's budget), whatever the list's order."""
    return (p.get("starts") is False, not p["sla_ok"], -p["tok_s"] if finite(p["tok_s"]) else math.inf,
            (p.get("config") or {}).get("gpu_memory_utilization", 0))


def rank_configurations(tier: str, space: Iterable[Config] | Mapping[str, list], requests: list[tuple[int, int]],
                        build: Build, baseline: Mapping | None = None, *, shape: Shape | None = None,
                        card: str = "dcu", link: str = "pcie", sla_ratio: float = SLA_RATIO) -> list[tuple[Config, dict]]:
    """Every configuration of `space` on the tier's requests, ranked (see the module's docstring).
    Without `baseline`, the finals' baseline is modelled on the same requests."""
    shape = shape or load_shape()
    base = baseline if baseline is not None else baseline_metrics(requests, shape=shape, card=card, link=link)
    ranked = []
    for cfg in expand_space(space):
        p = simulate_tier(cfg, requests, build, shape=shape, card=card, link=link)
        why = sla_check(p, base, sla_ratio)
        p.update(tier=tier, sla_ok=not why, why=why,
                 lift=(p["tok_s"] / base["tok_s"] - 1) if base.get("tok_s") else None)
        ranked.append((cfg, p))
    ranked.sort(key=lambda cp: rank_key(cp[1]))
    return ranked


def pick(preds: list[dict], limits: Mapping, margin: float = PICK_MARGIN, tie: float = PICK_TIE) -> dict:
    """The configuration to serve among ranked predictions (see the module's docstring); within the tie,
    the one that uses the least of its SLA limits (the larger of TTFT P99 / limit and TPOT P99 / limit)."""
    if not preds:
        raise ForgeError("no configuration to pick from")
    # a row whose tok/s or latency is no finite number is never picked, not even as the fastest
    usable = [p for p in preds if finite(p.get("tok_s")) and p.get("starts") is not False
              and all(p.get(k) is None or finite(p[k]) for k in ("ttft_p99_ms", "tpot_p99_ms"))]
    if not usable:
        raise ForgeError(f"none of the {len(preds)} configuration(s) starts with a finite tok/s, TTFT P99 and "
                         "TPOT P99 to pick from", hint="the build's speed-ups leave the model no finite time (give "
                                                       "factors nearer 1), or no utilization leaves room outside "
                                                       "vLLM's budget (forge plan prints it)")
    safe = [p for p in usable if not sla_check(p, limits, SLA_RATIO * (1 - margin))]
    inside = [p for p in usable if not sla_check(p, limits)]
    pool, rule = ((safe, f"inside the SLA with {margin:.0%} headroom") if safe else
                  (inside, "inside the SLA (none with headroom)") if inside else (usable, "fastest (none inside the SLA)"))
    best = max(p["tok_s"] for p in pool)

    def parts(p: dict) -> list[float]:
        return [p[k] / (SLA_RATIO * limits[k]) for k in ("ttft_p99_ms", "tpot_p99_ms")
                if limits.get(k) and finite(limits[k]) and p.get(k) is not None] or [0.0]

    chosen = min((p for p in pool if p["tok_s"] >= (1 - tie) * best),
                 key=lambda p: (round(max(parts(p)), 2), sum(parts(p)), -p["tok_s"],
                                # a tie taken at the lower utilization: more memory left outside vLLM's budget
                                (p.get("config") or {}).get("gpu_memory_utilization", 0)))
    chosen["pick_rule"], chosen["sla_use"] = rule, max(parts(chosen))
    return chosen
