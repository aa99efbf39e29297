"""configs/contest.yaml: the contest's rules, the organizers' start script and benchmark client,
tiers, formula and baselines, validated on load; and the one check every server command goes
through (`check_command`). Every option of the start script is "set by the organizers": a profile
may not change it (refused citing the start script, and the rule that also forbids it when there is
one); `forbidden_options` are "forbidden to change" by a rule of their own."""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Any

from ..config import Field, load, plain_name
from ..errors import ForgeError
from ..options import parse_number
from ..paths import CONFIGS, rel

RULE = {"text": Field(str)}
OPTION = {"option": Field(str), "rule": Field(str), "aliases": Field(list, item=str, required=False, default=[])}
VERBATIM = {"source": Field(str), "command": Field(str)}
ALLOWED = {"option": Field(str), "note": Field(str), "aliases": Field(list, item=str, required=False, default=[]),
           "values": Field(list, item=str, required=False, default=None),
           "rule": Field(str, required=False, default=None),
           "flag": Field(bool, required=False, default=False)}
TIER = {"name": Field(str, check=plain_name, doc="a plain name: it names the tier's result file"),
        "file": Field(str, check=plain_name, doc="the tier file's name in DATA_DIR"), "prompt_tokens": Field(list, item=int),
        "weight": Field(float), "num_prompts": Field(int, required=False, default=None)}
BASELINE = {"source": Field(str), "tok_s": Field(dict, value=object),
            "ttft_p99_ms": Field(dict, value=object), "tpot_p99_ms": Field(float, required=False, default=None),
            "accuracy": Field(dict, value=float, required=False, default={}),
            "sla_from": Field(str, required=False, default=None),
            "round": Field(str, required=False, default="preliminary")}
TASK = {"file": Field(str, check=plain_name), "metric": Field(str, choices=("qa_f1", "rouge_l", "list_match")),
        "max_tokens": Field(int), "template": Field(str)}

SCHEMA = {
    "rules": Field(dict, value=RULE),
    "forbidden_paths": Field(list, item={"glob": Field(str), "rule": Field(str)}),
    "server": Field({"served_model_name": Field(str), "host": Field(str), "health_path": Field(str),
                     "start_script": Field({**VERBATIM, "model_placeholder": Field(str)}),
                     "organizers_rule": Field(str, doc="the rule cited when a profile changes what the "
                                                       "start script sets")}),
    "forbidden_options": Field(list, item=OPTION),
    "allowed_options": Field(list, item=ALLOWED),
    "tiers": Field(list, item=TIER),
    "client": Field({**VERBATIM, "per_tier": Field(list, item=str, doc="options the tool sets per tier "
                                                                        "and server"),
                     "options": Field(list, item=list)}),
    "scoring": Field({
        "floor": Field(float), "gain": Field(float), "rate": Field(float),
        "ttft_p99_max_ratio": Field(float), "tpot_p99_max_ratio": Field(float),
        "min_completion": Field(float),
        "below_baseline": Field(str),
        "accuracy_factor": Field(list, item={"max_loss": Field(float), "factor": Field(float)}),
        "display_decimals": Field(int),
    }),
    "baselines": Field({"default": Field(str), "sets": Field(dict, value=BASELINE)}),
    "accuracy": Field({"script": Field(str), "tasks": Field(dict, value=TASK)}),
    "rounds": Field(dict, required=False, default={},
                    doc="the rounds beside the preliminary (forge.contest.rounds validates them)"),
}


