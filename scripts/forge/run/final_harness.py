"""`forge sweep --round final --harness`: the sweep's servers on a GPU machine without the real weights.

Every configuration's server (and the baseline's) gets what `forge e2e-gpu` gives its servers: the
changes of harness/gpu/harness.yaml `server_args` (random weights, the DCU's attention and GDN backends,
the model length), each recorded with its reason in the run's serve.json (`harness_args`,
`differences`), and the site folder the bundle was installed in first on PYTHONPATH, for the server and
the finals' client (`forge e2e-gpu --install-only` installs it). harness.yaml's side-by-side sizing is
not applied: the sweep serves one configuration at a time, with the configuration's own
--gpu-memory-utilization. `--kv-cache-memory-bytes BYTES` (with `--kv-why`) gives every server a fixed KV
cache instead, e.g. a DCU card's (`forge plan` prints its bytes), as e2e-gpu takes it. `--kv-cache-memory-bytes
dcu` gives each server the cache a DCU card holds for its own configuration (`for_config`): the capacity
planner's bytes per rank for its topology, KV dtype, utilization and batched tokens, so a sweep over TP2
and DP2 (whose caches per rank differ eightfold) and over utilizations compares configurations at the
capacity they would have on the contest's cards."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from .. import options, ui
from ..errors import ForgeError
from ..model import capacity
from ..model.shape import load_shape
from . import gpu_harness

DCU = "dcu"         # --kv-cache-memory-bytes dcu: each configuration's own DCU-card cache (for_config)

OPTIONS = (("--site", "site"), ("--kv-cache-memory-bytes", "kv_cache_memory_bytes"), ("--kv-why", "kv_why"))


@dataclass
class DcuSized(gpu_harness.Servers):
    """Harness servers whose KV cache is sized per configuration (--kv-cache-memory-bytes dcu): `why`, the
    reason given (--kv-why), else each configuration's own is written."""
    why: str | None = None


def kv_size(text: str) -> int | str:
    """--kv-cache-memory-bytes of a sweep: a whole number of bytes, or `dcu`."""
    t = text.strip()
    if t.lower() == DCU:
        return DCU
    v = options.parse_whole(t)
    if v is None and t.isascii() and t.isdigit() and len(t) > 30:
        raise argparse.ArgumentTypeError(f"{t[:40]}…: too large a number of bytes (`forge plan` prints a "
                                         "DCU card's, e.g. 7501512704 at TP1, bf16)")
    if v is None:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number of bytes nor 'dcu' (each configuration "
                                         "gets a DCU card's KV cache for its topology, KV dtype and utilization)")
    return v


def dcu_capacity(values: dict, kv_dtype: str) -> capacity.Capacity:
    """One rank's KV cache on a DCU card for a configuration (the round's settings: its topology, utilization
    and batched tokens; a DP replica is a TP1 server of its own), as `forge plan` computes it."""
    return capacity.capacity(load_shape(), tp=values["tensor_parallel_size"], kv_dtype=kv_dtype, card_name="dcu",
                             utilization=values["gpu_memory_utilization"],
                             max_num_batched_tokens=values["max_num_batched_tokens"])


def dcu_bytes(values: dict, kv_dtype: str) -> int:
    """--kv-cache-memory-bytes giving another card a DCU card's blocks for this configuration (per rank)."""
    return dcu_capacity(values, kv_dtype).kv_memory_for()


def _dcu_label(values: dict, kv_dtype: str) -> str:
    return (f"TP{values['tensor_parallel_size']}/DP{values['data_parallel_size']} {kv_dtype} at "
            f"--gpu-memory-utilization {values['gpu_memory_utilization']:g}, --max-num-batched-tokens "
            f"{values['max_num_batched_tokens']}")


