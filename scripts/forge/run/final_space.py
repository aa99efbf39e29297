"""The final round's search space (`forge sweep --round final`): topology x KV dtype x max-num-seqs x
max-num-batched-tokens x gpu-memory-utilization x client concurrency, one `Candidate` per point,
each checked against the round's bounds (forge.contest.rounds.check_settings: a point vLLM or the
rules refuse never reaches the ranking); per tier, beside each point whose concurrency would preempt,
the candidate at the capacity planner's max-num-seqs (`with_planned`); and the one interface a model
ranks them through.

The ranking interface (`Ranker`): a callable `rank(tier, candidates) -> list[Ranked]`, best first,
each `Ranked` holding the candidate, what the model predicts for it (`predicted`: any of tok_s,
ttft_p99_s, tpot_p99_ms, score, preempt) and why (one line). `model_ranker()` adapts the finals'
time model (forge.model) to it; a test or another model passes its own callable."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterable

from .. import options, paths
from ..contest import rounds
from ..errors import ForgeError

KV_DTYPES = {"bf16": None, "int8": "int8"}      # the sweep's name -> --kv-cache-dtype (None: the model's own)
SPACE_OPTIONS = ("topologies", "kv_dtypes", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                 "concurrency")
DEFAULTS = {"kv_dtypes": ("bf16", "int8"), "max_num_seqs": (16, 32, 64, 128),
            "max_num_batched_tokens": (2048, 4096, 8192, 16384), "gpu_memory_utilization": (0.95, 0.97),
            "concurrency": (8, 10, 12, 16)}


@dataclass(frozen=True)
class Candidate:
    tensor_parallel_size: int
    data_parallel_size: int
    kv_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    concurrency: int
    planned: bool = False        # max_num_seqs is the capacity planner's for the tier (`with_planned`)

    @property
    def topology(self) -> str:
        return f"tp{self.tensor_parallel_size}dp{self.data_parallel_size}"

    @property
    def key(self) -> str:
        """A name for the candidate's run folder: tp2dp1-bf16-s128-b4096-u0.95-c10 (the server's values
        alone: a planned max-num-seqs names the same configuration, and run folder, as the same value
        given in --max-num-seqs)."""
        return paths.plain_name(f"{self.topology}-{self.kv_dtype}-s{self.max_num_seqs}-b{self.max_num_batched_tokens}"
                                f"-u{self.gpu_memory_utilization:g}-c{self.concurrency}", "candidate")

    @property
    def label(self) -> str:
        """The key, with " (planned)" where max-num-seqs is the capacity planner's."""
        return self.key + (" (planned)" if self.planned else "")

    def settings_values(self) -> dict:
        """The round's settings (forge.contest.rounds.Settings fields) of this candidate."""
        return {"tensor_parallel_size": self.tensor_parallel_size, "data_parallel_size": self.data_parallel_size,
                "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "gpu_memory_utilization": self.gpu_memory_utilization, "concurrency": self.concurrency}

    def as_dict(self) -> dict:
        return {"kv_dtype": self.kv_dtype, **self.settings_values(), "planned": self.planned}


def from_record(rnd: rounds.Round, data, where: str) -> Candidate:
    """A candidate as a record holds it (`Candidate.as_dict`), checked as the space checks one: every
    field, of its type, within the round; a damaged or edited record is refused naming `where`."""
    names = [f.name for f in fields(Candidate)]
    if not isinstance(data, dict) or sorted(data) != sorted(names):
        raise ForgeError(f"{where}: not a configuration (expected {', '.join(names)})",
                         hint="restore the record, or start a new sweep (omit --sweep-id)")
    ints = [n for n in names if n not in ("kv_dtype", "gpu_memory_utilization", "planned")]
    if data["kv_dtype"] not in KV_DTYPES or not isinstance(data["planned"], bool) or \
            any(isinstance(data[n], bool) or not isinstance(data[n], int) for n in ints) or \
            isinstance(data["gpu_memory_utilization"], bool) or not isinstance(data["gpu_memory_utilization"], (int, float)):
        raise ForgeError(f"{where}: a value of the configuration is not of its type ({data!r:.160})",
                         hint="restore the record, or start a new sweep (omit --sweep-id)")
    cand = Candidate(**data)
    try:
        rounds.check_settings(rnd, cand.settings_values(), where=where)
    except ForgeError as e:
        raise ForgeError(e.message, hint="restore the record, or start a new sweep (omit --sweep-id)") from None
    return cand


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    predicted: dict = field(default_factory=dict)
    why: str = ""


Ranker = Callable[[str, list[Candidate]], list[Ranked]]


def topology_names(rnd: rounds.Round) -> dict[str, tuple[int, int]]:
    """The round's topologies by every name --topologies takes: 'tp2' / 'dp2' / 'tp2dp1' / 'tp1dp2'."""
    named = {f"tp{tp}dp{dp}": (tp, dp) for tp, dp in rnd.topologies}
    named.update({f"tp{tp}": (tp, dp) for tp, dp in rnd.topologies if dp == 1})
    named.update({f"dp{dp}": (tp, dp) for tp, dp in rnd.topologies if tp == 1})
    return named


def topology_of(text: str, rnd: rounds.Round) -> tuple[int, int]:
    """'tp2' / 'dp2' / 'tp2dp1' / 'tp1dp2' as (tp, dp), one of the round's topologies."""
    named, key = topology_names(rnd), text.strip().lower()
    if key not in named:
        raise ForgeError(f"--topologies: {text!r} is not a topology of the {rnd.name} round",
                         hint=f"topologies: {', '.join(sorted(named))}")
    return named[key]


def kv_dtype_list(text: str, why_twice: str, option: str = "--kv-dtype") -> list[str]:
    """The KV cache dtypes of `option` (plan, predict --round final): each one of KV_DTYPES, none given twice
    (`why_twice`: what a repeat would do), no empty item."""
    hint = f"{', '.join(KV_DTYPES)} or {','.join(KV_DTYPES)}"
    kv = options.comma_items(text, option, hint)
    bad = [k for k in kv if k not in KV_DTYPES]
    if bad:
        raise ForgeError(f"{option} {bad[0]!r}: not a KV cache dtype the tool knows", hint=hint)
    if len(set(kv)) < len(kv):
        raise ForgeError(f"{option} {text}: a dtype given twice ({why_twice})", hint=hint)
    return kv


def _list(text: str | None, option: str, conv, default: Iterable, repeats: bool = False) -> list:
    if text is None:
        return list(default)
    out = []
    items = options.comma_items(text, option, f"a comma-separated list, e.g. {option} {','.join(str(v) for v in default)}")
    if conv is not str:
        options.refuse_unplain(text, option, whole=conv is _whole)
    for x in items:
        try:
            out.append(conv(x))
        except ValueError:
            raise ForgeError(f"{option}: {x!r} is not a {'whole ' if conv is _whole else ''}number in plain digits",
                             hint=f"a comma-separated list, e.g. {option} {','.join(str(v) for v in default)}") from None
    if not out:
        raise ForgeError(f"{option}: empty list")
    if repeats:                 # a record's text, as the sweep took it before it refused a repeat
        return list(dict.fromkeys(out))
    options.refuse_repeats(text, option, out, "its configurations would be searched once")
    return out


def _whole(x: str) -> int:
    v = options.parse_whole(x)
    if v is None:
        raise ValueError(x)
    return v


def _number(x: str) -> float:
    v = options.parse_number(x)
    if v is None:
        raise ValueError(x)
    return v


def check_each(rnd: rounds.Round, option: str, values: Iterable, name: str | None = None) -> None:
    """Each value of an unlocked option (or of the client's --concurrency) within the round's bounds,
    refused naming `option` and its rule; the fix says to set `name` (default: each value of `option`)."""
    for v in values:
        if option == "--concurrency":
            rounds.check_settings(rnd, {"concurrency": v}, where=option)
        else:
            rounds.check_value(rnd, option, v, where=option, name=name or f"each value of {option}")


def option_values(rnd: rounds.Round, key: str, text: str | None, repeats: bool = False) -> list:
    """One option of the space (`key`, one of SPACE_OPTIONS) as the sweep reads it: its comma-separated text
    (None: the default), each value checked against the round, in the order given; a topology as (tp, dp). A value
    given twice is refused, or with `repeats` (a sweep record's text, the sweep took one before) taken once."""
    opt = option_name(key)
    if key == "topologies":
        # an empty item is refused as the other lists' are ("tp2," was "'' is not a topology"); one topology
        # named twice ("tp2,tp2dp1") is one
        return (list(dict.fromkeys(topology_of(x, rnd) for x in options.comma_items(
            text, opt, f"topologies: {', '.join(sorted(topology_names(rnd)))}"))) if text else list(rnd.topologies))
    if key == "kv_dtypes":
        kvs = _list(text, opt, str, DEFAULTS[key], repeats)
        bad = [k for k in kvs if k not in KV_DTYPES]
        if bad:
            raise ForgeError(f"{opt}: {bad[0]!r} is not a KV dtype of the sweep", hint=f"KV dtypes: {', '.join(KV_DTYPES)}")
        return kvs
    values = _list(text, opt, _number if key == "gpu_memory_utilization" else _whole, DEFAULTS[key], repeats)
    check_each(rnd, opt, values)        # each value alone, refused by its own option's name and rule
    return values


def canonical(key: str, values: list) -> list:
    """An option's values (`option_values`) as one space is written however it was typed: sorted, a topology by
    its full name (tp2dp1), a number as read (0.90 is 0.9): the space a sweep records and a resume compares."""
    if key == "topologies":
        return sorted(f"tp{tp}dp{dp}" for tp, dp in values)
    return sorted(values)


def canonical_space(rnd: rounds.Round, texts: dict) -> dict:
    """The space of the options' texts ({key: text}; a key left out: its default), each option `canonical`."""
    return {k: canonical(k, option_values(rnd, k, texts.get(k))) for k in SPACE_OPTIONS}


def space_text(values: list) -> str:
    """Canonical values as the option takes them: 8,10 (--concurrency); 0.95,0.97 (--gpu-memory-utilization)."""
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def option_name(key: str) -> str:
    """The option of a key of SPACE_OPTIONS: max_num_seqs -> --max-num-seqs."""
    return "--" + key.replace("_", "-")


def space(rnd: rounds.Round, *, topologies: str | None = None, kv_dtypes: str | None = None,
          max_num_seqs: str | None = None, max_num_batched_tokens: str | None = None,
          gpu_memory_utilization: str | None = None, concurrency: str | None = None) -> list[Candidate]:
    """Every candidate of the lists (comma-separated text, as the options give them; None: the
    defaults), each checked against the round; a value the round refuses is an error naming it."""
    if rnd.name == rounds.DEFAULT_ROUND:
        raise ForgeError("the preliminary round has no search space: it unlocks nothing",
                         hint="forge sweep --round final ...; the preliminary's sweep takes profiles")
    texts = dict(topologies=topologies, kv_dtypes=kv_dtypes, max_num_seqs=max_num_seqs, concurrency=concurrency,
                 max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization)
    # each list alone first, so a bad value is refused by its own option's name and rule
    topos, kvs, *lists = (option_values(rnd, k, texts[k]) for k in SPACE_OPTIONS)
    out = []
    for (tp, dp), kv, s, b, u, c in itertools.product(topos, kvs, *lists):
        if b < s:
            continue                 # vLLM refuses fewer batched tokens than sequences: not a point
        cand = Candidate(tp, dp, kv, s, b, u, c)
        rounds.check_settings(rnd, cand.settings_values(), where=f"candidate {cand.key}")
        out.append(cand)
    if not out:
        raise ForgeError("the search space is empty (every --max-num-batched-tokens is below every --max-num-seqs)",
                         hint="give --max-num-batched-tokens values at least as large as --max-num-seqs")
    return out


def with_planned(rnd: rounds.Round, candidates: list[Candidate],
                 planner: Callable[[Candidate], int | None]) -> list[Candidate]:
    """The candidates and, per (topology, KV dtype, batched tokens, utilization, concurrency), one
    more at `planner`'s max-num-seqs for it (the capacity planner's for a tier: how many of its largest
    requests one replica's cache holds, where the concurrency would preempt; None: no cap needed),
    marked planned and checked against the round like the others. A candidate of the space with that
    value already is marked planned instead of repeated (one key, one run folder)."""
    out = {c.key: c for c in candidates}
    for c in candidates:
        n = planner(c)
        if n is None or c.max_num_batched_tokens < n:
            continue                 # no cap needed, or one vLLM refuses (fewer batched tokens than sequences)
        p = replace(c, max_num_seqs=int(n), planned=True)
        rounds.check_settings(rnd, p.settings_values(), where=f"candidate {p.label}")
        out[p.key] = p
    return list(out.values())


def rank(ranker: Ranker, tier: str, candidates: list[Candidate]) -> list[Ranked]:
    """The ranker's order, checked: every candidate it returns is one it was given, each once."""
    ranked = list(ranker(tier, list(candidates)))
    given = set(candidates)
    seen = set()
    for r in ranked:
        if not isinstance(r, Ranked) or r.candidate not in given or r.candidate in seen:
            raise ForgeError(f"the ranking model returned {r!r} for tier {tier}: not one of the candidates it was "
                             "given, or one given twice", hint="the model's ranking function is broken; report it")
        seen.add(r.candidate)
    return ranked


def distinct(ranked: list[Ranked]) -> tuple[list[Ranked], dict[str, list[str]]]:
    """The ranking with one candidate per prediction: candidates the model predicts alike (e.g. a
    --max-num-seqs above the requests in flight, which vLLM never fills) are one point to serve; the
    first in the ranking stands for the others. Returns (the distinct ranking, {key: the keys it stands
    for}). A ranking without predictions is kept whole."""
    out, same, seen = [], {}, {}
    for r in ranked:
        sig = tuple(sorted((k, repr(v)) for k, v in r.predicted.items())) if r.predicted else None
        if sig is not None and sig in seen:
            same[seen[sig]].append(r.candidate.key)
            continue
        if sig is not None:
            seen[sig] = r.candidate.key
        same[r.candidate.key] = []
        out.append(r)
    return out, same


def profile_text(base: str, rnd: rounds.Round, tier: str, values: dict, kv: str | None, what: str) -> str:
    """The serve profile of one configuration (values: a Settings dict) for `tier`: `base` extended with the
    round's unlocked options, the KV dtype, and the tier's client concurrency variable."""
    opts = {u.option: {"value": values[u.key], "effect": f"{what}: {u.option} of this configuration"}
            for u in rnd.unlocked}
    if kv:
        opts["--kv-cache-dtype"] = {"value": kv, "effect": f"{what}: the KV cache stored as {kv}"}
    # the client's concurrency, as a team's start script sets it: the server's record names what the client ran
    var = rnd.client(tier).concurrency_env
    env = {var: {"value": str(values["concurrency"]), "effect": f"{what}: the client's concurrency for {tier}"}} \
        if var else {}
    return ("# Written by forge sweep --round final: one configuration of the search.\n"
            # JSON is YAML: no YAML writer needed where the tool runs (the container's Python has none)
            + json.dumps({"description": f"{what} ({base} with the configuration's values)", "round": rnd.name,
                          "extends": base, "options": opts, **({"env": env} if env else {})}, indent=2) + "\n")


def write_profile(sdir: Path, name: str, text: str) -> Path:
    """The profile file <sdir>/profiles/<name>.yaml, written only where its text changed."""
    p = sdir / "profiles" / f"{name}.yaml"
    if not (p.is_file() and p.read_text() == text):
        paths.write_atomic(p, text)
    return p
