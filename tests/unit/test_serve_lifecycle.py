"""forge serve / forge stop against the fake server started the way vLLM is (`... serve MODEL --port ...`):
health wait, run folder, state, stopping only our process group, early-exit diagnosis."""

import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import SUPPORT, forge, free_port, health, tiny_model  # noqa: E402

from forge.contest import profiles  # noqa: E402
from forge.contest import rules as contest  # noqa: E402
from forge.run import serve  # noqa: E402

FAKE = f"{sys.executable} {SUPPORT / 'fakeserver.py'}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def test_dry_run_prints_the_checked_command(tmp_path, model):
    r = forge(tmp_path, "serve", "--profile", "int8kv", "--model", str(model), "--dry-run")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if "vllm serve" in l)
    assert line.startswith("VLLM_FORGE_DECODE=0 ")
    c = contest.load_contest()
    script = " ".join(c["server"]["start_script"]["command"].split()).replace("$MODEL_DIR", str(model))
    assert shlex.split(line.split(" vllm serve ", 1)[1]) == shlex.split(script)[2:] + ["--kv-cache-dtype", "int8"]
    assert "NO_PROXY=" in line


def test_dry_run_of_the_contest_profile_is_the_organizers_start_script(tmp_path, model):
    """`make serve PROFILE=contest` runs exactly the organizers' start script (with the model
    directory), its environment added in front."""
    r = forge(tmp_path, "serve", "--profile", "contest", "--model", str(model), "--dry-run")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if "vllm serve" in l)
    env_part, cmd = line.split(" vllm serve ", 1)
    c = contest.load_contest()
    script = " ".join(c["server"]["start_script"]["command"].split()).replace("$MODEL_DIR", str(model))
    assert ["vllm", "serve", *shlex.split(cmd)] == shlex.split(script)
    assert all(w.split("=")[0].startswith(("VLLM_FORGE_", "NO_PROXY", "no_proxy")) for w in shlex.split(env_part))


def test_forbidden_profile_is_refused_before_start(tmp_path, model, monkeypatch):
    prof = tmp_path / "bad.yaml"
    prof.write_text("description: x\noptions:\n  --max-num-seqs:\n    value: '4'\n    effect: more batching\n")
    r = forge(tmp_path, "serve", "--profile", str(prof), "--model", str(model), "--dry-run")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "batch-scheduler options is forbidden" in r.stderr and "bad.yaml" in r.stderr


def test_serve_health_stop_only_ours(tmp_path, model):
    port = free_port()
    r = forge(tmp_path, "serve", "--profile", "fast-decode", "--model", str(model), "--vllm", FAKE,
              "--port", str(port), "--run-id", "s1", "--timeout", "30")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "s1"
    assert health(port)
    state = json.loads((tmp_path / "build" / "serve" / "server.json").read_text())
    log = (tmp_path / "runs" / "s1" / "server.log").read_text()
    assert "VLLM_FORGE_DECODE=1" in log                       # the profile's env reached the server
    serve_json = json.loads((tmp_path / "runs" / "s1" / "serve.json").read_text())
    assert serve_json["command"][:3] == ["vllm", "serve", str(model)] and serve_json["scored_port"] is False
    # a second server is refused while ours runs
    r2 = forge(tmp_path, "serve", "--profile", "upstream", "--model", str(model), "--vllm", FAKE, "--port", str(free_port()))
    assert r2.returncode == 2 and "already running" in r2.stderr
    r3 = forge(tmp_path, "stop")
    assert r3.returncode == 0 and "terminated" in r3.stderr
    for _ in range(50):
        if not health(port):
            break
        time.sleep(0.1)
    assert not health(port)
    with pytest.raises(ProcessLookupError):
        os.kill(state["pid"], 0)
    assert forge(tmp_path, "stop").returncode == 0


def test_stop_leaves_a_process_that_reused_the_pid_alone(tmp_path):
    # state that names a live process (this test) but with another start time: not ours
    st = tmp_path / "build" / "serve" / "server.json"
    st.parent.mkdir(parents=True)
    st.write_text(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "start_time": "1", "run_id": "x",
                              "cmdline": ["vllm", "serve", "/m"], "server_args": ["serve", "/m"], "boot_id": None}))
    r = forge(tmp_path, "stop")
    assert r.returncode == 0 and "now belongs to a different process" in r.stderr and "nothing was signalled" in r.stderr
    assert not st.exists()
    os.kill(os.getpid(), 0)                                   # and this process was left alone


@pytest.mark.parametrize("message,cause", [
    ("OSError: [Errno 98] Address already in use", "port 8001 is already in use"),
    ("vllm serve: error: unrecognized arguments: --bogus", "rejected an option"),
    ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB", "ran out of memory"),
    ("OSError: /m does not appear to have a file named config.json", "model directory is missing"),
])
def test_early_exit_shows_log_tail_and_cause(tmp_path, model, message, cause):
    r = forge(tmp_path, "serve", "--profile", "upstream", "--model", str(model), "--vllm", FAKE,
              "--port", str(free_port()), "--timeout", "20", FAKE_FAIL_START=message)
    assert r.returncode == 2
    assert "exited (code 1) before it became ready" in r.stderr
    assert message in r.stderr                      # the log tail
    assert cause in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "build" / "serve" / "server.json").exists()


