"""forge compare: deltas with a noise band from repeated runs; 'within noise' only when it is."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, forge  # noqa: E402

from forge.run import compare  # noqa: E402


def test_band_from_repeats_is_two_standard_errors():
    d = compare.delta([10.0, 10.2, 9.8], [10.1, 10.3, 9.9], noise_pct=3)
    # std of each side = 0.2; 2*sqrt(0.04/3 + 0.04/3) = 0.3266
    assert d["band"] == pytest.approx(0.32660, abs=1e-4) and d["within_noise"]
    d = compare.delta([10.0, 10.2, 9.8], [11.0, 11.2, 10.8], noise_pct=3)
    assert not d["within_noise"] and d["delta"] == pytest.approx(1.0)


def test_single_runs_use_the_assumed_band():
    assert compare.delta([100.0], [102.9], 3)["within_noise"]
    assert not compare.delta([100.0], [103.1], 3)["within_noise"]


def test_cli_on_recorded_runs(tmp_path):
    r = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(FIXTURE_RUNS / "fast"))
    assert r.returncode == 0, r.stderr
    rows = {l.split()[0] + " " + l.split()[1]: l for l in r.stdout.splitlines()[1:-1]}
    # the fast fake server streams twice as fast: TTFT P99 clearly lower on every tier
    for t in ("4-8K", "8-16K", "16-32K"):
        assert rows[f"{t} TTFT"].endswith("B lower")
    # TPOT P99 per tier, each side's from its results (a final-round run is often one tier: no pooled row)
    for t in ("4-8K", "8-16K", "16-32K"):
        a, b = (json.loads((FIXTURE_RUNS / run / f"{t}.json").read_text())["p99_tpot_ms"] for run in ("base", "fast"))
        assert a != b
        assert [float(x) for x in rows[f"{t} TPOT"].split()[4:6]] == pytest.approx([a, b], abs=0.006), rows[f"{t} TPOT"]
    same = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(FIXTURE_RUNS / "base"))
    assert all(l.endswith("within noise") for l in same.stdout.splitlines()[1:-1])


def test_missing_run_is_a_clear_error(tmp_path):
    r = forge(tmp_path, "compare", "--a", str(tmp_path / "nope"), "--b", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_runs_missing_a_tier_count_only_where_they_have_it(tmp_path):
    part = tmp_path / "part"               # a second run of fast's profile that did not run 4-8K
    shutil.copytree(FIXTURE_RUNS / "fast", part)
    (part / "4-8K.json").unlink()
    for tier in ("8-16K", "16-32K"):       # measured again: its own date and times (a copy is no repeat)
        f = part / f"{tier}.json"
        d = json.loads(f.read_text())
        f.write_text(json.dumps({**d, "date": "20261130-050000", "ttfts": [t * 1.02 for t in d["ttfts"]]}))
    r = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(FIXTURE_RUNS / "fast"), str(part))
    assert r.returncode == 0, r.stderr
    rows = {" ".join(l.split()[:2]): l.split() for l in r.stdout.splitlines()[1:-1]}
    assert rows["4-8K tok/s"][-3] == "1+1" and rows["8-16K tok/s"][-3] == "1+2"
    assert rows["pooled TPOT"][-3] == "1+1"          # pooled TPOT and score: complete runs only
    r = forge(tmp_path, "compare", "--a", str(part), "--b", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 0, r.stderr
    last = r.stdout.splitlines()[-1]
    assert last.startswith("not compared:") and "4-8K tok/s (no run on side A)" in last
    assert "pooled TPOT P99 ms (no run on side A)" in last and "8-16K" not in last
    empty = tmp_path / "empty"
    empty.mkdir()
    r = forge(tmp_path, "compare", "--a", str(empty), "--b", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 2 and "no tier results" in r.stderr and "Traceback" not in r.stderr


def _harness_runs(tmp_path, reference_in_summary: bool):
    """An e2e-style results folder: runs/upstream and runs/fast marked as harness runs."""
    import json
    root = tmp_path / "e2e"
    for name, src in (("upstream", "base"), ("fast", "fast")):
        shutil.copytree(FIXTURE_RUNS / src, root / "runs" / name)
        man = root / "runs" / name / "manifest.json"
        man.write_text(json.dumps({**json.loads(man.read_text()), "harness": True}))
    if reference_in_summary:
        (root / "summary.json").write_text(json.dumps({"reference": "upstream"}))
    return root / "runs"


def _rows(out: str) -> dict:
    return {" ".join(l.split()[:2]): l.split() for l in out.splitlines()[1:]}


def test_harness_runs_are_never_scored_against_the_dcu_baseline(tmp_path):
    from forge.contest import rules as contest
    from forge.run import score
    rdir = _harness_runs(tmp_path, reference_in_summary=False)
    r = forge(tmp_path, "compare", "--a", str(rdir / "upstream"), "--b", str(rdir / "fast"))
    assert r.returncode == 0, r.stderr
    assert "default baseline" not in r.stdout
    last = r.stdout.splitlines()[-1]
    assert last.startswith("not compared:") and "score" in last and "harness" in last and "--reference" in last
    # against the same run's reference, given or found through the results' summary.json
    c = contest.load_contest()
    want = score.score(c, score.load_run(rdir / "fast", c), score.baseline_from_run(rdir / "upstream", c))
    given = forge(tmp_path, "compare", "--a", str(rdir / "upstream"), "--b", str(rdir / "fast"),
                  "--reference", str(rdir / "upstream"))
    shutil.rmtree(tmp_path / "e2e")
    rdir = _harness_runs(tmp_path, reference_in_summary=True)
    found = forge(tmp_path, "compare", "--a", str(rdir / "upstream"), "--b", str(rdir / "fast"))
    for res in (given, found):
        assert res.returncode == 0, res.stderr
        row = _rows(res.stdout)["score (reference"]
        assert row[3:5] == ["60.00", f"{want['total']:.2f}"]
        assert "default baseline" not in res.stdout and "upstream" in res.stdout
    # a harness run and a DCU run share no baseline: no score row, or a refused reference
    mixed = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(rdir / "fast"))
    assert mixed.returncode == 0 and "score (" not in mixed.stdout.split("noise band")[0]
    assert "score" in mixed.stdout.splitlines()[-1]
    bad = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(rdir / "fast"),
                "--reference", str(rdir / "upstream"))
    assert bad.returncode == 2 and "harness" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("pct", ["-5", "0", "nan"])
def test_noise_pct_must_be_positive(tmp_path, pct):
    r = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(FIXTURE_RUNS / "fast"),
              "--noise-pct", pct)
    assert r.returncode == 2 and "--noise-pct" in r.stderr and "Traceback" not in r.stderr
