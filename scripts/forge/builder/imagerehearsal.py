"""`forge image-rehearsal`: Dockerfile.rocm built for real on a stand-in base made with debootstrap
(Debian, Python and a CPU torch inside, playing the vendor base's role; only BASE_IMAGE differs), then
the container's self-check; its record in image-rehearsal.{md,json}."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
import time
from pathlib import Path

from .. import config, proc, ui
from ..errors import ForgeError
from ..paths import BUILD, CACHE, REPORTS, rel, write_atomic
from ..recipe import provenance
from . import fetch
from .buildah import builder_cmd
from .image import build_args, build_command, pick_builder

STANDIN_TAG = "localhost/forge-standin-base:bookworm"
REHEARSAL_TAG = "localhost/dcu-forge-rehearsal:latest"


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
    have = proc.run([*builder_cmd(builder), "inspect", *(["--type", "image"] if builder == "buildah" else []),
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
            ctr = proc.output([*builder_cmd(builder), "from", "scratch"], what="buildah from scratch")
            try:
                proc.run([*builder_cmd(builder), "add", ctr, tarball, "/"], what="buildah add rootfs")
                tarball.unlink()       # in the container now: not a third copy on disk during the commit
                proc.run([*builder_cmd(builder), "commit", "-q", ctr, STANDIN_TAG], what="buildah commit")
            finally:
                proc.run([*builder_cmd(builder), "rm", ctr], capture=True, check=False)
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
    cmd = builder_cmd(builder)
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
    lines = ["<!-- generated by `make image-rehearsal` (scripts/forge/builder/imagerehearsal.py); do not edit -->",
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
            ctr = proc.output([*builder_cmd(builder), "from", tag])
            try:
                out = proc.output([*builder_cmd(builder), "run", "--isolation", "chroot", ctr, "--",
                                   "make", "PY=python3", "self-check"])
            finally:
                proc.run([*builder_cmd(builder), "rm", ctr], capture=True, check=False)
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
    p = sub.add_parser("image-rehearsal", help="build Dockerfile.rocm on a debootstrap stand-in base and run its self-check")
    p.add_argument("--builder", choices=("auto", "docker", "buildah"), default="auto")
    p.add_argument("--torch-wheel", help="CPU torch wheel for the stand-in base (default: the one in /opt/wheels)")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where image-rehearsal.{md,json} go (default reports/; `make test` gives build/test-reports)")
    p.set_defaults(func=cmd_image_rehearsal)
