"""forge compare: deltas with a noise band from repeated runs; 'within noise' only when it is."""

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
    same = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(FIXTURE_RUNS / "base"))
    assert all(l.endswith("within noise") for l in same.stdout.splitlines()[1:-1])


def test_missing_run_is_a_clear_error(tmp_path):
    r = forge(tmp_path, "compare", "--a", str(tmp_path / "nope"), "--b", str(FIXTURE_RUNS / "base"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_runs_missing_a_tier_count_only_where_they_have_it(tmp_path):
    part = tmp_path / "part"
    shutil.copytree(FIXTURE_RUNS / "fast", part)
    (part / "4-8K.json").unlink()
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
