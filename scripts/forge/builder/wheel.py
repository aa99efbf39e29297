"""Stage 3: the wheel, always built from a clean copy of build/vllm's HEAD (never from a tree with
stale build/ directories). CPU machines build the pure-Python wheel (VLLM_TARGET_DEVICE=empty);
ROCm/DTK machines build everything with PYTORCH_ROCM_ARCH from configs/build.yaml.

Version: 0.18.1+forge.<series hash>[.cpu] on the sdist base. On the vendor base and its stand-in a
ROCm wheel takes the version the tree's own setup.py gives, as on the contest's platform
(0.18.1+das.dtk<DTK release>; the vendor's setup.py refuses VLLM_VERSION_OVERRIDE), and is always
rebuilt (its name does not carry the series). A provenance record ships inside the wheel
(vllm/_forge_provenance.py, PROVENANCE) and next to it (<wheel>.provenance.json).

Interrupts: the build works in build/wheel (emptied first), and dist/ gets the wheel, then its
record, each by rename: a rerun after an interrupt at any moment rebuilds what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

from .. import config, proc, ui
from ..errors import ForgeError
from ..paths import BUILD, DIST, Lock, rel, write_atomic
from ..recipe import provenance
from ..tarsafe import extract_tar
from . import bases, tree

SOURCE_DATE_EPOCH = 1767225600          # 2026-01-01T00:00:00Z, the tree's commit date


def detect_device() -> str:
    try:
        import torch  # heavy and optional: only to tell a ROCm torch from another
    except ImportError:
        return "empty"
    return "rocm" if getattr(torch.version, "hip", None) else "empty"


def wheel_version(state: dict, device: str) -> str:
    up, b = config.upstream(), config.build()
    v = f"{up['version']}+{b['wheel_local_tag']}.{provenance.series_hash(state)[:10]}"
    # vLLM picks its CPU platform only when its version string says "cpu"
    return v + ".cpu" if device == "empty" else v


def clean_copy(tree_dir: Path, dest: Path) -> None:
    """Export HEAD (tracked files only) into an empty dest."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    arch = dest.parent / "src.tar"
    tree.git(tree_dir, "archive", "--format=tar", "-o", arch, "HEAD")
    with tarfile.open(arch) as tf:
        extract_tar(tf, dest)
    arch.unlink()


def _existing(version: str) -> Path | None:
    fname_version = version.replace("-", "_")
    for w in sorted(DIST.glob(f"vllm-{fname_version}-*.whl")):
        if Path(str(w) + ".provenance.json").is_file():
            return w
    return None


def dcu_version() -> str:
    """The version the vendor tree's setup.py gives a ROCm build: 0.18.1+das[.dtk<digits>]."""
    v = f"{config.upstream()['version']}+das"
    info = Path(os.environ.get("ROCM_PATH", "/nonexistent"), ".info", "rocm_version")
    if info.is_file():
        first = (info.read_text(errors="replace").strip().splitlines() or [""])[0]
        v += ".dtk" + "".join(c for c in first if c.isdigit())
    return v


def build_wheel(device: str = "auto", *, force: bool = False, tree_dir: Path | None = None,
                base: str = "sdist") -> Path:
    device = detect_device() if device == "auto" else device
    tree_dir = tree_dir or bases.tree_dir(base)
    state = tree.build_tree(tree_dir, base=base)
    if base != "sdist" and device == "rocm":
        force = True                    # the vendor's version names no series: never reuse
    BUILD.mkdir(parents=True, exist_ok=True)
    with Lock(BUILD / ".wheel.lock", "the wheel"):
        for stale in DIST.glob(".*.part"):      # a copy into dist/ that an interrupt cut short
            stale.unlink(missing_ok=True)
        return _build_wheel_locked(device, force, tree_dir, state)


