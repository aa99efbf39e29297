"""The contest's rounds as data (configs/contest.yaml: the preliminary is the top level, the final is
`rounds.final`), one API for every verb that takes `--round`.

Contract (kept backward compatible):
- `ROUNDS` = ("preliminary", "final"); `DEFAULT_ROUND` = "preliminary".
- `load_round(contest, name) -> Round`: a frozen description of one round: `name`, `source`, `cards`,
  `command` (the start script's template: `$MODEL_DIR` for the model, `$<ENV>` for each unlocked
  value), `organizers_rule`, `unlocked` (`Unlocked` per option: key, option, env, type, bounds or
  choices, the rule a bad value cites), `topologies` ((tp, dp) pairs), `allowed_options` (engine
  options the round adds to the preliminary's reviewed ones), `clients` (tier -> `TierClient`:
  concurrency, request_rate (float, inf for the final), output_len, num_prompts (None: every prompt),
  warmups, concurrency_env), `baseline` (`Settings`), `tier_order`. The preliminary unlocks nothing.
- `Settings`: one tier's configuration (tensor_parallel_size, data_parallel_size, max_num_seqs,
  max_num_batched_tokens, gpu_memory_utilization, concurrency).
- `check_settings(rnd, values, where=..., visible=None) -> Settings`: refuses a bad value (out of
  bounds, a topology the round does not allow, a value the round does not unlock, more cards than
  `visible` holds, two ranks on one device) with a one-line ForgeError citing the rule.
- `check_value(rnd, option, value, where, name=None)`: one unlocked option's value within its bounds (`name`: what
  the fix says to set; default the start script's variable). A variable's value is refused naming the variable.
- `tier_settings(rnd, tier, profile_values=None, environ=None) -> (Settings, sources)`: one tier's
  values, each from (first found) the variable `<ENV>_<TIER>` (e.g. MAX_NUM_SEQS_8_16K), `<ENV>`,
  the profile, the round's baseline; checked.
- `start_argv(rnd, settings, model)`, `tier_env(rnd, tier, settings)` (the per-tier environment a team
  sets), `contest_view(contest, rnd, settings)` (the contest dict `rules.check_command` checks a
  command of this round against; the preliminary's is `contest` itself), `visible_cards(environ)` and
  `check_cards(rnd, settings, visible)` (forge.contest.cards). The types live in round_types; the
  reading of a value as a setting's number in setting_values.
"""

from __future__ import annotations

import copy
import math
import os
import shlex
from typing import Any, Mapping

from ..config import Field, validate
from ..errors import ForgeError
from ..options import not_plain
from . import cards
from . import rules as contest_mod
from .cards import Visible, visible_cards  # noqa: F401  (part of this module's API)
from .round_types import Round, Settings, TierClient, Unlocked, _num  # noqa: F401  (part of this module's API)
from .setting_values import coerce, is_number, mistyped

ROUNDS = ("preliminary", "final")
DEFAULT_ROUND = "preliminary"
FILE = "configs/contest.yaml"

UNLOCKED = {"key": Field(str), "option": Field(str), "env": Field(str), "type": Field(str, choices=("int", "float")),
            "choices": Field(list, required=False, default=None), "min": Field(float, required=False, default=None),
            "max": Field(float, required=False, default=None), "rule": Field(str),
            "names_ours": Field(bool, required=False, default=False)}
