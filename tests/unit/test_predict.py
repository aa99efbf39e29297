"""forge predict: the tok/s formula on hand-computed cases, the component model on a one-request
workload worked out by hand, the official baseline reproduced, the best public team's published
stages predicted from their own TTFT/TPOT within a few points of their scores, ratios read from run
folders, and bad input refused."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, ROOT, forge  # noqa: E402

from forge.contest import rules as contest  # noqa: E402
from forge.run import predict, synth, timemodel  # noqa: E402

TIERS = ["4-8K", "8-16K", "16-32K"]


@pytest.fixture(scope="module")
def c():
    return contest.load_contest()


@pytest.fixture(scope="module")
def w(c):
    return synth.load_workload(c)


def formula(tok, base=(12.21, 8.81, 5.39), weights=(20, 50, 30)):
    """The contest formula written out (no SLA, no accuracy)."""
    return sum(wt * (0.6 + 0.4 * (1 - math.exp(-1.3 * (a / b - 1)))) for a, b, wt in zip(tok, base, weights))


def test_tier_tok_s_hand_computed():
    # two requests of 10 and 20 tokens, TTFT 1 s, TPOT 0.1 s: 30 tokens in 2 + (9 + 19) x 0.1 = 4.8 s
    assert timemodel.tier_tok_s([10, 20], 1.0, 0.1) == pytest.approx(6.25)
    # one token: TTFT only
    assert timemodel.tier_tok_s([1], 0.5, 9.9) == pytest.approx(2.0)


def test_ratios_of_one_reproduce_the_official_run(c, w):
    pred = predict.predict_from_ratios(w, {t: 1.0 for t in TIERS}, {t: 1.0 for t in TIERS})
    for t, published in zip(TIERS, (12.21, 8.81, 5.39)):
        assert pred[t]["tok_s"] == pytest.approx(published, rel=0.003)
    # TTFT share of wall time as published: 16 / 39 / 62 %
    assert [round(100 * pred[t]["ttft_share"]) for t in TIERS] == [17, 39, 62]
    assert predict.score_prediction(c, w, pred, "official")["total"] == pytest.approx(60.0, abs=0.1)


@pytest.mark.parametrize("ttft_s,tpot_ms,tok_s_published", [
    # the best public team's stages (design/contest-facts.md): mean TTFT, mean TPOT, measured tok/s
    ((1.55, 3.50, 6.28), (45.0, 45.7, 46.9), (19.59, 17.09, 13.00)),     # the stage scored 88.55
    ((1.84, 4.43, 8.35), (47.3, 48.0, 49.2), (18.35, 15.60, 11.43)),
])
def test_published_stages_come_out_within_a_few_points(tmp_path, ttft_s, tpot_ms, tok_s_published):
    r = forge(tmp_path, "predict", "--ttft-s", ",".join(map(str, ttft_s)), "--tpot-ms", ",".join(map(str, tpot_ms)),
              "--out", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "p" / "predict.json").read_text())
    assert abs(got["score"]["total"] - formula(tok_s_published)) < 2.0      # 88.55 -> 88.9; 85.7 -> 86.0
    for t, pub in zip(TIERS, tok_s_published):
        assert got["tiers"][t]["tok_s"] == pytest.approx(pub, rel=0.05)
    # 4-8K by hand: 12,463 output tokens in 50 requests
    assert got["tiers"]["4-8K"]["tok_s"] == pytest.approx(12463 / (50 * ttft_s[0] + 12413 * tpot_ms[0] / 1000))
    assert (tmp_path / "p" / "predict.png").stat().st_size > 1000
    md = (tmp_path / "p" / "predict.md").read_text()
    assert "What the prediction assumes" in md and "no request-rate spacing" in md


def one_request_workload():
    return {"tiers": {"X": {"baseline": {"output_tok_s": 1.0, "mean_ttft_ms": 7000.0, "p99_ttft_ms": 7000.0,
                                         "mean_tpot_ms": 70.0, "p99_tpot_ms": 70.0, "duration_s": 14.0},
                            "requests": [(10000, 101)]}}}


def test_component_model_hand_computed():
    w = one_request_workload()
    # prefill of 10,000 tokens: attention 196,608e8 / 4e12 = 4.9152 s, GEMMs 1.53 s, GDN 0.61 x 10/21.7
    # = 0.281106 s, elementwise 0.42 x 10/21.7 = 0.193548 s, fixed 0.1 s: 7.019854 s
    base = timemodel.component_times(w)["X"]
    assert base["ttft_s"] == pytest.approx(7.019854, abs=1e-5)
    # decode: 63.1 + 2.9 x 10/14 (2.071429) + 0.9 + 2.5 + 1.6 = 70.171429 ms
    assert base["tpot_ms"] == pytest.approx(70.171429, abs=1e-5)
    pred = predict.predict_from_components(w, {"prefill_attn": 1e9, "gemv": 2.0})["X"]
    # attention gone: 2.104654 / 7.019854 of the measured 7 s; GEMVs halved: 38.621429 / 70.171429 of 70 ms
    assert pred["ttft_ms"] == pytest.approx(7000 * 2.104654 / 7.019854, rel=1e-5)
    assert pred["tpot_ms"] == pytest.approx(70 * 38.621429 / 70.171429, rel=1e-5)
    assert pred["tok_s"] == pytest.approx(101 / (pred["ttft_ms"] / 1000 + 100 * pred["tpot_ms"] / 1000))
    same = predict.predict_from_components(w, {})["X"]
    assert (same["ttft_ms"], same["tpot_ms"]) == pytest.approx((7000.0, 70.0))


def test_component_model_agrees_with_the_measured_baseline(w):
    # the public time model, uncalibrated, against the official run's means: within 5 %
    pred = predict.predict_from_components(w, {})
    for t in TIERS:
        assert abs(pred[t]["model"]["model_vs_measured_ttft"]) < 0.05, t
        assert abs(pred[t]["model"]["model_vs_measured_tpot"]) < 0.05, t


def _means(run, t):
    """Mean TTFT and TPOT (ms) of a tier's successful requests, from vLLM's per-request lists."""
    res = json.loads((run / f"{t}.json").read_text())
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    ttft = sum(1000 * res["ttfts"][i] for i in ok) / len(ok)
    tpot = [1000 * sum(res["itls"][i]) / (res["output_lens"][i] - 1) for i in ok if res["output_lens"][i] > 1]
    return ttft, sum(tpot) / len(tpot)


def test_ratios_from_run_folders(tmp_path, w):
    r = forge(tmp_path, "predict", "--run", str(FIXTURE_RUNS / "fast"), "--reference", str(FIXTURE_RUNS / "base"),
              "--out", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "p" / "predict.json").read_text())
    for t in TIERS:
        (ft, fp), (bt, bp) = _means(FIXTURE_RUNS / "fast", t), _means(FIXTURE_RUNS / "base", t)
        b = w["tiers"][t]["baseline"]
        assert got["tiers"][t]["ttft_ratio"] == pytest.approx(ft / bt)
        assert got["tiers"][t]["ttft_ms"] == pytest.approx(b["mean_ttft_ms"] * ft / bt)
        assert got["tiers"][t]["tpot_ms"] == pytest.approx(b["mean_tpot_ms"] * fp / bp)
    # an e2e results folder: every profile against runs/upstream
    e2e = tmp_path / "e2e"
    shutil.copytree(FIXTURE_RUNS / "base", e2e / "runs" / "upstream")
    shutil.copytree(FIXTURE_RUNS / "fast", e2e / "runs" / "fast-int8")
    r = forge(tmp_path, "predict", "--e2e", str(e2e), "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    q = json.loads((tmp_path / "q" / "fast-int8" / "predict.json").read_text())
    assert q["tiers"]["8-16K"]["tok_s"] == pytest.approx(got["tiers"]["8-16K"]["tok_s"])


@pytest.mark.parametrize("args,msg", [
    ([], "give one source"),
    (["--speedup", "gemv=2", "--ttft-s", "1,2,3", "--tpot-ms", "1,2,3"], "not --speedup/--speedups and --ttft-s"),
    (["--speedup", "warp=2"], "unknown component 'warp'"),
    (["--speedup", "gemv=0"], "not a finite positive factor"),
    (["--speedup", "gemv=nan"], "not a finite positive factor"),
    (["--speedup", "gemv"], "expected NAME=FACTOR"),
    (["--ttft-s", "1,2,inf", "--tpot-ms", "40,40,40"], "not a finite positive time"),
    (["--ttft-s", "1,2,3"], "go together"),
    (["--run", str(FIXTURE_RUNS / "fast")], "needs --reference"),
])
def test_bad_input_is_refused(tmp_path, args, msg):
    r = forge(tmp_path, "predict", *args, "--out", str(tmp_path / "p"))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_make_predict_passes_speedups():
    r = subprocess.run(["make", "-n", "predict", "SPEEDUP=prefill_attn=10 gemv=1.45", "BASELINE_NAME=team"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--speedup prefill_attn=10 --speedup gemv=1.45" in r.stdout and "--baseline-name team" in r.stdout


def test_help_names_only_files_of_this_repository(tmp_path):
    import re
    r = forge(tmp_path, "predict", "--help")
    assert r.returncode == 0, r.stderr
    named = set(re.findall(r"[\w.-]+(?:/[\w.-]+)+\.(?:md|yaml|yml|json|py|txt)", r.stdout))
    assert "configs/workload.yaml" in named
    assert [p for p in named if not (ROOT / p).exists()] == []
