"""bench-all-tiers against the server `forge serve` started: the client's round must be the server's,
and in the final round (a server started per tier, with that tier's settings) the client runs the
server's tier, at the concurrency the start resolved for it (the profile's or the environment's then)
unless CONCURRENCY_<tier> is set now. The servers are the fake server behind `forge serve --vllm`; the
client replays results recorded by vLLM's real client (tests/data/runs/)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, SUPPORT, forge, forge_env, free_port, tier_files, tiny_model  # noqa: E402

REPLAY = f"{sys.executable} {SUPPORT / 'replayclient.py'}"
FAKE = f"{sys.executable} {SUPPORT / 'fakeserver.py'}"
TIERS = ("4-8K", "8-16K", "16-32K")
ROUND_VARS = ("ROUND", "TIER", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
              "TENSOR_PARALLEL_SIZE", "DATA_PARALLEL_SIZE", "MAX_NUM_SEQS", "MAX_NUM_BATCHED_TOKENS",
              "GPU_MEMORY_UTILIZATION", "CONCURRENCY_4_8K", "CONCURRENCY_8_16K", "CONCURRENCY_16_32K")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def data_dir(tmp_path):
    """Official-format tier files with more lines than the finals send."""
    return tier_files(tmp_path / "data")


def env_of(tmp_path, **extra):
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "replay.log"))
    for k in list(env):
        if k in ROUND_VARS or any(k.startswith(v + "_") for v in ROUND_VARS[5:10]):
            env.pop(k)
    env.update({"HIP_VISIBLE_DEVICES": "0,1", **extra})
    return env


def serve(tmp_path, model, env, *args):
    r = forge(tmp_path, "serve", "--model", str(model), "--vllm", FAKE, "--port", str(free_port()),
              "--run-id", "r1", "--timeout", "30", *args, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


def bench(tmp_path, model, data_dir, env, *args):
    return forge(tmp_path, "bench-all-tiers", "--client", REPLAY, "--data-dir", str(data_dir), *args, env=env)


def calls(tmp_path):
    log = tmp_path / "replay.log"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []


def test_a_final_round_server_is_measured_on_its_own_tier(tmp_path, model, data_dir):
    env = env_of(tmp_path)
    serve(tmp_path, model, env, "--round", "final", "--tier", "8-16K", "--profile", "final-tp2")
    try:
        r = bench(tmp_path, model, data_dir, env, "--round", "final")          # make bench-all-tiers ROUND=final
        assert r.returncode == 0, r.stderr[-2000:]
        assert [c["tier"] for c in calls(tmp_path)] == ["8-16K"]
        assert "started for tier 8-16K" in r.stderr
        m = json.loads((tmp_path / "runs" / "r1" / "manifest.json").read_text())
        assert sorted(m["client_settings"]["tiers"]) == ["8-16K"] and sorted(m["tiers"]) == ["8-16K"]
        # another tier against this server is refused, before anything is written
        before = (tmp_path / "runs" / "r1" / "manifest.json").read_text()
        r = bench(tmp_path, model, data_dir, env, "--round", "final", "--tiers", "4-8K,8-16K")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "tier(s) 4-8K: the server answering now was started for tier 8-16K" in r.stderr
        assert "--tiers 8-16K" in r.stderr
        assert (tmp_path / "runs" / "r1" / "manifest.json").read_text() == before
        assert len(calls(tmp_path)) == 1
    finally:
        forge(tmp_path, "stop", env=env)


@pytest.mark.parametrize("served,client,fix", [
    ((), ("--round", "final"), "make serve ROUND=final TIER="),
    (("--round", "final", "--tier", "4-8K"), (), "add --round final"),
])
def test_the_clients_round_must_be_the_servers(tmp_path, model, data_dir, served, client, fix):
    env = env_of(tmp_path)
    serve(tmp_path, model, env, "--profile", "final-tp2" if served else "contest", *served)
    try:
        r = bench(tmp_path, model, data_dir, env, *client)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        was, now = ("final", "preliminary") if served else ("preliminary", "final")
        assert f"the server answering now was started for the {was} round; the {now} round's client" in r.stderr
        assert fix in r.stderr
        assert calls(tmp_path) == [] and not (tmp_path / "runs" / "r1" / "manifest.json").exists()
    finally:
        forge(tmp_path, "stop", env=env)


@pytest.mark.parametrize("how", ["profile", "environment at the start"])
def test_the_tiers_concurrency_is_the_one_its_start_resolved(tmp_path, model, data_dir, how):
    env = env_of(tmp_path)
    if how == "profile":
        prof = tmp_path / "c6.yaml"
        prof.write_text("round: final\ndescription: x\nextends: final-tp2\nenv:\n  CONCURRENCY_16_32K:\n"
                        "    value: '6'\n    effect: e\n")
        serve(tmp_path, model, env, "--round", "final", "--tier", "16-32K", "--profile", str(prof))
    else:
        serve(tmp_path, model, {**env, "CONCURRENCY_16_32K": "6"}, "--round", "final", "--tier", "16-32K",
              "--profile", "final-tp2")
    try:
        r = bench(tmp_path, model, data_dir, env, "--round", "final")
        assert r.returncode == 0, r.stderr[-2000:]
        argv = calls(tmp_path)[0]["argv"]
        assert argv[argv.index("--max-concurrency") + 1] == "6"
        cs = json.loads((tmp_path / "runs" / "r1" / "manifest.json").read_text())["client_settings"]["tiers"]
        assert cs["16-32K"]["max_concurrency"] == 6 and "the server's start" in cs["16-32K"]["concurrency_from"]
        # the variable set now is the client's, as the finals' client reads it
        r = bench(tmp_path, model, data_dir, {**env, "CONCURRENCY_16_32K": "7"}, "--round", "final",
                  "--run-id", "r2")
        assert r.returncode == 0, r.stderr[-2000:]
        argv = calls(tmp_path)[1]["argv"]
        assert argv[argv.index("--max-concurrency") + 1] == "7"
    finally:
        forge(tmp_path, "stop", env=env)


@pytest.mark.parametrize("tiers", [(), ("--tiers", "4-8K")], ids=["the-servers-tier", "--tiers"])
def test_only_the_tiers_the_run_measures_read_their_concurrency_variable(tmp_path, model, data_dir, tiers):
    """CONCURRENCY_<tier> of a tier the run does not measure is not read (before, a run against a final-round
    server of tier 4-8K, without --tiers, planned every tier first and refused an out-of-bounds
    CONCURRENCY_16_32K that it would never use); the variable of the tier it runs is still checked, citing
    the rule and naming the variable, before anything is written or run."""
    env = env_of(tmp_path)
    serve(tmp_path, model, env, "--round", "final", "--tier", "4-8K", "--profile", "final-tp2")
    try:
        r = bench(tmp_path, model, data_dir, {**env, "CONCURRENCY_16_32K": "0", "CONCURRENCY_8_16K": "ten"},
                  "--round", "final", *tiers)
        assert r.returncode == 0, r.stderr[-2000:]
        assert [c["tier"] for c in calls(tmp_path)] == ["4-8K"]
        cs = json.loads((tmp_path / "runs" / "r1" / "manifest.json").read_text())["client_settings"]["tiers"]
        assert sorted(cs) == ["4-8K"]
        before = (tmp_path / "runs" / "r1" / "manifest.json").read_text()
        r = bench(tmp_path, model, data_dir, {**env, "CONCURRENCY_4_8K": "0", "CONCURRENCY_16_32K": "0"},
                  "--round", "final", "--run-id", "r2", *tiers)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "CONCURRENCY_4_8K='0' (environment), tier 4-8K: concurrency 0 is out of bounds" in r.stderr
        assert "rule 'final_unlocked'" in r.stderr and "tier 16-32K" not in r.stderr
        assert not (tmp_path / "runs" / "r2").exists() and len(calls(tmp_path)) == 1
        assert (tmp_path / "runs" / "r1" / "manifest.json").read_text() == before
    finally:
        forge(tmp_path, "stop", env=env)


def test_a_run_measured_over_per_tier_starts_keeps_each_tiers_server_record(tmp_path, model, data_dir):
    """The final round serves each tier from its own start (its own settings): the run's manifest keeps each
    tier's server record (before, only one, whichever bench ran last, so a tier served on another topology or
    capacity was recorded as the other tier's)."""
    env = env_of(tmp_path)
    for tier, extra in (("8-16K", {}), ("4-8K", {"MAX_NUM_SEQS_4_8K": "32"})):
        serve(tmp_path, model, {**env, **extra}, "--round", "final", "--tier", tier, "--profile", "final-tp2")
        try:
            r = bench(tmp_path, model, data_dir, env, "--round", "final")
            assert r.returncode == 0, r.stderr[-2000:]
        finally:
            forge(tmp_path, "stop", env=env)
    m = json.loads((tmp_path / "runs" / "r1" / "manifest.json").read_text())
    by = m["servers_by_tier"]
    assert sorted(by) == ["4-8K", "8-16K"] and sorted(m["tiers"]) == ["4-8K", "8-16K"]
    assert by["4-8K"]["settings"]["max_num_seqs"] == 32 and by["8-16K"]["settings"]["max_num_seqs"] == 128
    assert by["4-8K"]["tier"] == "4-8K" and by["8-16K"]["tier"] == "8-16K"