def for_config(hs: gpu_harness.Servers | None, values: dict, kv_dtype: str) -> gpu_harness.Servers | None:
    """The servers of one configuration: under --kv-cache-memory-bytes dcu, with its own DCU card's KV cache
    per rank (recorded with the planner's figures); otherwise the sweep's servers as they are."""
    if not isinstance(hs, DcuSized):
        return hs
    cap = dcu_capacity(values, kv_dtype)
    why = hs.why or (f"a DCU card's KV cache per rank for {_dcu_label(values, kv_dtype)} (forge plan: {cap.num_blocks} "
                     f"blocks of {cap.group_size} x {cap.page_bytes:,} B, reported by vLLM as {cap.reported_tokens:,} "
                     "tokens); the GPU's own memory does not size it")
    return gpu_harness.Servers([*hs.changes, {"args": ["--kv-cache-memory-bytes", str(cap.kv_memory_for())], "why": why}],
                               dict(hs.process_env))


def _refuse_no_dcu_cache(configs: list[tuple[dict, str]]) -> None:
    """Under --kv-cache-memory-bytes dcu, a configuration whose DCU card holds no KV cache beside its weights
    (under 256 MiB, as a given size is refused: no request of any tier fits) is refused before anything is
    written."""
    bad = sorted({_dcu_label(v, k) for v, k in configs if dcu_bytes(v, k) < gpu_harness.MIN_KV_CACHE_BYTES})
    if bad:
        raise ForgeError(f"--kv-cache-memory-bytes dcu: a DCU card holds no KV cache (under 256 MiB) beside the weights at "
                         f"{'; '.join(bad)} (forge plan)", hint="drop those values from the search space")


def servers(harness: bool, *, site: str | None = None, kv_cache_memory_bytes: int | str | None = None,
            kv_why: str | None = None, image: str | None = None,
            cands: list | None = None, baseline: dict | None = None) -> gpu_harness.Servers | None:
    """The harness's servers of a sweep (None without --harness), every option checked: the sizing
    options only with --harness, no image (the site's bundle runs natively), a site with the bundle
    installed (default: e2e-gpu's). With --kv-cache-memory-bytes dcu: a `DcuSized`, every candidate's
    and the baseline's (`baseline`: its settings, bf16) DCU cache checked first."""
    values = {"site": site, "kv_cache_memory_bytes": kv_cache_memory_bytes, "kv_why": kv_why}
    given = [opt for opt, key in OPTIONS if values[key] is not None]
    if not harness:
        if given:
            raise ForgeError(f"{', '.join(given)}: the options of a harness sweep's servers (a GPU machine, random "
                             "weights); this sweep serves the model as it is", hint="add --harness, or drop them")
        return None
    image = image or os.environ.get("IMAGE") or None
    if image:
        raise ForgeError(f"--harness with an image ({image}): a harness server runs the bundle installed in --site "
                         "natively, not in a container", hint="drop --image (and unset IMAGE) for a harness sweep")
    changes = [dict(c) for c in gpu_harness.harness_config()["server_args"]]
    dcu = kv_cache_memory_bytes == DCU
    if dcu:
        _refuse_no_dcu_cache([(c.settings_values(), c.kv_dtype) for c in cands or []]
                             + ([(baseline, "bf16")] if baseline else []))
    else:
        changes += gpu_harness.sizing_changes(kv_cache_memory_bytes, None, kv_why)
    where = gpu_harness.installed_site(site or gpu_harness.DEFAULT_SITE)
    if dcu:
        return DcuSized(changes, gpu_harness.site_env(where), why=kv_why)
    if kv_cache_memory_bytes is not None:
        _say_one_cache(cands or [])
    return gpu_harness.Servers(changes, gpu_harness.site_env(where))


