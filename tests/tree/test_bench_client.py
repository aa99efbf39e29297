"""forge bench-all-tiers with vLLM's real `vllm bench serve` client (from the rehearsal venv) against
the fake OpenAI server on 127.0.0.1: a run interrupted mid-way resumes without redoing finished
tiers, and a server that dies mid-tier becomes failed requests that the score counts."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from helpers import args_with, fake_server, forge_env, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def client(vllm_python):
    r = subprocess.run([str(vllm_python), "-c", "import pandas, vllm.benchmarks.serve"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("the rehearsal venv cannot run `vllm bench serve` with a custom dataset "
                    "(vLLM's bench extra, e.g. pandas, is missing): " + r.stderr.strip().splitlines()[-1])
    return f"{vllm_python} -m vllm.entrypoints.cli.main"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def bench(tmp_path, port, model, client, *extra, wait=True):
    cmd = [sys.executable, "-m", "forge", *args_with(["bench-all-tiers", "--port", str(port), "--model", str(model),
                                                      "--num-prompts", "2", "--client", client, "--progress-every",
                                                      "5"], extra)]
    env = forge_env(tmp_path)
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def test_real_client_run_interrupted_and_resumed(tmp_path, model, client):
    run = tmp_path / "runs" / "real"
    with fake_server(model, FAKE_OUTPUT_TOKENS="16", FAKE_TOKEN_MS="1") as (port, _):
        p = bench(tmp_path, port, model, client, "--run-id", "real", wait=False)
        for _ in range(1800):  # bounded: 180 s
            m = run / "manifest.json"
            if (run / "4-8K.json").exists() and m.exists() and \
                    json.loads(m.read_text()).get("client_running", {}).get("tier") == "8-16K":
                break
            if p.poll() is not None:
                break
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()[1]
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err
        first = (run / "4-8K.json").read_bytes()
        assert not (run / "8-16K.json").exists()
        r = bench(tmp_path, port, model, client, "--run-id", "real")
        assert r.returncode == 0, r.stderr
    assert "4-8K (1/3): already done" in r.stderr
    assert (run / "4-8K.json").read_bytes() == first
    for t in ("4-8K", "8-16K", "16-32K"):
        res = json.loads((run / f"{t}.json").read_text())
        assert res["backend"] == "openai-chat" and res["completed"] == 2 and res["failed"] == 0
        assert res["max_concurrency"] == 1 and res["request_rate"] == 1.0
        ds = json.loads((run / "manifest.json").read_text())["datasets"][t]
        # the contest workload's pairs: vLLM's client counts exactly input_len prompt tokens, and asks
        # for each line's own output length (the fake server stops at 16)
        assert res["input_lens"] == [i for i, _ in ds["requests"]]
        assert res["output_lens"] == [min(o, 16) for _, o in ds["requests"]]
        assert "p99_ttft_ms" in res and "p99_tpot_ms" in res
        lo, hi = {"4-8K": (4096, 8192), "8-16K": (8192, 16384), "16-32K": (16384, 31744)}[t]
        # vLLM's client counted the chat-templated prompt; ours is the raw prompt plus the template
        assert all(lo <= n <= hi for n in ds["prompt_tokens"])
        assert all(n >= lo for n in res["input_lens"])
    s = subprocess.run([sys.executable, "-m", "forge", "score", "--run", str(run)], cwd=ROOT, env=forge_env(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert s.returncode == 0, s.stderr
    assert json.loads((run / "score.json").read_text())["tiers"]["8-16K"]["completion"] == 1.0


def test_server_dying_mid_tier_becomes_failed_requests(tmp_path, model, client):
    run = tmp_path / "runs" / "died"
    # 4 prompts: the ready check, 2 warm-ups and request 1 succeed; the server exits inside request 2
    with fake_server(model, FAKE_OUTPUT_TOKENS="16", FAKE_DIE_AFTER="5") as (port, srv):
        r = bench(tmp_path, port, model, client, "--run-id", "died", "--tiers", "4-8K,8-16K", "--num-prompts", "4")
        assert srv.wait(timeout=30) == 3
    assert r.returncode == 1, r.stderr           # tiers with failed requests: named, exit 1
    assert "tier(s) have failed requests" in r.stderr and "4-8K:" in r.stderr
    t1 = json.loads((run / "4-8K.json").read_text())
    assert t1["failed"] >= 1 and t1["completed"] + t1["failed"] == 4
    assert "forge_synthesized" not in t1                    # vLLM's client recorded the failures itself
    assert any(e for e in t1["errors"])
    t2 = json.loads((run / "8-16K.json").read_text())
    assert t2["completed"] == 0 and t2["failed"] == 4 and t2["forge_synthesized"]
