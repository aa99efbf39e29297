"""The container image (Dockerfile.rocm): `image` builds it for a DCU host, `image --pin-base` (make
pin-base) records the base image's digest, `image-rehearsal` builds the same Dockerfile on a stand-in base made with
debootstrap (Python + CPU torch inside, playing the vendor base's role) and runs its self-check.
`warm-kernels` and `self-check` are the steps the Dockerfile's runtime stage runs."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from .. import config, proc, records, ui
from ..errors import ForgeError
from ..paths import BUILD, CACHE, CONFIGS, KERNELS, REPORTS, ROOT, rel, write_atomic
from ..recipe import provenance
from . import fetch, tree, wheel

DOCKERFILE = ROOT / "Dockerfile.rocm"
STANDIN_TAG = "localhost/forge-standin-base:bookworm"
REHEARSAL_TAG = "localhost/dcu-forge-rehearsal:latest"


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


# --- image rehearsal: the same Dockerfile on a debootstrap stand-in base -------------------------

# what `import vllm` needs beyond torch (the vendor base has all of vLLM's dependencies), plus the
# wheel build's tools
STANDIN_PACKAGES = ["numpy", "pyyaml", "setuptools>=77.0.3,<81", "setuptools-scm>=8", "wheel", "packaging>=24.2", "jinja2",
                    "regex"]
STANDIN_SETUP = """set -e
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends python3 python3-pip python3-venv git make ca-certificates >/dev/null
rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
python3 -m pip install -q --no-cache-dir --no-index --find-links /tmp/wheels /tmp/wheels/torch-*.whl -r /tmp/wheels/reqs
apt-get clean; rm -rf /var/lib/apt/lists/* /tmp/wheels
"""


def make_standin(builder: str, torch_wheel: Path) -> str:
    """debootstrap bookworm + python + CPU torch, imported as an image (cached by its inputs)."""
    work = CACHE / "standin"
    rootfs = work / "rootfs"
    stamp = work / "stamp"
    key = f"{torch_wheel.name}\n{STANDIN_PACKAGES}\n{STANDIN_SETUP}"
    have = proc.run([*_builder_cmd(builder), "inspect", *(["--type", "image"] if builder == "buildah" else []),
                     STANDIN_TAG], capture=True, check=False).returncode == 0
    if have and stamp.is_file() and stamp.read_text() == key:
        ui.info(f"stand-in base {STANDIN_TAG} is up to date")
        return STANDIN_TAG
    if not shutil.which("debootstrap"):
        raise ForgeError("debootstrap is not installed", hint="apt-get install debootstrap")
    _refuse_mounts(work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = work / "standin.log"
    with ui.step("stand-in base: debootstrap bookworm (minbase)"):
        proc.run(["debootstrap", "--variant=minbase", "bookworm", rootfs], log=log, what="debootstrap")
    # the chroot resolves names through the host's resolver config and reaches the same package sources
    shutil.copyfile("/etc/resolv.conf", rootfs / "etc" / "resolv.conf")
    # Python packages are fetched here, with this machine's pip configuration, and installed offline
    wheels = rootfs / "tmp" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    shutil.copy(torch_wheel, wheels)
    (wheels / "reqs").write_text("\n".join(STANDIN_PACKAGES) + "\n")
    with ui.step("stand-in base: downloading wheels for Python 3.11"):
        proc.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.11",
                  "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                  "--platform", "manylinux_2_28_x86_64", "--platform", "any", "-d", wheels,
                  torch_wheel, *STANDIN_PACKAGES], log=log, what="pip download (stand-in base)")
    with ui.step("stand-in base: python3, pip, CPU torch"):
        # no bind mounts: debootstrap made the device nodes the setup needs, and nothing of the host's
        # /dev or /proc can be reached (or removed) through the rootfs
        proc.run(["chroot", rootfs, "/bin/bash", "-c", STANDIN_SETUP], log=log, what="stand-in setup")
    tarball = work / "rootfs.tar"
    proc.run(["tar", "-C", rootfs, "-cf", tarball, "."], what="tar stand-in rootfs")
    shutil.rmtree(rootfs, ignore_errors=True)
    with ui.step(f"stand-in base: import as {STANDIN_TAG}"):
        if builder == "docker":
            proc.run(["docker", "import", tarball, STANDIN_TAG], what="docker import")
        else:
            ctr = proc.output([*_builder_cmd(builder), "from", "scratch"], what="buildah from scratch")
            try:
                proc.run([*_builder_cmd(builder), "add", ctr, tarball, "/"], what="buildah add rootfs")
                tarball.unlink()       # in the container now: not a third copy on disk during the commit
                proc.run([*_builder_cmd(builder), "commit", "-q", ctr, STANDIN_TAG], what="buildah commit")
            finally:
                proc.run([*_builder_cmd(builder), "rm", ctr], capture=True, check=False)
    tarball.unlink(missing_ok=True)
    write_atomic(stamp, key)   # last: a stand-in interrupted before this is rebuilt
    return STANDIN_TAG


def _refuse_mounts(path: Path) -> None:
    """Never delete a folder that has something mounted below it."""
    p = str(path.resolve())
    with open("/proc/mounts") as f:
        mounted = [line.split()[1] for line in f if line.split()[1].startswith(p + "/")]
    if mounted:
        raise ForgeError(f"{rel(path)} has mounts below it ({', '.join(mounted)}); not removing it",
                         hint="umount them first")


def prune_rehearsal_leftovers(builder: str) -> dict:
    """Remove what earlier rehearsals left behind: working containers of our two images or of an
    untagged one (an interrupted build), then untagged images. Each rebuild moves the tag and leaves the
    old image untagged, a full copy of the root filesystem with buildah's vfs driver (1.3 GB here), so
    without this the disk fills after a few runs."""
    if builder != "buildah":
        out = proc.run(["docker", "image", "prune", "-f", "--filter",
                        "label=org.opencontainers.image.title=dcu-forge vLLM"], capture=True, check=False)
        return {"docker image prune": out.returncode}
    cmd = _builder_cmd(builder)
    removed = []
    ls = proc.run([*cmd, "containers", "--json"], capture=True, check=False)
    try:
        ctrs = json.loads(ls.stdout or "[]") or []
    except ValueError:
        ctrs = []
    for c in ctrs:
        image = c.get("imagename") or ""
        if image in ("", "<none>") or image.split(":")[0] in (REHEARSAL_TAG.split(":")[0], STANDIN_TAG.split(":")[0]):
            if proc.run([*cmd, "rm", c["id"]], capture=True, check=False).returncode == 0:
                removed.append(c.get("containername") or c["id"][:12])
    pr = proc.run([*cmd, "rmi", "--prune"], capture=True, check=False)
    images = [x for x in pr.stdout.split() if x]
    if removed or images:
        ui.info(f"image rehearsal: removed {len(removed)} leftover container(s) and {len(images)} untagged image(s)")
    return {"containers": len(removed), "images": len(images)}


def _builder_cmd(builder: str) -> list[str]:
    if builder == "buildah":
        return ["buildah", "--storage-driver", storage_driver()]
    return ["docker"]


# buildah's storage driver, decided once per run (see storage_driver)
_DRIVER: list[str] = []
# What the image rehearsal needs free while it builds, by driver (measured on a fresh machine: with vfs
# every layer is a full copy of the root filesystem, 11.1 GB at the build's peak and 3.8 GB kept; with
# overlay 5.4 GB at the stand-in's import, before the stand-in's tarball was removed ahead of its
# commit, and 1.3 GB kept).
NEED_GB = {"overlay": 4.0, "vfs": 12.0}


def storage_driver() -> str:
    """buildah's storage driver: BUILDAH_STORAGE when set; else overlay where this machine can mount an
    overlay container (root with overlayfs), else vfs, which works everywhere but copies the whole root
    filesystem for every layer."""
    env = os.environ.get("BUILDAH_STORAGE")
    if env:
        return env
    if not _DRIVER:
        _DRIVER.append("overlay" if _overlay_mounts() else "vfs")
        if _DRIVER[0] == "vfs":
            ui.info(f"buildah: overlay storage does not mount here; using vfs (every layer a full copy: "
                    f"about {NEED_GB['vfs']:.0f} GB free needed while the image builds)")
    return _DRIVER[0]


def _overlay_mounts() -> bool:
    """Create, mount and remove an empty overlay container: what every RUN step of a build does."""
    if not shutil.which("buildah"):
        return False
    cmd = ["buildah", "--storage-driver", "overlay"]
    made = proc.run([*cmd, "from", "scratch"], capture=True, check=False)
    if made.returncode != 0 or not made.stdout.strip():
        return False
    ctr = made.stdout.strip().splitlines()[-1]
    try:
        ok = proc.run([*cmd, "mount", ctr], capture=True, check=False).returncode == 0
        if ok:
            proc.run([*cmd, "umount", ctr], capture=True, check=False)
    finally:
        proc.run([*cmd, "rm", ctr], capture=True, check=False)
    return ok


def cmd_image_rehearsal(args) -> int:
    report_dir = Path(args.report_dir) if args.report_dir else None
    if report_dir is not None and report_dir.exists() and not report_dir.is_dir():
        raise ForgeError(f"--report-dir {args.report_dir}: a file is there, not a folder",
                         hint="name a folder (it is created if missing)")
    image_rehearsal(args.builder, args.torch_wheel, report_dir)
    return 0


def image_rehearsal(builder_pref: str = "auto", torch_wheel: str | None = None,
                    report_dir: Path | None = None) -> dict:
    """Build Dockerfile.rocm on the stand-in base and run the container's self-check; writes
    image-rehearsal.{md,json} into report_dir (default reports/)."""
    t0 = time.monotonic()
    rec: dict = {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "command": "make image-rehearsal", "forge": provenance.forge_commit(), "ok": False}
    try:
        rec.update(_image_rehearsal(builder_pref, torch_wheel, rec))
        rec["ok"] = True
    except ForgeError as e:
        rec["error"] = e.message
        raise
    finally:
        rec["seconds"] = round(time.monotonic() - t0, 1)
        _write_image_report(rec, report_dir)
    return rec


def _write_image_report(rec: dict, report_dir: Path | None = None) -> None:
    out = report_dir or REPORTS
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "image-rehearsal.json", json.dumps(rec, indent=1) + "\n")
    lines = ["<!-- generated by `make image-rehearsal` (scripts/forge/builder/image.py); do not edit -->",
             "# Image rehearsal", "",
             f"Result: **{'PASS' if rec['ok'] else 'FAIL'}** — {rec['started']}, {rec.get('seconds')} s, "
             f"forge commit `{(rec['forge'].get('commit') or '?')[:12]}`", ""]
    for k in ("builder", "base", "image", "standin_torch_wheel", "self_check", "error"):
        if rec.get(k):
            lines.append(f"- {k.replace('_', ' ')}: `{rec[k]}`")
    for s in rec.get("stages", []):
        lines.append(f"- {s['stage']}: {s['seconds']} s")
    write_atomic(out / "image-rehearsal.md", "\n".join(lines) + "\n")


def _image_rehearsal(builder_pref: str, torch_wheel: str | None, rec: dict) -> dict:
    b = config.build()
    builder = pick_builder(builder_pref)
    rec["builder"] = builder
    stages = rec.setdefault("stages", [])
    wheels = [Path(torch_wheel)] if torch_wheel else standin_torch_wheel()
    rec["standin_torch_wheel"] = wheels[-1].name
    t0 = time.monotonic()
    base = make_standin(builder, wheels[-1])
    stages.append({"stage": "stand-in base (debootstrap + python + CPU torch)", "seconds": round(time.monotonic() - t0, 1)})
    rec["base"] = base
    fetch.ensure_source()
    bargs = build_args(b, base, device="empty", warm_arch="gfx90a")
    tag = REHEARSAL_TAG
    prune_rehearsal_leftovers(builder)
    rec["image"] = tag
    cmd, env = build_command(builder, tag, bargs)
    t0 = time.monotonic()
    with ui.step(f"image rehearsal: building Dockerfile.rocm on {base} with {builder}"):
        proc.run(cmd, env=env, what="image build (rehearsal)", log=BUILD / "image-rehearsal.log")
    stages.append({"stage": "build Dockerfile.rocm (all stages)", "seconds": round(time.monotonic() - t0, 1)})
    t0 = time.monotonic()
    with ui.step("image rehearsal: container self-check"):
        if builder == "docker":
            out = proc.output(["docker", "run", "--rm", "--entrypoint", "make", tag, "PY=python3", "self-check"])
        else:
            ctr = proc.output([*_builder_cmd(builder), "from", tag])
            try:
                out = proc.output([*_builder_cmd(builder), "run", "--isolation", "chroot", ctr, "--",
                                   "make", "PY=python3", "self-check"])
            finally:
                proc.run([*_builder_cmd(builder), "rm", ctr], capture=True, check=False)
    stages.append({"stage": "container self-check", "seconds": round(time.monotonic() - t0, 1)})
    rec["pruned"] = prune_rehearsal_leftovers(builder)
    print(out)
    return {"self_check": out.strip().splitlines()[-1]}


def standin_torch_wheel() -> list[Path]:
    """The CPU torch wheel that goes into the stand-in base: pip's configured find-links first, else
    one downloaded (pip's own configuration decides from where)."""
    cache = CACHE / "standin-wheels"
    found = sorted(cache.glob("torch-*cp311*.whl"))
    if found:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    spec = config.build()["rehearsal"]["standin_torch"]
    proc.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
              "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "-d", cache, spec],
             what=f"pip download {spec}", hint="set pip's find-links/index to where a CPU torch wheel for Python 3.11 is")
    found = sorted(cache.glob("torch-*cp311*.whl"))
    if not found:
        raise ForgeError(f"no Python 3.11 wheel for {spec} was found", hint="pass --torch-wheel PATH (a cp311 CPU build)")
    return found


def register(sub) -> None:
    p = sub.add_parser("image", help="build the DCU image from Dockerfile.rocm", description=__doc__)
    p.add_argument("--builder", choices=("auto", "docker", "buildah"), default="auto")
    p.add_argument("--dry-run", action="store_true", help="print the exact build command only")
    p.add_argument("--allow-unpinned", action="store_true", help="accept a base image not pinned by digest")
    p.add_argument("--pin-base", action="store_true", help="write the pulled base image's digest to configs/build.yaml")
    p.set_defaults(func=cmd_image)
    p = sub.add_parser("image-rehearsal", help="build Dockerfile.rocm on a debootstrap stand-in base and run its self-check")
    p.add_argument("--builder", choices=("auto", "docker", "buildah"), default="auto")
    p.add_argument("--torch-wheel", help="CPU torch wheel for the stand-in base (default: the one in /opt/wheels)")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where image-rehearsal.{md,json} go (default reports/; `make test` gives build/test-reports)")
    p.set_defaults(func=cmd_image_rehearsal)
    p = sub.add_parser("warm-kernels", help="(in the image) compile our Triton kernels for ARCH into TRITON_CACHE_DIR")
    p.add_argument("--arch", default="gfx936")
    p.set_defaults(func=cmd_warm)
    sub.add_parser("self-check", help="(in the image) check that the installed vLLM is our wheel").set_defaults(
        func=cmd_self_check)
