"""Interrupt each stage (fetch, tree, wheel) at random moments, with SIGINT (Ctrl-C) and SIGKILL
(kill -9 of the whole process group), then rerun it: the rerun must succeed by itself, leave no
temporary files behind, and give exactly what an uninterrupted run gives (same manifest, same
commit hashes, same wheel bytes).

The moments are drawn uniformly over the stage's uninterrupted run time; the seed is printed in
every failure (set FORGE_FAULT_SEED to replay one)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import time
import zipfile

import pytest
from project import interrupt, make_project, run

SEED = int(os.environ.get("FORGE_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
POINTS = int(os.environ.get("FORGE_FAULT_POINTS", "3"))     # per stage and signal
STAGES = ("fetch", "tree", "wheel")
SIGNALS = {"SIGINT": signal.SIGINT, "SIGKILL": signal.SIGKILL}


def _reset(proj, stage):
    root = proj["root"]
    if stage == "fetch":
        shutil.rmtree(root / ".cache", ignore_errors=True)
    elif stage == "tree":
        shutil.rmtree(root / "build" / "vllm", ignore_errors=True)
    else:
        shutil.rmtree(root / "dist", ignore_errors=True)
        shutil.rmtree(root / "build" / "wheel", ignore_errors=True)


def _args(stage):
    return {"fetch": ["fetch"], "tree": ["tree"], "wheel": ["wheel", "--device", "empty"]}[stage]


def _git(root, *a):
    import subprocess
    return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, check=True).stdout.strip()


def _result(proj, stage):
    """What the stage produced, in a form two runs can be compared by."""
    root = proj["root"]
    if stage == "fetch":
        src = root / ".cache" / "forge" / "src"
        man = (src / "vllm-0.18.1" / ".forge-manifest.json").read_text()
        return {"manifest": hashlib.sha256(man.encode()).hexdigest(),
                "tarball": hashlib.sha256((src / "vllm-0.18.1.tar.gz").read_bytes()).hexdigest(),
                "entries": sorted(p.name for p in src.iterdir() if p.name != ".lock")}
    if stage == "tree":
        t = root / "build" / "vllm"
        state = json.loads((t / ".git" / "forge-state.json").read_text())
        return {"head": _git(t, "rev-parse", "HEAD"), "log": _git(t, "log", "--format=%H %s"),
                "status": _git(t, "status", "--porcelain", "--untracked-files=all"),
                "pending": state.get("pending"),
                "leftovers": sorted(p.name for p in (root / "build").iterdir()
                                    if p.name.startswith(".") and not p.name.endswith(".lock"))}
    wheels = sorted((root / "dist").iterdir())
    out = {"files": [p.name for p in wheels],
           "sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in wheels}}
    # what a difference is made of, named in the failure: each member of the wheel, each field of
    # the provenance record
    for p in wheels:
        if p.suffix == ".whl":
            with zipfile.ZipFile(p) as z:
                out[f"{p.name} members"] = {i.filename: (hashlib.sha256(z.read(i)).hexdigest()[:16], i.date_time,
                                                          i.external_attr) for i in z.infolist()}
        elif p.name.endswith(".provenance.json"):
            out[f"{p.name} fields"] = json.loads(p.read_text())
    return out


def _differences(got: dict, want: dict, prefix: str = "") -> list[str]:
    """Leaf by leaf: what differs between two results."""
    if not (isinstance(got, dict) and isinstance(want, dict)):
        return [] if got == want else [f"{prefix}: {want!r} -> {got!r}"[:400]]
    return [d for k in sorted(set(got) | set(want), key=str)
            for d in _differences(got.get(k, "<absent>"), want.get(k, "<absent>"), f"{prefix}/{k}")]


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    """The project with one uninterrupted run of each stage: its time and its result."""
    p = make_project(tmp_path_factory.mktemp("faults") / "proj")
    p["baseline"], p["seconds"] = {}, {}
    for stage in STAGES:
        _reset(p, stage)
        t0 = time.monotonic()
        r = run(p, *_args(stage))
        p["seconds"][stage] = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        p["baseline"][stage] = _result(p, stage)
    return p


CASES = [(stage, sig, k) for stage in STAGES for sig in SIGNALS for k in range(POINTS)]


@pytest.mark.parametrize("stage,sig,k", CASES, ids=[f"{s}-{g}-{k}" for s, g, k in CASES])
def test_interrupted_stage_resumes_to_the_same_result(proj, stage, sig, k):
    rng = random.Random(f"{SEED}-{stage}-{sig}-{k}")
    at = rng.uniform(0.02, 1.0) * proj["seconds"][stage]
    where = f"(FORGE_FAULT_SEED={SEED}: {sig} at {at:.2f} s of {proj['seconds'][stage]:.2f} s)"
    _reset(proj, stage)
    interrupt(proj, _args(stage), at, SIGNALS[sig])
    r = run(proj, *_args(stage))
    assert r.returncode == 0, f"rerun after {where} failed:\n{r.stderr[-3000:]}"
    got = _result(proj, stage)
    assert got == proj["baseline"][stage], (f"rerun after {where} differs:\n  "
                                            + "\n  ".join(_differences(got, proj["baseline"][stage])[:20]))