def _build_wheel_locked(device: str, force: bool, tree_dir: Path, state: dict) -> Path:
    b = config.build()
    own_version = state.get("base", "sdist") != "sdist" and device == "rocm"
    version = dcu_version() if own_version else wheel_version(state, device)
    if not force and (w := _existing(version)):
        ui.info(f"{rel(w)} is up to date (same upstream, overlay and patches); --force rebuilds")
        return w
    work = BUILD / "wheel"
    src = work / "src"
    ui.info(f"clean copy of {rel(tree_dir)} HEAD -> {rel(src)}")
    clean_copy(tree_dir, src)
    rec = provenance.record(state, version=version, device=device,
                            rocm_arch=b["rocm_arch"] if device == "rocm" else None)
    env = {}
    if device == "rocm":
        env["PYTORCH_ROCM_ARCH"] = ";".join(b["rocm_arch"])
        jobs = os.environ.get("MAX_JOBS") or (str(b["max_jobs"]) if b["max_jobs"] else None)
        if jobs:
            env["MAX_JOBS"] = jobs
    wheel = build_from_src(src, version, device, rec, work, env, override=not own_version)
    check_wheel(wheel, state)
    final = publish(wheel, rec)
    ui.info(f"wheel: {rel(final)}")
    return final


def publish(wheel: Path, rec: dict) -> Path:
    """Move a finished wheel into dist/, then its provenance record: dist/ holds a wheel with its
    record or no wheel of this version at all (a wheel without its record is rebuilt), whenever the
    process is stopped."""
    DIST.mkdir(parents=True, exist_ok=True)
    final = DIST / wheel.name
    side = Path(str(final) + ".provenance.json")
    side.unlink(missing_ok=True)
    part = DIST / f".{wheel.name}.part"
    shutil.copyfile(wheel, part)
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, final)
    write_atomic(side, json.dumps(rec, indent=1, sort_keys=True) + "\n")
    wheel.unlink()
    return final


def build_from_src(src: Path, version: str, device: str, rec: dict, work: Path,
                   extra_env: dict | None = None, override: bool = True) -> Path:
    """Write the provenance module into `src` and run the wheel build there; the wheel lands in
    work/dist (emptied first). Returns its path."""
    (src / "vllm" / "_forge_provenance.py").write_text(
        '"""Generated by dcu-forge at wheel build: what this vLLM was built from."""\n'
        f"PROVENANCE = {json.dumps(rec, indent=1, sort_keys=True)}\n".replace(": null", ": None")
        .replace(": true", ": True").replace(": false", ": False"))
    # SOURCE_DATE_EPOCH: the zip's timestamps, so the same inputs give the same wheel bytes
    env = {"VLLM_TARGET_DEVICE": device,
           **({"VLLM_VERSION_OVERRIDE": version, "SETUPTOOLS_SCM_PRETEND_VERSION": version} if override else {}),
           "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", str(SOURCE_DATE_EPOCH)), **(extra_env or {})}
    out = work / "dist"
    shutil.rmtree(out, ignore_errors=True)
    log = work / "build.log"
    log.unlink(missing_ok=True)
    ui.info(f"building vllm {version} ({'pure Python' if device == 'empty' else device + ' ' + env.get('PYTORCH_ROCM_ARCH', '')})"
            f"; log: {rel(log)}")
    proc.run([sys.executable, "setup.py", "bdist_wheel", "--dist-dir", out], cwd=src, env=env, log=log,
             what="wheel build", hint=f"see {rel(log)}; on a CPU box the project venv needs requirements/dev.txt "
                                      "(make venv)")
    wheels = list(out.glob("vllm-*.whl"))
    if len(wheels) != 1:
        raise ForgeError(f"wheel build produced {len(wheels)} wheels in {rel(out)}", hint=f"see {rel(log)}")
    return wheels[0]


def check_wheel(whl: Path, state: dict) -> None:
    """The wheel must carry our overlay and the provenance module."""
    names = set(zipfile.ZipFile(whl).namelist())
    need = ["vllm/_forge_provenance.py"] + [e["dst"] for e in tree.overlay_entries() if e["dst"].startswith("vllm/")]
    missing = [n for n in need if n not in names]
    if missing:
        raise ForgeError(f"{whl.name} is missing {', '.join(missing)}",
                         hint="package_data/packaging of the tree dropped them; check the overlay destinations")


def cmd_wheel(args) -> int:
    w = build_wheel(args.device, force=args.force, base=args.base)
    print(w)
    return 0


def register(sub) -> None:
    p = sub.add_parser("wheel", help="build the vllm wheel from a clean copy of build/vllm", description=__doc__,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "empty", "rocm"), default="auto",
                   help="auto: rocm when torch is a ROCm build, else empty (pure Python)")
    p.add_argument("--force", action="store_true", help="rebuild even if dist/ has this version")
    tree.add_base_argument(p)
    p.set_defaults(func=cmd_wheel)