def _cross_check(data: dict, file: str) -> None:
    rules = data["rules"]

    def need_rule(key: str, rule: str | None) -> None:
        if rule is not None and rule not in rules:
            raise ForgeError(f"{file}: key '{key}': unknown rule {rule!r}",
                             hint=f"rules defined: {', '.join(sorted(rules))}")

    for i, fp in enumerate(data["forbidden_paths"]):
        need_rule(f"forbidden_paths[{i}].rule", fp["rule"])
    for section in ("forbidden_options", "allowed_options"):
        for i, o in enumerate(data[section]):
            need_rule(f"{section}[{i}].rule", o.get("rule"))
            for name in [o["option"], *o["aliases"]]:
                if not name.startswith("-"):
                    raise ForgeError(f"{file}: key '{section}[{i}].option': {name!r} is not an option",
                                     hint="write options as on the command line, e.g. --max-num-seqs")
            if section == "allowed_options" and o["values"] is not None and o["rule"] is None:
                raise ForgeError(f"{file}: key 'allowed_options[{i}]': 'values' needs a 'rule' to cite")
    need_rule("server.organizers_rule", data["server"]["organizers_rule"])
    organizer_options(data, file)
    names = [t["name"] for t in data["tiers"]]
    if len(set(names)) != len(names) or not names:
        raise ForgeError(f"{file}: key 'tiers': tier names must be unique and non-empty")
    for i, t in enumerate(data["tiers"]):
        lo_hi = t["prompt_tokens"]
        if len(lo_hi) != 2 or not 0 < lo_hi[0] < lo_hi[1]:
            raise ForgeError(f"{file}: key 'tiers[{i}].prompt_tokens': expected [min, max] with 0 < min < max")
    for i, opt in enumerate(data["client"]["options"]):
        if not opt or not all(isinstance(x, str) for x in opt) or not opt[0].startswith("--") or len(opt) > 2:
            raise ForgeError(f"{file}: key 'client.options[{i}]': expected [--flag] or [--option, \"value\"]",
                             hint="quote numbers: [--max-concurrency, \"1\"]")
    b = data["baselines"]
    if b["default"] not in b["sets"]:
        raise ForgeError(f"{file}: key 'baselines.default': {b['default']!r} is not in baselines.sets",
                         hint=f"sets: {', '.join(sorted(b['sets']))}")
    for name, s in b["sets"].items():
        for key in ("tok_s", "ttft_p99_ms"):
            missing = [n for n in names if n not in s[key]]
            extra = [k for k in s[key] if k not in names]
            if missing or extra:
                raise ForgeError(f"{file}: key 'baselines.sets.{name}.{key}': needs exactly the tiers "
                                 f"{', '.join(names)}" + (f" (unknown: {', '.join(extra)})" if extra else ""))
        for k, v in s["ttft_p99_ms"].items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ForgeError(f"{file}: key 'baselines.sets.{name}.ttft_p99_ms.{k}': expected a positive number or null")
        for k, v in s["tok_s"].items():
            if v is None and s["round"] != "preliminary":
                continue         # a later round's figures unpublished: scored only against a baseline run
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and v != float("inf")):
                raise ForgeError(f"{file}: key 'baselines.sets.{name}.tok_s.{k}': expected a finite positive number, got {v}"
                                 + (" (null only in a set of a later round: round: final)" if v is None else ""))
        if s["tpot_p99_ms"] is not None and not (0 < s["tpot_p99_ms"] < float("inf")):
            raise ForgeError(f"{file}: key 'baselines.sets.{name}.tpot_p99_ms': expected a finite positive number or null")
        rounds = [r for r, v in (data.get("rounds") or {}).items() if isinstance(v, dict)]
        if s["round"] not in ("preliminary", *rounds) or (name == b["default"] and s["round"] != "preliminary"):
            raise ForgeError(f"{file}: key 'baselines.sets.{name}.round': {s['round']!r} is not a round"
                             + (" (the default set is the preliminary's)" if name == b["default"] else ""),
                             hint=f"rounds: {', '.join(['preliminary', *rounds])}")
        src = s["sla_from"]
        if src is not None:
            if src == name or src not in b["sets"]:
                raise ForgeError(f"{file}: key 'baselines.sets.{name}.sla_from': {src!r} is not another set",
                                 hint=f"sets: {', '.join(sorted(b['sets']))}")
            if b["sets"][src]["round"] != s["round"]:
                raise ForgeError(f"{file}: key 'baselines.sets.{name}.sla_from': {src!r} is a set of another round")
            if b["sets"][src].get("sla_from"):
                raise ForgeError(f"{file}: key 'baselines.sets.{name}.sla_from': {src!r} takes its own SLA "
                                 "limits from another set; name that set directly")
    _check_ranges(data, file)
    bounds = [a["max_loss"] for a in data["scoring"]["accuracy_factor"]]
    if bounds != sorted(bounds):
        raise ForgeError(f"{file}: key 'scoring.accuracy_factor': max_loss bounds must increase")


