"""forge score: the contest formula reproduces the published checks, zeroes tiers on SLA breaches or
low completion, and reads result files written by vLLM's real client (tests/data/runs/)."""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, forge  # noqa: E402

from forge.contest import rules as contest  # noqa: E402
from forge.run import score  # noqa: E402

TIERS = ["4-8K", "8-16K", "16-32K"]


@pytest.fixture(scope="module")
def c():
    return contest.load_contest()


def run_of(tok, ttft=None, tpot_pooled=None, completion=None):
    return {"tiers": {t: {"tok_s": v, "ttft_p99_ms": (ttft or {}).get(t), "completion": (completion or {}).get(t, 1.0),
                          "completed": 10, "failed": 0} for t, v in zip(TIERS, tok)},
            "tpot_p99_pooled_ms": tpot_pooled}


def base_of(tok, ttft, tpot):
    return {"label": "b", "tiers": {t: {"tok_s": v, "ttft_p99_ms": ttft[t]} for t, v in zip(TIERS, tok)},
            "tpot_p99_pooled_ms": tpot, "accuracy": None}


@pytest.mark.parametrize("tok,shown", [("15.97,14.44,11.04", "79.1"), ("12.95,10.03,5.75", "60.0")])
def test_what_if_prints_the_published_totals(tmp_path, tok, shown):
    r = forge(tmp_path, "score", "--tok-s", tok)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].split()[:2] == ["total", shown]


def test_what_if_rejects_bad_input(tmp_path):
    r = forge(tmp_path, "score", "--tok-s", "1,2")
    assert r.returncode == 2 and "needs 3 values" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("tok,bad", [("nan,nan,nan", "nan"), ("inf,10,5", "inf"), ("12,-inf,5", "-inf"),
                                     ("0,0,0", "0"), ("12,10,-1", "-1"), ("12,x,5", "x")])
def test_what_if_refuses_non_finite_and_non_positive_tok_s(tmp_path, tok, bad):
    r = forge(tmp_path, "score", "--tok-s", tok)
    assert r.returncode == 2, r.stdout
    assert f"{bad!r}" in r.stderr and "Traceback" not in r.stderr and "total" not in r.stdout


def _formula(tok, base, weights=(20, 50, 30)):
    """The contest formula written out independently of forge.score."""
    return sum(w * (0.6 + 0.4 * (1 - math.exp(-1.3 * (a / b - 1)))) for a, b, w in zip(tok, base, weights))


def test_what_if_against_a_named_set_with_sla_values(tmp_path):
    # the official set has TTFT/TPOT P99 values: a what-if has none and must not crash on them
    r = forge(tmp_path, "score", "--tok-s", "15.97,14.44,11.04", "--baseline-name", "official")
    assert r.returncode == 0, r.stderr
    expect = _formula([15.97, 14.44, 11.04], [12.21, 8.81, 5.39])        # 82.85...
    assert r.stdout.strip().splitlines()[-1].split()[1] == f"{math.floor(expect * 10) / 10:.1f}"
    assert "official" in r.stdout


