"""configs/serve/<profile>.yaml: the environment (and, if any, reviewed engine options) one server
runs with, checked against configs/contest.yaml on load, and rendered into the exact server
command: the organizers' start script plus that."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from .. import switches
from ..config import Field, load_yaml, validate, written_text
from ..errors import ForgeError
from ..options import named, parse_number, refuse_unplain
from ..paths import CONFIGS, name_problem, rel
from . import rounds
from . import rules as contest_mod

PROFILES = CONFIGS / "serve"

ENTRY = {"value": Field(object), "effect": Field(str, doc="what it changes; goes into reports/env-vars.md")}
SCHEMA = {
    "description": Field(str),
    "extends": Field(str, required=False, default=None, doc="a profile this one adds to"),
    "env": Field(dict, value=ENTRY, required=False, default={}),
    "options": Field(dict, value=ENTRY, required=False, default={}),
    "round": Field(str, required=False, default=rounds.DEFAULT_ROUND, choices=rounds.ROUNDS,
                   doc="the round this profile is for (a preliminary profile may also be the base of a final one)"),
}
_ROUND_KEY = re.compile(r"^round:\s*[\"']?([A-Za-z]+)", re.M)


def profile_names(round_name: str | None = rounds.DEFAULT_ROUND) -> list[str]:
    """The profiles of configs/serve/ for `round_name` (their key 'round'; None: every profile). A file
    that cannot be read counts as the preliminary's (loading it says what is wrong)."""
    out = []
    for p in PROFILES.glob("*.yaml"):
        try:
            m = _ROUND_KEY.search(p.read_text(errors="replace"))
        except OSError:
            m = None
        if round_name is None or (m.group(1) if m else rounds.DEFAULT_ROUND) == round_name:
            out.append(p.stem)
    return sorted(out)


def _path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".yaml" and p.is_file():
        return p
    if name_problem(name) and p.suffix != ".yaml":
        # "../contest" read configs/contest.yaml as a profile ("unknown key 'rules'"); "../serve/x" took x
        raise ForgeError(f"profile {name!r}: {name_problem(name)}", hint="name a profile of configs/serve/ by its name "
                         f"({', '.join(profile_names(None))}), or give a profile file's path ending in .yaml")
    q = PROFILES / f"{name}.yaml"
    if not q.is_file():
        raise ForgeError(f"profile {name!r} not found ({rel(q)})",
                         hint=f"profiles: {', '.join(profile_names(None)) or '(none)'}")
    return q


# variables that make the server's process load or run code other than the submission's wheel (the
# dynamic loader's and the interpreter's): never a profile's to set
LOADER_VARS = re.compile(r"^(LD_|DYLD_)|^(PYTHONPATH|PYTHONHOME|PYTHONSTARTUP|PYTHONUSERBASE|PYTHONEXECUTABLE)$")


def check_env(name: str, value, file: str) -> str:
    """A profile's environment variable: a valid name, a one-line string value, no loader or interpreter
    variable, and for our own switches (VLLM_FORGE_*) one of the switch's values (forge.switches: the
    validator the patched vLLM reads them with). Refused naming `file` and the key."""
    where, at_value = f"{file}: key 'env.{name}'", f"{file}: key 'env.{name}.value'"
    contest_mod.check_env_name(name, where)
    if not isinstance(value, str):
        raise ForgeError(f"{at_value}: expected a string, got {value!r}", hint=f"quote it: value: \"{value}\"")
    if LOADER_VARS.search(name):
        raise ForgeError(f"{where}: {name} is a dynamic-loader or interpreter variable: it would load code into the "
                         "server that is not the submission's (the wheel built from patches/)",
                         hint=f"remove {name} from the profile; code the server runs goes through a reviewed patch")
    if any(c in value for c in "\n\r\0"):
        raise ForgeError(f"{at_value}: {value!r} holds a line break; a variable's value is one line",
                         hint="write the value on one line")
    if name.startswith(switches.PREFIX):
        return switches.check(name, value, at_value)
    return value


