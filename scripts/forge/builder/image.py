"""The container image (Dockerfile.rocm): `image` builds it for a DCU host, `image --pin-base` (make
pin-base) records the base image's digest (the same Dockerfile on a stand-in base: imagerehearsal.py).
`warm-kernels` and `self-check` are the steps the Dockerfile's runtime stage runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from .. import config, proc, records, ui
from ..errors import ForgeError
from ..paths import CONFIGS, KERNELS, ROOT, rel, write_atomic
from ..recipe import provenance
from . import fetch, tree, wheel
from .buildah import storage_driver

DOCKERFILE = ROOT / "Dockerfile.rocm"


def pick_builder(pref: str = "auto") -> str:
    if pref != "auto":
        return pref
    if shutil.which("docker"):
        ok = proc.run(["docker", "info"], capture=True, check=False).returncode == 0
        if ok:
            return "docker"
    if shutil.which("buildah"):
        return "buildah"
    raise ForgeError("no image builder: need a running Docker engine (with BuildKit) or buildah",
                     hint="start the Docker daemon, or install buildah (apt-get install buildah)")


def base_ref(b: dict, allow_unpinned: bool = False) -> str:
    env = os.environ.get("BASE_IMAGE")
    if env:
        ref = env
    elif b["base_image_digest"]:
        ref = f"{b['base_image'].split('@')[0]}@{b['base_image_digest']}"
    else:
        ref = b["base_image"]
    if "@sha256:" not in ref and not allow_unpinned:
        raise ForgeError(f"base image '{ref}' is not pinned by digest (configs/build.yaml base_image_digest is empty)",
                         hint="on the DCU host: docker pull <base>; make pin-base  (or pass BASE_IMAGE=<ref>@sha256:…; "
                              "--allow-unpinned for a throwaway build)")
    return ref


def build_args(b: dict, base: str, *, device: str = "auto", warm_arch: str | None = None,
               state: dict | None = None) -> dict[str, str]:
    """The image's build arguments; `state` is the sdist tree's record (default: build/vllm, brought up
    to date first)."""
    state = state or tree.build_tree()
    sh = provenance.series_hash(state)
    up = config.upstream()
    args = {"BASE_IMAGE": base, "PYTORCH_ROCM_ARCH": ";".join(b["rocm_arch"]),
            "FORGE_WHEEL_DEVICE": device, "WARM_ARCH": warm_arch or b["rocm_arch"][0],
            "FORGE_VERSION": wheel.wheel_version(state, "rocm"), "UPSTREAM_SHA256": up["sdist"]["sha256"],
            "SERIES_HASH": sh, "FORGE_COMMIT": provenance.forge_commit().get("commit") or "unknown"}
    jobs = os.environ.get("MAX_JOBS") or (str(b["max_jobs"]) if b["max_jobs"] else "")
    if jobs:
        args["MAX_JOBS"] = jobs
    return args


def build_command(builder: str, tag: str, args: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    ba = [x for k, v in args.items() for x in ("--build-arg", f"{k}={v}")]
    if builder == "docker":
        return ["docker", "build", "-f", str(DOCKERFILE), "--target", "runtime", "-t", tag, *ba, str(ROOT)], \
            {"DOCKER_BUILDKIT": "1"}
    return ["buildah", "--storage-driver", storage_driver(), "build",
            "--isolation", "chroot", "-f", str(DOCKERFILE), "--target", "runtime", "-t", tag, *ba,
            str(ROOT)], {}


def cmd_image(args) -> int:
    b = config.build()
    if args.pin_base:
        return pin_base(b, pick_builder(args.builder))
    try:
        base = base_ref(b, args.allow_unpinned)
    except ForgeError as e:
        if not args.dry_run:
            raise
        ui.warn(e.message + " — a real build refuses this")
        base = base_ref(b, allow_unpinned=True)
    if args.dry_run:
        # `make -n image` prints what would run and runs nothing: no fetch, no tree; the series hash
        # and version come from the tree's inputs, as the build's own tree record will give them
        bargs = build_args(b, base, state=tree.planned_state())
    else:
        fetch.ensure_source()        # the sdist travels in the build context (.cache/forge/src)
        bargs = build_args(b, base)
    tag = f"{b['image_name']}:{bargs['FORGE_VERSION'].replace('+', '-')}"
    builder = "docker" if args.dry_run and args.builder == "auto" else pick_builder(args.builder)
    cmd, env = build_command(builder, tag, bargs)
    print(" ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + proc.fmt(cmd))
    if args.dry_run:
        return 0
    with ui.step(f"building image {tag}"):
        proc.run(cmd, env=env, what="image build")
    return 0


def pin_base(b: dict, builder: str) -> int:
    ref = b["base_image"].split("@")[0]
    if builder == "docker":
        out = proc.output(["docker", "image", "inspect", "--format", "{{json .RepoDigests}}", ref],
                          what="docker image inspect", hint=f"docker pull {ref} first")
    else:
        out = proc.output(["buildah", "inspect", "--type", "image", "--format", "{{json .FromImageDigest}}", ref],
                          what="buildah inspect", hint=f"buildah pull {ref} first")
    m = re.search(r"sha256:[0-9a-f]{64}", out)
    if not m:
        raise ForgeError(f"{ref}: no registry digest found ({out.strip()})",
                         hint="pull the image from its registry (a locally built image has no digest)")
    path = CONFIGS / "build.yaml"
    text = path.read_text()
    new, n = re.subn(r"^base_image_digest:.*$", f"base_image_digest: {m.group(0)}", text, flags=re.M)
    if n != 1:
        raise ForgeError(f"{rel(path)}: no 'base_image_digest:' line to update", hint="add `base_image_digest: null`")
    write_atomic(path, new)
    print(f"{rel(path)}: base_image_digest: {m.group(0)}")
    return 0


# --- steps run inside the image ----------------------------------------------------------------

def cmd_warm(args) -> int:
    """Compile our Triton kernels for the target arch ahead of time into TRITON_CACHE_DIR."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        raise ForgeError("TRITON_CACHE_DIR is not set", hint="the image sets it; on a host, export it first")
    try:
        # optional: only the image (or a host with Triton) has it
        import triton  # noqa: F401
    except ImportError:
        ui.warn("triton is not installed here: nothing to warm (the stand-in base has no triton)")
        return 0
    out = Path(cache) / "forge-aot.json"
    Path(cache).mkdir(parents=True, exist_ok=True)
    proc.run([sys.executable, KERNELS / "aot.py", "--target", f"hip:{args.arch}", "--json", out],
             what=f"ahead-of-time compile for {args.arch}")
    ui.info(f"warmed Triton kernels for {args.arch} into {cache}")
    return 0


