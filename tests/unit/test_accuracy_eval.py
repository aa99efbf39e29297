"""forge accuracy: LongBench metrics against hand-computed values, our evaluator against a server,
the official script's output recorded, and A/B giving the contest's accuracy factor."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import fake_server, forge, tiny_model  # noqa: E402

from forge.run import accuracy  # noqa: E402


def test_qa_f1_hand_computed():
    assert accuracy.qa_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    # pred tokens {paris, france}, truth {paris}: P = 1/2, R = 1 -> F1 = 2/3
    assert accuracy.qa_f1("Paris, France", "Paris") == pytest.approx(2 / 3)
    assert accuracy.qa_f1("London", "Paris") == 0.0


def test_rouge_l_hand_computed():
    pytest.importorskip("rouge_score")
    # LCS of "a b c d" and "a c d e" is "a c d": P = R = 3/4
    assert accuracy.rouge_l("alpha bravo charlie delta", "alpha charlie delta echo") == pytest.approx(0.75)


def test_list_match():
    assert accuracy.list_match("keys: apple, plum", ["apple", "pear", "plum"]) == pytest.approx(2 / 3)
    assert accuracy.list_match("APPLE pear plum", "apple, pear, plum") == 1.0


def test_evaluator_queries_the_server(tmp_path):
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "acc"
    data.mkdir()
    recs = [{"context": "Answer key: Paris\nmore text", "input": "capital of France?", "answers": ["Paris"]},
            {"context": "Answer key: Rome", "input": "capital of France?", "answers": ["Paris"]}]
    (data / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (data / "retrieval_multi_point.jsonl").write_text(
        json.dumps({"context": "x", "input": "Answer key: apple plum", "answers": [["apple", "pear", "plum"]]}) + "\n")
    with fake_server(model) as (port, _):
        r = forge(tmp_path, "accuracy", "--data", str(data), "--port", str(port), "--run-id", "a1")
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "runs" / "a1" / "accuracy.json").read_text())
    assert out["mode"] == "forge"
    assert out["scores"]["hotpotqa"] == pytest.approx(50.0)          # one exact, one wrong
    assert out["scores"]["retrieval_multi_point"] == pytest.approx(200 / 3)


def test_official_script_is_run_and_recorded(tmp_path):
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "official"
    data.mkdir()
    (data / "run_accuracy.sh").write_text('echo "server at $HOST:$PORT"\necho "hotpotqa: 77.50"\n'
                                          'echo "gov_report  score 31.2"\n')
    with fake_server(model) as (port, _):
        r = forge(tmp_path, "accuracy", "--port", str(port), "--run-id", "o1", DATA_DIR=str(data))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "runs" / "o1" / "accuracy.json").read_text())
    assert out["mode"] == "official" and out["exit_code"] == 0
    assert out["scores"] == {"hotpotqa": 77.5, "gov_report": 31.2}
    assert f"127.0.0.1:{port}" in Path(out["log"]).read_text()


def test_ab_gives_the_accuracy_factor(tmp_path):
    for name, scores in (("a", {"hotpotqa": 80.0, "gov_report": 40.0}), ("b", {"hotpotqa": 78.0, "gov_report": 40.0})):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        (d / "accuracy.json").write_text(json.dumps({"scores": scores}))
    r = forge(tmp_path, "accuracy", "--a", str(tmp_path / "runs" / "a"), "--b", str(tmp_path / "runs" / "b"))
    assert r.returncode == 0, r.stderr
    # mean 60 -> 59: loss 1.67 % -> factor 0.97
    assert "relative loss 1.67 %" in r.stdout and "accuracy factor 0.97" in r.stdout
    assert "-2.50%" in r.stdout


def test_no_server_is_a_clear_error(tmp_path):
    from helpers import free_port
    r = forge(tmp_path, "accuracy", "--data", str(tmp_path), "--port", str(free_port()))
    assert r.returncode == 2 and "no server answers" in r.stderr


# --- failures, interruptions and recorded results ------------------------------------------------

def _official(tmp_path, body: str) -> Path:
    data = tmp_path / "official"
    data.mkdir()
    (data / "run_accuracy.sh").write_text(body)
    return data


@pytest.mark.parametrize("body", ['echo "hotpotqa 55.0"\nexit 3\n', "exit 1\n"])
def test_failed_official_script_is_an_error_and_not_recorded(tmp_path, body):
    model = tiny_model(tmp_path / "model")
    data = _official(tmp_path, body)
    with fake_server(model) as (port, _):
        r = forge(tmp_path, "accuracy", "--port", str(port), "--run-id", "f1", DATA_DIR=str(data))
    code = body.rsplit("exit ", 1)[1].strip()
    assert r.returncode == 2, r.stderr
    assert "run_accuracy.sh" in r.stderr and f"exited {code}" in r.stderr and "accuracy.failed.log" in r.stderr
    rdir = tmp_path / "runs" / "f1"
    assert not (rdir / "accuracy.json").exists()              # score finds no accuracy result
    failed = json.loads((rdir / "accuracy.failed.json").read_text())
    assert failed["exit_code"] == int(code)
    assert (rdir / "accuracy.failed.log").is_file()


def _hotpot(data: Path, n: int) -> None:
    data.mkdir(exist_ok=True)
    recs = [{"context": f"Answer key: {'Paris' if i % 2 == 0 else 'Rome'}", "input": "capital of France?",
             "answers": ["Paris"]} for i in range(n)]
    (data / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_interrupted_evaluation_resumes_where_it_stopped(tmp_path):
    import signal
    import subprocess
    import time

    from helpers import ROOT, forge_env
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "acc"
    _hotpot(data, 5000)
    rdir = tmp_path / "runs" / "r1"
    errlog = tmp_path / "first.err"
    with fake_server(model) as (port, _), open(errlog, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "forge", "accuracy", "--data", str(data), "--port", str(port),
                              "--run-id", "r1"], cwd=ROOT, env=forge_env(tmp_path),
                             stdout=subprocess.DEVNULL, stderr=err, text=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60 and p.poll() is None and "hotpotqa: 100/" not in errlog.read_text():
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
        assert p.returncode == 130, errlog.read_text()
        assert not (rdir / "accuracy.json").exists()
        saved = (rdir / "accuracy.progress.jsonl").read_text().splitlines()
        done = len(saved) - 1                                  # the first line holds the settings
        assert 60 <= done < 5000
        # a cut-short last line (an interrupted write) is dropped, not misread
        with open(rdir / "accuracy.progress.jsonl", "a") as f:
            f.write('{"task": "hotpotqa", "i": ')
        # other settings are not mixed into the saved results
        r = forge(tmp_path, "accuracy", "--data", str(data), "--port", str(port), "--run-id", "r1", "--limit", "10")
        assert r.returncode == 2 and "--force" in r.stderr, r.stderr
        r = forge(tmp_path, "accuracy", "--data", str(data), "--port", str(port), "--run-id", "r1")
    assert r.returncode == 0, r.stderr
    assert f"resuming: {done} records" in r.stderr
    assert "accuracy hotpotqa: 10/" not in r.stderr            # the saved records are not asked again
    out = json.loads((rdir / "accuracy.json").read_text())
    assert len(out["per_request"]["hotpotqa"]) == 5000
    assert out["scores"]["hotpotqa"] == pytest.approx(50.0)
    assert not (rdir / "accuracy.progress.jsonl").exists()


def test_recorded_accuracy_is_replaced_only_with_force(tmp_path):
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "acc"
    _hotpot(data, 4)
    rdir = tmp_path / "runs" / "k1"
    rdir.mkdir(parents=True)
    full = {"mode": "forge", "limit": None, "scores": {"hotpotqa": 77.0}}
    (rdir / "accuracy.json").write_text(json.dumps(full))
    with fake_server(model) as (port, _):
        r = forge(tmp_path, "accuracy", "--data", str(data), "--port", str(port), "--run-id", "k1", "--limit", "2")
        assert r.returncode == 2 and "already holds" in r.stderr and "--force" in r.stderr, r.stderr
        assert json.loads((rdir / "accuracy.json").read_text()) == full
        r = forge(tmp_path, "accuracy", "--data", str(data), "--port", str(port), "--run-id", "k1", "--limit", "2",
                  "--force")
    assert r.returncode == 0, r.stderr
    out = json.loads((rdir / "accuracy.json").read_text())
    assert out["limit"] == 2 and out["scores"]["hotpotqa"] == pytest.approx(50.0)


def test_a_recorded_result_is_compared_with_the_baseline_without_a_server(tmp_path):
    """`accuracy --run-id R --baseline B` on a run that already has its result compares that result
    (make accuracy RUN=R BASELINE=B); it neither refuses nor needs a server."""
    runs_dir = tmp_path / "runs"
    for name, v in (("base", 80.0), ("k1", 79.0)):
        (runs_dir / name).mkdir(parents=True)
        (runs_dir / name / "accuracy.json").write_text(json.dumps({"mode": "forge", "limit": None,
                                                                    "scores": {"hotpotqa": v}}))
    before = (runs_dir / "k1" / "accuracy.json").read_text()
    r = forge(tmp_path, "accuracy", "--run-id", "k1", "--baseline", str(runs_dir / "base"))
    assert r.returncode == 0, r.stderr
    assert "hotpotqa" in r.stdout and "80.00" in r.stdout and "79.00" in r.stdout
    assert (runs_dir / "k1" / "accuracy.json").read_text() == before


def test_no_server_leaves_no_run_folder(tmp_path):
    from helpers import free_port
    data = tmp_path / "acc"
    _hotpot(data, 2)
    r = forge(tmp_path, "accuracy", "--data", str(data), "--port", str(free_port()), "--run-id", "n1")
    assert r.returncode == 2 and "no server answers" in r.stderr
    assert not (tmp_path / "runs" / "n1").exists()
