"""The final round's scoring and search given a baseline or a record it should not take: a baseline run not
served at the finals' baseline configuration (`score --round final --baseline RUN`, `sweep --round final
--baseline RUN`: a value of the server or the client's concurrency that differs, named with where it came
from, or no record of the server at all; a harness run's own server arguments are still taken), a resumed
sweep whose configuration's tier-score.json is damaged (never a traceback, never a NaN winner written to the
tier-environment file), a sweep record whose id is not its folder's, a --data-dir that is no folder of tier
files, and --baseline given with --baseline-profile. Each is refused before anything is written or started:
exit code 2, one error line naming the option, file or key and a `fix:` line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import FIXTURE_RUNS, ROOT, forge, free_port, tiny_model
from test_bad_inputs import refused, writes_nothing

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_final_sweep import BENCH, FAKE, STEADY, _sweep  # noqa: E402

from forge.contest import rounds, rules  # noqa: E402

TIERS = ("4-8K", "8-16K", "16-32K")
BASELINE = rounds.load_round(rules.load_contest(), "final").baseline.as_dict()
ONE = ["--topologies", "tp2", "--kv-dtypes", "bf16", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
       "--gpu-memory-utilization", "0.95", "--concurrency", "8"]          # one configuration per tier
CONFIG = "c-4-8K-tp2dp1-bf16-s64-b4096-u0.95-c8"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round6-model"))


def final_run(root: Path, name: str, src: str = "base", harness: bool = False, **settings) -> Path:
    """A fixture run recorded as forge serve --round final and bench-all-tiers --round final record one:
    each tier's server values and their sources (`settings`: key -> (value, source), the rest the
    baseline's), the client's concurrency in each result."""
    d = root / name
    shutil.copytree(FIXTURE_RUNS / src, d)
    m = json.loads((d / "manifest.json").read_text())
    values = {**BASELINE, **{k: v for k, (v, _) in settings.items()}}
    sources = {**{k: "baseline" for k in BASELINE}, **{k: s for k, (_, s) in settings.items()}}
    srv = {"profile": "upstream", "round": "final", "settings": values, "sources": sources}
    m.update(round="final", harness=harness, servers_by_tier={t: {**srv, "tier": t} for t in TIERS})
    m["client_settings"] = {"tiers": {t: {"max_concurrency": values["concurrency"],
                                          "concurrency_from": sources["concurrency"]} for t in TIERS}}
    (d / "manifest.json").write_text(json.dumps(m))
    for t in TIERS:
        res = json.loads((d / f"{t}.json").read_text())
        (d / f"{t}.json").write_text(json.dumps({**res, "max_concurrency": values["concurrency"]}))
    return d


# --- score / sweep --baseline RUN: the finals' baseline configuration -----------------------------------

@pytest.mark.parametrize("settings,words", [
    ({"max_num_seqs": (4, "env MAX_NUM_SEQS")}, ["--max-num-seqs 4 (env MAX_NUM_SEQS; the baseline's 128)"]),
    ({"gpu_memory_utilization": (0.5, "env GPU_MEMORY_UTILIZATION_4_8K")},
     ["--gpu-memory-utilization 0.5 (env GPU_MEMORY_UTILIZATION_4_8K; the baseline's 0.95)"]),
    ({"tensor_parallel_size": (1, "profile"), "data_parallel_size": (2, "profile")},
     ["--tensor-parallel-size 1 (profile; the baseline's 2)", "--data-parallel-size 2 (profile; the baseline's 1)"]),
    ({"max_num_batched_tokens": (8192, "env MAX_NUM_BATCHED_TOKENS"), "concurrency": (4, "CONCURRENCY_8_16K")},
     ["--max-num-batched-tokens 8192", "client concurrency 4 (CONCURRENCY_8_16K; the baseline's 10)"]),
])
def test_score_refuses_a_final_baseline_served_at_other_values(tmp_path, settings, words):
    """It was taken, and every lift and the total rose with the weaker baseline."""
    run = final_run(tmp_path, "run", "fast")
    weak = final_run(tmp_path, "weak", **settings)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline", str(weak))
        w = forge(tmp_path, "score", "--round", "final", "--tok-s", "40,40,40", "--baseline", str(weak))
    for x in (r, w):
        refused(x, "baseline run weak", "not served at the finals' baseline configuration",
                "rounds.final.baseline", *words)
    env = [s for _, s in settings.values() if s.isupper() or s.startswith("env ")]
    assert all(s.removeprefix("env ") in r.stderr.split("fix:")[1] for s in env), r.stderr   # the fix: unset them
    # the same run at the baseline's values is taken
    assert forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline",
                 str(final_run(tmp_path, "good"))).returncode == 0


def test_score_refuses_a_final_baseline_whose_server_is_not_recorded(tmp_path):
    """A run measured against a server forge did not start records no values: nothing says it was the baseline."""
    run = final_run(tmp_path, "run", "fast")
    bare = final_run(tmp_path, "bare")
    m = json.loads((bare / "manifest.json").read_text())
    del m["servers_by_tier"]
    (bare / "manifest.json").write_text(json.dumps(m))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline", str(bare))
    refused(r, "baseline run bare", "no record of its server's values", "4-8K, 8-16K, 16-32K")


def test_a_harness_baseline_is_checked_but_its_harness_arguments_are_not(tmp_path):
    run = final_run(tmp_path, "run", "fast", harness=True)
    weak = final_run(tmp_path, "weak", harness=True, max_num_seqs=(16, "env MAX_NUM_SEQS"))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline", str(weak))
    refused(r, "--max-num-seqs 16 (env MAX_NUM_SEQS")
    # e2e-gpu's upstream: the harness's own server arguments (a DCU card's cache, side-by-side sizing), and a
    # one-card server without --finals-servers: no final-round values recorded, taken as documented
    e2e = final_run(tmp_path, "e2e", harness=True)
    m = json.loads((e2e / "manifest.json").read_text())
    del m["servers_by_tier"]
    (e2e / "manifest.json").write_text(json.dumps(m))
    (e2e / "serve.json").write_text(json.dumps({"profile": "upstream", "harness_args": [
        "--gpu-memory-utilization", "0.47", "--kv-cache-memory-bytes", "7501512704"]}))
    r = forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline", str(e2e))
    assert r.returncode == 0, r.stderr


def test_sweep_refuses_a_baseline_run_served_at_other_values(tmp_path, model):
    """The sweep recorded a winner against a baseline served at MAX_NUM_SEQS=4."""
    port = free_port()
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "MAX_NUM_SEQS": "4"}
    try:
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", "upstream", "--model",
                  str(model), "--vllm", FAKE, "--run-id", "weak", "--timeout", "30", "--port", str(port), **env)
        assert r.returncode == 0, r.stderr[-2000:]
        r = forge(tmp_path, "bench-all-tiers", "--round", "final", "--client", BENCH, "--num-prompts", "2")
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        forge(tmp_path, "stop")
    with writes_nothing(tmp_path):
        r = _sweep(tmp_path, model, "--baseline", "weak", *ONE, top="1")
    refused(r, "baseline run weak", "--max-num-seqs 4 (env MAX_NUM_SEQS; the baseline's 128) in tier 4-8K")
    assert not (tmp_path / "sweeps").exists() and not (tmp_path / "tier-env.json").exists()


# --- sweep --round final: its resume, its record, its options -----------------------------------------------

@pytest.fixture(scope="module")
def swept(tmp_path_factory, model):
    """One finished one-configuration sweep `c` of tier 4-8K (its baseline measured in the sweep)."""
    root = tmp_path_factory.mktemp("round6-sweep")
    # STEADY: the fake server's 8 ms a token, so a loaded machine's jitter cannot push the one configuration out
    # of the SLA against its baseline (no winner, no tier-env.json: the fixture's own failure, not a test's)
    r = _sweep(root, model, "--baseline-profile", "upstream", "--sweep-id", "c", *ONE, top="1", env=STEADY)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (root / "runs" / CONFIG / "tier-score.json").is_file()
    (root / "tier-env.json").unlink()
    return root


def copy_sweep(tmp_path, swept):
    for d in ("runs", "sweeps"):
        shutil.copytree(swept / d, tmp_path / d)


def resume(tmp_path, model, sweep_id="c"):
    return _sweep(tmp_path, model, "--baseline-profile", "upstream", "--sweep-id", sweep_id, *ONE, top="1",
                  env=STEADY)


def _nan(d):
    return {k: float("nan") if isinstance(v, float) else v for k, v in d.items()}


@pytest.mark.parametrize("damage,words", [
    (_nan, ["key 'tok_s': nan is not a finite number"]),                  # picked as the winner, NaN written out
    (lambda d: {}, ["key 'tier' is missing"]),                               # KeyError
    (lambda d: [1], ["a JSON list, not a tier score"]),                      # TypeError
    (lambda d: {**d, "tok_s": "fast"}, ["key 'tok_s': 'fast' is not a finite number"]),     # ValueError
    (lambda d: {**d, "zeroed_by": None}, ["key 'zeroed_by': None is not a list of reasons"]),
])
def test_a_resume_refuses_a_damaged_tier_score(tmp_path, swept, model, damage, words):
    copy_sweep(tmp_path, swept)
    f = tmp_path / "runs" / CONFIG / "tier-score.json"
    f.write_text(json.dumps(damage(json.loads(f.read_text()))))
    with writes_nothing(tmp_path):
        r = resume(tmp_path, model)
    refused(r, f"{CONFIG}/tier-score.json", *words)
    assert "delete it" in r.stderr and "server ready" not in r.stdout + r.stderr
    assert not (tmp_path / "tier-env.json").exists()
    if damage is _nan:        # as the fix says: deleted, the resume scores it again from its result
        f.unlink()
        r = resume(tmp_path, model)
        assert r.returncode == 0, r.stderr[-3000:]
        win = json.loads((tmp_path / "tier-env.json").read_text())["tiers"]["4-8K"]
        assert win["run"] == CONFIG and win["tok_s"] > 0 and "server ready" not in r.stdout + r.stderr


def test_a_resume_refuses_a_sweep_record_of_another_id(tmp_path, swept, model):
    """sweep.json's own id was not checked: the sweep resumed as 'other' and printed its winners under it."""
    copy_sweep(tmp_path, swept)
    shutil.copytree(tmp_path / "sweeps" / "c", tmp_path / "sweeps" / "c3")
    sj = tmp_path / "sweeps" / "c3" / "sweep.json"
    sj.write_text(json.dumps({**json.loads(sj.read_text()), "sweep": "other"}))
    with writes_nothing(tmp_path):
        r = resume(tmp_path, model, sweep_id="c3")
    refused(r, "c3/sweep.json", "key 'sweep': 'other' is not the id of its folder (c3)")


