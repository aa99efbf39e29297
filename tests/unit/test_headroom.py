"""The memory a utilization leaves outside vLLM's budget (scripts/forge/model/headroom.py), held to what the
GPU machine's servers logged, and its use by the finals' model, predict --round final and plan.

The logs: every one-server-at-a-time run on the GPU machine recorded under reports/e2e (the H100 runs of the
final round), each a vLLM 0.18.1 server under the default compilation config; each logs its max-num-seqs and
batched tokens, the largest captured batch it chose, and what the graph pool took."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from forge.errors import ForgeError
from forge.model import capacity, finals, headroom
from forge.model.costs import UPSTREAM

ROOT = Path(__file__).resolve().parents[2]
E2E = ROOT / "reports" / "e2e"
GIB = 1 << 30


def _server_logs() -> list[dict]:
    out = []
    for d in sorted(E2E.glob("*-h100-*")):
        with tarfile.open(d / "raw.tgz") as tf:
            for m in tf.getmembers():
                if not re.search(r"logs/server-[^/]*\.log$", m.name):
                    continue
                txt = tf.extractfile(m).read().decode("utf-8", "replace")
                took = re.findall(r"Graph capturing finished in \d+ secs, took ([\d.]+) GiB", txt)
                if not took:
                    continue          # a server that never got as far as capturing (a crash kept for its stacks)
                first = {k: int(re.search(rf"'{k}': (\d+)", txt).group(1))
                         for k in ("max_num_seqs", "max_num_batched_tokens", "max_cudagraph_capture_size")}
                out.append({"report": d.name, "log": m.name, **first, "took_gib": float(took[0])})
    return out


LOGS = _server_logs()


def test_the_logs_cover_small_and_large_capture_sizes():
    # the envelope below is only as good as the sizes it was checked at: the planned seqs (4-8) and the baseline's 128
    assert len(LOGS) >= 20
    assert {x["max_cudagraph_capture_size"] for x in LOGS} >= {8, 16, 256}


@pytest.mark.parametrize("log", LOGS, ids=lambda x: f"{x['report']}:{x['log']}")
def test_capture_size_is_the_one_vllm_chose(log):
    assert headroom.capture_size(log["max_num_seqs"], log["max_num_batched_tokens"]) == log["max_cudagraph_capture_size"]


@pytest.mark.parametrize("log", LOGS, ids=lambda x: f"{x['report']}:{x['log']}")
def test_the_graph_pool_estimate_is_never_below_what_a_server_took(log):
    # the log rounds to 0.01 GiB
    assert headroom.graph_pool_bytes(log["max_num_seqs"], log["max_num_batched_tokens"]) >= (log["took_gib"] - 0.005) * GIB


def test_each_measured_point_is_in_its_report():
    for report, size, gib in headroom.GRAPH_POOL_MEASURED:
        assert any(x["report"] == report and x["max_cudagraph_capture_size"] == size and x["took_gib"] == gib
                   for x in LOGS), (report, size, gib)


def test_the_envelope_is_tight_at_its_largest_point():
    # an envelope far above every measurement would keep out utilizations that start
    largest = max(LOGS, key=lambda x: x["max_cudagraph_capture_size"])
    est = headroom.graph_pool_bytes(largest["max_num_seqs"], largest["max_num_batched_tokens"]) / GIB
    assert est == pytest.approx(largest["took_gib"], rel=0.02)


def test_capture_size_follows_the_batched_tokens_and_the_512_cap():
    assert headroom.capture_size(128, 100) == 96          # 1, 2, 4, then steps of 8 below 100
    assert headroom.capture_size(400) == 512
    assert headroom.capture_size(3) == 4                  # 2 x 3 = 6: the largest size within it
    with pytest.raises(ForgeError, match="at least 1"):
        headroom.capture_size(0)


DCU = capacity.CARDS["dcu"].memory_bytes


def test_the_baseline_utilization_starts_at_any_seqs():
    h = headroom.headroom(DCU, 0.95, 128)
    assert h.fits and h.known_good
    # the graph pool alone (6.3 GiB on the GPU machine) would not fit the 3.2 GiB left: the organizers' command is
    # what says it starts on the card
    assert h.graph_pool_bytes > h.outside_bytes


def test_above_the_baseline_the_outside_memory_must_hold_the_needs():
    small, large = headroom.headroom(DCU, 0.97, 5), headroom.headroom(DCU, 0.97, 128)
    assert small.fits and not large.fits and not small.known_good
    assert small.needed_bytes <= small.outside_bytes < large.needed_bytes
    # the largest seqs it reports is the boundary: it fits, one more does not
    n = small.max_seqs
    assert headroom.headroom(DCU, 0.97, n).fits and not headroom.headroom(DCU, 0.97, n + 1).fits
    assert "--max-num-seqs %d at most" % n in large.why()
    gone = headroom.headroom(DCU, 0.99, 1)
    assert not gone.fits and gone.max_seqs == 0 and "no --max-num-seqs" in gone.why()


def test_more_utilization_never_allows_more_seqs():
    seqs = [headroom.headroom(DCU, u, 1).max_seqs for u in (0.955, 0.96, 0.965, 0.97, 0.975, 0.98)]
    assert seqs == sorted(seqs, reverse=True) and seqs[0] > seqs[-1]


def test_at_097_a_dcu_card_holds_one_more_long_request_at_tp1():
    # what makes 0.97 worth searching: a request more resident in the two long tiers (the planner's blocks)
    from forge.model.shape import load_shape
    shape = load_shape()
    for longest, more in ((25_000 + 1024, 1), (32_000 + 1024, 1)):
        at = {u: capacity.capacity(shape, utilization=u).usable_blocks // capacity.capacity(shape, utilization=u)
              .blocks_for(longest) for u in (0.95, 0.97)}
        assert at[0.97] >= at[0.95] + more


def _requests(n=6, prompt=20_000, out=64):
    return [(prompt, out)] * n


def test_the_model_never_picks_a_configuration_that_would_not_start():
    reqs = _requests()
    base = finals.baseline_metrics(reqs)
    cfgs = [finals.Config(tp=1, dp=2, max_num_seqs=s, max_num_batched_tokens=4096, gpu_memory_utilization=u,
                          concurrency=6) for s, u in ((128, 0.98), (128, 0.97), (4, 0.97), (128, 0.95))]
    ranked = finals.rank_configurations("16-32K", cfgs, reqs, UPSTREAM, base)
    by = {(c.max_num_seqs, c.gpu_memory_utilization): p for c, p in ranked}
    for key in ((128, 0.98), (128, 0.97)):
        assert by[key]["starts"] is False and not by[key]["sla_ok"]
        assert any(w.startswith("would not start: ") for w in by[key]["why"])
    assert by[(4, 0.97)]["starts"] and by[(128, 0.95)]["starts"]
    # even when it is the fastest row, a configuration that does not start is not picked
    fake = dict(by[(128, 0.98)], tok_s=1e6, sla_ok=True, why=[])
    chosen = finals.pick([fake, by[(4, 0.97)], by[(128, 0.95)]], base)
    assert chosen["starts"] is not False and chosen["tok_s"] < 1e6
    with pytest.raises(ForgeError, match="starts"):
        finals.pick([fake], base)


def test_plan_prints_the_outside_memory_and_its_seqs(capsys):
    from forge.run import plan
    res = plan.plan("final", tiers=["16-32K"], kv_dtypes=["bf16"], utilization=0.97)
    text = "\n".join(plan.render(res))
    n = headroom.headroom(DCU, 0.97, 1).max_seqs
    assert "1.92 GiB at this utilization" in text and f"up to --max-num-seqs {n}" in text
    res = plan.plan("final", tiers=["16-32K"], kv_dtypes=["bf16"])
    assert "where the organizers' command starts" in "\n".join(plan.render(res))


def test_predict_models_097_with_the_cap_that_lets_it_start():
    import argparse

    from forge.contest import rules
    from forge.run import predict_final, synth
    contest = rules.load_contest()
    args = argparse.Namespace(calibration=None, kv_dtype="bf16", concurrency="10", max_num_batched_tokens="4096",
                              gpu_memory_utilization="0.95,0.97", outputs="forced", link="pcie")
    res = predict_final.predict_final(args, contest, synth.load_workload(contest), {"gemv": 1.3})
    rows = {p["label"]: p for p in res["tiers"]["16-32K"]["ranked"]}
    # DP2 sends 5 requests to each card: 0.95's cache holds 4 of the largest (capped at 4), 0.97's holds 5, and
    # 0.97 starts only with max-num-seqs at the 5 a replica runs at once
    assert rows["TP1/DP2 bf16 seqs 4 (planned) batched 4096 util 0.95 c10"]["starts"]
    up = rows["TP1/DP2 bf16 seqs 5 (planned) batched 4096 util 0.97 c10"]
    assert up["starts"] and up["preemptions"] == 0
    for label in ("TP1/DP2 bf16 seqs 128 batched 4096 util 0.97 c10", "TP2/DP1 bf16 seqs 128 batched 4096 util 0.97 c10"):
        assert rows[label]["starts"] is False and not rows[label]["sla_ok"]
    # TP2's cache holds the tier at 0.95: nothing to gain, no capped 0.97 configuration is added
    assert not any(p["label"].startswith("TP2/DP1") and "(planned)" in p["label"] for p in rows.values())
    assert res["space"]["gpu_memory_utilization"] == [0.95, 0.97]


@pytest.mark.parametrize("env,warned", [({"GPU_MEMORY_UTILIZATION": "0.97"}, True),
                                        ({"GPU_MEMORY_UTILIZATION": "0.97", "MAX_NUM_SEQS_16_32K": "5"}, False),
                                        ({"GPU_MEMORY_UTILIZATION": "0.95"}, False)])
def test_serve_says_when_a_start_above_095_may_not_fit(tmp_path, env, warned):
    from helpers import forge
    r = forge(tmp_path, "serve", "--round", "final", "--tier", "16-32K", "--profile", "contest", "--dry-run", **env)
    assert r.returncode == 0, r.stderr
    n = headroom.headroom(DCU, 0.97, 1).max_seqs
    said = "the server may fail to start" in r.stderr
    assert said == warned, r.stderr
    if warned:
        assert f"set MAX_NUM_SEQS_16_32K (or MAX_NUM_SEQS) to {n} or less" in r.stderr and "a DCU card" in r.stderr
    assert "--gpu-memory-utilization " + env["GPU_MEMORY_UTILIZATION"] in r.stdout
