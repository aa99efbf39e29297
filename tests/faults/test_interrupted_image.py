"""Interrupt the image stage (`forge image-rehearsal`: stand-in base, image build, self-check,
report) at random moments, with SIGINT (Ctrl-C) and SIGKILL (kill -9 of the whole process group),
then rerun it: the rerun must succeed by itself — reusing the stand-in base only when it was
finished, rebuilding it otherwise — and leave what an uninterrupted run leaves: the same images,
the same stand-in record, a passing report, and no temporary files.

No real image is built: `docker`, `debootstrap` and `chroot` are the stand-ins in fakebin/ (on
PATH; steps that take a while and make their output appear whole, as the real tools do), and pip
downloads the stand-in base's wheels from a folder of tiny wheels. The moments are drawn uniformly
over the uninterrupted run's time; the seed is printed in every failure (FORGE_FAULT_SEED replays
one, FORGE_FAULT_POINTS sets how many moments per signal)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
import zipfile
from pathlib import Path

import pytest
from project import interrupt, make_project, run

SEED = int(os.environ.get("FORGE_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
POINTS = int(os.environ.get("FORGE_FAULT_POINTS", "3"))     # per signal
SIGNALS = {"SIGINT": signal.SIGINT, "SIGKILL": signal.SIGKILL}
FAKEBIN = Path(__file__).resolve().parent / "fakebin"
WHEELS = {"numpy": "2.0.0", "pyyaml": "6.0.2", "setuptools": "80.0.0", "setuptools-scm": "8.1.0", "wheel": "0.45.1",
          "packaging": "24.2", "jinja2": "3.1.4", "regex": "2024.11.6"}


def fake_wheel(dest: Path, name: str, version: str, tag: str = "py3-none-any") -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = dest / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                              f"Tag: {tag}\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def _paths(proj):
    root = proj["root"]
    return {"standin": root / ".cache" / "forge" / "standin", "reports": root / "reports",
            "docker": proj["docker_state"]}


def _reset(proj):
    p = _paths(proj)
    for d in (p["standin"], p["docker"]):
        shutil.rmtree(d, ignore_errors=True)
    for f in p["reports"].glob("*image-rehearsal*") if p["reports"].is_dir() else []:
        f.unlink()


def _result(proj) -> dict:
    """What the stage left, in a form two runs can be compared by (no timings)."""
    p = _paths(proj)
    rec = json.loads((p["reports"] / "image-rehearsal.json").read_text())
    md = (p["reports"] / "image-rehearsal.md").read_text()
    images = p["docker"] / "images"
    return {"ok": rec["ok"], "error": rec.get("error"), "md_pass": "Result: **PASS**" in md,
            "report": {k: rec.get(k) for k in ("builder", "base", "image", "standin_torch_wheel", "self_check")},
            "stages": [s["stage"] for s in rec.get("stages", [])],
            "reports_dir": sorted(f.name for f in p["reports"].iterdir()),
            "standin_dir": sorted(f.name for f in p["standin"].iterdir()),
            "stamp": (p["standin"] / "stamp").read_text(),
            "images": {f.name: f.read_text() for f in images.iterdir() if not f.name.endswith(".part")}}


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    base = tmp_path_factory.mktemp("image-faults")
    p = make_project(base / "proj", n_modules=50, n_patches=2)
    wheels = base / "wheels"
    wheels.mkdir()
    for name, version in WHEELS.items():
        fake_wheel(wheels, name, version)
    torch = fake_wheel(base, "torch", "2.5.1+cpu", "cp311-cp311-manylinux_2_28_x86_64")
    p["docker_state"] = base / "docker"
    p["env"] = {"PATH": f"{FAKEBIN}{os.pathsep}{os.environ['PATH']}", "FAKE_DOCKER_STATE": str(base / "docker"),
                "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "FAKE_STEP_S": "0.3"}
    p["args"] = ["image-rehearsal", "--builder", "docker", "--torch-wheel", str(torch)]
    r = run(p, "tree")
    assert r.returncode == 0, r.stderr
    _reset(p)
    t0 = time.monotonic()
    r = run(p, *p["args"], **p["env"])
    p["seconds"] = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    p["baseline"] = _result(p)
    assert p["baseline"]["ok"] and p["baseline"]["md_pass"] and len(p["baseline"]["images"]) == 2
    assert p["baseline"]["standin_dir"] == ["stamp", "standin.log"]
    return p


CASES = [(sig, k) for sig in SIGNALS for k in range(POINTS)]


@pytest.mark.parametrize("sig,k", CASES, ids=[f"image-{s}-{k}" for s, k in CASES])
def test_interrupted_image_rehearsal_resumes_to_the_same_result(proj, sig, k):
    rng = random.Random(f"{SEED}-image-{sig}-{k}")
    at = rng.uniform(0.02, 1.0) * proj["seconds"]
    where = f"(FORGE_FAULT_SEED={SEED}: {sig} at {at:.2f} s of {proj['seconds']:.2f} s)"
    _reset(proj)
    interrupt(proj, proj["args"], at, SIGNALS[sig], **proj["env"])
    r = run(proj, *proj["args"], **proj["env"])
    assert r.returncode == 0, f"rerun after {where} failed:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr
    assert _result(proj) == proj["baseline"], f"rerun after {where} differs"


def test_finished_stand_in_is_reused_and_a_half_written_report_swept(proj):
    """A kill while the report was being written leaves its temporary file (named by the dead
    writer's pid); a kill after the stand-in's stamp leaves a finished stand-in. The rerun reuses
    the stand-in (no second debootstrap or import) and leaves no temporary file."""
    _reset(proj)
    r = run(proj, *proj["args"], **proj["env"])
    assert r.returncode == 0, r.stderr
    reports = _paths(proj)["reports"]
    dead = 2 ** 22 + 12345          # above the default pid_max: no live process has it
    (reports / f".image-rehearsal.json.{dead}.tmp").write_text('{"ok": tr')
    calls = _paths(proj)["docker"] / "calls"
    calls.unlink()
    r = run(proj, *proj["args"], **proj["env"])
    assert r.returncode == 0, r.stderr
    assert "stand-in base localhost/forge-standin-base:bookworm is up to date" in r.stderr + r.stdout
    assert not any(json.loads(c)[0] == "import" for c in calls.read_text().splitlines())
    assert _result(proj) == proj["baseline"]
