"""bench-all-tiers --round final (the finals' client per tier, recorded in the manifest, no resume across
rounds) and score --round final (the preliminary's formula and SLA against a baseline of the final
round only). The client replays results recorded by vLLM's real client (tests/data/runs/)."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, SUPPORT, fake_server, forge, tier_files, tiny_model  # noqa: E402

from forge.contest import rounds, rules  # noqa: E402

REPLAY = f"{sys.executable} {SUPPORT / 'replayclient.py'}"
TIERS = ("4-8K", "8-16K", "16-32K")
FINALS = {"4-8K": 80, "8-16K": 70, "16-32K": 60}          # contest-facts "The final round": requests per tier


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def data_dir(tmp_path):
    """Official-format tier files with more lines than the finals send."""
    return tier_files(tmp_path / "data")


def _bench(tmp_path, port, model, data_dir, *extra, **env):
    return forge(tmp_path, "bench-all-tiers", "--port", str(port), "--model", str(model), "--client", REPLAY,
                 "--run-id", "f1", "--profile", "test", "--data-dir", str(data_dir), *extra, timeout=120,
                 REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "replay.log"), **env)


def _calls(tmp_path):
    return [json.loads(x) for x in (tmp_path / "replay.log").read_text().splitlines()]


def _opt(argv, name):
    return argv[argv.index(name) + 1]


def test_final_round_client_per_tier_and_its_record(tmp_path, model, data_dir):
    with fake_server(model) as (port, _):
        r = _bench(tmp_path, port, model, data_dir, "--round", "final", CONCURRENCY_8_16K="12")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "variables" not in r.stderr
    calls = {c["tier"]: c["argv"] for c in _calls(tmp_path)}
    assert set(calls) == set(TIERS)
    for t, argv in calls.items():
        assert _opt(argv, "--max-concurrency") == ("12" if t == "8-16K" else "10")
        assert _opt(argv, "--request-rate") == "inf"
        assert _opt(argv, "--custom-output-len") == "1024"
        assert _opt(argv, "--num-warmups") == "2"
        assert _opt(argv, "--num-prompts") == str(FINALS[t])
        assert argv.count("--max-concurrency") == 1 and argv.count("--request-rate") == 1
    m = json.loads((tmp_path / "runs" / "f1" / "manifest.json").read_text())
    assert m["round"] == "final"
    cs = m["client_settings"]
    assert cs["differences"] == []
    assert cs["tiers"]["8-16K"]["max_concurrency"] == 12 and cs["tiers"]["8-16K"]["concurrency_from"] == "CONCURRENCY_8_16K"
    assert cs["tiers"]["4-8K"]["max_concurrency"] == 10 and cs["tiers"]["16-32K"]["num_prompts"] == 60
    assert {t: m["datasets"][t]["num_prompts"] for t in TIERS} == FINALS


def test_fewer_prompts_is_recorded_as_a_difference_from_the_finals(tmp_path, model, data_dir):
    with fake_server(model) as (port, _):
        r = _bench(tmp_path, port, model, data_dir, "--round", "final", "--num-prompts", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(_opt(c["argv"], "--num-prompts") == "12" for c in _calls(tmp_path))
    diffs = json.loads((tmp_path / "runs" / "f1" / "manifest.json").read_text())["client_settings"]["differences"]
    assert sorted(diffs) == sorted(f"tier {t}: --num-prompts 12 (the final round sends {n})" for t, n in FINALS.items())


def test_the_preliminary_client_is_unchanged_by_default(tmp_path, model, data_dir):
    with fake_server(model) as (port, _):
        r = _bench(tmp_path, port, model, data_dir, "--num-prompts", "3", CONCURRENCY_4_8K="7")
    assert r.returncode == 0, r.stderr[-2000:]
    for c in _calls(tmp_path):
        assert _opt(c["argv"], "--max-concurrency") == "1" and _opt(c["argv"], "--request-rate") == "1"
        assert _opt(c["argv"], "--num-prompts") == "3"
    assert json.loads((tmp_path / "runs" / "f1" / "manifest.json").read_text())["round"] == "preliminary"
    # the variable it did not read is named, so a team that forgot --round final sees it
    assert "CONCURRENCY_4_8K set: the final round's variables; the preliminary round's client reads none" in r.stderr


@pytest.mark.parametrize("first,then", [(["--round", "final"], []), ([], ["--round", "final"])])
def test_a_run_of_one_round_is_not_resumed_in_the_other(tmp_path, model, data_dir, first, then):
    with fake_server(model) as (port, _):
        r = _bench(tmp_path, port, model, data_dir, "--tiers", "4-8K", "--num-prompts", "2", *first)
        assert r.returncode == 0, r.stderr[-2000:]
        mpath = tmp_path / "runs" / "f1" / "manifest.json"
        before = mpath.read_bytes()
        n = len(_calls(tmp_path))
        r = _bench(tmp_path, port, model, data_dir, "--tiers", "8-16K", "--num-prompts", "2", *then)
    was, now = ("final", "preliminary") if first else ("preliminary", "final")
    assert r.returncode == 2 and f"run f1 was measured in the {was} round; this is the {now} round" in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2 and "Traceback" not in r.stderr
    assert mpath.read_bytes() == before and len(_calls(tmp_path)) == n       # nothing written, nothing run


def test_a_resume_may_not_change_a_finished_tiers_concurrency(tmp_path, model, data_dir):
    with fake_server(model) as (port, _):
        assert _bench(tmp_path, port, model, data_dir, "--round", "final", "--tiers", "4-8K",
                      "--num-prompts", "2").returncode == 0
        r = _bench(tmp_path, port, model, data_dir, "--round", "final", "--num-prompts", "2", CONCURRENCY_4_8K="16")
    assert r.returncode == 2 and "tier 4-8K was measured with other client settings" in r.stderr
    assert "max_concurrency 10 -> 16" in r.stderr


@pytest.mark.parametrize("var,value", [("CONCURRENCY_4_8K", "0"), ("CONCURRENCY_16_32K", "257"),
                                       ("CONCURRENCY_8_16K", "ten"), ("CONCURRENCY_8_16K", "2.5")])
def test_a_bad_concurrency_is_refused_before_anything_runs(tmp_path, model, data_dir, var, value):
    with fake_server(model) as (port, _):
        r = _bench(tmp_path, port, model, data_dir, "--round", "final", **{var: value})
    assert r.returncode == 2 and var in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "replay.log").exists()


# --- score --round final -----------------------------------------------------------------------------

def _final_run(tmp_path, name, src):
    """A copy of a fixture run recorded as a final-round run at the finals' baseline configuration (each tier's
    server values as forge serve records them, the client at the baseline's concurrency)."""
    d = tmp_path / name
    shutil.copytree(FIXTURE_RUNS / src, d)
    m = json.loads((d / "manifest.json").read_text())
    m["round"] = "final"
    base = rounds.load_round(rules.load_contest(), "final").baseline.as_dict()
    m["servers_by_tier"] = {t: {"round": "final", "tier": t, "settings": base, "sources": {k: "baseline" for k in base}}
                            for t in TIERS}
    (d / "manifest.json").write_text(json.dumps(m))
    for t in TIERS:
        res = json.loads((d / f"{t}.json").read_text())
        (d / f"{t}.json").write_text(json.dumps({**res, "max_concurrency": base["concurrency"]}))
    return d