def _option_value(v, where: str) -> None:
    """An option's value as a profile may give it: not empty, not infinite or NaN, not an option."""
    try:
        infinite = isinstance(v, (float, str)) and not math.isfinite(float(v))
    except ValueError:
        infinite = False
    if infinite:
        raise ForgeError(f"{where}.value: {v!r} is not a finite number", hint="give the option a finite value")
    if isinstance(v, str) and not v.strip():
        raise ForgeError(f"{where}.value: an empty value", hint="give the option its value, or remove the option")
    if isinstance(v, str) and v.startswith("-") and parse_number(v) is None:
        raise ForgeError(f"{where}.value: {v!r} looks like an option, not a value: the server would read it as "
                         "one", hint="each option is its own key under options:")
    if isinstance(v, str) and any(c in v for c in "\n\r\0"):
        raise ForgeError(f"{where}.value: {v!r} holds a line break", hint="write the value on one line")


def _round_env(contest: dict, rnd: rounds.Round | None, name: str, value: str, where: str) -> None:
    """A profile's variable that a round reads: the unlocked server values go under `options` (per
    tier: a mapping); CONCURRENCY_<tier> is the final round's client concurrency, refused elsewhere."""
    if "final" not in (contest.get("rounds") or {}):
        return
    final = rnd if rnd is not None and rnd.name == "final" else rounds.load_round(contest, "final")
    u = next((u for u in final.unlocked if name == u.env or name.startswith(u.env + "_")), None)
    if u is not None:
        raise ForgeError(f"{where}: {name} is the final round's start-script variable for {u.option}; a profile "
                         f"sets {u.option} under options", hint=f"options: {{{u.option}: {{value: …, effect: …}}}} "
                         "(a mapping tier -> value for per-tier values)")
    tier = next((c.tier for c in final.clients.values() if c.concurrency_env == name), None)
    if tier is None:
        return
    refuse_unplain(value.strip(), where, example="value:")     # the server's environment gets it as written
    if rnd is None or rnd.name != "final":
        prelim = rounds.load_round(contest, rounds.DEFAULT_ROUND)
        rounds.check_settings(prelim, {"concurrency": value}, where=f"{where} (the client's concurrency for {tier})")
    else:
        rounds.check_settings(rnd, {"concurrency": value}, where=where)


def _check_entries(data: dict, path: Path, contest: dict, rnd: rounds.Round | None = None) -> None:
    file = rel(path)
    view = rounds.contest_view(contest, rnd, rnd.baseline) if rnd is not None else contest
    for name, e in data["env"].items():
        check_env(name, e["value"], file)
        _round_env(contest, rnd, name, e["value"], f"{file}: key 'env.{name}'")
    spelled: dict[str, str] = {}
    for name, e in data["options"].items():
        where = f"{file}: key 'options.{name}'"
        if not name.startswith("-"):
            raise ForgeError(f"{where}: option names are written as on the command line",
                             hint=f"write --{name}")
        canon = contest_mod.option_base(name)
        if canon in spelled:
            raise ForgeError(f"{file}: keys 'options.{spelled[canon]}' and 'options.{name}' are the same option "
                             f"({canon}) in two spellings; the server would take only the last",
                             hint=f"keep one of them ({canon})")
        spelled[canon] = name
        v = e["value"]
        if v is False or v is None:
            raise ForgeError(f"{where}.value: {v!r} is not a value",
                             hint="true for a flag; remove the option to leave it unset")
        if not isinstance(v, (str, int, float, bool, dict, list)):
            raise ForgeError(f"{where}.value: expected a string, number, true, or a mapping (JSON)")
        _option_value(v, where)
        if rnd is not None and rnd.unlocked_option(name) is not None:
            for tier, x in (v.items() if isinstance(v, dict) else [(None, v)]):
                if tier is not None and tier not in rnd.tier_order:
                    raise ForgeError(f"{where}.value: {tier!r} is not a tier of the {rnd.name} round",
                                     hint=f"tiers: {', '.join(rnd.tier_order)}")
                w = f"{where}.value" + (f".{tier}" if tier else "")
                # as written: YAML reads 064 as the octal 52, +64 as 64, 0x40 and 1_024 as numbers
                text = x if isinstance(x, str) else written_text(path, ("options", name, "value", *[tier][:bool(tier)]))
                if text is not None:
                    refuse_unplain(text.strip(), w, whole=rnd.unlocked_option(name).type == "int",
                                   example=f"{tier or 'value'}:")
                rounds.check_value(rnd, name, x if text is None else text.strip(), w)
            continue
        contest_mod.check_option(view, name, v if not isinstance(v, (dict, list)) else json.dumps(v), where)


