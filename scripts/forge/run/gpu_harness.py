"""The GPU harness's settings as a server on a GPU machine takes them: harness/gpu/harness.yaml (read
and checked), the site folder its bundle is installed in (`forge e2e-gpu --install-only`) and the
environment that puts it first, and the server's KV-cache sizing option, each change to the
organizers' command with its reason. Read by the lab (`forge gpu-bundle`, `forge e2e-gpu`) and by the
final round's sweep (`forge sweep --round final --harness`): the run stage serves with them, so they
live here, below both."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import config
from ..errors import ForgeError
from ..model.capacity import CARDS
from ..paths import ROOT, rel

HARNESS = ROOT / "harness" / "gpu"
DEFAULT_SITE = "/tmp/forge-e2e-site"      # where `forge e2e-gpu` installs the bundle's wheels
# no card the capacity planner knows (forge.model.capacity CARDS) holds a KV cache larger than its whole memory
LARGEST_CARD = max(CARDS.values(), key=lambda c: c.memory_bytes)
SITE_MARKER = ".forge-bundle"             # written last by the install: the wheels it holds, by sha256


def _nonempty(v) -> str | None:
    return None if str(v).strip() else "give the reason this differs from the organizers' command"


def _args(v) -> str | None:
    if not v or not all(isinstance(x, str) for x in v) or not v[0].startswith("--"):
        return f"{v!r}: expected a list of strings starting with an option (--name[, value])"
    return None


# one change to the organizers' command: the options as they are added (or replace theirs), and why
_CHANGE = {"args": config.Field(list, check=_args), "why": config.Field(str, check=_nonempty)}
SCHEMA = {
    "python": config.Field(str),
    "platforms": config.Field(list),
    "wheels": config.Field(list, item=str, check=lambda v: next(
        (f"{x!r} is not an exact pin (name==version)" for x in v if x.count("==") != 1), None)),
    "model": config.Field({"config": config.Field(str), "vocab_size": config.Field(int),
                           "eos_token_id": config.Field(int)}),
    "server_args": config.Field(list, item=_CHANGE),
    "side_by_side": config.Field({"gpu_memory_utilization": config.Field(float),
                                  "kv_cache_memory_bytes": config.Field(int, required=False, default=None),
                                  "why": config.Field(str, check=_nonempty)}),
    "client_args": config.Field(list, item=_CHANGE),
    "profiles": config.Field(list, item=str),
    "max_bundle_mib": config.Field(int),
}


def harness_config(path: Path | None = None) -> dict:
    path = path or HARNESS / "harness.yaml"
    return config.validate(config.load_yaml(path), SCHEMA, rel(path))


def change_args(changes: list[dict]) -> list[str]:
    """The server arguments of a list of changes ({"args", "why"}), in order."""
    return [x for c in changes for x in c["args"]]


def server_differences(changes: list[dict]) -> list[dict]:
    """Changes to the server's command as a run records them: {"side": "server", "args", "why"}."""
    return [{"side": "server", "args": list(c["args"]), "why": c["why"]} for c in changes]


MIN_KV_CACHE_BYTES = 1 << 28        # 256 MiB: a fixed KV cache under it holds no request of any tier


def sizing_changes(kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None,
                   why: str | None) -> list[dict]:
    """This invocation's server sizing (--kv-cache-memory-bytes with --kv-why, --gpu-memory-utilization),
    each a change with its reason."""
    out = []
    if why is not None and kv_cache_memory_bytes is None:
        raise ForgeError("--kv-why: it records why the KV cache has the size --kv-cache-memory-bytes gives, and "
                         "none is given", hint="add --kv-cache-memory-bytes BYTES, or leave out --kv-why")
    if why is not None and not why.strip():      # recorded as the reason of the change: a blank one says nothing
        raise ForgeError(f"--kv-why {why!r}: an empty reason; the run's record gives each change to the organizers' "
                         "command with its reason", hint="say why the KV cache has that size, e.g. --kv-why \"a DCU "
                                                         "card's KV cache at TP1, bf16 (forge plan)\", or leave out "
                                                         "--kv-why for the default reason")
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes < MIN_KV_CACHE_BYTES:
            raise ForgeError(f"--kv-cache-memory-bytes {kv_cache_memory_bytes}: under 256 MiB holds no request "
                             "of any tier", hint="`forge plan` prints the bytes of a DCU card's KV cache")
        if kv_cache_memory_bytes > LARGEST_CARD.memory_bytes:
            # whether it fits the GPU at hand beside the weights: forge.lab.gpufit, before e2e-gpu starts any server
            raise ForgeError(f"--kv-cache-memory-bytes {kv_cache_memory_bytes}: more than the whole memory of the "
                             f"largest card the capacity planner knows ({LARGEST_CARD.name}: "
                             f"{LARGEST_CARD.memory_bytes} bytes, forge.model.capacity CARDS), before its weights",
                             hint="`forge plan` prints the bytes of a DCU card's KV cache (7501512704 at TP1, bf16)")
        out.append({"args": ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)],
                    "why": why or "the KV cache given to this run (--kv-cache-memory-bytes)"})
    if gpu_memory_utilization is not None:
        if not 0.05 <= gpu_memory_utilization <= 0.99:
            raise ForgeError(f"--gpu-memory-utilization {gpu_memory_utilization}: outside 0.05-0.99",
                             hint="give --gpu-memory-utilization from 0.05 to 0.99, e.g. 0.44 (harness.yaml's side by "
                                  "side share)")
        out.append({"args": ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"],
                    "why": "this run's share of the GPU for each server (--gpu-memory-utilization)"})
    return out


def site_env(site: Path | None) -> dict[str, str]:
    """What the children (servers, the bench client, probes) need on top of this process's
    environment to import the bundle's vLLM first; this process's own environment is left alone."""
    if not site:
        return {}
    old = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(site) + (os.pathsep + old if old else "")}


def installed_site(site: str, option: str = "--site") -> Path:
    """A site folder the bundle was installed in (its marker is written last); refused, naming the
    option and the install command, where there is none."""
    p = Path(site)
    if not (p / SITE_MARKER).is_file():
        raise ForgeError(f"{option} {site}: no GPU bundle is installed there (no {SITE_MARKER})",
                         hint="install it once: forge e2e-gpu --install-only --site " + site
                              + " (the bundle from `make gpu-bundle`)")
    return p.resolve()


@dataclass
class Servers:
    """What a harness server gets beyond its profile's checked command: `changes` (each {"args",
    "why"}) appended after it, and `process_env` (the site folder first on PYTHONPATH; not recorded)."""
    changes: list[dict]
    process_env: dict[str, str] = field(default_factory=dict)

    @property
    def args(self) -> list[str]:
        return change_args(self.changes)

    def start_kwargs(self) -> dict:
        """serve.start_server's keywords for such a server: recorded in its serve.json (`harness_args`,
        `differences`), the site's environment given to the process only."""
        return {"harness_args": self.args, "differences": server_differences(self.changes),
                "process_env": dict(self.process_env)}