def _in_range(file: str, key: str, v: float, lo: float, hi: float, lo_open: bool, hi_open: bool,
              allowed: str, example: str, why: str) -> None:
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        raise ForgeError(f"{file}: key '{key}': {v!r} is out of range; allowed: {allowed}",
                         hint=f"set a value in that range, e.g. {example} ({why})")


def _check_ranges(data: dict, file: str) -> None:
    """The numbers of the formula and the tiers, within the ranges the score computation assumes."""
    inf = math.inf
    for i, t in enumerate(data["tiers"]):
        _in_range(file, f"tiers[{i}].weight", t["weight"], 0, inf, True, True, "a finite number > 0", "20",
                  "a tier's weight is its share of the total score")
        if t["num_prompts"] is not None and t["num_prompts"] < 1:
            raise ForgeError(f"{file}: key 'tiers[{i}].num_prompts': {t['num_prompts']} is out of range; "
                             "allowed: an integer >= 1, or null", hint="null sends every prompt of the tier file")
    sc = data["scoring"]
    for key, lo_open, allowed, example, why in (
            ("floor", False, "a finite number >= 0", "0.6", "a tier at its baseline's tok/s scores floor x weight"),
            ("gain", False, "a finite number >= 0", "0.4", "the most a tier gains above floor x weight"),
            ("rate", True, "a finite number > 0", "1.3", "how fast a tier's score rises with its lift"),
            ("ttft_p99_max_ratio", True, "a finite number > 0", "1.5", "a tier's TTFT P99 limit is this x the "
                                                                        "baseline's"),
            ("tpot_p99_max_ratio", True, "a finite number > 0", "1.5", "the pooled TPOT P99 limit is this x the "
                                                                        "baseline's")):
        _in_range(file, f"scoring.{key}", sc[key], 0, inf, lo_open, True, allowed, example, why)
    _in_range(file, "scoring.min_completion", sc["min_completion"], 0, 1, True, False, "a fraction in (0, 1]",
              "0.99", "the share of its requests a tier must complete")
    for i, a in enumerate(sc["accuracy_factor"]):
        _in_range(file, f"scoring.accuracy_factor[{i}].max_loss", a["max_loss"], 0, 1, False, False,
                  "a fraction in [0, 1]", "0.02", "a relative accuracy loss against the baseline")
        _in_range(file, f"scoring.accuracy_factor[{i}].factor", a["factor"], 0, 1, False, False,
                  "a number in [0, 1]", "0.97", "the multiplier on the total up to that loss")
    dec = sc["display_decimals"]
    if not 0 <= dec <= 6:
        raise ForgeError(f"{file}: key 'scoring.display_decimals': {dec} is out of range; allowed: an integer "
                         "from 0 to 6", hint="set a value in that range, e.g. 1 (the decimals the total is shown with)")


def load_contest(path: str = "contest.yaml") -> dict:
    """The validated contest config."""
    data = load(path, SCHEMA)
    p = Path(path)
    _cross_check(data, rel(p if p.is_absolute() or p.exists() else CONFIGS / p))
    return data