def check_baseline_run(hs: gpu_harness.Servers | None, run_dir, baseline: dict) -> None:
    """Under --kv-cache-memory-bytes dcu, a baseline run (--baseline RUN) must have been served with the DCU
    card's cache of the finals' baseline (TP2, bf16): its server's recorded --kv-cache-memory-bytes, else the
    scores compare other capacities."""
    if not isinstance(hs, DcuSized):
        return
    want = str(dcu_bytes(baseline, "bf16"))
    try:
        args = json.loads((run_dir / "serve.json").read_text()).get("harness_args") or []
    except (OSError, ValueError, AttributeError):
        args = []
    got = args[args.index("--kv-cache-memory-bytes") + 1] if "--kv-cache-memory-bytes" in args[:-1] else None
    if got != want:
        raise ForgeError(f"baseline run {run_dir.name}: served with "
                         + (f"--kv-cache-memory-bytes {got}" if got else "no fixed KV cache (its serve.json names none)")
                         + f"; this sweep gives every server a DCU card's cache, the finals' baseline's {want} bytes "
                           f"({_dcu_label(baseline, 'bf16')})",
                         hint="give a baseline run served with that cache, or --baseline-profile upstream (the sweep "
                              "measures it)")


def _say_one_cache(cands: list) -> None:
    """A fixed KV cache is the same bytes per GPU for every configuration: a DCU card's cache per rank
    differs between TP2 and DP2 (forge plan), and --gpu-memory-utilization no longer sizes it."""
    several = [opt for opt, vals in (
        ("--topologies", {(c.tensor_parallel_size, c.data_parallel_size) for c in cands}),
        ("--gpu-memory-utilization", {c.gpu_memory_utilization for c in cands})) if len(vals) > 1]
    if several:
        ui.warn(f"--kv-cache-memory-bytes gives every server the same KV cache per GPU, while {' and '.join(several)} "
                "take several values here: a DCU card's cache per rank differs by topology (forge plan), and the "
                "utilization no longer sizes the cache; one topology and utilization per sweep compares like "
                "with like, or --kv-cache-memory-bytes dcu sizes each configuration's cache as a DCU card holds it")


def record(hs: gpu_harness.Servers | None, baseline: dict | None = None) -> dict:
    """What the sweep's record keeps of its harness servers (a resume must serve them alike). Sized per
    configuration: also the baseline's bytes (`baseline`: its settings), so a resume after the planner's
    figures changed is refused rather than served with other caches."""
    if isinstance(hs, DcuSized):
        base = dcu_bytes(baseline, "bf16") if baseline else None
        return {"harness_server_args": hs.args, "harness_kv_cache": DCU, "harness_kv_why": hs.why,
                "harness_kv_baseline_bytes": base}
    # None, not absent: a sweep sized per configuration (dcu) is not resumed as one sized by the GPU; a record
    # written before the key existed reads None, as it was
    return {"harness_server_args": hs.args, "harness_kv_cache": None} if hs else {}


def add_arguments(s) -> None:
    s.add_argument("--harness", action="store_true",
                   help="final: the servers run random weights (a GPU machine): each gets harness/gpu/harness.yaml's "
                        "server_args (recorded with their reasons in serve.json) and the bundle's site folder (--site); "
                        "every request runs to its output length (end-of-text ignored) and the runs are marked "
                        "harness, scored only against a harness baseline")
    s.add_argument("--site", help=f"final, with --harness: the folder `forge e2e-gpu --install-only` installed the "
                                  f"bundle in (default {gpu_harness.DEFAULT_SITE})")
    s.add_argument("--kv-cache-memory-bytes", type=kv_size, metavar="BYTES|dcu",
                   help="final, with --harness: every server's KV cache in bytes per GPU, e.g. a DCU card's (`forge "
                        "plan` prints them per topology and KV dtype); `dcu`: each configuration's (and the "
                        "baseline's) own, the bytes of a DCU card's cache per rank for its topology, KV dtype, "
                        "utilization and batched tokens; default: sized by the configuration's "
                        "--gpu-memory-utilization")
    s.add_argument("--kv-why", metavar="TEXT", help="final, with --harness: why the KV cache has that size, for the "
                                                    "runs' records")


def given(args) -> list[tuple[str, bool]]:
    """These options as the preliminary's sweep refuses them: (option, given)."""
    return [("--harness", args.harness), *((opt, getattr(args, key) is not None) for opt, key in OPTIONS)]