@pytest.mark.parametrize("kind,words", [
    ("missing", ["DATA_DIR", "no such folder"]),
    ("file", ["DATA_DIR", "a file, not a folder"]),
    ("empty", ["DATA_DIR", "the tier file 4-8K_throughput.jsonl is missing"]),
])
@pytest.mark.parametrize("how", ["--data-dir", "DATA_DIR"])
def test_sweep_checks_data_dir_before_it_writes_or_serves(tmp_path, model, kind, words, how):
    """It was found by the client only, after the sweep record was written and the baseline server started."""
    d = tmp_path / "data"
    if kind == "file":
        d.write_text("x")
    elif kind == "empty":
        d.mkdir()
    args, env = (["--data-dir", str(d)], {}) if how == "--data-dir" else ([], {"DATA_DIR": str(d)})
    with writes_nothing(tmp_path):
        r = _sweep(tmp_path, model, "--baseline-profile", "upstream", *args, *ONE, top="1", env=env)
    refused(r, *words)
    assert "server ready" not in r.stdout + r.stderr and not (tmp_path / "sweeps").exists()


def test_sweep_with_both_baselines_says_both_were_given(tmp_path, model):
    """The text for neither was printed, its fix suggesting the --baseline-profile already given."""
    with writes_nothing(tmp_path):
        r = _sweep(tmp_path, model, "--baseline", "some-run", "--baseline-profile", "upstream", *ONE, top="1")
    refused(r, "--baseline and --baseline-profile both given; give one")
    assert "unpublished" not in r.stderr
