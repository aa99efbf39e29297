"""The vendor base and CI's stand-in for it (configs/upstream.yaml vendor, patches/base/): the pin is
self-consistent with the sdist; the stand-in changes exactly the files the pin says the vendor
changes, and passes the same build checks as the real tree (run on the real tree too whenever
VENDOR_SRC is set); the pristine sdist fails every one of them; a checkout that differs is refused
naming its files, with the fix for a vllm/version.py an earlier vendor build rewrote."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge.builder import basecheck, bases, fetch  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.hashing import manifest_diff, manifest_hash, tree_manifest  # noqa: E402

CACHE = Path(os.environ.get("FORGE_CACHE_DIR", ROOT / ".cache" / "forge"))
SDIST = CACHE / "src" / "vllm-0.18.1"
VENDOR_SRC = os.environ.get("VENDOR_SRC")
needs_sdist = pytest.mark.skipif(fetch.read_manifest(SDIST) is None,
                                 reason="needs the verified sdist in the cache (make fetch)")
needs_vendor = pytest.mark.skipif(not VENDOR_SRC, reason="VENDOR_SRC (a vllm_cscc checkout) is not set")


@pytest.fixture(scope="module")
def vcfg():
    return bases.vendor_cfg()


@pytest.fixture(scope="module")
def standin():
    return bases.standin_source()


def test_the_pin_says_what_it_covers(vcfg):
    assert vcfg["scope"]["files"] == ["CMakeLists.txt", "setup.py", "pyproject.toml", "MANIFEST.in",
                                      "use_existing_torch.py"]
    assert vcfg["scope"]["folders"] == ["cmake", "csrc", "requirements", "vllm"]
    assert sorted(vcfg["changed"]) == sorted([
        "CMakeLists.txt", "setup.py", "vllm/platforms/rocm.py", "csrc/cuda_vec_utils.cuh",
        "csrc/fused_qknorm_rope_kernel.cu", "csrc/quantization/gptq/q_gemm.cu", "requirements/rocm.txt"])
    assert all(bases.in_scope(p, vcfg) for p in [*vcfg["changed"], *vcfg["absent"]])
    for outside in ("des.md", "tests/x.py", "benchmarks/b.py", "docs/a.png", ".github/w.yml", "vllm/__pycache__/a.pyc"):
        assert not bases.in_scope(outside, vcfg)


@needs_sdist
def test_the_pinned_scope_hash_is_the_sdist_with_the_vendor_changes(vcfg):
    """scope_sha256 = hash(sdist scope - absent + changed): the seven files and two absences are the
    whole difference, so a mismatch elsewhere can be named file by file from the sdist."""
    assert manifest_hash(bases.expected_vendor_manifest(SDIST, vcfg)) == vcfg["scope_sha256"]


@needs_sdist
def test_the_standin_changes_exactly_the_files_the_vendor_changes(vcfg, standin):
    sdist = bases.scope_manifest(SDIST, vcfg)
    ours = bases.scope_manifest(standin, vcfg)
    diff = manifest_diff(sdist, ours)
    assert sorted(d.split(":")[0] for d in diff) == sorted(vcfg["changed"]), diff
    assert all(": changed (" in d for d in diff)              # nothing added or removed in the scope
    # the stand-in is our own text, never the vendor's
    for p, c in vcfg["changed"].items():
        assert ours[p][2] != c["sha256"], p
    # outside the scope the stand-in is the sdist (its generated files stay)
    whole = manifest_diff(tree_manifest(SDIST, exclude=fetch.INTERNAL), tree_manifest(standin, exclude=fetch.INTERNAL))
    assert sorted(d.split(":")[0] for d in whole) == sorted(vcfg["changed"])


def _report(results) -> str:
    return "\n".join(f"{'ok' if ok else 'FAIL'} {name}: {detail}" for name, ok, detail in results)


@needs_sdist
def test_the_standin_passes_the_vendor_build_checks(standin):
    results = basecheck.check(standin)
    assert [r[0] for r in results] == ["arch list", "offline", "extensions", "version", "rocm import"]
    assert all(ok for _, ok, _ in results), _report(results)
    assert "0.18.1+das.dtk2604" in dict((n, d) for n, _, d in results)["version"]


@needs_sdist
def test_the_pristine_sdist_fails_every_vendor_build_check():
    results = basecheck.check(SDIST)
    assert not any(ok for _, ok, _ in results), _report(results)
    detail = dict((n, d) for n, _, d in results)
    assert "vllm._rocm_C" in detail["extensions"] and "vllm.triton_kernels" in detail["extensions"]
    assert "triton_kernels.cmake:17" in detail["offline"]


@needs_vendor
def test_the_real_vendor_tree_verifies_and_passes_the_same_checks():
    src = Path(VENDOR_SRC)
    files, h = bases.verify_vendor(src)
    assert h == bases.vendor_cfg()["scope_sha256"]
    results = basecheck.check(src)
    assert all(ok for _, ok, _ in results), _report(results)


@needs_vendor
def test_the_standin_and_the_real_tree_agree_on_every_check(standin):
    ours = [(n, ok) for n, ok, _ in basecheck.check(standin)]
    theirs = [(n, ok) for n, ok, _ in basecheck.check(Path(VENDOR_SRC))]
    assert ours == theirs


# --- verification of a checkout: the stand-in plays the vendor tree (its hashes pinned here) ------

@pytest.fixture
def fake_vendor(tmp_path, monkeypatch, standin, vcfg):
    """A plain copy of the stand-in, with configs/upstream.yaml's vendor pin pointed at it."""
    d = tmp_path / "vllm_cscc"
    shutil.copytree(standin, d, ignore=shutil.ignore_patterns(*fetch.INTERNAL))
    for generated in vcfg["absent"]:
        (d / generated).unlink()
    man = bases.scope_manifest(d, vcfg)
    pin = {**vcfg, "scope_sha256": manifest_hash(man),
           "changed": {p: {"size": man[p][1], "sha256": man[p][2]} for p in vcfg["changed"]}}
    monkeypatch.setattr(bases, "vendor_cfg", lambda: pin)
    return d


