"""Interrupt `forge bench-all-tiers` at random moments, with SIGINT (Ctrl-C) and SIGKILL (kill -9 of
its process group; the benchmark client, in a group of its own, is left running as it would be),
then rerun it with the same --run-id: the rerun must succeed by itself and leave the run folder
complete and consistent — every tier's result present, valid and free of failed requests, no
partial or temporary file, nothing set aside, the manifest agreeing with the result files — and
equal to an uninterrupted run in everything but timings (same tiers, datasets, request counts and
token counts).

The server is tests/support/fakeserver.py; the client tests/support/benchclient.py, which sends
the requests for real and writes its result file as vLLM's client does (not atomically). The
moments are drawn uniformly over the uninterrupted run's time; the seed is printed in every
failure (set FORGE_FAULT_SEED to replay one, FORGE_FAULT_POINTS for more moments)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, SUPPORT, fake_server, forge, forge_env, tiny_model
from project import signal_after

SEED = int(os.environ.get("FORGE_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
POINTS = int(os.environ.get("FORGE_FAULT_POINTS", "3"))     # per signal
SIGNALS = {"SIGINT": signal.SIGINT, "SIGKILL": signal.SIGKILL}
TIERS = ["4-8K", "8-16K"]
CLIENT = f"{sys.executable} {SUPPORT / 'benchclient.py'}"
SERVER_ENV = {"FAKE_OUTPUT_TOKENS": "48", "FAKE_TOKEN_MS": "2", "FAKE_TTFT_MS": "20"}


def _args(port: int, model: Path, run_id: str) -> list[str]:
    return ["bench-all-tiers", "--port", str(port), "--model", str(model), "--profile", "faults",
            "--tiers", ",".join(TIERS), "--num-prompts", "1", "--client", CLIENT, "--run-id", run_id,
            "--progress-every", "0.5"]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _check_run(rdir: Path) -> dict:
    """The run folder's content checked for completeness and consistency; returns what two runs
    must share (everything but timings and dates)."""
    files = sorted(str(p.relative_to(rdir)) for p in rdir.rglob("*") if p.is_file())
    want = sorted(["manifest.json"] + [f"{t}.json" for t in TIERS] + [f"{t}.client.log" for t in TIERS]
                  + [f"datasets/{t}.jsonl" for t in TIERS])
    assert files == want, f"run folder holds {files}, expected {want}"
    man = json.loads((rdir / "manifest.json").read_text())
    assert man["run_id"] == rdir.name and man["profile"] == "faults" and man["harness"] is False
    assert "client_running" not in man, "the manifest still records a running client"
    assert sorted(man["tiers"]) == sorted(TIERS) and sorted(man["datasets"]) == sorted(TIERS)
    shared = {}
    for t in TIERS:
        res = json.loads((rdir / f"{t}.json").read_text())
        ds = man["datasets"][t]
        n = ds["num_prompts"]
        assert Path(ds["path"]) == rdir / "datasets" / f"{t}.jsonl"
        assert ds["sha256"] == _sha(rdir / "datasets" / f"{t}.jsonl"), f"{t}: dataset hash in manifest is stale"
        lines = (rdir / "datasets" / f"{t}.jsonl").read_text().splitlines()
        assert len(lines) == n == 1
        assert res["num_prompts"] == n and res["completed"] == n and res["failed"] == 0, f"{t}: {res}"
        assert res["errors"] == [""] * n and all(res["output_lens"]) and len(res["ttfts"]) == n
        rec = man["tiers"][t]
        assert rec["status"] == "done", f"{t}: manifest status {rec}"
        assert (rec["completed"], rec["failed"], rec["output_throughput"]) == \
               (res["completed"], res["failed"], res["output_throughput"]), f"{t}: manifest {rec} vs result file"
        assert CLIENT.split()[-1] in man["client_commands"][t]
        shared[t] = {"dataset": ds["sha256"], "requests": ds.get("requests"), "num_prompts": n,
                     "input_lens": res["input_lens"], "output_lens": res["output_lens"],
                     "total_output_tokens": res["total_output_tokens"], "texts": res["generated_texts"]}
    return shared


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """A fake server, the tiny model, and one uninterrupted run: its time and its content."""
    tmp = tmp_path_factory.mktemp("bench-faults")
    model = tiny_model(tmp / "model")
    with fake_server(model, **SERVER_ENV) as (port, _):
        t0 = time.monotonic()
        r = forge(tmp, *_args(port, model, "baseline"))
        seconds = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        yield {"tmp": tmp, "model": model, "port": port, "seconds": seconds,
               "baseline": _check_run(tmp / "runs" / "baseline")}


CASES = [(sig, k) for sig in SIGNALS for k in range(POINTS)]


@pytest.mark.parametrize("sig,k", CASES, ids=[f"bench-{s}-{k}" for s, k in CASES])
def test_interrupted_benchmark_resumes_to_a_complete_run(bench, sig, k):
    rng = random.Random(f"{SEED}-bench-{sig}-{k}")
    at = rng.uniform(0.02, 1.0) * bench["seconds"]
    where = f"(FORGE_FAULT_SEED={SEED}: {sig} at {at:.2f} s of {bench['seconds']:.2f} s)"
    tmp, run_id = bench["tmp"], f"{sig}-{k}"
    args = _args(bench["port"], bench["model"], run_id)
    signal_after([sys.executable, "-m", "forge", *args], ROOT, forge_env(tmp), at, SIGNALS[sig])
    r = forge(tmp, *args)
    assert r.returncode == 0, f"rerun after {where} failed:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr
    try:
        got = _check_run(tmp / "runs" / run_id)
    except AssertionError as e:
        raise AssertionError(f"after {where}: {e}") from None
    assert got == bench["baseline"], f"rerun after {where} differs from an uninterrupted run"


def _kill_between_result_and_manifest(rdir: Path) -> None:
    """The last tier's result renamed into place, the manifest not yet told."""
    man = json.loads((rdir / "manifest.json").read_text())
    del man["tiers"][TIERS[-1]]
    (rdir / "manifest.json").write_text(json.dumps(man))