def _formula(run, base):
    """The contest formula written out independently of forge.score (weights 20/50/30)."""
    tok = {d: {t: json.loads((d / f"{t}.json").read_text())["output_throughput"] for t in TIERS} for d in (run, base)}
    return sum(w * (0.6 + 0.4 * (1 - math.exp(-1.3 * (tok[run][t] / tok[base][t] - 1))))
               for t, w in zip(TIERS, (20, 50, 30)))


def test_score_final_against_a_final_baseline_run(tmp_path):
    run, base = _final_run(tmp_path, "fast", "fast"), _final_run(tmp_path, "upstream", "base")
    r = forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline", str(base))
    assert r.returncode == 0, r.stderr
    res = json.loads((run / "score.json").read_text())
    assert res["round"] == "final" and res["total"] == pytest.approx(_formula(run, base))
    for t in TIERS:
        p99 = json.loads((base / f"{t}.json").read_text())["p99_ttft_ms"]
        assert res["tiers"][t]["ttft_p99_limit_ms"] == pytest.approx(1.5 * p99)
    assert res["tpot_p99_limit_ms"] is not None and res["tpot_ok"] is True


def test_score_infers_the_round_from_the_run(tmp_path):
    run, base = _final_run(tmp_path, "fast", "fast"), _final_run(tmp_path, "upstream", "base")
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(base))
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "score.json").read_text())["round"] == "final"