SELF_CHECK = r"""
import json, sys, vllm, vllm._forge_provenance as p
rec = p.PROVENANCE
print(json.dumps({"version": vllm.__version__, "series_hash": rec["series_hash"],
                  "patches": [x["name"] for x in rec["patches"]]}))
"""


def cmd_self_check(args) -> int:
    out = proc.output([sys.executable, "-c", SELF_CHECK], what="import vllm (self-check)").splitlines()[-1]
    info = json.loads(out)
    dist = sorted((ROOT / "dist").glob("vllm-*.whl"))
    if dist:
        side = Path(str(dist[-1]) + ".provenance.json")
        if side.is_file() and records.read_json(side).get("series_hash") != info["series_hash"]:
            raise ForgeError("installed vLLM is not the wheel in dist/", hint="reinstall dist/vllm-*.whl --no-deps")
    print(f"self-check: OK vllm {info['version']} with {len(info['patches'])} patches (series {info['series_hash'][:10]})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("image", help="build the DCU image from Dockerfile.rocm", description=__doc__)
    p.add_argument("--builder", choices=("auto", "docker", "buildah"), default="auto")
    p.add_argument("--dry-run", action="store_true", help="print the exact build command only")
    p.add_argument("--allow-unpinned", action="store_true", help="accept a base image not pinned by digest")
    p.add_argument("--pin-base", action="store_true", help="write the pulled base image's digest to configs/build.yaml")
    p.set_defaults(func=cmd_image)
    p = sub.add_parser("warm-kernels", help="(in the image) compile our Triton kernels for ARCH into TRITON_CACHE_DIR")
    p.add_argument("--arch", default="gfx936")
    p.set_defaults(func=cmd_warm)
    sub.add_parser("self-check", help="(in the image) check that the installed vLLM is our wheel").set_defaults(
        func=cmd_self_check)