def _kill_while_writing_the_manifest(rdir: Path) -> None:
    text = (rdir / "manifest.json").read_text()
    (rdir / "manifest.json.tmp").write_text(text[: len(text) // 2])


def _kill_while_the_client_writes(rdir: Path) -> None:
    """The last tier's client cut short while writing its result; the manifest names a client that
    is gone (its pid reused by nothing of ours: start time 0)."""
    t = TIERS[-1]
    text = (rdir / f"{t}.json").read_text()
    (rdir / f"{t}.json").unlink()
    (rdir / f"{t}.client.json").write_text(text[: len(text) // 3])
    man = json.loads((rdir / "manifest.json").read_text())
    del man["tiers"][t]
    man["client_running"] = {"pid": os.getpid(), "pgid": os.getpgid(0), "start_time": 0, "tier": t}
    (rdir / "manifest.json").write_text(json.dumps(man))


STATES = {"result-before-manifest": _kill_between_result_and_manifest,
          "manifest-half-written": _kill_while_writing_the_manifest,
          "client-result-cut-short": _kill_while_the_client_writes}


@pytest.mark.parametrize("state", list(STATES), ids=[f"bench-{s}" for s in STATES])
def test_benchmark_resumes_from_what_a_kill_leaves(bench, state):
    """The states a kill leaves in windows too short to hit by chance, made directly."""
    tmp, run_id = bench["tmp"], f"state-{state}"
    args = _args(bench["port"], bench["model"], run_id)
    r = forge(tmp, *args)
    assert r.returncode == 0, r.stderr
    STATES[state](tmp / "runs" / run_id)
    r = forge(tmp, *args)
    assert r.returncode == 0, f"rerun after a kill ({state}) failed:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr
    assert _check_run(tmp / "runs" / run_id) == bench["baseline"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc names a process's start time and arguments")
@pytest.mark.parametrize("ours", [True, False], ids=["bench-the-client", "bench-another-process"])
def test_a_client_left_running_is_stopped_only_when_it_is_that_client(bench, ours):
    """A rerun stops the client an interrupted run left running, named in the manifest: only when the
    process is that client (its start time, its command line ending with the client's arguments, the
    group it leads); a process that has the recorded pid and start time but another command line is
    left alone, with a warning."""
    import subprocess

    sys.path.insert(0, str(ROOT / "scripts"))
    from forge import proc
    tmp, run_id = bench["tmp"], f"stale-{'ours' if ours else 'other'}"
    args = _args(bench["port"], bench["model"], run_id)
    assert forge(tmp, *args).returncode == 0
    rdir = tmp / "runs" / run_id
    tail = ["--result-dir", str(rdir), "--result-filename", f"{TIERS[-1]}.client.json"]
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *(tail if ours else ["--other"])],
                         start_new_session=True)
    try:
        assert proc.command_line(p.pid, wait_s=5.0)[-1] == (tail[-1] if ours else "--other")
        man = json.loads((rdir / "manifest.json").read_text())
        man["client_running"] = {"pid": p.pid, "pgid": p.pid, "start_time": proc.process_start_time(p.pid),
                                 "boot_id": proc.boot_id(), "argv_tail": tail, "tier": TIERS[-1]}
        (rdir / "manifest.json").write_text(json.dumps(man))
        r = forge(tmp, *args)
        assert r.returncode == 0, r.stderr
        if ours:
            assert "stopping a client left running" in r.stderr
            assert p.wait(timeout=20) is not None
        else:
            assert "that process is not it" in r.stderr and "nothing was signalled" in r.stderr
            assert p.poll() is None, "a process that is not the client was signalled"
        assert _check_run(rdir) == bench["baseline"]
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.parametrize("record", ["x", [1], {"pid": "1", "pgid": 1, "start_time": "5"}, {"pid": 0, "pgid": 0}],
                         ids=["bench-client-str", "bench-client-list", "bench-client-pid-str", "bench-client-pid-0"])
def test_a_malformed_client_record_is_dropped_with_a_warning(bench, record):
    tmp, run_id = bench["tmp"], f"malformed-{abs(hash(str(record)))}"
    args = _args(bench["port"], bench["model"], run_id)
    assert forge(tmp, *args).returncode == 0
    rdir = tmp / "runs" / run_id
    man = json.loads((rdir / "manifest.json").read_text())
    man["client_running"] = record
    (rdir / "manifest.json").write_text(json.dumps(man))
    r = forge(tmp, *args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "client_running record is malformed" in r.stderr and "nothing was signalled" in r.stderr
    assert _check_run(rdir) == bench["baseline"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_benchmark_client_does_not_outlive_a_killed_forge(tmp_path):
    """forge killed right after starting the client, before it can record it in the manifest (so
    the rerun cannot stop it): the client must end too, not write a result later."""
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from forge import proc\n"
            "p = proc.start([sys.executable, '-c', 'import time; time.sleep(30)'], log=%r, die_with_parent=True)\n"
            "print(p.pid, flush=True); time.sleep(30)\n") % (str(ROOT / "scripts"), str(tmp_path / "log"))
    import subprocess
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    for _ in range(50):   # bounded: 5 s
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the client kept running after forge was killed")
