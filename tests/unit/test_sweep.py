"""forge sweep end to end against the fake server: for each profile, its server starts with the
profile's environment, every tier runs, the server stops and the run is scored; one line per run."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, SUPPORT, forge, free_port, health, tiny_model  # noqa: E402

FAKE = f"{sys.executable} {SUPPORT / 'fakeserver.py'}"
REPLAY = f"{sys.executable} {SUPPORT / 'replayclient.py'}"
TIERS = ("4-8K", "8-16K", "16-32K")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def test_sweep_serves_benches_scores_and_stops_each_profile(tmp_path, model):
    port = free_port()
    r = forge(tmp_path, "sweep", "upstream", "fast-decode", "--model", str(model), "--vllm", FAKE,
              "--client", REPLAY, "--port", str(port), "--num-prompts", "2", "--timeout", "30",
              timeout=300, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "replay.log"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert not health(port), "the last server is stopped"
    assert not (tmp_path / "build" / "serve" / "server.json").exists()
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    by_profile = {json.loads((d / "serve.json").read_text())["profile"]: d for d in runs}
    assert set(by_profile) == {"upstream", "fast-decode"}
    # each server ran with its own profile's environment
    assert "VLLM_FORGE_DECODE=1" in (by_profile["fast-decode"] / "server.log").read_text()
    assert "VLLM_FORGE_DECODE=1" not in (by_profile["upstream"] / "server.log").read_text()
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["profile", "run", "score"]
    for d in runs:
        s = json.loads((d / "score.json").read_text())
        for t in TIERS:               # the scored tok/s are the replayed client results, tier by tier
            fixture = json.loads((FIXTURE_RUNS / "base" / f"{t}.json").read_text())
            assert s["tiers"][t]["tok_s"] == pytest.approx(fixture["output_throughput"], rel=1e-9)
        assert any(line.split()[1] == d.name and line.split()[2] == s["display"] for line in lines[1:])


def test_sweep_refuses_an_unknown_profile_before_starting_anything(tmp_path, model):
    port = free_port()
    r = forge(tmp_path, "sweep", "upstream", "no-such-profile", "--model", str(model), "--vllm", FAKE,
              "--client", REPLAY, "--port", str(port))
    assert r.returncode == 2 and "no-such-profile" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


def test_sweep_of_a_profile_given_as_a_path_makes_a_fresh_run_each_time(tmp_path, model):
    prof = tmp_path / "mine.yaml"          # a profile file outside configs/serve/, given by its path
    prof.write_text((Path(__file__).resolve().parents[2] / "configs" / "serve" / "fast-decode.yaml").read_text())
    for n in (1, 2):
        r = forge(tmp_path, "sweep", str(prof), "--model", str(model), "--vllm", FAKE, "--client", REPLAY,
                  "--port", str(free_port()), "--num-prompts", "1", "--timeout", "30", timeout=300,
                  REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "replay.log"))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs = sorted((tmp_path / "runs").iterdir())
        # a new run named after the profile each time, never the earlier one's folder reused
        assert len(runs) == n and all("-mine" in d.name and ".yaml" not in d.name for d in runs)
        assert all((d / "score.json").is_file() for d in runs)
        assert r.stdout.strip().splitlines()[-1].split()[1] in {d.name for d in runs}


@pytest.mark.parametrize("repeat", ["0", "-1"])
def test_sweep_refuses_a_repeat_below_one(tmp_path, model, repeat):
    r = forge(tmp_path, "sweep", "upstream", "--model", str(model), "--vllm", FAKE, "--client", REPLAY,
              "--port", str(free_port()), "--repeat", repeat)
    assert r.returncode == 2 and "--repeat" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()