def test_what_if_against_a_baseline_run_uses_its_tok_s(tmp_path):
    r = forge(tmp_path, "score", "--tok-s", "12,10,6", "--baseline", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 0, r.stderr
    base = [json.loads((FIXTURE_RUNS / "base" / f"{t}.json").read_text())["output_throughput"] for t in TIERS]
    exact = float(r.stdout.split("(exact ")[1].split(";")[0])
    assert exact == pytest.approx(_formula([12, 10, 6], base), abs=1e-4)


@pytest.mark.parametrize("args,msg", [
    (["--tok-s", "12,10,6", "--run", "x"], "both --run and --tok-s"),
    (["--tok-s", "12,10,6", "--baseline", "x", "--baseline-name", "team"], "both --baseline"),
])
def test_contradictory_inputs_are_refused(tmp_path, args, msg):
    r = forge(tmp_path, "score", *args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


def test_make_score_passes_the_named_baseline_and_force():
    import subprocess
    r = subprocess.run(["make", "-n", "score", "TOK_S=1,2,3", "BASELINE_NAME=official", "FORCE=1"],
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--baseline-name official" in r.stdout and "--tok-s 1,2,3" in r.stdout and "--force" in r.stdout


def test_team_set_takes_its_sla_limits_from_the_official_set(c):
    team = score.baseline_from_config(c, "team")
    assert [team["tiers"][t]["tok_s"] for t in TIERS] == [12.95, 10.03, 5.75]
    assert [team["tiers"][t]["ttft_p99_ms"] for t in TIERS] == [4790.0, 24900.0, 28700.0]
    assert team["tpot_p99_pooled_ms"] == 71.82
    res = score.score(c, run_of([12.95, 10.03, 5.75], ttft={"4-8K": 7200.0, "8-16K": 1, "16-32K": 1},
                                tpot_pooled=70.0), team)
    assert res["tiers"]["4-8K"]["contribution"] == 0 and res["tiers"]["4-8K"]["ttft_p99_limit_ms"] == 7185.0
    assert res["total"] == pytest.approx(48.0)


def test_below_baseline_follows_the_formula_and_says_so(c, tmp_path):
    base = score.baseline_from_config(c, "team")
    res = score.score(c, run_of([12.95 / 2, 10.03, 5.75]), base)
    # 20 * (0.6 + 0.4 * (1 - e^0.65)) = 4.676..., computed by hand
    assert res["tiers"]["4-8K"]["contribution"] == pytest.approx(20 * (0.6 + 0.4 * (1 - 1.915540829)), abs=1e-6)
    assert "not clamped" in c["scoring"]["below_baseline"]
    assert "not clamped" in score.render_md(res, None, None)


@pytest.mark.parametrize("old,new,msg", [
    ("tok_s: {4-8K: 12.95,", "tok_s: {4-8K: .nan,", "baselines.sets.team.tok_s.4-8K"),
    ("tok_s: {4-8K: 12.95,", "tok_s: {4-8K: 0,", "baselines.sets.team.tok_s.4-8K"),
    ("      sla_from: official", "      sla_from: nobody", "sla_from"),
])
def test_baseline_sets_are_validated(tmp_path, old, new, msg):
    from forge.errors import ForgeError
    text = (Path(__file__).resolve().parents[2] / "configs" / "contest.yaml").read_text()
    assert old in text
    bad = tmp_path / "contest.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(ForgeError, match=msg):
        contest.load_contest(str(bad))


def test_damaged_result_file_names_the_file(tmp_path):
    run = tmp_path / "nanrun"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    d = json.loads((run / "8-16K.json").read_text())
    d["output_throughput"] = float("nan")
    (run / "8-16K.json").write_text(json.dumps(d))
    r = forge(tmp_path, "score", "--run", str(run))
    assert r.returncode == 2 and "8-16K.json" in r.stderr and "Traceback" not in r.stderr


def test_a_recorded_score_is_not_replaced_without_force(tmp_path):
    run = tmp_path / "fast"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    assert forge(tmp_path, "score", "--run", str(run)).returncode == 0
    first = (run / "score.json").read_bytes()
    r = forge(tmp_path, "score", "--run", str(run), "--baseline-name", "official")
    assert r.returncode == 2 and "already holds a recorded score" in r.stderr and "--force" in r.stderr
    assert (run / "score.json").read_bytes() == first
    r = forge(tmp_path, "score", "--run", str(run), "--baseline-name", "official", "--force")
    assert r.returncode == 0, r.stderr
    assert "official" in json.loads((run / "score.json").read_text())["baseline"]["label"]


def _harness_copy(tmp_path, src, name):
    run = tmp_path / name
    shutil.copytree(FIXTURE_RUNS / src, run)
    m = json.loads((run / "manifest.json").read_text())
    m["harness"] = True
    (run / "manifest.json").write_text(json.dumps(m))
    return run


def test_a_harness_run_is_never_scored_against_a_dcu_baseline(tmp_path):
    run = _harness_copy(tmp_path, "fast", "h-fast")
    for extra in ([], ["--baseline-name", "official"], ["--baseline", str(FIXTURE_RUNS / "base")]):
        r = forge(tmp_path, "score", "--run", str(run), *extra)
        assert r.returncode == 2 and "harness run" in r.stderr, (extra, r.stderr)
        assert not (run / "score.json").exists()
    # nor a real run against a harness baseline
    real = tmp_path / "real"
    shutil.copytree(FIXTURE_RUNS / "fast", real)
    r = forge(tmp_path, "score", "--run", str(real), "--baseline", str(run))
    assert r.returncode == 2 and "harness run" in r.stderr


def test_a_harness_run_is_labelled_in_every_score(tmp_path):
    run = _harness_copy(tmp_path, "fast", "h-fast")
    ref = _harness_copy(tmp_path, "base", "h-base")
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(ref))
    assert r.returncode == 0, r.stderr
    assert "harness" in r.stdout.splitlines()[-1]
    res = json.loads((run / "score.json").read_text())
    assert res["harness"] is True and res["baseline"]["harness"] is True and "random weights" in res["kind"]
    md = (run / "score.md").read_text()
    assert md.splitlines()[2].startswith("# Proxy score (harness run)") and "not a DCU score" in md


def test_tier_scores_against_hand_computed_values(c):
    base = score.baseline_from_config(c, "team")
    res = score.score(c, run_of([12.95 * 2, 10.03, 5.75 * 1.5]), base)
    # 20*(0.6+0.4*(1-e^-1.3)), 50*0.6, 30*(0.6+0.4*(1-e^-0.65)) computed independently
    assert res["tiers"]["4-8K"]["contribution"] == pytest.approx(20 * (0.6 + 0.4 * (1 - 0.272531793)), abs=1e-6)
    assert res["tiers"]["8-16K"]["contribution"] == pytest.approx(30.0)
    assert res["tiers"]["16-32K"]["contribution"] == pytest.approx(30 * (0.6 + 0.4 * (1 - 0.522045777)), abs=1e-6)


def test_ttft_breach_zeroes_only_that_tier(c):
    ttft_b = {"4-8K": 1000.0, "8-16K": 2000.0, "16-32K": 4000.0}
    base = base_of([10, 10, 10], ttft_b, 50.0)
    ok = score.score(c, run_of([10, 10, 10], ttft={"4-8K": 1500.0, "8-16K": 2000, "16-32K": 4000}, tpot_pooled=75.0), base)
    assert ok["total"] == pytest.approx(60.0) and ok["tpot_ok"] is True          # exactly 1.5x is allowed
    bad = score.score(c, run_of([10, 10, 10], ttft={"4-8K": 1501.0, "8-16K": 2000, "16-32K": 4000}, tpot_pooled=60.0), base)
    assert bad["tiers"]["4-8K"]["contribution"] == 0 and "TTFT P99" in bad["tiers"]["4-8K"]["zeroed_by"][0]
    assert bad["total"] == pytest.approx(48.0)


def test_pooled_tpot_breach_zeroes_every_tier(c):
    base = base_of([10, 10, 10], {t: 1000.0 for t in TIERS}, 50.0)
    res = score.score(c, run_of([20, 20, 20], ttft={t: 900.0 for t in TIERS}, tpot_pooled=75.01), base)
    assert res["total"] == 0 and res["tpot_ok"] is False
    assert all("TPOT" in t["zeroed_by"][0] for t in res["tiers"].values())


def test_completion_below_99_percent_zeroes_the_tier(c):
    base = score.baseline_from_config(c, "team")
    res = score.score(c, run_of([12.95, 10.03, 5.75], completion={"8-16K": 0.989, "16-32K": 0.99}), base)
    assert res["tiers"]["8-16K"]["contribution"] == 0
    assert res["tiers"]["16-32K"]["contribution"] == pytest.approx(18.0)
    assert res["total"] == pytest.approx(30.0)


@pytest.mark.parametrize("loss,factor", [(0.0, 1.0), (0.009, 1.0), (0.015, 0.97), (0.025, 0.94), (0.04, 0.90),
                                         (0.08, 0.85), (0.12, 0.0)])
def test_accuracy_factor_steps(c, loss, factor):
    base = {"hotpotqa": 80.0, "gov_report": 40.0}
    ours = {k: v * (1 - loss) for k, v in base.items()}
    assert score.accuracy_factor(c["scoring"], ours, base)["factor"] == factor


def test_percentile_matches_numpy():
    xs = [3.0, 1.0, 7.5, 2.25, 9.0, 4.0, 4.0]
    for q in (50, 95, 99):
        assert score.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


# --- real `vllm bench serve` result files -------------------------------------------------------

def test_fixture_metrics_agree_with_vllms_own_numbers(c):
    run = score.load_run(FIXTURE_RUNS / "base", c)
    for t in TIERS:
        raw = json.loads((FIXTURE_RUNS / "base" / f"{t}.json").read_text())
        m = run["tiers"][t]
        assert m["tok_s"] == raw["output_throughput"] and m["ttft_p99_ms"] == raw["p99_ttft_ms"]
        # our per-request TPOT (from itls) reproduces vLLM's own P99 TPOT within the usage-chunk gap
        assert score.percentile(m["tpots_ms"], 99) == pytest.approx(raw["p99_tpot_ms"], rel=0.05)
    pooled = [1000 * sum(itl) / (n - 1) for t in TIERS
              for itl, n in zip(*(json.loads((FIXTURE_RUNS / "base" / f"{t}.json").read_text())[k]
                                  for k in ("itls", "output_lens")))]
    assert run["tpot_p99_pooled_ms"] == pytest.approx(float(np.percentile(pooled, 99)))


def test_score_fast_against_base_run(tmp_path, c):
    run = tmp_path / "fast"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 0, r.stderr
    res = json.loads((run / "score.json").read_text())
    raw = {d: {t: json.loads((FIXTURE_RUNS / d / f"{t}.json").read_text()) for t in TIERS} for d in ("base", "fast")}
    expect = 0.0
    for t, w in zip(TIERS, (20, 50, 30)):
        lift = raw["fast"][t]["output_throughput"] / raw["base"][t]["output_throughput"] - 1
        expect += w * (0.6 + 0.4 * (1 - math.exp(-1.3 * lift)))
        assert res["tiers"][t]["ttft_ok"] is True
        assert res["tiers"][t]["ttft_p99_limit_ms"] == pytest.approx(1.5 * raw["base"][t]["p99_ttft_ms"])
    assert res["tpot_ok"] is True and res["total"] == pytest.approx(expect)
    assert all(d["differ"] == 0 for d in res["output_drift"].values())
    md = (run / "score.md").read_text()
    assert md.startswith("<!-- Generated by `forge score`") and res["display"] in md
    assert (run / "score.png").stat().st_size > 1000
    # a run scored against itself is refused (compare refuses it too): it would show no difference
    back = forge(tmp_path, "score", "--run", str(run), "--baseline", str(run), "--force")
    assert back.returncode == 2 and "same run folder" in back.stderr and "Traceback" not in back.stderr


def test_output_length_drift_is_flagged(tmp_path):
    run = tmp_path / "drift"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    p = run / "8-16K.json"
    d = json.loads(p.read_text())
    d["output_lens"][1] -= 5
    p.write_text(json.dumps(d))
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 0
    assert "output lengths differ" in r.stderr and "8-16K 1/" in r.stderr
    assert json.loads((run / "score.json").read_text())["output_drift"]["8-16K"]["requests"] == [1]


def test_server_death_mid_tier_zeroes_the_affected_tiers(tmp_path):
    run = tmp_path / "died"
    shutil.copytree(FIXTURE_RUNS / "died", run)
    raw2 = json.loads((run / "8-16K.json").read_text())
    raw3 = json.loads((run / "16-32K.json").read_text())
    assert raw2["failed"] >= 1 and raw2["completed"] >= 1      # recorded by vLLM's client itself
    assert raw3["completed"] == 0
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 0, r.stderr
    res = json.loads((run / "score.json").read_text())
    assert res["tiers"]["4-8K"]["contribution"] > 0
    assert res["tiers"]["8-16K"]["contribution"] == 0 and "completion" in res["tiers"]["8-16K"]["zeroed_by"][-1]
    assert res["tiers"]["16-32K"]["contribution"] == 0


def test_missing_tier_is_a_clear_error(tmp_path):
    run = tmp_path / "part"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    (run / "16-32K.json").unlink()
    r = forge(tmp_path, "score", "--run", str(run))
    assert r.returncode == 2 and "tier 16-32K has no result" in r.stderr and "--run-id part" in r.stderr


# --- damaged inputs and failed writes: an error naming the file, never a traceback ---------------

def test_a_failed_score_write_records_no_score_and_does_not_block_the_rerun(tmp_path):
    run = tmp_path / "fast"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    (run / "score.md").mkdir()                          # score.md cannot be written
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 2 and "score.md" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (run / "score.json").exists()
    assert not [p for p in run.iterdir() if ".tmp" in p.name]
    (run / "score.md").rmdir()
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 0, r.stderr
    assert (run / "score.json").is_file() and (run / "score.md").is_file()


@pytest.mark.parametrize("file,change,key", [
    ("8-16K.json", lambda d: d.update(completed="3"), "completed"),
    ("8-16K.json", lambda d: d.update(output_lens=[2, 2, "x"]), "output_lens[2]"),
    ("4-8K.json", lambda d: d["itls"].__setitem__(1, [0.01, None]), "itls[1]"),
    ("4-8K.json", lambda d: d.update(errors=["", ""]), "errors"),
    ("16-32K.json", lambda d: d.update(p99_ttft_ms="fast"), "p99_ttft_ms"),
    ("manifest.json", None, "null"),
])
def test_mistyped_result_fields_name_the_file_and_key(tmp_path, file, change, key):
    run = tmp_path / "bad"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    p = run / file
    if change is None:
        p.write_text("null")
    else:
        d = json.loads(p.read_text())
        change(d)
        p.write_text(json.dumps(d))
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert file in r.stderr and key in r.stderr
    assert not (run / "score.json").exists()


@pytest.mark.parametrize("make_args", [
    lambda f: ["predict", "--speedup", "gemv=2", "--out", str(f)],
    lambda f: ["report", "--out", str(f / "x")],
])
def test_a_path_that_cannot_be_written_is_a_one_line_error(tmp_path, make_args):
    f = tmp_path / "a-file"
    f.write_text("x")
    r = forge(tmp_path, *make_args(f))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and str(f) in r.stderr
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and errors[0].startswith(f"forge {make_args(f)[0]}: error: ")