def test_the_finals_unpublished_baseline_asks_for_a_baseline_run(tmp_path):
    run = _final_run(tmp_path, "fast", "fast")
    r = forge(tmp_path, "score", "--round", "final", "--run", str(run))
    assert r.returncode == 2 and "not published" in r.stderr and "--baseline RUN" in r.stderr
    assert not (run / "score.json").exists()
    r = forge(tmp_path, "score", "--round", "final", "--tok-s", "30,30,30")
    assert r.returncode == 2 and "not published" in r.stderr


@pytest.mark.parametrize("how", ["final run, preliminary baseline run", "final run, preliminary set",
                                 "preliminary run, final baseline run", "preliminary run, final set"])
def test_a_run_is_never_scored_against_a_baseline_of_the_other_round(tmp_path, how):
    final_run = "final run" in how
    run = _final_run(tmp_path, "fast", "fast") if final_run else tmp_path / "fast"
    if not final_run:
        shutil.copytree(FIXTURE_RUNS / "fast", run)
    if "baseline run" in how:
        base = FIXTURE_RUNS / "base" if final_run else _final_run(tmp_path, "upstream", "base")
        args = ["--baseline", str(base)]
    else:
        args = ["--baseline-name", "team" if final_run else "final"]
    r = forge(tmp_path, "score", "--run", str(run), *args)
    assert r.returncode == 2 and "round" in r.stderr and "of its own round" in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2 and not (run / "score.json").exists()


def test_round_given_must_be_the_runs_own(tmp_path):
    run = tmp_path / "fast"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    r = forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline",
              str(_final_run(tmp_path, "upstream", "base")))
    assert r.returncode == 2 and "preliminary round" in r.stderr and not (run / "score.json").exists()


def test_the_final_baseline_set_carries_its_source_and_nulls():
    from forge.contest import rules
    s = rules.load_contest()["baselines"]["sets"]["final"]
    assert s["round"] == "final" and set(s["tok_s"].values()) == {None}
    assert "280.9 / 376.9 / 752.6 s" in s["source"] and "+25 / +44 / +76 %" in s["source"]


def test_a_null_tok_s_in_a_preliminary_set_is_refused(tmp_path):
    import yaml

    from forge.contest import rules
    from forge.errors import ForgeError
    data = yaml.safe_load((Path(rules.__file__).resolve().parents[3] / "configs" / "contest.yaml").read_text())
    data["baselines"]["sets"]["official"]["tok_s"]["8-16K"] = None
    p = tmp_path / "contest.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ForgeError, match="official.tok_s.8-16K"):
        rules.load_contest(str(p))


def test_a_round_sending_more_requests_than_the_workload_holds_repeats_its_pairs():
    from forge.contest import rules
    from forge.run import bench_data, synth
    pairs = synth.load_workload(rules.load_contest())["tiers"]["4-8K"]["requests"]
    out = bench_data.workload_pairs(pairs, 80)
    assert len(pairs) == 50 and len(out) == 80
    assert out[:50] == list(pairs) and out[50:] == list(pairs[:30])
    assert bench_data.workload_pairs(pairs, 12) == synth.stratified(pairs, 12)   # fewer: as the preliminary picks them
    assert bench_data.workload_pairs(pairs, None) == list(pairs)