def test_missing_model_and_busy_port(tmp_path, model):
    r = forge(tmp_path, "serve", "--model", str(tmp_path / "nope"), "--vllm", FAKE, "--port", str(free_port()))
    assert r.returncode == 2 and "no config.json" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = forge(tmp_path, "serve", "--model", str(model), "--vllm", FAKE, "--port", str(port))
    assert r.returncode == 2 and f"port {port}" in r.stderr and "already in use" in r.stderr


def test_health_timeout_stops_the_server(tmp_path, model):
    port = free_port()
    r = forge(tmp_path, "serve", "--profile", "upstream", "--model", str(model), "--vllm", FAKE,
              "--port", str(port), "--timeout", "1.5", FAKE_STARTUP_S="60")
    assert r.returncode == 2 and "did not answer" in r.stderr
    time.sleep(0.3)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()


def test_container_command_has_the_dcu_device_flags():
    c = contest.load_contest()
    r = profiles.render(profiles.load_profile("contest", c), "/models/q", c)
    cmd = serve.launch_command(r, image="img@sha256:abc", vllm_cmd=None, port=8001, container="forge-x", shm_size="64g")
    text = " ".join(cmd)
    for flag in ("--device=/dev/kfd", "--device=/dev/mkfd", "--device=/dev/dri", "/opt/hyhal:/opt/hyhal:ro",
                 "--group-add video", "--ipc=host", "--shm-size=64g", "-v /models/q:/models/q:ro",
                 "-e VLLM_FORGE_DECODE=1", "-e NO_PROXY="):
        assert flag in text
    i = cmd.index("img@sha256:abc")
    assert cmd[i - 2:i] == ["--entrypoint", "vllm"] and cmd[i + 1] == "serve" and cmd[i + 2:] == r["argv"][2:]


def test_known_failure_patterns_are_distinct():
    found = serve.diagnose("RuntimeError: Address already in use")
    assert len(found) == 1 and "port" in found[0][0]
    assert serve.diagnose("all good") == []


def test_foreground_execs_the_checked_command(monkeypatch, tmp_path):
    seen = {}

    def fake_exec(file, argv, env):
        seen.update(file=file, argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(serve.os, "execvpe", fake_exec)
    from forge.cli import main
    with pytest.raises(SystemExit):
        main(["serve", "--foreground", "--profile", "int8kv", "--model", str(tmp_path), "--vllm", "vllm"])
    assert seen["argv"][:3] == ["vllm", "serve", str(tmp_path.resolve())]
    assert "--kv-cache-dtype" in seen["argv"] and seen["argv"][seen["argv"].index("--port") + 1] == "8001"
    assert seen["env"]["NO_PROXY"]


def test_a_run_keeps_the_profile_it_was_measured_with(tmp_path, model):
    client = f"{sys.executable} {SUPPORT / 'benchclient.py'}"
    bench = ("bench-all-tiers", "--num-prompts", "1", "--tiers", "4-8K", "--client", client)
    run = tmp_path / "runs" / "t1"

    def serve_(profile, *extra):
        return forge(tmp_path, "serve", "--profile", profile, "--model", str(model), "--vllm", FAKE,
                     "--port", str(free_port()), "--timeout", "30", *extra)

    try:
        assert serve_("contest", "--run-id", "t1").returncode == 0
        r = forge(tmp_path, *bench)
        assert r.returncode == 0, r.stderr
        assert forge(tmp_path, "stop").returncode == 0
        serve_json, manifest = (run / "serve.json").read_bytes(), (run / "manifest.json").read_bytes()
        # another profile's server is refused that run id: serve.json and the log stay the contest server's
        r = serve_("upstream", "--run-id", "t1")
        assert r.returncode == 2 and "run t1 was measured with profile contest" in r.stderr, r.stderr
        assert "would run profile upstream" in r.stderr and "new run" in r.stderr and "Traceback" not in r.stderr
        assert (run / "serve.json").read_bytes() == serve_json
        assert not (tmp_path / "build" / "serve" / "server.json").exists()
        # results of another profile's server are refused that run: nothing is relabelled
        assert serve_("upstream").returncode == 0
        r = forge(tmp_path, *bench, "--run-id", "t1")
        assert r.returncode == 2 and "run t1 was measured with profile contest" in r.stderr, r.stderr
        assert "the server answering now runs profile upstream" in r.stderr
        assert (run / "manifest.json").read_bytes() == manifest
        assert forge(tmp_path, "stop").returncode == 0
        # the same profile resumes
        assert serve_("contest", "--run-id", "t1").returncode == 0
        r = forge(tmp_path, *bench)
        assert r.returncode == 0 and "already done in run t1; kept" in r.stderr, r.stderr
        assert json.loads((run / "manifest.json").read_text())["profile"] == "contest"
    finally:
        forge(tmp_path, "stop")
