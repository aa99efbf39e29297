"""forge sweep --round final --harness --kv-cache-memory-bytes dcu: each served configuration (and the
baseline) gets the KV cache a DCU card holds per rank for its own topology, KV dtype and utilization,
checked against the public DCU figures (28,224 tokens at TP1 / 0.95, 268,128 at TP2), not against the
planner's own output; a configuration whose card holds no cache is refused before anything is written.
The fake server (tests/support/fakeserver.py) stands in for vLLM, as in test_final_sweep.py."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import SUPPORT, forge, free_port, probe_bundle, tiny_model  # noqa: E402

from forge.errors import ForgeError  # noqa: E402
from forge.run import final_harness, gpu_harness  # noqa: E402

FAKE = f"{sys.executable} {SUPPORT / 'fakeserver.py'}"
BENCH = f"{sys.executable} {SUPPORT / 'benchclient.py'}"
TP1_BF16_PAGE = 3_211_264         # one block's page of Qwen3.5-27B at TP1, bf16 (vLLM's unified page, 784 tokens)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def _sweep(tmp_path, model, *extra, top="1", baseline=True):
    return forge(tmp_path, "sweep", "--round", "final", "--tiers", "4-8K", "--model", str(model), "--vllm", FAKE,
                 "--client", BENCH, "--port", str(free_port()), "--num-prompts", "2", "--timeout", "30",
                 "--top", top, "--tier-env", str(tmp_path / "tier-env.json"),
                 *(["--baseline-profile", "upstream"] if baseline else []),
                 "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--concurrency", "8", *extra,
                 timeout=300, **{"CUDA_VISIBLE_DEVICES": "0,1", "FAKE_TTFT_MS": "400", "FAKE_TOKEN_MS": "8"})


def _site(tmp_path) -> Path:
    site = tmp_path / "site"
    r = forge(tmp_path, "e2e-gpu", "--install-only", "--bundle", str(probe_bundle(tmp_path)), "--site", str(site))
    assert r.returncode == 0, r.stderr[-3000:]
    return site


def _kv_change(run: Path) -> dict:
    srv = json.loads((run / "serve.json").read_text())
    (ch,) = [d for d in srv["differences"] if d["args"][0] == "--kv-cache-memory-bytes"]
    i = srv["harness_args"].index("--kv-cache-memory-bytes")
    assert srv["harness_args"][i + 1] == ch["args"][1]
    assert repr(ch["args"][1]) in (run / "server.log").read_text()      # the server received it
    return ch


def _tokens(nbytes: int, page: int) -> int:
    """What vLLM reports for a cache of `nbytes`: blocks of 16 tensors of `page` bytes, 4 groups, 784 tokens."""
    return nbytes // (16 * page) // 4 * 784


def test_each_configuration_and_the_baseline_get_their_own_dcu_cache(tmp_path, model):
    r = _sweep(tmp_path, model, "--harness", "--site", str(_site(tmp_path)), "--kv-cache-memory-bytes", "dcu",
               "--topologies", "tp2,dp2", "--kv-dtypes", "bf16", "--gpu-memory-utilization", "0.95", top="2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "the same KV cache per GPU" not in r.stderr             # each its own: nothing to warn of
    runs = {d.name.rsplit("-4-8K-", 1)[1]: d for d in (tmp_path / "runs").iterdir()}
    assert sorted(runs) == ["baseline", "tp1dp2-bf16-s64-b4096-u0.95-c8", "tp2dp1-bf16-s64-b4096-u0.95-c8"]
    dp2 = _kv_change(runs["tp1dp2-bf16-s64-b4096-u0.95-c8"])
    tp2 = _kv_change(runs["tp2dp1-bf16-s64-b4096-u0.95-c8"])
    base = _kv_change(runs["baseline"])
    # a DP2 replica is a TP1 server on a card of its own: the public 28,224 tokens at TP1 / 0.95, exactly
    assert _tokens(int(dp2["args"][1]), TP1_BF16_PAGE) == 28_224
    assert "TP1/DP2 bf16" in dp2["why"] and "28,224 tokens" in dp2["why"]
    # TP2 halves the KV heads and the GDN heads per rank (half the page): the public 268,128 within 3 %
    got = _tokens(int(tp2["args"][1]), TP1_BF16_PAGE // 2)
    assert abs(got - 268_128) / 268_128 < 0.03 and "TP2/DP1 bf16" in tp2["why"]
    assert base == tp2                                              # the finals' baseline is TP2, 0.95, bf16
    st = json.loads(next((tmp_path / "sweeps").iterdir()).joinpath("sweep.json").read_text())
    assert st["harness_kv_cache"] == "dcu" and st["harness_kv_why"] is None
    assert "--kv-cache-memory-bytes" not in st["harness_server_args"]      # per configuration, not the sweep's
    # resumed as a sweep sized by the GPU's own memory, its remaining configurations would get many times a
    # DCU card's cache and be scored against the DCU-sized baseline: refused (it was accepted)
    sid = next((tmp_path / "sweeps").iterdir()).name
    r = _sweep(tmp_path, model, "--harness", "--site", str(tmp_path / "site"), "--sweep-id", sid,
               "--topologies", "tp2,dp2", "--kv-dtypes", "bf16", "--gpu-memory-utilization", "0.95", "--force")
    assert r.returncode == 2 and f"sweep {sid} was started with other" in r.stderr, r.stderr[-2000:]
    assert "harness_kv_cache" in r.stderr
    assert st["harness_kv_baseline_bytes"] == int(base["args"][1])       # a planner change is not resumed silently
    # a baseline run given (--baseline RUN) is taken only when it was served with the baseline's DCU cache
    kw = ["--harness", "--site", str(tmp_path / "site"), "--kv-cache-memory-bytes", "dcu", "--topologies", "dp2",
          "--kv-dtypes", "bf16", "--gpu-memory-utilization", "0.95", "--force"]
    before = sorted(p.name for p in (tmp_path / "runs").iterdir())
    r = _sweep(tmp_path, model, *kw, "--baseline", str(runs["tp1dp2-bf16-s64-b4096-u0.95-c8"]), baseline=False)
    assert r.returncode == 2 and f"--kv-cache-memory-bytes {dp2['args'][1]}" in r.stderr, r.stderr[-2000:]
    assert f"the finals' baseline's {tp2['args'][1]} bytes" in r.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == before
    r = _sweep(tmp_path, model, *kw, "--baseline", str(runs["baseline"]), baseline=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_a_reason_given_is_recorded_for_every_configuration():
    hs = final_harness.DcuSized([{"args": ["--x"], "why": "y"}], {"PYTHONPATH": "/s"}, why="the cards of team A")
    v = {"tensor_parallel_size": 1, "data_parallel_size": 2, "gpu_memory_utilization": 0.95,
         "max_num_batched_tokens": 4096}
    out = final_harness.for_config(hs, v, "int8")
    assert out.changes[0] == {"args": ["--x"], "why": "y"} and out.process_env == {"PYTHONPATH": "/s"}
    assert out.changes[1]["why"] == "the cards of team A"
    bf16 = final_harness.for_config(hs, v, "bf16").changes[1]["args"][1]
    assert _tokens(int(bf16), TP1_BF16_PAGE) == 28_224 and out.changes[1]["args"][1] != bf16
    assert hs.changes == [{"args": ["--x"], "why": "y"}]             # the sweep's own servers are unchanged
    fixed = gpu_harness.Servers([{"args": ["--kv-cache-memory-bytes", "1"], "why": "z"}])
    assert final_harness.for_config(fixed, v, "bf16") is fixed and final_harness.for_config(None, v, "bf16") is None


@pytest.mark.parametrize("args,needle", [
    (["--topologies", "dp2", "--gpu-memory-utilization", "0.8"],
     "a DCU card holds no KV cache (under 256 MiB) beside the weights at TP1/DP2 bf16 at --gpu-memory-utilization 0.8"),
    (["--kv-cache-memory-bytes", "dcu2"], "neither a whole number of bytes nor 'dcu'"),
])
def test_a_dcu_sized_sweep_refuses_before_anything_is_written(tmp_path, model, args, needle):
    kv = [] if "--kv-cache-memory-bytes" in args else ["--kv-cache-memory-bytes", "DCU"]
    space = [] if "--topologies" in args else ["--topologies", "tp2", "--gpu-memory-utilization", "0.95"]
    r = _sweep(tmp_path, model, "--harness", "--site", str(tmp_path), *kv, "--kv-dtypes", "bf16", *space, *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "sweeps").exists()


def test_the_size_option_reads_bytes_or_dcu():
    assert final_harness.kv_size(" Dcu ") == "dcu" and final_harness.kv_size("7501512704") == 7_501_512_704
    assert final_harness.kv_size(" 7501512704 ") == 7_501_512_704          # was called "too large"
    with pytest.raises(Exception, match="too large a number of bytes"):
        final_harness.kv_size("9" * 31)
    for bad in ("7.5e9", "", "0x10", "dcu card"):
        with pytest.raises(Exception, match="neither a whole number"):
            final_harness.kv_size(bad)
    with pytest.raises(ForgeError, match="--kv-cache-memory-bytes: the options of a harness sweep"):
        final_harness.servers(False, kv_cache_memory_bytes="dcu")