@needs_sdist
def test_a_matching_checkout_verifies_and_build_outputs_do_not_count(fake_vendor):
    (fake_vendor / "vllm" / "__pycache__").mkdir(exist_ok=True)
    (fake_vendor / "vllm" / "__pycache__" / "envs.cpython-310.pyc").write_bytes(b"x")
    (fake_vendor / "des.md").write_text("the rules\n")                   # outside the pin
    assert bases.verify_vendor(fake_vendor)[0] is None                    # a plain folder: all its files


@needs_sdist
def test_a_rewritten_version_py_is_refused_with_the_way_back(fake_vendor):
    vp = fake_vendor / "vllm" / "version.py"
    vp.write_text(vp.read_text() + "__hcu_version__ = '0.18.1+das.dtk2604'\n")
    (fake_vendor / "csrc" / "mine.cu").write_text("// a change in the checkout\n")
    with pytest.raises(ForgeError) as e:
        bases.verify_vendor(fake_vendor)
    msg = str(e.value)
    assert "vllm/version.py: changed" in msg and "csrc/mine.cu: added (not in the vendor tree)" in msg
    assert f"git -C {fake_vendor} checkout vllm/version.py" in msg and "keep your changes in patches/" in msg


@needs_sdist
def test_a_changed_vendor_file_is_named_against_its_pinned_hash(fake_vendor):
    (fake_vendor / "setup.py").write_text((fake_vendor / "setup.py").read_text() + "\n# edited\n")
    with pytest.raises(ForgeError, match=r"setup.py: differs from the vendor's"):
        bases.verify_vendor(fake_vendor)


@needs_sdist
def test_a_git_checkout_is_read_by_its_tracked_files(fake_vendor):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"], "HOME": str(fake_vendor.parent)}
    for cmd in (["init", "-q"], ["add", "-A", "-f"], ["commit", "-qm", "vendor"]):
        subprocess.run(["git", "-C", str(fake_vendor), *cmd], check=True, env=env, capture_output=True)
    (fake_vendor / "vllm" / "scratch.py").write_text("untracked\n")       # not the checkout's content
    files, _ = bases.verify_vendor(fake_vendor)
    assert "vllm/scratch.py" not in files and "setup.py" in files


def test_the_vendor_base_needs_a_checkout(monkeypatch):
    monkeypatch.delenv("VENDOR_SRC", raising=False)
    with pytest.raises(ForgeError, match="no VENDOR_SRC given") as e:
        bases.resolve("vendor")
    assert "never downloaded" in e.value.hint and "BASE=standin" in e.value.hint
    with pytest.raises(ForgeError, match="not a base"):
        bases.resolve("vendr")
    assert bases.tree_dir("sdist").name == "vllm" and bases.tree_dir("vendor").name == "vllm-vendor"
