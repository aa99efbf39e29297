"""forge bench-all-tiers: the client command, synthetic tier data, resume after a kill, and a server
that is gone becoming failed requests. The client here replays results recorded by vLLM's real
client (tests/data/runs/); tests/tree/test_bench_client.py runs the real client."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, ROOT, SUPPORT, args_with, fake_server, forge, forge_env, tiny_model  # noqa: E402

from forge.contest import rules as contest  # noqa: E402
from forge.run import bench, synth  # noqa: E402

REPLAY = f"{sys.executable} {SUPPORT / 'replayclient.py'}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def test_client_args_are_the_contest_options(tmp_path):
    c = contest.load_contest()
    args = bench.client_args(c, dataset=Path("/d/8-16K.jsonl"), num_prompts=7, model="/m", host="127.0.0.1",
                             port=8001, result_dir=tmp_path, result_name="8-16K.client.json")
    text = " ".join(args)
    assert args[:2] == ["bench", "serve"]
    for piece in ("--backend openai-chat", "--endpoint /v1/chat/completions", "--dataset-name custom",
                  "--max-concurrency 1", "--request-rate 1", "--temperature 0", "--disable-shuffle",
                  "--custom-output-len 1024", "--num-warmups 2", "--save-detailed",
                  "--percentile-metrics ttft,tpot,itl,e2el", "--metric-percentiles 50,95,99", "--save-result",
                  "--dataset-path /d/8-16K.jsonl", "--num-prompts 7", "--served-model-name Qwen3.5-27B"):
        assert piece in text


def test_synthetic_prompts_fall_in_the_tier_range(tmp_path, model):
    c = contest.load_contest()
    tok = synth.Tok(model)
    for t in c["tiers"]:
        out = tmp_path / f"{t['name']}.jsonl"
        info = synth.build_tier(model, t, 3, out)
        lines = [json.loads(l) for l in out.read_text().splitlines()]
        assert len(lines) == 3
        lo, hi = t["prompt_tokens"]
        for rec, n in zip(lines, info["prompt_tokens"]):
            assert lo <= len(tok.encode(rec["prompt"])) == n <= hi
        again = tmp_path / "again.jsonl"
        synth.build_tier(model, t, 3, again)
        assert again.read_bytes() == out.read_bytes()          # deterministic


def _run_bench(tmp_path, port, model, *extra, env=None, wait=True):
    cmd = [sys.executable, "-m", "forge", *args_with(["bench-all-tiers", "--port", str(port), "--model", str(model),
                                                      "--num-prompts", "2", "--client", REPLAY, "--run-id", "r1",
                                                      "--profile", "test"], extra)]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_interrupted_run_resumes_without_redoing_finished_tiers(tmp_path, model):
    log = tmp_path / "replay.log"
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(log), REPLAY_HANG_TIER="8-16K")
    run = tmp_path / "runs" / "r1"
    with fake_server(model) as (port, _):
        p = _run_bench(tmp_path, port, model, env=env, wait=False)
        for _ in range(300):  # bounded: 30 s
            m = run / "manifest.json"
            if m.exists() and json.loads(m.read_text()).get("client_running", {}).get("tier") == "8-16K" \
                    and log.exists() and "8-16K" in log.read_text():   # the client is hanging in tier 2
                break
            time.sleep(0.1)
        client = json.loads((run / "manifest.json").read_text())["client_running"]
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err
        assert "finished stages are kept" in err
        assert (run / "4-8K.json").is_file() and not (run / "8-16K.json").exists()
        with pytest.raises(ProcessLookupError):   # the client was stopped with us
            for _ in range(50):
                os.kill(client["pid"], 0)
                time.sleep(0.1)
        first = (run / "4-8K.json").read_bytes()
        mtime = (run / "4-8K.json").stat().st_mtime_ns
        env.pop("REPLAY_HANG_TIER")
        r = _run_bench(tmp_path, port, model, env=env)
        assert r.returncode == 0, r.stderr
    assert "tier 4-8K (1/3): already done" in r.stderr
    calls = [json.loads(l)["tier"] for l in log.read_text().splitlines()]
    assert calls == ["4-8K", "8-16K", "8-16K", "16-32K"]
    assert (run / "4-8K.json").read_bytes() == first and (run / "4-8K.json").stat().st_mtime_ns == mtime
    man = json.loads((run / "manifest.json").read_text())
    assert set(man["tiers"]) == {"4-8K", "8-16K", "16-32K"} and "client_running" not in man
    for name, ds in man["datasets"].items():
        assert ds["kind"] == "synthetic"
        assert ds["sha256"] == hashlib.sha256(Path(ds["path"]).read_bytes()).hexdigest()
    assert man["git"]["commit"] and man["profile"] == "test" and man["scored_port"] is False


def test_no_server_is_an_error_naming_the_cause_and_leaves_no_run_folder(tmp_path, model):
    log = tmp_path / "replay.log"
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(log))
    with fake_server(model) as (port, srv):
        pass  # started and stopped: nothing listens on `port` any more
    r = _run_bench(tmp_path, port, model, env=env)
    assert r.returncode == 2, r.stderr
    assert f"no server answers http://127.0.0.1:{port}/health" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs" / "r1").exists()      # no empty run folder
    assert not log.exists()                              # no client was started against a dead server


def test_server_gone_mid_run_exits_1_and_failed_tiers_run_again_on_resume(tmp_path, model):
    log = tmp_path / "replay.log"
    run = tmp_path / "runs" / "r1"
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(log),
                    REPLAY_HANG_TIER="4-8K", REPLAY_HANG_S="3")
    with fake_server(model) as (port, srv):
        p = _run_bench(tmp_path, port, model, env=env, wait=False)
        for _ in range(300):   # bounded: 30 s; the client is in tier 1
            if log.exists() and "4-8K" in log.read_text():
                break
            time.sleep(0.1)
        srv.terminate()
        srv.wait(timeout=10)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert "2 of 3 tier(s) have failed requests" in err and "8-16K: the server stopped answering" in err
    assert "--run-id r1" in err and "Traceback" not in err
    for t in ("8-16K", "16-32K"):
        res = json.loads((run / f"{t}.json").read_text())
        assert res["completed"] == 0 and res["failed"] == 2
    first = (run / "4-8K.json").read_bytes()
    env.pop("REPLAY_HANG_TIER")
    with fake_server(model, port=port):
        r = _run_bench(tmp_path, port, model, env=env)
    assert r.returncode == 0, r.stderr
    assert "tier 4-8K (1/3): already done" in r.stderr
    assert (run / "4-8K.json").read_bytes() == first
    for t in ("8-16K", "16-32K"):                       # measured now; the failed results set aside
        res = json.loads((run / f"{t}.json").read_text())
        assert res["completed"] > 0 and res["failed"] == 0
        assert json.loads((run / "failed" / f"{t}.1.json").read_text())["failed"] == 2
    calls = [json.loads(l)["tier"] for l in log.read_text().splitlines()]
    assert calls == ["4-8K", "8-16K", "16-32K"]
    s = forge(tmp_path, "score", "--run", str(run))
    assert s.returncode == 0 and "ZERO" not in s.stdout


def test_keep_failed_keeps_a_failed_tier_on_resume(tmp_path, model):
    c = contest.load_contest()
    log = tmp_path / "replay.log"
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    failed = bench.failed_result(c, "8-16K", 2, "server not reachable")
    (run / "8-16K.json").write_text(json.dumps(failed))
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(log))
    with fake_server(model) as (port, _):
        r = _run_bench(tmp_path, port, model, "--tiers", "8-16K", "--keep-failed", env=env)
        assert r.returncode == 0, r.stderr
        assert "kept with its 2 failed request(s) (--keep-failed)" in r.stderr and not log.exists()
        r = _run_bench(tmp_path, port, model, "--tiers", "8-16K", env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads((run / "8-16K.json").read_text())
    assert res["completed"] > 0 and res["failed"] == 0
    assert json.loads((run / "failed" / "8-16K.1.json").read_text()) == failed


def test_model_without_tokenizer_names_the_missing_file(tmp_path, model):
    bare = tmp_path / "bare-model"
    bare.mkdir()
    (bare / "config.json").write_text((model / "config.json").read_text())
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "l"))
    with fake_server(model) as (port, _):
        r = _run_bench(tmp_path, port, bare, env=env)
    assert r.returncode == 2
    assert "tokenizer.json is missing" in r.stderr and "is installed" not in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs" / "r1").exists()      # no empty run folder


def test_client_failure_with_server_up_is_an_error_and_keeps_nothing_half_done(tmp_path, model):
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "l"), REPLAY_FAIL="1")
    with fake_server(model) as (port, _):
        r = _run_bench(tmp_path, port, model, "--tiers", "4-8K", env=env)
    assert r.returncode == 2
    assert "vllm bench serve failed" in r.stderr and "replay: failing as told" in r.stderr
    assert "--run-id r1" in r.stderr and not (tmp_path / "runs" / "r1" / "4-8K.json").exists()


def test_official_data_dir_is_used_and_hashed(tmp_path, model):
    data = tmp_path / "data"
    data.mkdir()
    for f in ("4-8K_throughput.jsonl", "8-16K_throughput.jsonl", "16-32K_throughput.jsonl"):
        (data / f).write_text("".join(json.dumps({"prompt": f"w{i} w2 w3"}) + "\n" for i in range(5)))
    log = tmp_path / "replay.log"
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(log), DATA_DIR=str(data))
    with fake_server(model) as (port, _):
        cmd = [sys.executable, "-m", "forge", "bench-all-tiers", "--port", str(port), "--model", str(model),
               "--client", REPLAY, "--run-id", "off"]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = [json.loads(l)["argv"] for l in log.read_text().splitlines()]
    assert [a[a.index("--dataset-path") + 1] for a in calls] == [str(data / f) for f in
                                                                  ("4-8K_throughput.jsonl", "8-16K_throughput.jsonl",
                                                                   "16-32K_throughput.jsonl")]
    assert all(a[a.index("--num-prompts") + 1] == "5" for a in calls)   # every prompt of the file
    man = json.loads((tmp_path / "runs" / "off" / "manifest.json").read_text())
    assert man["datasets"]["8-16K"]["kind"] == "official"
    (data / "16-32K_throughput.jsonl").unlink()
    with fake_server(model, port=port):
        r = subprocess.run(cmd[:-2] + ["--run-id", "off2"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 2 and "16-32K_throughput.jsonl is missing" in r.stderr
    assert not (tmp_path / "runs" / "off2").exists()      # no empty run folder


def test_resume_under_another_profile_is_refused_and_changes_nothing(tmp_path, model):
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "l"))
    run = tmp_path / "runs" / "r1"
    with fake_server(model) as (port, _):
        r = _run_bench(tmp_path, port, model, "--tiers", "4-8K", env=env)
        assert r.returncode == 0, r.stderr
        before = (run / "manifest.json").read_bytes()
        r = _run_bench(tmp_path, port, model, "--tiers", "8-16K", "--profile", "other", env=env)
        assert r.returncode == 2, r.stderr
        assert "run r1 was measured with profile test (tier(s) 4-8K)" in r.stderr and "profile other" in r.stderr
        assert "new run" in r.stderr and "Traceback" not in r.stderr
        assert (run / "manifest.json").read_bytes() == before and not (run / "8-16K.json").exists()
        r = _run_bench(tmp_path, port, model, "--tiers", "8-16K", env=env)   # the same profile resumes
    assert r.returncode == 0, r.stderr
    man = json.loads((run / "manifest.json").read_text())
    assert man["profile"] == "test" and set(man["tiers"]) == {"4-8K", "8-16K"}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_refused_dataset_change_writes_nothing_and_a_changed_file_is_caught(tmp_path, model):
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "l"))
    run = tmp_path / "runs" / "r1"
    ds = run / "datasets" / "4-8K.jsonl"
    with fake_server(model) as (port, _):
        r = _run_bench(tmp_path, port, model, "--tiers", "4-8K", env=env)
        assert r.returncode == 0, r.stderr
        data, manifest = ds.read_bytes(), (run / "manifest.json").read_bytes()
        r = _run_bench(tmp_path, port, model, "--tiers", "4-8K", "--num-prompts", "3", env=env)
        assert r.returncode == 2 and "tier 4-8K: the dataset differs" in r.stderr, r.stderr
        assert ds.read_bytes() == data and (run / "manifest.json").read_bytes() == manifest
        assert sorted(p.name for p in ds.parent.iterdir()) == ["4-8K.jsonl"]   # no half-built file left
        # a dataset file changed since the tier was measured: built again from its record, not re-hashed
        ds.write_bytes(data + b'{"prompt": "x", "output_tokens": 1}\n')
        r = _run_bench(tmp_path, port, model, "--tiers", "4-8K", env=env)
    assert r.returncode == 0, r.stderr
    assert "already done in run r1; kept" in r.stderr
    rec = json.loads((run / "manifest.json").read_text())["datasets"]["4-8K"]
    assert ds.read_bytes() == data and rec["sha256"] == _sha(ds) and rec["num_prompts"] == 2


def test_client_failure_before_any_tier_keeps_the_log_it_points_at(tmp_path, model):
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "l"), REPLAY_FAIL="1")
    run = tmp_path / "runs" / "r1"
    with fake_server(model) as (port, _):
        r = _run_bench(tmp_path, port, model, "--tiers", "4-8K", env=env)
        assert r.returncode == 2, r.stderr
        assert "--- last lines of" in r.stderr and "4-8K.client.log ---" in r.stderr
        assert "replay: failing as told" in (run / "4-8K.client.log").read_text()
        data = (run / "datasets" / "4-8K.jsonl").read_bytes()
        env.pop("REPLAY_FAIL")
        r = _run_bench(tmp_path, port, model, "--tiers", "4-8K", env=env)   # the rerun the error asks for
    assert r.returncode == 0, r.stderr
    assert "synthetic dataset 4-8K" not in r.stderr            # the kept dataset is used
    assert (run / "datasets" / "4-8K.jsonl").read_bytes() == data and (run / "4-8K.json").is_file()


def test_interrupt_in_the_dataset_step_keeps_the_built_datasets(tmp_path, model, monkeypatch):
    monkeypatch.setenv("FORGE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("REPLAY_FROM", str(FIXTURE_RUNS / "base"))
    monkeypatch.setenv("REPLAY_LOG", str(tmp_path / "l"))
    real, built = synth.build_workload_tier, []

    def build(model_dir, tier, pairs, out, **kw):
        if tier == "8-16K" and "-" not in built:
            raise KeyboardInterrupt          # Ctrl-C while the second tier's prompts are built
        built.append(tier)
        return real(model_dir, tier, pairs, out, **kw)

    monkeypatch.setattr(synth, "build_workload_tier", build)
    run = tmp_path / "runs" / "r1"
    kw = dict(profile="test", run_id="r1", model=str(model), num_prompts=2, client=REPLAY)
    with fake_server(model) as (port, _):
        with pytest.raises(KeyboardInterrupt):
            bench.run_tiers(port=port, **kw)
        assert built == ["4-8K"]
        ds = run / "datasets" / "4-8K.jsonl"
        rec = json.loads((run / "manifest.json").read_text())["datasets"]
        assert set(rec) == {"4-8K"} and rec["4-8K"]["sha256"] == _sha(ds)
        assert sorted(p.name for p in ds.parent.iterdir()) == ["4-8K.jsonl"]
        built.append("-")
        bench.run_tiers(port=port, **kw)
    assert built == ["4-8K", "-", "8-16K", "16-32K"]            # the kept one is not built again
    assert all((run / f"{t}.json").is_file() for t in ("4-8K", "8-16K", "16-32K"))
