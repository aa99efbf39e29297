"""Values a new user gives that reached a server, a score or a message unchecked: a serve profile's
switches and options, numbers typed on the command line, accuracy and server records read back, runs
with nothing to compare, and SIGTERM/SIGHUP while `forge serve` waits for the server. Each bad value is
refused before anything is written or started (exit code 2, one error line naming it and a `fix:` line,
`git status` as it was); a signal ends the verb with one line, its own exit code and the server stopped."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import FIXTURE_RUNS, ROOT, SUPPORT, forge, forge_env, free_port
from test_bad_inputs import copy_runs, make, refused, writes_nothing
from test_bad_inputs_records import calibrated_folder

from forge import proc
from forge.errors import ForgeError

# --- 7, 14: a serve profile's environment and options, refused at load (so --dry-run fails too) -----

def _profile(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "p.yaml"
    p.write_text("description: a profile with one bad value\n" + body)
    return p


def _env(name: str, value: str) -> str:
    return f"env:\n  {name}:\n    value: {json.dumps(value)}\n    effect: e\n"


@pytest.mark.parametrize("name,value,words", [
    ("VLLM_FORGE_DECODE", "yes", ["VLLM_FORGE_DECODE='yes'", "0, 1"]),
    ("VLLM_FORGE_DECODE", "true", ["VLLM_FORGE_DECODE='true'", "0, 1"]),
    ("VLLM_FORGE_GEMV", "maybe", ["VLLM_FORGE_GEMV='maybe'", "0, 1, auto"]),
    ("VLLM_FORGE_PREFILL", "on", ["VLLM_FORGE_PREFILL='on'"]),
    ("VLLM_FORGE_INT8_WRITE", "fast", ["VLLM_FORGE_INT8_WRITE='fast'", "triton, compiled"]),
    ("VLLM_FORGE_GEMV_SHAPES", "5120by17408", ["'5120by17408'", "NxK"]),
    ("VLLM_FORGE_DECODE", "1\n", ["env.VLLM_FORGE_DECODE", "line break"]),
    ("NCCL_DEBUG", "INFO\nLD_PRELOAD=/x.so", ["env.NCCL_DEBUG", "line break"]),
    ("VLLM_FORGE_DECOD", "1", ["VLLM_FORGE_DECOD is not a dcu-forge switch", "VLLM_FORGE_DECODE"]),
    ("LD_PRELOAD", "/tmp/x.so", ["LD_PRELOAD", "loader"]),
    ("LD_LIBRARY_PATH", "/tmp", ["LD_LIBRARY_PATH", "loader"]),
    ("PYTHONPATH", "/tmp", ["PYTHONPATH", "interpreter"]),
])
def test_a_profile_variable_is_one_of_its_values(tmp_path, name, value, words):
    prof = _profile(tmp_path, _env(name, value))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--profile", str(prof), "--dry-run", "--model", "/m")
    refused(r, "p.yaml", *words)


def test_the_switches_values_are_what_the_profiles_use():
    from forge import switches
    for name, value in (("VLLM_FORGE_DECODE", "0"), ("VLLM_FORGE_GEMV", "auto"), ("VLLM_FORGE_INT8_WRITE", "compiled"),
                        ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/1, 96x5120"), ("VLLM_FORGE_TUNED", "0")):
        assert switches.check(name, value, "here") == value
    assert switches.gemv_shapes("96x5120/2,96x5120/1", "here") == {(96, 5120): {1, 2}}
    assert switches.gemv_shapes("96x5120/12=mma,96x5120/1", "here") == {(96, 5120): {1, 12}}
    for both in ("96x5120/12=mma,96x5120/12", "96x5120/2=mma,96x5120"):     # one pair on two kernels
        with pytest.raises(ForgeError, match="both on the GEMV and on the skinny GEMM"):
            switches.gemv_shapes(both, "here")


@pytest.mark.parametrize("options,words", [
    ({"--kv-cache-dtype": "fp8", "--kv_cache_dtype": "auto"}, ["options.--kv-cache-dtype", "options.--kv_cache_dtype",
                                                               "two spellings"]),
    ({"--kv-cache-dtype": ""}, ["options.--kv-cache-dtype", "empty"]),
    ({"--kv-cache-dtype": float("inf")}, ["options.--kv-cache-dtype", "not a finite number"]),
    ({"--kv-cache-dtype": "inf"}, ["options.--kv-cache-dtype", "not a finite number"]),
    ({"--kv-cache-dtype": "-O3"}, ["options.--kv-cache-dtype", "'-O3'", "looks like an option"]),
])
def test_a_profile_option_has_one_spelling_and_a_real_value(tmp_path, options, words):
    body = "options:\n" + "".join(f"  {k}:\n    value: {'.inf' if v == float('inf') else json.dumps(v)}\n    effect: e\n"
                                  for k, v in options.items())
    prof = _profile(tmp_path, body)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--profile", str(prof), "--dry-run", "--model", "/m")
    refused(r, "p.yaml", *words)


# --- 17: numbers on the command line: plain digits, bounded, a run never its own baseline ----------

@pytest.mark.parametrize("args,words", [
    (["score", "--tok-s", "1_000,1,1"], ["--tok-s", "'1_000'", "not a number"]),
    (["score", "--tok-s", "\u0967\u0968,1,1"], ["--tok-s", "not a number"]),          # Devanagari 12
    (["predict", "--speedup", "gemv=1_5"], ["--speedup", "'1_5'", "not a number"]),
    (["compare", "--a", "x", "--b", "y", "--noise-pct", "1e308"], ["--noise-pct", "1e308"]),
    (["compare", "--a", "x", "--b", "y", "--noise-pct", "1_0"], ["--noise-pct", "1_0"]),
    (["accuracy", "--limit", "1_0"], ["--limit", "'1_0'", "whole number"]),
    (["predict", "--round", "final", "--top", "\u0665"], ["--top", "whole number"]),   # an option of a group
    (["serve", "--dry-run", "--model", "/m", "--timeout", "nan"], ["--timeout", "'nan'"]),
])
def test_a_number_is_plain_digits_in_range(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, *words)


def test_score_refuses_a_run_as_its_own_baseline(tmp_path):
    run, _ = copy_runs(tmp_path)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(run))
    refused(r, "same run folder")


# --- 9: accuracy results read as score reads them ---------------------------------------------------

@pytest.mark.parametrize("content,words", [
    ("[]", ["expected a JSON object"]),
    ("{}", ["'scores'"]),
    ('{"scores": {"qa": "high"}}', ["'scores.qa'", "'high'"]),
    ('{"scores": {"qa": NaN}}', ["'scores.qa'", "nan"]),
    ('{"scores": {"qa": 1e400}}', ["'scores.qa'", "inf"]),
    ('{"scores": {"qa": -3}}', ["'scores.qa'", "-3"]),
])
def test_accuracy_a_b_reads_results_as_score_does(tmp_path, content, words):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, text in ((a, content), (b, '{"scores": {"qa": 50.0}}')):
        d.mkdir()
        (d / "accuracy.json").write_text(text)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "accuracy", "--a", str(a), "--b", str(b))
    refused(r, "accuracy.json", *words)
    # forge score refuses the same file with the same words
    run, base = copy_runs(tmp_path)
    shutil.copy(a / "accuracy.json", run / "accuracy.json")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(base))
    refused(r, "accuracy.json", *words)


# --- 10: a damaged server record of an e2e results folder --------------------------------------------

@pytest.mark.parametrize("record,words", [
    ([], ["a JSON list"]),
    ({"env": "x"}, ["key 'env'"]),
    ({"command": 5}, ["key 'command'"]),
    ({"launch": ["vllm", 5]}, ["key 'launch'"]),
])
def test_e2e_decode_refuses_a_damaged_serve_record(tmp_path, record, words):
    folder = tmp_path / "e2e"
    for prof, rec in (("upstream", record), ("contest", {"command": ["vllm", "serve", "m"], "env": {}})):
        (folder / "runs" / prof).mkdir(parents=True)
        (folder / "runs" / prof / "serve.json").write_text(json.dumps(rec))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-decode", str(folder))
    refused(r, "serve.json", *words)


# --- 11: calibrate --install-vllm where no vLLM is installed ------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="a vLLM is installed for this Python")
def test_install_vllm_without_vllm_names_the_fix(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "calibrate", "--install-vllm", "--out", str(tmp_path / "cal"))
    line = refused(r, "--install-vllm", "no vLLM is installed")
    assert "pip install" in r.stderr and line


# --- 13: two runs with no tier in common ---------------------------------------------------------------

def test_compare_of_runs_without_a_common_tier_is_refused(tmp_path):
    run, base = copy_runs(tmp_path)
    for d, keep in ((run, "4-8K"), (base, "16-32K")):
        for f in d.glob("*K.json"):
            if f.stem != keep:
                f.unlink()
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "compare", "--a", str(base), "--b", str(run))
    refused(r, "no tier in common", "4-8K", "16-32K")


# --- 16: messages that say what is true -----------------------------------------------------------------

def test_stop_on_a_record_whose_pid_another_process_holds_says_so(tmp_path):
    state = tmp_path / "build" / "serve" / "server.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"pid": 1, "pgid": 1, "start_time": "1", "cmdline": ["vllm", "serve", "/m"],
                                 "server_args": ["serve", "/m"], "boot_id": None, "run_id": "r"}))
    r = forge(tmp_path, "stop")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "already exited" not in r.stderr, r.stderr
    assert "pid 1 now belongs to a different process" in r.stderr and "nothing was signalled" in r.stderr, r.stderr


def test_a_run_id_hint_does_not_offer_what_is_refused(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--dry-run", "--model", "/m", "--run-id", ".hidden")
    refused(r, "'.hidden'")
    assert "start with a letter or digit" in r.stderr, r.stderr


def test_a_speedup_that_leaves_no_finite_time_is_named(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--speedup", "gemv=1e-308")
    refused(r, "gemv=1e-308")


def test_a_folder_in_place_of_a_family_file_is_not_a_file(tmp_path):
    cal = calibrated_folder(tmp_path)
    (cal / "gemv.json").unlink()
    (cal / "gemv.json").mkdir()
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--calibration", str(cal), "--out", str(tmp_path / "pred"))
    refused(r, "gemv.json", "a folder, not a file")


def test_image_help_names_only_verbs_that_exist(tmp_path):
    r = forge(tmp_path, "image", "--help")
    assert r.returncode == 0
    text = " ".join(re.sub(r"-\n\s*", "-", r.stdout).split())         # argparse wraps at hyphens
    verbs = forge(tmp_path, "--help").stdout
    assert "`pin-base`" not in text and "--pin-base" in text
    assert "pin-base " not in verbs.split("verbs, by stage:")[1], "a pin-base verb was added: this test is stale"


def test_make_score_with_a_blank_in_run_says_what_is_wrong(tmp_path):
    with writes_nothing(tmp_path):
        r = make(tmp_path, "score", "RUN=a b")
    refused(r, "--run", "one value", "'a' 'b'")
    assert "unrecognized arguments" not in r.stderr


# --- 18: SIGTERM / SIGHUP while forge serve waits for /health ----------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_serve_waits_stops_the_server_it_started(tmp_path, sig):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = forge_env(tmp_path, FAKE_STARTUP_S="120")
    p = subprocess.Popen([sys.executable, "-m", "forge", "serve", "--profile", "upstream", "--model", str(model),
                          "--vllm", f"{sys.executable} {SUPPORT / 'fakeserver.py'}", "--port", str(free_port()),
                          "--timeout", "120", "--run-id", "sig"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    state = tmp_path / "build" / "serve" / "server.json"
    server = None
    try:
        for _ in range(300):
            if state.is_file():
                try:
                    server = json.loads(state.read_text())["pid"]
                    break
                except ValueError:
                    pass
            time.sleep(0.1)
        assert server is not None, "serve recorded no server"
        time.sleep(0.5)                      # waiting for /health now
        os.kill(p.pid, sig)                  # the verb's process only, as `kill PID` does
        out, err = p.communicate(timeout=90)
        assert p.returncode == 128 + sig, (p.returncode, err)
        assert "Traceback" not in err, err
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith("[forge] ")]
        assert lines == [f"forge serve: stopped by {signal.Signals(sig).name}; finished stages are kept, "
                         "rerun to resume"], err
        for _ in range(50):
            if not proc.alive(server):
                break
            time.sleep(0.1)
        assert not proc.alive(server), "the server it started is still running"
        assert not state.exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if server and proc.alive(server):
            os.killpg(server, signal.SIGKILL)


assert FIXTURE_RUNS.is_dir()