def test_a_damaged_record_of_the_tiers_servers_is_refused_by_name(tmp_path, model, data_dir):
    env = env_of(tmp_path)
    serve(tmp_path, model, env, "--round", "final", "--tier", "8-16K", "--profile", "final-tp2")
    try:
        m = tmp_path / "runs" / "r1" / "manifest.json"
        m.write_text(json.dumps({"run_id": "r1", "round": "final", "servers_by_tier": ["8-16K"]}))
        r = bench(tmp_path, model, data_dir, env, "--round", "final")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "key 'servers_by_tier'" in r.stderr and "manifest.json" in r.stderr, r.stderr
    finally:
        forge(tmp_path, "stop", env=env)


def _make_n(*args):
    r = subprocess.run(["make", "-n", *args], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if k not in ("PROFILE", "MAKEFLAGS",
                                                                                        "MAKELEVEL", "MFLAGS")})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_bench_labels_the_run_only_with_a_profile_the_user_gave():
    """`make bench-all-tiers` records the running server's profile; it passes --profile only where PROFILE is
    given (it passed the default `contest` always, so a final-tp2 server warned on every run)."""
    assert "--profile" not in _make_n("bench-all-tiers", "ROUND=final")
    assert "--profile final-tp2" in _make_n("bench-all-tiers", "PROFILE=final-tp2")


def test_make_sweep_passes_the_baseline_profile():
    assert "--baseline-profile upstream" in _make_n("sweep", "ROUND=final", "BASELINE_PROFILE=upstream")
