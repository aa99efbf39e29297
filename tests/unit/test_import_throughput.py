"""forge import-throughput: the organizers' run_throughput.sh result files (test/<tier>_throughput/
result.json in their testdata folder) become a run folder that `make score` reads like our own."""

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, forge  # noqa: E402


def their_folder(tmp_path: Path, tiers=("4-8K", "8-16K", "16-32K")) -> Path:
    """Their folder layout, holding the recorded `vllm bench serve --save-result` files of a fixture run."""
    d = tmp_path / "testdata"
    for t in tiers:
        (d / "test" / f"{t}_throughput").mkdir(parents=True)
        shutil.copyfile(FIXTURE_RUNS / "fast" / f"{t}.json", d / "test" / f"{t}_throughput" / "result.json")
    return d


def test_their_results_become_a_run_that_scores_like_ours(tmp_path):
    r = forge(tmp_path, "import-throughput", str(their_folder(tmp_path)), "--run-id", "theirs")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "runs" / "theirs"
    for t in ("4-8K", "8-16K", "16-32K"):
        assert (run / f"{t}.json").read_bytes() == (FIXTURE_RUNS / "fast" / f"{t}.json").read_bytes()
    man = json.loads((run / "manifest.json").read_text())
    assert "run_throughput.sh" in man["source"] and man["harness"] is False and man["profile"] == "contest"
    ours, theirs = tmp_path / "ours", tmp_path / "theirs-score"
    shutil.copytree(FIXTURE_RUNS / "fast", ours)
    shutil.copytree(run, theirs)
    a = forge(tmp_path, "score", "--run", str(ours), "--baseline", str(FIXTURE_RUNS / "base"))
    b = forge(tmp_path, "score", "--run", str(theirs), "--baseline", str(FIXTURE_RUNS / "base"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    sa, sb = (json.loads((p / "score.json").read_text()) for p in (ours, theirs))
    assert sa["total"] == sb["total"]


def test_a_folder_without_their_results_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    r = forge(tmp_path, "import-throughput", str(tmp_path / "empty"))
    assert r.returncode == 2 and "test/<tier>_throughput/result.json" in r.stderr and "Traceback" not in r.stderr
    d = their_folder(tmp_path, tiers=("8-16K",))
    (d / "test" / "8-16K_throughput" / "result.json").write_text('{"not": "a result"}')
    r = forge(tmp_path, "import-throughput", str(d))
    assert r.returncode == 2 and "not a `vllm bench serve` result" in r.stderr and "8-16K_throughput" in r.stderr
