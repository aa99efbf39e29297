"""Bad inputs, each refused by the command line with the real cause named, exit code 2 and no
traceback: tampered sdist (given, cached, downloaded), tampered extracted tree, missing sdist,
patch that does not apply, missing overlay file, forbidden serve options, corrupt result files,
a model folder without its tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import FIXTURE_RUNS, ROOT, forge_env, free_port
from project import make_project, run


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    p = make_project(tmp_path_factory.mktemp("refusals") / "proj", n_modules=50, n_patches=2)
    r = run(p, "tree")
    assert r.returncode == 0, r.stderr
    return p


def refused(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr[-2000:])


def src_dir(proj):
    return proj["root"] / ".cache" / "forge" / "src"


# --- the source ----------------------------------------------------------------------------------

def test_tampered_sdist_given_is_not_used(proj, tmp_path):
    bad = tmp_path / "vllm-0.18.1.tar.gz"
    data = bytearray(proj["sdist"].read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    r = run(proj, "fetch", VLLM_SRC=str(bad))
    refused(r, "sha256 mismatch", proj["sdist_sha256"], "was not used")


def test_tampered_cached_sdist_is_set_aside_and_fetched_again(proj):
    tb = src_dir(proj) / "vllm-0.18.1.tar.gz"
    tb.write_bytes(tb.read_bytes() + b"\0")
    refused(run(proj, "tree"), "tampered", ".rejected")
    assert (src_dir(proj) / "vllm-0.18.1.tar.gz.rejected").is_file()
    assert run(proj, "tree").returncode == 0          # fetched again from the index, verified


def test_download_with_other_content_is_not_kept(proj, tmp_path):
    wrong = tmp_path / "vllm-0.18.1.tar.gz"
    wrong.write_bytes(b"not the sdist")
    idx = tmp_path / "simple" / "vllm"
    idx.mkdir(parents=True)
    (idx / "index.html").write_text(f'<a href="{wrong.as_uri()}">vllm-0.18.1.tar.gz</a>')
    cache = tmp_path / "cache"
    r = run(proj, "fetch", PIP_INDEX_URL=(tmp_path / "simple").as_uri(), FORGE_CACHE_DIR=str(cache))
    refused(r, "downloaded vllm-0.18.1.tar.gz: sha256 mismatch", "nothing was kept")
    assert not any((cache / "src").glob("vllm-0.18.1.tar.gz*"))


def test_no_sdist_anywhere_says_how_to_give_one(proj, tmp_path):
    (tmp_path / "empty").mkdir()
    r = run(proj, "fetch", PIP_INDEX_URL=(tmp_path / "empty").as_uri(), FORGE_CACHE_DIR=str(tmp_path / "c"))
    refused(r, "not found on pip's configured indexes", "VLLM_SRC=")


TAMPER = {
    "edited": (lambda d: (d / "vllm" / "config.py").write_text("# TAMPERED\n"), "vllm/config.py: changed"),
    "added": (lambda d: (d / "vllm" / "sitecustom.py").write_text("import os\n"), "vllm/sitecustom.py: added"),
    "removed": (lambda d: (d / "setup.py").unlink(), "setup.py: missing"),
}


@pytest.mark.parametrize("verb", ["tree", "patches-check"])
@pytest.mark.parametrize("how", sorted(TAMPER))
def test_tampered_extracted_tree_is_refused_and_set_aside(proj, verb, how):
    d = src_dir(proj) / "vllm-0.18.1"
    for old in src_dir(proj).glob("vllm-0.18.1.rejected*"):
        shutil.rmtree(old)
    fn, named = TAMPER[how]
    fn(d)
    args = [verb] if verb == "tree" else [verb]
    r = run(proj, *args, FORCE="1")
    refused(r, named, "differs from the pinned sdist", "moved to")
    assert (src_dir(proj) / "vllm-0.18.1.rejected").is_dir() and not d.exists()
    assert run(proj, "tree").returncode == 0


# --- the tree ------------------------------------------------------------------------------------

def test_patch_that_does_not_apply_names_patch_file_and_hunk(proj):
    p = proj["root"] / "patches" / "change_1.patch"
    good = p.read_text()
    try:
        p.write_text(good.replace(" ATT_13 = 13", " ATT_13 = 1300"))
        refused(run(proj, "tree"), "change_1.patch", "vllm/attention.py", "hunk #1")
    finally:
        p.write_text(good)
    assert run(proj, "tree").returncode == 0


def test_missing_overlay_source_is_named(proj):
    k = proj["root"] / "kernels" / "k.py"
    text = k.read_text()
    k.unlink()
    try:
        refused(run(proj, "tree"), "kernels/overlay.yaml", "kernels/k.py does not exist")
    finally:
        k.write_text(text)


@pytest.mark.parametrize("table, words", [
    ('{"schema": "forge-tuned/1", "gemv": [1]}', ["key 'validators'"]),
    ('{"schema": "forge-tuned/1", "validators": {"device_name": "BW", "arch": "gfx936", "compute_units": 80, '
     '"toolkit": "hip 6.3", "torch": "2.10", "triton": "3.4"}, "prefill": "x"}', ["key 'prefill'"]),
    ('{"schema": "forge-tuned/1", "validators": {"device_name": "BW", "arch": "gfx936", "compute_units": 80, '
     '"toolkit": "hip 6.3", "torch": "2.10", "triton": "3.4"}, "provenance": {"commit": "0123456789ab", '
     '"command": "forge calibrate --out /tmp/x/cal", "report": "/tmp/x/cal"}}', ["names a path on the machine"]),
])
def test_a_tuned_table_the_server_would_refuse_never_enters_the_tree(proj, table, words):
    """`make tree` validates every per-device table before the overlay carries it into the tree (and so into
    the wheel and the submission): with the loader's own validator, and the shipped-provenance rule."""
    root = proj["root"]
    shutil.copytree(ROOT / "kernels" / "forge_tuned", root / "kernels" / "forge_tuned", dirs_exist_ok=True)
    overlay = root / "kernels" / "overlay.yaml"
    good_overlay = overlay.read_text()
    tuned = root / "configs" / "kernels" / "tuned"
    tuned.mkdir(parents=True, exist_ok=True)
    bad = tuned / "bw-gfx936-80cu.json"
    head = subprocess.run(["git", "-C", str(root / "build" / "vllm"), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout
    try:
        overlay.write_text(good_overlay + "  - src: configs/kernels/tuned/*.json\n    dst: vllm/forge_tuned/\n")
        bad.write_text(table)
        refused(run(proj, "tree"), "configs/kernels/tuned/bw-gfx936-80cu.json", *words)
        assert subprocess.run(["git", "-C", str(root / "build" / "vllm"), "rev-parse", "HEAD"],
                              capture_output=True, text=True).stdout == head      # the tree was not touched
    finally:
        bad.unlink(missing_ok=True)
        overlay.write_text(good_overlay)
    assert run(proj, "tree").returncode == 0


# --- serving and results (this repository's own configs) -------------------------------------------

def forge(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "forge", *args], cwd=ROOT, env=forge_env(tmp_path),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("option,rule_words", [("--max-num-seqs", "scheduler"),
                                               ("--speculative-config", "peculative"),
                                               ("--quantization", "quantiz"), ("--port", "port")])
def test_forbidden_serve_option_is_refused_with_its_rule(tmp_path, option, rule_words):
    prof = tmp_path / "bad.yaml"
    prof.write_text(f"description: x\nextends: contest\noptions:\n  '{option}':\n    value: '4'\n    effect: e\n")
    r = forge(tmp_path, "serve", "--profile", str(prof), "--model", str(tmp_path), "--dry-run")
    refused(r, "bad.yaml", option)
    assert rule_words in r.stderr.lower() or rule_words in r.stderr


@pytest.mark.parametrize("fault", ["truncated tier", "tier without results", "truncated manifest"])
def test_corrupt_result_file_is_named(tmp_path, fault):
    run_dir, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(FIXTURE_RUNS / "fast", run_dir)
    shutil.copytree(FIXTURE_RUNS / "base", base)
    name = {"truncated tier": "4-8K.json", "tier without results": "8-16K.json",
            "truncated manifest": "manifest.json"}[fault]
    f = run_dir / name
    f.write_text(f.read_text()[:150] if "truncated" in fault else json.dumps({}))
    r = forge(tmp_path, "score", "--run", str(run_dir), "--baseline", str(base))
    refused(r, name)
    assert not (run_dir / "score.json").exists()


def _model_without_tokenizer(tmp_path):
    from helpers import tiny_model
    m = tiny_model(tmp_path / "model")
    (m / "tokenizer.json").unlink()
    return m


def test_model_without_tokenizer_names_the_file_and_leaves_no_run(tmp_path):
    """A server answers (so the check that no server is up does not come first): the missing
    tokenizer file is named, and no run folder is left behind."""
    from helpers import fake_server
    m = _model_without_tokenizer(tmp_path)
    port = free_port()
    with fake_server(m, port):
        r = forge(tmp_path, "bench-all-tiers", "--model", str(m), "--port", str(port), "--profile", "x")
    refused(r, "tokenizer.json")
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir())


def test_benchmark_without_server_fails(tmp_path):
    from helpers import tiny_model
    m = tiny_model(tmp_path / "model")
    r = forge(tmp_path, "bench-all-tiers", "--model", str(m), "--port", str(free_port()), "--profile", "x",
              "--num-prompts", "1", "--tiers", "4-8K")
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_a_result_file_given_for_a_run_folder_is_named(tmp_path):
    """`score --baseline FILE` (a tier's JSON where a run folder is expected): the refusal says it
    is a file and which folder to give, not that the run does not exist."""
    res = FIXTURE_RUNS / "base" / "4-8K.json"
    r = forge(tmp_path, "score", "--run", str(FIXTURE_RUNS / "base"), "--baseline", str(res))
    refused(r, "is a file, not a run folder", str(res.parent))


def test_a_missing_provenance_file_is_named_with_the_fix(tmp_path):
    r = forge(tmp_path, "report", "--out", str(tmp_path / "out"), "--provenance", str(tmp_path / "nope.json"))
    refused(r, "nope.json: not found", "fix:")


def test_a_json_that_is_no_provenance_record_is_refused(tmp_path):
    """A JSON object without a wheel's provenance keys (here: a tier result) is refused, naming the
    missing keys, instead of writing a submission readme full of '?'."""
    bad = tmp_path / "not-prov.json"
    bad.write_text(json.dumps({"completed": 1, "output_throughput": 2.0}))
    r = forge(tmp_path, "report", "--out", str(tmp_path / "out"), "--provenance", str(bad))
    refused(r, "not a wheel's provenance record", "version", "fix:")
    assert not (tmp_path / "out" / "submission-readme.md").exists()
