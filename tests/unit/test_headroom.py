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
                # the GDN layers' cap, applied after the engine's config is logged
                cap = re.search(r"Capping cudagraph capture sizes from max \d+ to (\d+) to fit Mamba cache blocks "
                                r"\((\d+) blocks available\)", txt)
                out.append({"report": d.name, "log": m.name, **first, "took_gib": float(took[0]),
                            "captured": int(cap.group(1)) if cap else first["max_cudagraph_capture_size"],
                            "num_blocks": int(cap.group(2)) if cap else None})
    return out


LOGS = _server_logs()


def test_the_logs_cover_small_and_large_capture_sizes():
    # the envelope below is only as good as the sizes it was checked at: the planned seqs (4-8) and the baseline's 128
    assert len(LOGS) >= 20
    assert {x["captured"] for x in LOGS} >= {8, 16, 144}
    assert any(x["num_blocks"] for x in LOGS)             # the GDN cap seen at least once


@pytest.mark.parametrize("log", LOGS, ids=lambda x: f"{x['report']}:{x['log']}")
def test_capture_size_is_the_one_vllm_captured(log):
    assert headroom.capture_size(log["max_num_seqs"], log["max_num_batched_tokens"], log["num_blocks"]) == log["captured"]


@pytest.mark.parametrize("log", LOGS, ids=lambda x: f"{x['report']}:{x['log']}")
def test_the_measured_envelope_is_never_below_what_a_server_took(log):
    # the log rounds to 0.01 GiB
    assert headroom.MEASURED_PER_ENTRY * log["captured"] >= (log["took_gib"] - 0.005) * GIB


def test_each_measured_point_is_in_its_report():
    for report, size, gib in headroom.GRAPH_POOL_MEASURED:
        assert any(x["report"] == report and x["captured"] == size and x["took_gib"] == gib for x in LOGS), \
            (report, size, gib)


def test_the_envelope_is_tight_at_its_largest_point():
    # an envelope far above every measurement would keep out utilizations that run
    largest = max(LOGS, key=lambda x: x["captured"])
    assert headroom.MEASURED_PER_ENTRY * largest["captured"] / GIB == pytest.approx(largest["took_gib"], rel=0.02)


def test_capture_size_follows_the_batched_tokens_and_the_512_cap():
    assert headroom.capture_size(128, 100) == 96          # 1, 2, 4, then steps of 8 below 100
    assert headroom.capture_size(400) == 512
    assert headroom.capture_size(3) == 4                  # 2 x 3 = 6: the largest size within it
    with pytest.raises(ForgeError, match="at least 1"):
        headroom.capture_size(0)


DCU = capacity.CARDS["dcu"].memory_bytes
SHAPE = None


def _shape():
    from forge.model.shape import load_shape
    return load_shape()


def _dcu_room(u: float, seqs: int, tp: int = 1):
    shape = _shape()
    return capacity.room(shape, capacity.capacity(shape, tp=tp, utilization=u), seqs)


def test_the_dcu_pool_is_derived_from_the_organizers_command_running_there():
    shape = _shape()
    per = capacity.graph_pool_per_entry(shape, "dcu")
    base = capacity.capacity(shape, utilization=0.95)
    # that command's KV cache (146 blocks) caps its 256 captured entries at 144, as the GPU machine's log shows
    assert base.num_blocks == 146 and headroom.capture_size(128, 4096, base.num_blocks) == 144
    # its needs fill what 0.95 leaves, no more
    outside = int(DCU * 0.05)
    assert headroom.CONTEXT_ALLOWANCE + headroom.MARGIN + per * 144 == pytest.approx(outside, abs=1)
    # the docstring's claim: less than a third of the GPU machine's, or that command would not run on the card
    assert per < headroom.MEASURED_PER_ENTRY / 3
    assert capacity.graph_pool_per_entry(shape, "h200") == headroom.MEASURED_PER_ENTRY


def test_the_readme_figures_of_the_dcu_card():
    # README ("A utilization above 0.95"): at 0.97 --max-num-seqs 27 at most, at 0.98 7, at 0.99 none
    assert [_dcu_room(u, 1).max_seqs for u in (0.97, 0.98, 0.99)] == [27, 7, 0]
    readme = (ROOT / "README.md").read_text()
    assert "`--max-num-seqs` 27 at most" in readme


def test_the_baseline_utilization_runs_at_any_seqs_and_tp():
    for tp in (1, 2):
        h = _dcu_room(0.95, 128, tp)
        assert h.fits and h.known_good