def _split(command: str, file: str, key: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError as e:
        raise ForgeError(f"{file}: key '{key}': not a shell command line ({e})")


def organizer_options(contest: dict, file: str = "configs/contest.yaml") -> list[tuple[str, Any]]:
    """The start script's options in order: [(option, value or True for a flag)]."""
    ss = contest["server"]["start_script"]
    argv = _split(ss["command"], file, "server.start_script.command")
    if argv[:3] != ["vllm", "serve", ss["model_placeholder"]]:
        raise ForgeError(f"{file}: key 'server.start_script.command': expected `vllm serve "
                         f"{ss['model_placeholder']} ...`, got `{' '.join(argv[:3])} ...`")
    out: list[tuple[str, Any]] = []
    rest = argv[3:]
    i = 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("--"):
            raise ForgeError(f"{file}: key 'server.start_script.command': {tok!r} follows no option")
        if "=" in tok:
            out.append(tuple(tok.split("=", 1)))
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            out.append((tok, rest[i + 1]))
            i += 1
        else:
            out.append((tok, True))
        i += 1
    return out


def organizers_argv(contest: dict, model: str) -> list[str]:
    """The start script's command with `model` for the model directory, exactly as the organizers
    run it (`vllm serve <model> ...`)."""
    ss = contest["server"]["start_script"]
    argv = _split(ss["command"], "configs/contest.yaml", "server.start_script.command")
    return [model if a == ss["model_placeholder"] else a for a in argv]


def rule_text(contest: dict, rule: str) -> str:
    return contest["rules"][rule]["text"]


def tier_names(contest: dict) -> list[str]:
    return [t["name"] for t in contest["tiers"]]


# --- options ------------------------------------------------------------------------------------

def per_tier_values(text: str, option: str, names: list[str], what: str, hint: str | None = None) -> dict[str, float]:
    """An option's "a,b,c": one finite positive number per tier, in the contest's tier order; anything
    else is a ForgeError naming the option and the tier."""
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != len(names):
        raise ForgeError(f"{option} {text!r}: needs {len(names)} values, one per tier ({', '.join(names)})", hint=hint)
    out = {}
    for n, x in zip(names, parts):
        v = parse_number(x)
        if v is None:
            raise ForgeError(f"{option}: the {n} value {x!r} is not a number in plain digits (e.g. 15.97), so not a "
                             f"finite positive {what}", hint=hint)
        if not (math.isfinite(v) and v > 0):
            raise ForgeError(f"{option}: the {n} value {x!r} is not a finite positive {what}", hint=hint)
        out[n] = v
    return out


def option_base(token: str) -> str:
    """The option a command-line token names: `--max_num_seqs=4` -> `--max-num-seqs`,
    `--compilation-config.mode` -> `--compilation-config`, `-O3` -> `-O`."""
    t = token.split("=", 1)[0]
    if t.startswith("--"):
        t = "--" + t[2:].replace("_", "-")
        t = t.split(".", 1)[0]
    elif t.startswith("-") and len(t) > 2 and not t.startswith("-O.") and t[1] != "-":
        # short option with an attached value (-O3, -q8) or a multi-letter short (-tp)
        t = t if t in ("-tp", "-pp", "-dp") else t[:2]
    elif t.startswith("-O."):
        t = "-O"
    return t


def attached_value(token: str) -> str | None:
    """The value written into a short option's token (`-O3` -> "3"), else None (`-O`, `-O.mode`, long
    options: their value follows or comes after '=')."""
    t = token.split("=", 1)[0]
    base = option_base(t)
    if t.startswith("--") or "=" in token or len(t) <= len(base) or t[len(base)] == ".":
        return None
    return t[len(base):]


def _index(contest: dict) -> tuple[dict, dict, dict]:
    forbidden, allowed, locked = {}, {}, {}      # locked: what the organizers' start script sets
    for o in contest["forbidden_options"]:
        for n in [o["option"], *o["aliases"]]:
            forbidden[n] = o
    for o in contest["allowed_options"]:
        for n in [o["option"], *o["aliases"]]:
            allowed[n] = o
    for name, value in organizer_options(contest):
        locked[option_base(name)] = {"option": name, "value": value, "rule": contest["server"]["organizers_rule"]}
    return forbidden, allowed, locked


def lookup_option(contest: dict, name: str) -> tuple[str, dict | None]:
    """('organizers'|'forbidden'|'allowed'|'unreviewed', entry) for an option name in any spelling."""
    forbidden, allowed, locked = _index(contest)
    base = option_base(name)
    candidates = [base]
    if base.startswith("--no-"):
        candidates.append("--" + base[5:])
    for c in candidates:
        if c in locked:
            return "organizers", {**locked[c], "also": forbidden.get(c)}
        if c in forbidden:
            return "forbidden", forbidden[c]
        if c in allowed:
            return "allowed", allowed[c]
    return "unreviewed", None


def check_option(contest: dict, name: str, value: Any, where: str) -> str:
    """Raise ForgeError when a profile may not set `name` (to `value`); return its canonical name."""
    kind, entry = lookup_option(contest, name)
    if kind == "forbidden":
        raise ForgeError(f"{where}: {name} is forbidden by the contest rules: "
                         f"\"{rule_text(contest, entry['rule'])}\" (rule '{entry['rule']}')",
                         hint=f"remove {name} from the profile")
    if kind == "organizers":
        raise ForgeError(f"{where}: {name} is set by the organizers' start script"
                         + (f" to {entry['value']}" if entry["value"] is not True else "") +
                         f"; a profile may not change it: \"{rule_text(contest, entry['rule'])}\" (rule "
                         f"'{entry['rule']}')" + _also(contest, entry.get("also")),
                         hint=f"remove {name} from the profile (the start script is configs/contest.yaml "
                              "server.start_script)")
    if kind == "unreviewed":
        raise ForgeError(f"{where}: {name} has not been reviewed against the contest rules",
                         hint="if it is allowed, add it to configs/contest.yaml allowed_options with a "
                              "note saying which rule it was checked against; otherwise remove it")
    if value is True and attached_value(name) is not None:
        value = attached_value(name)
    if entry["flag"] and value is not True:
        raise ForgeError(f"{where}: {name} is a flag and takes no value (got {value!r})",
                         hint=f"set it as `{name}: {{value: true, effect: …}}`, or remove it")
    if not entry["flag"] and entry["values"] is None and value is True:
        raise ForgeError(f"{where}: {name} needs a value and was given none (a bare flag)",
                         hint=f"give {name} its value, or mark it `flag: true` in configs/contest.yaml "
                              "allowed_options if vLLM takes it bare")
    if entry["values"] is not None and value is True:
        # an option restricted to values takes one; given bare, the server would refuse the command
        raise ForgeError(f"{where}: {name} needs a value and was given none (a bare flag)",
                         hint=f"set one of the allowed values: {', '.join(entry['values'])}")
    if entry["values"] is not None and str(value) not in entry["values"]:
        raise ForgeError(f"{where}: {name} {value} is forbidden by the contest rules: "
                         f"\"{rule_text(contest, entry['rule'])}\" (rule '{entry['rule']}')",
                         hint=f"allowed values: {', '.join(entry['values'])}")
    return entry["option"]


def _also(contest: dict, forbidden: dict | None) -> str:
    if not forbidden:
        return ""
    return (f"; it is also forbidden to change: \"{rule_text(contest, forbidden['rule'])}\" "
            f"(rule '{forbidden['rule']}')")


def check_command(contest: dict, args: list[str], where: str = "server command") -> None:
    """Check a full rendered `vllm serve` argument list (after `serve <model>`): the start script's
    options must appear exactly once with their values, nothing forbidden or unreviewed may appear."""
    _, _, locked = _index(contest)
    seen: dict[str, str] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("-"):
            raise ForgeError(f"{where}: unexpected argument {tok!r}",
                             hint="the model directory is the only positional argument")
        value: Any = True
        if "=" in tok:
            value = tok.split("=", 1)[1]
        elif attached_value(tok) is not None:
            value = attached_value(tok)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 1
        base = option_base(tok)
        if base in locked:
            if base in seen:
                raise ForgeError(f"{where}: {base} given twice",
                                 hint=f"\"{rule_text(contest, locked[base]['rule'])}\"")
            if value != locked[base]["value"] and str(value) != str(locked[base]["value"]):
                raise ForgeError(f"{where}: {base} {value} differs from the start script's {locked[base]['value']}: "
                                 f"\"{rule_text(contest, locked[base]['rule'])}\" (rule '{locked[base]['rule']}')"
                                 + _also(contest, _index(contest)[0].get(base)))
            seen[base] = str(value)
        else:
            check_option(contest, tok, value, where)
        i += 1
    for name, o in locked.items():
        if name not in seen:
            raise ForgeError(f"{where}: the start script's option {name}"
                             + (f" {o['value']}" if o["value"] is not True else "") + " is missing",
                             hint=f"\"{rule_text(contest, o['rule'])}\"")


def check_env_name(name: str, where: str) -> None:
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
        raise ForgeError(f"{where}: {name!r} is not a valid environment variable name")
