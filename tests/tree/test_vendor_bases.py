"""The real series on the vendor base and on CI's stand-in for it: it applies, the patched tree builds
offline for HIP, and `make submission` writes the repository a team pushes, whose pre-flight passes
and whose wheel metadata builds for the empty target with setup.py and no network at all. The vendor
cases run whenever VENDOR_SRC names a vllm_cscc checkout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge.builder import bases, offline, setupprobe, tree  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.recipe import patchfile  # noqa: E402
from forge.ship import submission  # noqa: E402

VENDOR_SRC = os.environ.get("VENDOR_SRC")
BASES = ["standin"] + (["vendor"] if VENDOR_SRC else [])
SERIES = patchfile.read_series(ROOT / "patches")


def forge(tmp: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts"), "FORGE_BUILD_DIR": str(tmp / "build"),
           "FORGE_DIST_DIR": str(tmp / "dist")}
    return subprocess.run([sys.executable, "-m", "forge", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("base", BASES)
def test_the_whole_series_applies_and_the_tree_builds_offline(tmp_path, base):
    st = tree.build_tree(tmp_path / "t", base=base)
    assert [n for n, _, _ in st["patches"]] == SERIES and st["base"] == base
    first = tree.git_out(tmp_path / "t", "log", "--format=%s", tree.UPSTREAM_REF)
    assert first.startswith("vendor stand-in (CI)" if base == "standin" else "vendor vLLM 0.18.1")
    w = offline.require_offline(tmp_path / "t")
    assert w.findings == [] and not any("triton_kernels" in f for f in w.files)


@pytest.fixture(scope="module")
def standin_submission(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sub")
    r = forge(tmp, "submission", "--base", "standin", "--into", str(tmp / "repo"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp / "repo", r, json.loads((tmp / "build" / "submission-preflight.json").read_text())


def test_the_standin_submission_has_the_base_our_commits_and_the_documents(standin_submission):
    repo, r, rec = standin_submission
    subjects = tree.git_out(repo, "log", "--reverse", "--format=%s").splitlines()
    assert subjects[0].startswith("vendor stand-in (CI)") and "NOT the vendor tree" in subjects[0]
    assert subjects[1].startswith("forge kernel overlay")
    want = [patchfile.parse(ROOT / "patches" / n).subject for n in SERIES]
    assert subjects[2:2 + len(SERIES)] == want
    assert subjects[-1].startswith("Submission documents") and len(subjects) == len(SERIES) + 3
    # each patch commit carries the patch's review record
    for i, n in enumerate(SERIES):
        body = tree.git_out(repo, "log", "-1", "--format=%B", f"HEAD~{len(SERIES) - i}")
        assert all(f"{s}:" in body for s in patchfile.REVIEW_SECTIONS), n
    env_md, opt_md = (repo / "ENVIRONMENT.md").read_text(), (repo / "OPTIMIZATION.md").read_text()
    for var in ("VLLM_FORGE_DECODE", "VLLM_FORGE_PREFILL", "VLLM_FORGE_PREFILL_TILES", "VLLM_FORGE_GEMV"):
        assert f"| `{var}` |" in env_md
    assert "No environment variable needs to be set" in env_md and "--max-num-batched-tokens 4096" in env_md
    run = yaml.safe_load((ROOT / "configs" / "optimizations.yaml").read_text())["submission"]["run"]
    assert "## Summary" in opt_md and "## Methods" in opt_md and f"run {Path(run).name} on " in opt_md
    assert "STAND-IN BASE: not for pushing" in (repo / "SUBMISSION.md").read_text()
    assert "STAND-IN" in r.stderr


def test_the_standin_submission_passes_its_preflight(standin_submission):
    _, r, rec = standin_submission
    checks = {x["check"]: x for x in rec["preflight"]}
    assert set(checks) == {"arch list", "offline", "extensions", "version", "rocm import", "patch check",
                           "forbidden paths", "defaults on", "tuned tables", "no build outputs"}
    assert all(x["ok"] for x in rec["preflight"]), rec["preflight"]
    assert "nvidia-h200-sm_90-132cu.json" in checks["tuned tables"]["detail"]     # read by the shipped loader
    assert "vllm._rocm_C" not in checks["extensions"]["detail"] and "0.18.1+das.dtk2604" in checks["version"]["detail"]
    assert "[ok] patch check" in r.stdout


def test_the_standin_submission_builds_its_wheel_metadata_without_network(standin_submission, tmp_path):
    """`setup.py dist_info` for the empty target (no compiler), with every connection off the
    loopback refused and recorded, proxies pointed at a closed port and git limited to files."""
    repo = standin_submission[0]
    res = setupprobe.build_empty_metadata(repo, tmp_path / "meta")
    assert res["network"] == [], res["network"]
    assert "Name: vllm" in res["metadata"] and "Version: 0.18.1+empty" in res["metadata"]
    # the guard is live: the same environment refuses (and records) a connection
    work = tmp_path / "guard"
    env = setupprobe._with_path(setupprobe.offline_env(work))
    probe = subprocess.run([sys.executable, "-c", "import urllib.request; urllib.request.urlopen('http://example.com', "
                                                  "timeout=5)"], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode != 0 and setupprobe.network_attempts(work)


def test_a_submission_goes_only_into_an_empty_or_new_directory(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine\n")
    with pytest.raises(ForgeError, match="not empty"):
        submission.target_dir(str(tmp_path / "full"))
    assert submission.target_dir(str(tmp_path / "new")) == (tmp_path / "new").resolve()
    with pytest.raises(ForgeError, match="inside this project's checkout"):
        submission.target_dir(str(ROOT / "scripts" / "sub"))


@pytest.mark.skipif(not VENDOR_SRC, reason="VENDOR_SRC (a vllm_cscc checkout) is not set")
def test_the_vendor_submission_passes_its_preflight(tmp_path):
    r = forge(tmp_path, "submission", "--into", str(tmp_path / "repo"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads((tmp_path / "build" / "submission-preflight.json").read_text())
    assert rec["base"] == "vendor" and all(x["ok"] for x in rec["preflight"])
    first = tree.git_out(tmp_path / "repo", "log", "--format=%s", f"HEAD~{len(SERIES) + 2}")
    src = Path(VENDOR_SRC)
    if (src / ".git").exists():         # the vendor's own commit is the base: a fork of its history
        assert tree.git_out(tmp_path / "repo", "rev-parse", f"HEAD~{len(SERIES) + 2}") == \
            tree.git_out(src, "rev-parse", "HEAD")
    else:
        assert first.startswith("vendor vLLM 0.18.1")
    assert "STAND-IN" not in (tmp_path / "repo" / "SUBMISSION.md").read_text()
    assert bases.tree_dir("vendor").name == "vllm-vendor"


@pytest.mark.skipif(not VENDOR_SRC, reason="VENDOR_SRC (a vllm_cscc checkout) is not set")
def test_the_real_tree_builds_only_for_hip_which_the_standin_does_not_copy(tmp_path):
    """The vendor's setup.py shadows setuptools-scm's get_version with a zero-argument one: every
    non-HIP build of the real tree stops with a TypeError (documented in the stand-in's message,
    which keeps the empty target buildable for CI)."""
    with pytest.raises(ForgeError, match="unexpected keyword argument 'write_to'"):
        setupprobe.build_empty_metadata(Path(VENDOR_SRC), tmp_path / "meta")
    assert "TypeError" in (ROOT / "patches" / "base" / "vendor-standin.patch").read_text()