def test_above_the_baseline_the_outside_memory_must_hold_the_needs():
    small, large = _dcu_room(0.97, 5), _dcu_room(0.97, 128)
    assert small.fits and not large.fits and not small.known_good
    assert small.needed_bytes <= small.outside_bytes < large.needed_bytes
    n = small.max_seqs
    assert _dcu_room(0.97, n).fits and not _dcu_room(0.97, n + 1).fits
    assert "--max-num-seqs %d at most" % n in large.why()
    gone = _dcu_room(0.99, 1)
    assert not gone.fits and gone.max_seqs == 0 and "no --max-num-seqs" in gone.why()
    # TP2 above the baseline: not modelled, never taken
    tp2 = _dcu_room(0.97, 5, tp=2)
    assert not tp2.fits and tp2.max_seqs == 0 and "only TP1 is modelled" in tp2.why()


def test_more_utilization_never_allows_more_seqs():
    seqs = [_dcu_room(u, 1).max_seqs for u in (0.955, 0.96, 0.965, 0.97, 0.975, 0.98)]
    assert seqs == sorted(seqs, reverse=True) and seqs[0] > seqs[-1]


def test_at_097_a_dcu_card_holds_one_more_long_request_at_tp1():
    # what makes 0.97 worth searching: a request more resident in the two long tiers (the planner's blocks)
    shape = _shape()
    for longest in (16_001 + 1024, 32_000 + 1024):
        at = {u: capacity.capacity(shape, utilization=u).usable_blocks // capacity.capacity(shape, utilization=u)
              .blocks_for(longest) for u in (0.95, 0.97)}
        assert at[0.97] == at[0.95] + 1


def test_the_planned_cap_above_the_baseline():
    shape = _shape()
    prompts = [20_000] * 8
    kw = dict(kv_dtype="bf16", card_name="dcu", max_num_batched_tokens=4096)
    # DP2 at concurrency 10: 0.95's cache holds 4 of these (capped), 0.97's 5: capped at the replica's share
    assert capacity.planned_seqs(shape, 1, 2, prompts, 1024, 10, utilization=0.95, **kw) == 4
    assert capacity.planned_seqs(shape, 1, 2, prompts, 1024, 10, utilization=0.97, **kw) == 5
    # short requests preempt nothing: a cap above 0.95 all the same, none at 0.95; not the replica's share (5) but
    # the whole concurrency its cache holds (vLLM's balancer may send a replica more than its share for a while)
    short = [4_000] * 8
    assert capacity.planned_seqs(shape, 1, 2, short, 1024, 10, utilization=0.95, **kw) is None
    assert capacity.planned_seqs(shape, 1, 2, short, 1024, 10, utilization=0.97, **kw) == 10
    # never above what the outside memory holds, none where it holds nothing, none at TP2
    tiny = [200] * 8                    # 34 of them fit at once: the cap is what the memory left holds
    assert capacity.planned_seqs(shape, 1, 1, tiny, 1024, 64, utilization=0.97, **kw) == 27
    assert capacity.planned_seqs(shape, 1, 2, short, 1024, 10, utilization=0.99, **kw) is None
    assert capacity.planned_seqs(shape, 2, 1, prompts, 1024, 10, utilization=0.97, **kw) is None
    # no utilization given: the baseline's
    assert capacity.planned_seqs(shape, 1, 2, short, 1024, 10, **kw) is None


def _requests(n=6, prompt=20_000, out=64):
    return [(prompt, out)] * n


def test_the_model_ranks_last_and_never_picks_a_configuration_that_would_not_start():
    reqs = _requests()
    base = finals.baseline_metrics(reqs)
    cfgs = [finals.Config(tp=1, dp=2, max_num_seqs=s, max_num_batched_tokens=4096, gpu_memory_utilization=u,
                          concurrency=6) for s, u in ((128, 0.98), (128, 0.97), (3, 0.97), (128, 0.95))]
    ranked = finals.rank_configurations("16-32K", cfgs, reqs, UPSTREAM, base)
    by = {(c.max_num_seqs, c.gpu_memory_utilization): p for c, p in ranked}
    for key in ((128, 0.98), (128, 0.97)):
        assert by[key]["starts"] is False and not by[key]["sla_ok"]
        assert any(w.startswith("would not start: ") for w in by[key]["why"])
    assert by[(3, 0.97)]["starts"] and by[(128, 0.95)]["starts"]
    # last, after every configuration that runs, whatever its tok/s (the sweep serves the top of the ranking)
    assert [p["starts"] for _, p in ranked][-2:] == [False, False]
    fast = dict(by[(128, 0.98)], tok_s=1e6, sla_ok=False)
    slow_breaker = dict(by[(128, 0.95)], tok_s=1.0, sla_ok=False)
    assert sorted([fast, slow_breaker], key=finals.rank_key)[0] is slow_breaker
    # even when it is the fastest row, a configuration that does not start is not picked
    fake = dict(by[(128, 0.98)], tok_s=1e6, sla_ok=True, why=[])
    chosen = finals.pick([fake, by[(3, 0.97)], by[(128, 0.95)]], base)
    assert chosen["starts"] is not False and chosen["tok_s"] < 1e6
    with pytest.raises(ForgeError, match="starts"):
        finals.pick([fake], base)