def load_profile(name: str, contest: dict | None = None, _chain: tuple = (), rnd: rounds.Round | None = None) -> dict:
    """A validated profile with `extends` resolved: {name, description, chain (the profiles' names, base
    first), chain_files (their files), env, options, file}. env/options map a name to {value, effect,
    source}. `rnd`: the round it is served in (None: the preliminary); a final round's profile may set
    the options that round unlocks, a value or a mapping tier -> value each (adds 'round')."""
    contest = contest or contest_mod.load_contest()
    rnd = None if rnd is None or rnd.name == rounds.DEFAULT_ROUND else rnd
    path = _path(name)
    file = rel(path)
    # `_chain`: the files (resolved) that extend this one: a cycle is one file met twice, not one name
    if path.resolve() in _chain:
        raise ForgeError(f"{file}: key 'extends': cycle {' -> '.join(rel(f) for f in [*_chain, path.resolve()])}")
    data = validate(load_yaml(path), SCHEMA, file)
    if data["round"] != rounds.DEFAULT_ROUND and (rnd is None or rnd.name != data["round"]):
        raise ForgeError(f"{file}: key 'round': profile {path.stem} is for the {data['round']} round",
                         hint=f"serve it with --round {data['round']} (make serve ROUND={data['round']})")
    _check_entries(data, path, contest, rnd)
    env: dict[str, dict] = {}
    options: dict[str, dict] = {}
    chain, files = [path.stem], [file]
    if data["extends"]:
        parent = load_profile(data["extends"], contest, (*_chain, path.resolve()), rnd)
        env.update(parent["env"])
        options.update(parent["options"])
        chain, files = parent["chain"] + chain, parent["chain_files"] + files
    for k, e in data["env"].items():
        env[k] = {**e, "source": file}
    for k, e in data["options"].items():
        canon = contest_mod.option_base(k)
        # a child overrides its parent's spelling of the same option
        for old in [o for o in options if contest_mod.option_base(o) == canon]:
            del options[old]
        options[k] = {**e, "source": file}
    out = {"name": path.stem, "description": data["description"], "chain": chain, "chain_files": files,
           "env": env, "options": options, "file": file}
    if rnd is not None:              # the preliminary's profile dict stays as it was
        out["round"] = rnd.name
    return out


def option_args(options: dict[str, dict]) -> list[str]:
    out: list[str] = []
    for name, e in options.items():
        v = e["value"]
        if v is True:
            out.append(name)
        elif isinstance(v, (dict, list)):
            out += [name, json.dumps(v, separators=(",", ":"))]
        else:
            out += [name, str(v)]
    return out


def render(profile: dict, model: str, contest: dict) -> dict:
    """The server command for `profile`: argv is the organizers' start script (configs/contest.yaml
    server.start_script) with `model` for its model directory, plus the profile's reviewed options
    (none for the submission's profiles); env is the profile's variables plus the loopback proxy
    bypass. Checked against the contest rules."""
    argv = contest_mod.organizers_argv(contest, str(model)) + option_args(profile["options"])
    args = argv[3:]
    contest_mod.check_command(contest, args, where=f"profile {profile['name']} ({profile['file']})")
    env = {k: e["value"] for k, e in profile["env"].items()}
    env.update(loopback_env(env))
    return {"argv": argv, "env": env, "engine_args": args, "model": str(model)}


