"""configs/serve/<profile>.yaml: the environment (and, if any, reviewed engine options) one server
runs with, checked against configs/contest.yaml on load, and rendered into the exact server
command: the organizers' start script plus that."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import Field, load_yaml, validate
from ..errors import ForgeError
from ..paths import CONFIGS, rel
from . import rules as contest_mod

PROFILES = CONFIGS / "serve"

ENTRY = {"value": Field(object), "effect": Field(str, doc="what it changes; goes into reports/env-vars.md")}
SCHEMA = {
    "description": Field(str),
    "extends": Field(str, required=False, default=None, doc="a profile this one adds to"),
    "env": Field(dict, value=ENTRY, required=False, default={}),
    "options": Field(dict, value=ENTRY, required=False, default={}),
}


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))


def _path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".yaml" and p.is_file():
        return p
    q = PROFILES / f"{name}.yaml"
    if not q.is_file():
        raise ForgeError(f"profile {name!r} not found ({rel(q)})",
                         hint=f"profiles: {', '.join(profile_names()) or '(none)'}")
    return q


def _check_entries(data: dict, file: str, contest: dict) -> None:
    for name, e in data["env"].items():
        contest_mod.check_env_name(name, f"{file}: key 'env.{name}'")
        if not isinstance(e["value"], str):
            raise ForgeError(f"{file}: key 'env.{name}.value': expected a string, got {e['value']!r}",
                             hint=f"quote it: value: \"{e['value']}\"")
    for name, e in data["options"].items():
        where = f"{file}: key 'options.{name}'"
        if not name.startswith("-"):
            raise ForgeError(f"{where}: option names are written as on the command line",
                             hint=f"write --{name}")
        v = e["value"]
        if v is False or v is None:
            raise ForgeError(f"{where}.value: {v!r} is not a value",
                             hint="true for a flag; remove the option to leave it unset")
        if not isinstance(v, (str, int, float, bool, dict, list)):
            raise ForgeError(f"{where}.value: expected a string, number, true, or a mapping (JSON)")
        contest_mod.check_option(contest, name, v if not isinstance(v, (dict, list)) else json.dumps(v), where)


def load_profile(name: str, contest: dict | None = None, _chain: tuple = ()) -> dict:
    """A validated profile with `extends` resolved: {name, description, chain (the profiles' names, base
    first), chain_files (their files), env, options, file}. env/options map a name to {value, effect,
    source}."""
    contest = contest or contest_mod.load_contest()
    path = _path(name)
    file = rel(path)
    # `_chain`: the files (resolved) that extend this one: a cycle is one file met twice, not one name
    if path.resolve() in _chain:
        raise ForgeError(f"{file}: key 'extends': cycle {' -> '.join(rel(f) for f in [*_chain, path.resolve()])}")
    data = validate(load_yaml(path), SCHEMA, file)
    _check_entries(data, file, contest)
    env: dict[str, dict] = {}
    options: dict[str, dict] = {}
    chain, files = [path.stem], [file]
    if data["extends"]:
        parent = load_profile(data["extends"], contest, (*_chain, path.resolve()))
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
    return {"name": path.stem, "description": data["description"], "chain": chain, "chain_files": files,
            "env": env, "options": options, "file": file}


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
