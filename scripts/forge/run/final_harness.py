"""`forge sweep --round final --harness`: the sweep's servers on a GPU machine without the real weights.

Every configuration's server (and the baseline's) gets what `forge e2e-gpu` gives its servers: the
changes of harness/gpu/harness.yaml `server_args` (random weights, the DCU's attention and GDN backends,
the model length), each recorded with its reason in the run's serve.json (`harness_args`,
`differences`), and the site folder the bundle was installed in first on PYTHONPATH, for the server and
the finals' client (`forge e2e-gpu --install-only` installs it). harness.yaml's side-by-side sizing is
not applied: the sweep serves one configuration at a time, with the configuration's own
--gpu-memory-utilization. `--kv-cache-memory-bytes BYTES` (with `--kv-why`) gives every server a fixed KV
cache instead, e.g. a DCU card's (`forge plan` prints its bytes), as e2e-gpu takes it."""

from __future__ import annotations

import os

from .. import ui
from ..errors import ForgeError
from . import gpu_harness

OPTIONS = (("--site", "site"), ("--kv-cache-memory-bytes", "kv_cache_memory_bytes"), ("--kv-why", "kv_why"))


def servers(harness: bool, *, site: str | None = None, kv_cache_memory_bytes: int | None = None,
            kv_why: str | None = None, image: str | None = None,
            cands: list | None = None) -> gpu_harness.Servers | None:
    """The harness's servers of a sweep (None without --harness), every option checked: the sizing
    options only with --harness, no image (the site's bundle runs natively), a site with the bundle
    installed (default: e2e-gpu's)."""
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
    changes += gpu_harness.sizing_changes(kv_cache_memory_bytes, None, kv_why)
    where = gpu_harness.installed_site(site or gpu_harness.DEFAULT_SITE)
    if kv_cache_memory_bytes is not None:
        _say_one_cache(cands or [])
    return gpu_harness.Servers(changes, gpu_harness.site_env(where))


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
                "with like")


def record(hs: gpu_harness.Servers | None) -> dict:
    """What the sweep's record keeps of its harness servers (a resume must serve them alike)."""
    return {"harness_server_args": hs.args} if hs else {}


def add_arguments(s) -> None:
    s.add_argument("--harness", action="store_true",
                   help="final: the servers run random weights (a GPU machine): each gets harness/gpu/harness.yaml's "
                        "server_args (recorded with their reasons in serve.json) and the bundle's site folder (--site); "
                        "every request runs to its output length (end-of-text ignored) and the runs are marked "
                        "harness, scored only against a harness baseline")
    s.add_argument("--site", help=f"final, with --harness: the folder `forge e2e-gpu --install-only` installed the "
                                  f"bundle in (default {gpu_harness.DEFAULT_SITE})")
    s.add_argument("--kv-cache-memory-bytes", type=int, metavar="BYTES",
                   help="final, with --harness: every server's KV cache in bytes per GPU, e.g. a DCU card's (`forge "
                        "plan` prints them per topology and KV dtype); default: sized by the configuration's "
                        "--gpu-memory-utilization")
    s.add_argument("--kv-why", metavar="TEXT", help="final, with --harness: why the KV cache has that size, for the "
                                                    "runs' records")


def given(args) -> list[tuple[str, bool]]:
    """These options as the preliminary's sweep refuses them: (option, given)."""
    return [("--harness", args.harness), *((opt, getattr(args, key) is not None) for opt, key in OPTIONS)]