def test_a_tie_is_picked_at_the_lower_utilization():
    reqs = _requests(n=4, prompt=4_000)
    base = finals.baseline_metrics(reqs)
    cfgs = [finals.Config(tp=1, dp=2, max_num_seqs=2, max_num_batched_tokens=4096, gpu_memory_utilization=u,
                          concurrency=4) for u in (0.97, 0.95)]
    preds = [p for _, p in finals.rank_configurations("4-8K", cfgs, reqs, UPSTREAM, base)]
    assert preds[0]["tok_s"] == preds[1]["tok_s"]              # nothing preempts at either: the same schedule
    # ranked (what the sweep serves from) at the lower utilization first, whatever the space's order
    assert preds[0]["config"]["gpu_memory_utilization"] == 0.95
    assert finals.pick(preds, base)["config"]["gpu_memory_utilization"] == 0.95
    assert finals.pick(preds[::-1], base)["config"]["gpu_memory_utilization"] == 0.95


def test_plan_prints_the_outside_memory_and_its_seqs():
    from forge.run import plan
    text = "\n".join(plan.render(plan.plan("final", tiers=["16-32K"], kv_dtypes=["bf16"], utilization=0.97)))
    assert "1.92 GiB at this utilization" in text and "up to --max-num-seqs 27" in text
    assert "TP2 is not modelled above 0.95" in text
    text = "\n".join(plan.render(plan.plan("final", tiers=["16-32K"], kv_dtypes=["bf16"])))
    assert "where the organizers' command runs" in text


def _predict(util: str) -> dict:
    import argparse

    from forge.contest import rules
    from forge.run import predict_final, synth
    contest = rules.load_contest()
    args = argparse.Namespace(calibration=None, kv_dtype="bf16", concurrency="10", max_num_batched_tokens="4096",
                              gpu_memory_utilization=util, outputs="forced", link="pcie")
    return predict_final.predict_final(args, contest, synth.load_workload(contest), {"gemv": 1.3})


def test_predict_models_097_with_the_cap_that_lets_it_run():
    res = _predict("0.95,0.97")
    rows = {p["label"]: p for p in res["tiers"]["16-32K"]["ranked"]}
    # DP2 sends 5 requests to each card: 0.95's cache holds 4 of the largest (capped at 4), 0.97's holds 5, and
    # 0.97 runs only with max-num-seqs at the 5 a replica runs at once
    assert rows["TP1/DP2 bf16 seqs 4 (planned) batched 4096 util 0.95 c10"]["starts"]
    up = rows["TP1/DP2 bf16 seqs 5 (planned) batched 4096 util 0.97 c10"]
    assert up["starts"] and up["preemptions"] == 0
    for label in ("TP1/DP2 bf16 seqs 128 batched 4096 util 0.97 c10", "TP2/DP1 bf16 seqs 128 batched 4096 util 0.97 c10"):
        assert rows[label]["starts"] is False and not rows[label]["sla_ok"]
    # TP2 above 0.95 is not modelled: no capped configuration there
    assert not any(p["label"].startswith("TP2/DP1") and "util 0.97" in p["label"] and p["starts"] for p in rows.values())
    assert res["space"]["gpu_memory_utilization"] == [0.95, 0.97]


def test_predict_at_097_alone_picks_per_tier():
    # every tier keeps a configuration that runs: DP2 at the replica's share, where seqs 128 would not
    res = _predict("0.97")
    for tier, t in res["tiers"].items():
        assert t["pick"]["starts"], tier
        assert t["pick"]["label"].startswith("TP1/DP2") and "(planned)" in t["pick"]["label"], t["pick"]["label"]


@pytest.mark.parametrize("env,said", [
    ({"GPU_MEMORY_UTILIZATION": "0.97", "TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2"},
     "set MAX_NUM_SEQS_16_32K to 27 or less, or GPU_MEMORY_UTILIZATION to 0.95 or less"),
    ({"GPU_MEMORY_UTILIZATION_16_32K": "0.97", "MAX_NUM_SEQS": "40", "TENSOR_PARALLEL_SIZE": "1",
      "DATA_PARALLEL_SIZE": "2"}, "set MAX_NUM_SEQS to 27 or less, or GPU_MEMORY_UTILIZATION_16_32K to 0.95 or less"),
    ({"GPU_MEMORY_UTILIZATION": "0.97"}, "only TP1 is modelled"),                     # the baseline's TP2
    ({"GPU_MEMORY_UTILIZATION": "0.99", "TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2"},
     "set GPU_MEMORY_UTILIZATION to 0.95 or less"),
    ({"GPU_MEMORY_UTILIZATION": "0.97", "MAX_NUM_SEQS_16_32K": "5", "TENSOR_PARALLEL_SIZE": "1",
      "DATA_PARALLEL_SIZE": "2"}, None),
    ({"GPU_MEMORY_UTILIZATION": "0.95"}, None)])