def render_round(profile: dict, model: str, contest: dict, rnd: rounds.Round, tier: str | None,
                 environ: dict | None = None) -> dict:
    """render() for a server of round `rnd` serving `tier`: the round's start script with the tier's
    values (rounds.tier_settings: the environment, then the profile, then the round's baseline), plus
    the profile's other reviewed options, checked against the round's view of the contest. Adds
    round, tier, settings, sources (where each value came from) and tier_env (the variables a team sets
    for the tier) to render()'s keys. The preliminary's is render()'s."""
    if rnd.name == rounds.DEFAULT_ROUND:
        return render(profile, model, contest)
    if tier is None:
        raise ForgeError(f"the {rnd.name} round starts one server per tier: no tier given",
                         hint=f"pass --tier (make serve TIER=...), one of {', '.join(rnd.tier_order)}")
    rnd.client(tier)
    values = {rnd.unlocked_option(k).key: e["value"] for k, e in profile["options"].items()
              if rnd.unlocked_option(k) is not None}
    conc = rnd.client(tier).concurrency_env
    if conc in profile["env"]:
        values["concurrency"] = profile["env"][conc]["value"]
    where = f"profile {profile['name']} ({profile['file']}), tier {tier}"
    settings, sources = rounds.tier_settings(rnd, tier, values, environ, where=where)
    rest = {k: e for k, e in profile["options"].items() if rnd.unlocked_option(k) is None}
    argv = rounds.start_argv(rnd, settings, str(model)) + option_args(rest)
    contest_mod.check_command(rounds.contest_view(contest, rnd, settings), argv[3:], where=where)
    env = {k: e["value"] for k, e in profile["env"].items()}
    env.update(loopback_env(env))
    return {"argv": argv, "env": env, "engine_args": argv[3:], "model": str(model), "round": rnd.name,
            "tier": tier, "settings": settings.as_dict(), "sources": sources,
            "tier_env": rounds.tier_env(rnd, tier, settings)}


def render_checked(prof: dict, model_path, contest: dict, rnd: rounds.Round | None, tier: str | None,
                   env: dict | None = None, cards: bool = True) -> dict:
    """The checked server command of `prof` in round `rnd` (None: the preliminary: render(), unchanged);
    a round's multi-card server is refused before anything runs when its cards are not all visible, one
    per rank, to a process with this environment plus the profile's and `env` (`cards`)."""
    if rnd is None or rnd.name == rounds.DEFAULT_ROUND:
        if tier is not None:           # the tier's values would be silently dropped
            name = named("--tier", "TIER", tier)
            raise ForgeError(f"{name} {tier}: the preliminary round's one server serves every tier; a server per tier "
                             "is the final round's", hint=f"add --round final (make serve ROUND=final), or drop {name}")
        return render(prof, str(model_path), contest)
    rendered = render_round(prof, str(model_path), contest, rnd, tier)
    if cards:
        visible = rounds.visible_cards({**os.environ, **rendered["env"], **(env or {})})
        rounds.check_cards(rnd, rounds.Settings(**rendered["settings"]), visible, where=f"profile {prof['name']}, tier {tier}")
    return rendered


def loopback_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """NO_PROXY/no_proxy extended with the loopback names, so proxy variables never capture
    requests to 127.0.0.1."""
    out = {}
    for var in ("NO_PROXY", "no_proxy"):
        cur = (env or {}).get(var, os.environ.get(var, ""))
        items = [x for x in cur.split(",") if x]
        for h in ("127.0.0.1", "localhost", "::1"):
            if h not in items:
                items.append(h)
        out[var] = ",".join(items)
    return out