ALLOWED = contest_mod.ALLOWED
ROUND_SCHEMA = {
    "source": Field(str), "cards": Field(int),
    "start_script": Field({"source": Field(str), "model_placeholder": Field(str), "command": Field(str)}),
    "organizers_rule": Field(str),
    "unlocked": Field(list, item=UNLOCKED),
    "topologies": Field(list, item=list),
    "allowed_options": Field(list, item=ALLOWED, required=False, default=[]),
    "client": Field({"source": Field(str), "request_rate": Field(object), "output_len": Field(int),
                     "warmups": Field(int),
                     "concurrency": Field({"min": Field(int), "max": Field(int), "rule": Field(str)}),
                     "tiers": Field(dict, value={"concurrency": Field(int), "concurrency_env": Field(str),
                                                 "num_prompts": Field(int)})}),
    "baseline": Field(dict),
    "tier_order": Field(list, item=str),
}
SETTING_KEYS = ("tensor_parallel_size", "data_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                "gpu_memory_utilization", "concurrency")


def _cite(rule: str, rules: Mapping) -> str:
    return f"\"{rules[rule]['text']}\" (rule '{rule}')"


def load_round(contest: dict, name: str) -> Round:
    """The round `name` of a loaded contest (rules.load_contest()); a name not in ROUNDS, or a round
    configs/contest.yaml does not describe, is a one-line ForgeError."""
    if name not in ROUNDS:
        raise ForgeError(f"--round {name!r}: not a round of the contest", hint=f"rounds: {', '.join(ROUNDS)}")
    if name == "preliminary":
        return _preliminary(contest)
    data = (contest.get("rounds") or {}).get(name)
    if data is None:
        raise ForgeError(f"{FILE}: key 'rounds.{name}' is missing", hint="restore the round's section")
    return _parse(contest, name, validate(data, ROUND_SCHEMA, FILE, f"rounds.{name}"))


def _preliminary(contest: dict) -> Round:
    opts = dict(contest_mod.organizer_options(contest))
    client = {o[0]: (o[1] if len(o) > 1 else True) for o in contest["client"]["options"]}
    base = Settings(int(opts.get("--tensor-parallel-size", 1)), int(opts.get("--data-parallel-size", 1)),
                    int(opts["--max-num-seqs"]), int(opts["--max-num-batched-tokens"]),
                    float(opts["--gpu-memory-utilization"]), int(client["--max-concurrency"]))
    clients = {t["name"]: TierClient(t["name"], base.concurrency, float(client["--request-rate"]),
                                     int(client["--custom-output-len"]), t["num_prompts"],
                                     int(client["--num-warmups"]), None) for t in contest["tiers"]}
    ss = contest["server"]["start_script"]
    rnd = Round("preliminary", ss["source"], base.cards, ss["command"], ss["model_placeholder"],
                contest["server"]["organizers_rule"], (), ((base.tensor_parallel_size, base.data_parallel_size),),
                (), clients, base, tuple(contest_mod.tier_names(contest)), None)
    object.__setattr__(rnd, "_rules", contest["rules"])
    return rnd


def _parse(contest: dict, name: str, d: dict) -> Round:
    key = f"rounds.{name}"
    rules = contest["rules"]
    tiers = contest_mod.tier_names(contest)
    for where, rule in [(f"{key}.organizers_rule", d["organizers_rule"]),
                        (f"{key}.client.concurrency.rule", d["client"]["concurrency"]["rule"]),
                        *[(f"{key}.unlocked[{i}].rule", u["rule"]) for i, u in enumerate(d["unlocked"])],
                        *[(f"{key}.allowed_options[{i}].rule", o["rule"]) for i, o in enumerate(d["allowed_options"])]]:
        if rule is not None and rule not in rules:
            raise ForgeError(f"{FILE}: key '{where}': unknown rule {rule!r}", hint=f"rules: {', '.join(sorted(rules))}")
    argv = shlex.split(d["start_script"]["command"])
    unlocked = []
    for i, u in enumerate(d["unlocked"]):
        for f in ("key", "option", "env"):
            if any(x[f] == u[f] for x in d["unlocked"][:i]):
                raise ForgeError(f"{FILE}: key '{key}.unlocked[{i}].{f}': {u[f]!r} is unlocked twice",
                                 hint="give each setting, option and variable one entry")
        if u["key"] not in SETTING_KEYS[:-1]:
            raise ForgeError(f"{FILE}: key '{key}.unlocked[{i}].key': {u['key']!r} is not a server setting",
                             hint=f"settings: {', '.join(SETTING_KEYS[:-1])}")
        contest_mod.check_env_name(u["env"], f"{FILE}: key '{key}.unlocked[{i}].env'")
        if u["option"] not in argv or argv[argv.index(u["option"]) + 1] != f"${u['env']}":
            raise ForgeError(f"{FILE}: key '{key}.unlocked[{i}]': the start script does not give "
                             f"{u['option']} ${u['env']}", hint="the start script takes each unlocked value from its variable")
        if (u["choices"] is None) == (u["min"] is None or u["max"] is None):
            raise ForgeError(f"{FILE}: key '{key}.unlocked[{i}]': give either choices or min and max")
        if u["choices"] is not None and not (u["choices"] and all(is_number(c, u["type"]) for c in u["choices"])):
            raise ForgeError(f"{FILE}: key '{key}.unlocked[{i}].choices': {u['choices']!r} is not a list of "
                             f"{'whole numbers' if u['type'] == 'int' else 'numbers'}", hint="e.g. choices: [1, 2]")
        unlocked.append(Unlocked(u["key"], u["option"], u["env"], u["type"],
                                 tuple(u["choices"]) if u["choices"] is not None else None,
                                 u["min"], u["max"], u["rule"], u["names_ours"]))
    topo = []
    for i, t in enumerate(d["topologies"]):
        if len(t) != 2 or not all(isinstance(x, int) and x > 0 for x in t) or t[0] * t[1] != d["cards"]:
            raise ForgeError(f"{FILE}: key '{key}.topologies[{i}]': expected [tp, dp] with tp x dp = {d['cards']} cards")
        topo.append((t[0], t[1]))
    c = d["client"]
    if sorted(c["tiers"]) != sorted(tiers) or sorted(d["tier_order"]) != sorted(tiers):
        raise ForgeError(f"{FILE}: key '{key}.client.tiers' / '{key}.tier_order': need exactly the tiers "
                         f"{', '.join(tiers)}")
    try:
        rate = float(c["request_rate"])
    except (TypeError, ValueError):
        rate = math.nan
    if not rate > 0:
        raise ForgeError(f"{FILE}: key '{key}.client.request_rate': expected a positive number or inf")
    cb = c["concurrency"]
    for where, v, lo in ((f"{key}.client.output_len", c["output_len"], 1), (f"{key}.client.warmups", c["warmups"], 0),
                         *((f"{key}.client.tiers.{t}.num_prompts", v["num_prompts"], 1) for t, v in c["tiers"].items()),
                         *((f"{key}.client.tiers.{t}.concurrency", v["concurrency"], cb["min"])
                           for t, v in c["tiers"].items())):
        hi = cb["max"] if where.endswith(".concurrency") else None
        if v < lo or (hi is not None and v > hi):
            rng = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
            raise ForgeError(f"{FILE}: key '{where}': {v} is out of range", hint=f"give a whole number {rng}")
    taken = {u.env for u in unlocked}
    for t, v in c["tiers"].items():
        where = f"{FILE}: key '{key}.client.tiers.{t}.concurrency_env'"
        contest_mod.check_env_name(v["concurrency_env"], where)
        if v["concurrency_env"] in taken:
            raise ForgeError(f"{where}: {v['concurrency_env']!r} is already the variable of another setting",
                             hint="one variable per tier's concurrency (CONCURRENCY_4_8K, ...)")
        taken.add(v["concurrency_env"])
    clients = {t: TierClient(t, v["concurrency"], rate, c["output_len"], v["num_prompts"], c["warmups"],
                             v["concurrency_env"]) for t, v in c["tiers"].items()}
    missing = [k for k in SETTING_KEYS if k not in d["baseline"]]
    if missing or set(d["baseline"]) - set(SETTING_KEYS):
        raise ForgeError(f"{FILE}: key '{key}.baseline': needs exactly {', '.join(SETTING_KEYS)}")
    for k in SETTING_KEYS:
        if not is_number(d["baseline"][k], "float" if k == "gpu_memory_utilization" else "int"):
            raise ForgeError(f"{FILE}: key '{key}.baseline.{k}': {d['baseline'][k]!r} is not a number",
                             hint="write the value as a plain number, unquoted")
    rnd = Round(name, d["source"], d["cards"], d["start_script"]["command"], d["start_script"]["model_placeholder"],
                d["organizers_rule"], tuple(unlocked), tuple(topo), tuple(d["allowed_options"]), clients,
                Settings(**{k: d["baseline"][k] for k in SETTING_KEYS}), tuple(d["tier_order"]),
                (cb["min"], cb["max"], cb["rule"]))
    object.__setattr__(rnd, "_rules", rules)
    check_settings(rnd, rnd.baseline.as_dict(), where=f"{FILE}: key '{key}.baseline'")
    return rnd


# --- values -------------------------------------------------------------------------------------

def _rules(rnd: Round) -> Mapping:
    return rnd._rules                 # set by load_round: the rules its refusals cite


def check_settings(rnd: Round, values: Mapping[str, Any], where: str = "settings",
                   visible: Visible | None = None, sources: Mapping[str, str] | None = None) -> Settings:
    """`values` (a Settings field -> value; missing ones from the round's baseline) as checked Settings.
    A value the round does not unlock must equal the baseline; an unlocked one must be within its
    bounds; the topology must be one of the round's; with `visible`, its cards must be there, one per
    rank. Every refusal is a one-line ForgeError citing the rule; `sources` (key -> "env VAR" |
    "profile") names where a pair the server refuses came from."""
    rules = _rules(rnd)
    unknown = [k for k in values if k not in SETTING_KEYS]
    if unknown:
        raise ForgeError(f"{where}: unknown setting {unknown[0]!r}", hint=f"settings: {', '.join(SETTING_KEYS)}")
    out: dict[str, Any] = {}
    for k in SETTING_KEYS:
        base = getattr(rnd.baseline, k)
        u = next((x for x in rnd.unlocked if x.key == k), None)
        if k not in values:
            out[k] = base
            continue
        typ = u.type if u else ("float" if isinstance(base, float) else "int")
        what = u.option if u else ("concurrency" if k == "concurrency" else "--" + k.replace("_", "-"))
        bounds = (u.bounds() if u else f"{rnd.concurrency_bounds[0]}..{rnd.concurrency_bounds[1]}"
                  if k == "concurrency" and rnd.concurrency_bounds is not None else "locked")
        v = coerce(values[k], typ, what, where, f"the {rnd.name} round's bounds: {bounds}")
        if k == "concurrency" and rnd.concurrency_bounds is not None:
            lo, hi, rule = rnd.concurrency_bounds
            if not lo <= v <= hi:
                raise ForgeError(f"{where}: concurrency {v} is out of bounds ({lo}..{hi}): {_cite(rule, rules)}",
                                 hint=f"set the client's concurrency to a whole number from {lo} to {hi}")
        elif u is None:
            if v != base:
                rule = rnd.organizers_rule
                raise ForgeError(f"{where}: {what} is locked at {_num(base)} in the {rnd.name} round (got {_num(v)}): "
                                 f"{_cite(rule, rules)}", hint="remove it, or use the round that unlocks it")
        else:
            _in_bounds(u, v, where, rules)
        out[k] = v
    s = Settings(**out)
    topo = (s.tensor_parallel_size, s.data_parallel_size)
    if topo not in rnd.topologies:
        allowed = " or ".join(f"TP={t}/DP={d}" for t, d in rnd.topologies)
        rule = next((u.rule for u in rnd.unlocked if u.key == "tensor_parallel_size"), rnd.organizers_rule)
        tp, dp = ((sources or {}).get(k) or "the baseline" for k in ("tensor_parallel_size", "data_parallel_size"))
        envs, said = [v[4:] for v in (tp, dp) if v.startswith("env ")], f" (TP from {tp}, DP from {dp})" if sources else ""
        raise ForgeError(f"{where}: TP={topo[0]}/DP={topo[1]}{said} is not a topology of the "
                         f"{rnd.name} round ({allowed}): {_cite(rule, rules)}",
                         hint=f"set TP x DP to {allowed}" + (f" (unset or change {' and '.join(envs)})" if envs else ""))
    if s.max_num_batched_tokens < s.max_num_seqs:
        u = rnd.unlocked_option("--max-num-batched-tokens")
        said = {k: f" ({v})" for k, v in (sources or {}).items() if v}
        bt = (sources or {}).get("max_num_batched_tokens") or ""
        raise ForgeError(f"{where}: --max-num-batched-tokens {s.max_num_batched_tokens}"
                         f"{said.get('max_num_batched_tokens', '')} is below --max-num-seqs {s.max_num_seqs}"
                         f"{said.get('max_num_seqs', '')} (vLLM refuses it): "
                         f"{_cite(u.rule if u else rnd.organizers_rule, rules)}",
                         hint=f"raise {bt[4:] if bt.startswith('env ') else '--max-num-batched-tokens'} to at least "
                              "--max-num-seqs")
    if visible is not None:
        check_cards(rnd, s, visible, where)
    return s


def _in_bounds(u: Unlocked, v: float | int, where: str, rules: Mapping, name: str | None = None) -> None:
    if u.choices is not None and v not in u.choices:
        raise ForgeError(f"{where}: {u.option} {_num(v)} is not allowed ({u.bounds()}): {_cite(u.rule, rules)}",
                         hint=f"set {name or u.env} to {u.bounds()}")
    if u.choices is None and not u.min <= v <= u.max:
        raise ForgeError(f"{where}: {u.option} {_num(v)} is out of bounds ({u.bounds()}): {_cite(u.rule, rules)}",
                         hint=f"set {name or u.env} within {u.bounds()}")


def check_value(rnd: Round, option: str, value: Any, where: str, name: str | None = None) -> float | int:
    """One unlocked option's value (a number, or its text) within the round's bounds, as the number the
    command gets; the topology and the cross-checks wait for the whole tier (`check_settings`). `name`:
    what the fix tells the user to set (default: the start script's variable; an option of ours names itself)."""
    u = rnd.unlocked_option(option)
    if u is None:
        raise ForgeError(f"{where}: {option} is not unlocked in the {rnd.name} round")
    v = coerce(value, u.type, u.option, where, f"the {rnd.name} round's bounds: {u.bounds()}")
    _in_bounds(u, v, where, _rules(rnd), name)
    return v


def _tier_suffix(tier: str) -> str:
    return tier.replace("-", "_").replace(".", "_").upper()


def env_names(u: Unlocked, tier: str) -> tuple[str, str]:
    """The variables that set unlocked option `u` for `tier`, the one that wins first: the tier's own
    (MAX_NUM_SEQS_16_32K), then the round's (MAX_NUM_SEQS)."""
    return f"{u.env}_{_tier_suffix(tier)}", u.env


def tier_settings(rnd: Round, tier: str, profile_values: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None, where: str | None = None) -> tuple[Settings, dict]:
    """One tier's checked Settings and where each value came from ({key: "env MAX_NUM_SEQS_8_16K" |
    "env MAX_NUM_SEQS" | "profile" | "baseline"}). `profile_values`: a Settings field -> a value, or a
    mapping tier -> value. The preliminary reads no variable (it unlocks nothing)."""
    rnd.client(tier)
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for k, v in (profile_values or {}).items():
        if isinstance(v, Mapping):
            bad = [t for t in v if t not in rnd.tier_order]
            if bad:
                raise ForgeError(f"{where or 'profile'}: {k}: {bad[0]!r} is not a tier of the {rnd.name} round",
                                 hint=f"tiers: {', '.join(rnd.tier_order)}")
            if tier not in v:
                continue
            v = v[tier]
        values[k], sources[k] = v, "profile"
    if rnd.unlocked:
        refuse_mistyped(rnd, environ, where or f"the {rnd.name} round, tier {tier}")
        for u in rnd.unlocked:
            for var in env_names(u, tier):
                if environ.get(var, "") != "":
                    values[u.key] = env_value(rnd, u, var, environ[var], where or f"the {rnd.name} round, tier {tier}")
                    sources[u.key] = f"env {var}"
                    break
        var = rnd.client(tier).concurrency_env
        if var and environ.get(var, "") != "":
            values["concurrency"] = env_value(rnd, None, var, environ[var], where or f"the {rnd.name} round, tier {tier}")
            sources["concurrency"] = f"env {var}"
    s = check_settings(rnd, values, where=where or f"the {rnd.name} round, tier {tier}", sources=sources)
    return s, {k: sources.get(k, "baseline") for k in SETTING_KEYS}


def refuse_mistyped(rnd: Round, environ: Mapping[str, str], where: str) -> None:
    """A round's variable mistyped (MAX_NUM_SEQS_4_8k, CONCURRENCY_48K) is read by nothing: refused, not left out."""
    tiers = {t: rnd.client(t).concurrency_env for t in rnd.tier_order}
    known = {v for u in rnd.unlocked for t in tiers for v in env_names(u, t)} | {v for v in tiers.values() if v}
    stems = {u.env for u in rnd.unlocked} | {v[:-len(_tier_suffix(t)) - 1] for t, v in tiers.items() if v}
    for var, near in mistyped(environ, known, stems)[:1]:       # the first, as the other refusals name one
        raise ForgeError(f"{var}={environ[var]!r} (environment), {where}: not a variable of the {rnd.name} round, so "
                         "nothing reads it" + (f" (it reads as {near})" if near else ""),
                         hint=f"rename it {near}, or unset it" if near else "unset it; the tiers' own variables end in "
                              + ", ".join("_" + _tier_suffix(t) for t in tiers))


def env_value(rnd: Round, u: Unlocked | None, var: str, raw: str, where: str) -> float | int:
    """One variable's value (`u`'s, or the tier's concurrency for None) within the round's bounds; a
    refusal names the variable and how to set it."""
    w = f"{var}={raw!r} (environment), {where}"
    text, whole = raw.strip(), u is None or u.type == "int"
    try:
        # the finals' start script and client pass the text as written: "+64" and "064" are not what forge ran
        if not_plain(text, whole):
            raise ForgeError(f"{w}: {not_plain(text, whole)} before the number; the "
                             f"{rnd.name} round's start script and client get the value as written")
        if u is not None:
            return check_value(rnd, u.option, text, w)
        return check_settings(rnd, {"concurrency": text}, where=w).concurrency
    except ForgeError as e:
        lo, hi, _ = rnd.concurrency_bounds or (None, None, None)
        raise ForgeError(e.message, hint=f"set {var} to " + (
            u.bounds() if u is not None and u.choices is not None else
            f"{'a whole number' if whole else 'a number of at most 6 significant digits'} within "
            f"{u.bounds() if u is not None else f'{lo}..{hi}'}") + ", or unset it") from None


def tier_env(rnd: Round, tier: str, settings: Settings) -> dict[str, str]:
    """The environment a team sets for `tier`: each unlocked variable and the tier's concurrency
    variable (empty for the preliminary)."""
    env = {u.env: _num(getattr(settings, u.key)) for u in rnd.unlocked}
    var = rnd.client(tier).concurrency_env
    if var:
        env[var] = str(settings.concurrency)
    return env


def start_argv(rnd: Round, settings: Settings, model: str) -> list[str]:
    """The round's start script with `model` and the settings' values filled in."""
    subst = {f"${u.env}": _num(getattr(settings, u.key)) for u in rnd.unlocked}
    subst[rnd.model_placeholder] = str(model)
    return [subst.get(a, a) for a in shlex.split(rnd.command)]


def contest_view(contest: dict, rnd: Round, settings: Settings) -> dict:
    """The contest as `rules.check_command` / `check_option` should see it for a server of this round
    with these settings: the start script with the values filled in, the round's organizers rule and
    reviewed options, the unlocked options no longer forbidden on their own (the start script sets
    them). The preliminary's view is `contest` itself."""
    if rnd.name == "preliminary":
        return contest
    view = copy.deepcopy(contest)
    argv = start_argv(rnd, settings, rnd.model_placeholder)
    view["server"]["start_script"] = {"source": rnd.source, "model_placeholder": rnd.model_placeholder,
                                      "command": shlex.join(argv)}
    view["server"]["organizers_rule"] = rnd.organizers_rule
    opened = {u.option for u in rnd.unlocked}
    view["forbidden_options"] = [o for o in view["forbidden_options"] if o["option"] not in opened]
    view["allowed_options"] = [*view["allowed_options"], *copy.deepcopy(list(rnd.allowed_options))]
    return view


# --- the cards ----------------------------------------------------------------------------------

def check_cards(rnd: Round, settings: Settings, visible: Visible, where: str = "server") -> None:
    """Refuse a start of `settings` that needs more cards than `visible` holds, would put two ranks on
    one device, or where the count cannot be told (forge.contest.cards)."""
    rule = next((u.rule for u in rnd.unlocked if u.key == "tensor_parallel_size"), rnd.organizers_rule)
    cards.check_cards(settings.cards, f"TP={settings.tensor_parallel_size}/DP={settings.data_parallel_size}",
                      visible, _cite(rule, _rules(rnd)), where)