def test_serve_says_when_a_start_above_095_may_not_run(tmp_path, env, said):
    from helpers import forge
    r = forge(tmp_path, "serve", "--round", "final", "--tier", "16-32K", "--profile", "contest", "--dry-run", **env)
    assert r.returncode == 0, r.stderr
    if said is None:
        assert "may fail to start" not in r.stderr, r.stderr
    else:
        assert "may fail to start" in r.stderr and said in r.stderr and "(a DCU card)" in r.stderr, r.stderr


def test_serve_prices_a_card_its_tool_reports(monkeypatch):
    from forge.contest import rounds, rules
    from forge.run import serve_headroom
    rnd = rounds.load_round(rules.load_contest(), "final")
    rendered = {"tier": "16-32K", "env": {}, "sources": {}, "engine_args": [],
                "settings": {"tensor_parallel_size": 1, "data_parallel_size": 2, "max_num_seqs": 32,
                             "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.97, "concurrency": 10}}
    said = []
    monkeypatch.setattr(serve_headroom.ui, "warn", said.append)
    # an H200: 4.19 GiB outside at 0.97 holds 32 seqs' pool (64 entries) at the GPU machine's measured cost
    monkeypatch.setattr(serve_headroom, "card_memory", lambda env: ([150_109_880_320], "nvidia-smi"))
    serve_headroom.say_headroom(rendered, rnd)
    assert said == []
    # a DCU card's tool: 1.92 GiB holds 27 at most
    monkeypatch.setattr(serve_headroom, "card_memory", lambda env: ([64 << 30], "hy-smi"))
    serve_headroom.say_headroom(rendered, rnd)
    assert len(said) == 1 and "(hy-smi: 64.0 GiB)" in said[0] and "27 or less" in said[0]
    # an empty list of cards (every device hidden): priced as a DCU card, not a crash
    monkeypatch.setattr(serve_headroom, "card_memory", lambda env: ([], "nvidia-smi, CUDA_VISIBLE_DEVICES="))
    serve_headroom.say_headroom(rendered, rnd)
    assert len(said) == 2 and "(a DCU card)" in said[1]


def test_the_submission_says_why_a_winner_above_095_runs(tmp_path):
    import json

    from helpers import forge
    env = {"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2", "MAX_NUM_SEQS": "6",
           "MAX_NUM_BATCHED_TOKENS": "4096", "GPU_MEMORY_UTILIZATION": "0.97", "CONCURRENCY_8_16K": "10"}
    tp2 = dict(env, TENSOR_PARALLEL_SIZE="2", DATA_PARALLEL_SIZE="1", MAX_NUM_SEQS="128", CONCURRENCY_8_16K=None)
    tp2 = {k.replace("8_16K", "16_32K"): v for k, v in tp2.items() if v is not None} | {"CONCURRENCY_16_32K": "10"}
    (tmp_path / "te.json").write_text(json.dumps({"round": "final", "tiers": {
        "8-16K": {"environment": env, "engine_options": {}, "kv_dtype": "bf16", "run": "r-8", "sweep": "s1",
                  "tok_s": 50.0, "lift": 0.2, "score": 40.0},
        "16-32K": {"environment": tp2, "engine_options": {}, "kv_dtype": "bf16", "run": "r-16", "sweep": "s1",
                   "tok_s": 20.0, "lift": 0.1, "score": 20.0}}}))
    r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(tmp_path / "te.json"), "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    doc = (tmp_path / "o" / "submission" / "ENVIRONMENT.md").read_text()
    line = next(x for x in doc.splitlines() if x.startswith("- 8-16K: `GPU_MEMORY_UTILIZATION=0.97`"))
    assert "1.92 GiB outside vLLM's budget at utilization 0.97 holds" in line and "--max-num-seqs 6" in line
    assert "measured on the card in sweep s1, run r-8" in line
    line = next(x for x in doc.splitlines() if x.startswith("- 16-32K: `GPU_MEMORY_UTILIZATION=0.97`"))
    assert "only TP1 is modelled" in line
    assert "- 4-8K:" not in doc                    # the baseline's 0.95: nothing to say
