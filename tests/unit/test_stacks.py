"""Stack samples of the servers' processes (`forge e2e-gpu --stack-every`): harness/gpu/stacks/sitecustomize.py
really samples a process held in a long call, and a forked child on its own; the digest names where each
process's main thread was (not a helper thread's frames); the raw files stay out of the packed archive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

from forge.lab import packing, stacks

ROOT = Path(__file__).resolve().parents[2]

HELD = textwrap.dedent("""
    import os, threading, time

    def idle_helper():                      # a thread beside the main one: never the process's answer
        time.sleep(30)

    def held_in_parent():
        t = time.time()
        while time.time() - t < 1.5:
            pass

    def held_in_child():
        t = time.time()
        while time.time() - t < 1.5:
            pass

    threading.Thread(target=idle_helper, daemon=True).start()
    pid = os.fork()
    if pid == 0:
        held_in_child()
        os._exit(0)
    held_in_parent()
    os.waitpid(pid, 0)
""")


def _run_held(tmp_path: Path, every: str = "0.1") -> Path:
    out = tmp_path / "run"
    env = {**os.environ, **stacks.server_env(out, "prof", float(every), os.environ.get("PYTHONPATH", ""))}
    Path(env["FORGE_STACK_DIR"]).mkdir(parents=True)
    script = tmp_path / "held.py"
    script.write_text(HELD)
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60)
    return out


def test_a_held_process_and_its_forked_child_are_sampled_where_each_main_thread_is(tmp_path):
    out = _run_held(tmp_path)
    digest = stacks.collect(out)
    procs = {p["pid"]: p for p in digest["prof"]}
    assert len(procs) == 2, digest
    parent = next(p for p in procs.values() if p["ppid"] not in procs)
    child = next(p for p in procs.values() if p["ppid"] == parent["pid"])
    for p, frame in ((parent, "held_in_parent"), (child, "held_in_child")):
        assert p["samples"] >= 5 and p["every_s"] == 0.1
        top, n = p["top"][0]
        assert top.startswith(f"{frame} (") and n >= 0.6 * p["samples"], p["top"]
        assert len(p["timeline"]) == p["samples"]
        assert not any("idle_helper" in f or "sleep" in f for f, _ in p["top"])
    assert stacks.read(out) == json.loads(json.dumps(digest))       # what summary.md is made from
    md = "\n".join(stacks.summary_lines(digest))
    assert "| prof | other |" in md and "held_in_parent" in md and "held_in_child" in md


def test_roles_come_from_the_frames_a_process_was_sampled_in(tmp_path):
    text = ("# forge stacks pid 7 ppid 1 every 2 s from 0\n# argv x\nTimeout (0:00:02)!\n"
            "Thread 0x1 (most recent call first):\n"
            '  File "/s/site-packages/vllm/v1/engine/core.py", line 9 in step\n'
            '  File "<string>", line 1 in <module>\n')
    head, samples = stacks._samples(text)
    assert head == {"pid": 7, "ppid": 1, "every_s": 2.0, "argv": "x"}
    assert samples == [[("vllm/v1/engine/core.py:9", "step", False), ("<string>:1", "<module>", False)]]
    assert stacks._role(samples) == "engine core"
    # `python -m` (the servers' start): the main thread ends in runpy's frame, a started thread in _bootstrap
    text = ("Timeout (0:00:02)!\nThread 0x2 (most recent call first):\n"
            '  File "/usr/lib/python3.12/threading.py", line 9 in wait\n'
            '  File "/usr/lib/python3.12/threading.py", line 1 in _bootstrap\n\n'
            "Thread 0x1 (most recent call first):\n"
            '  File "/v/site-packages/vllm/entrypoints/openai/api_server.py", line 5 in serve\n'
            '  File "<frozen runpy>", line 198 in _run_module_as_main\n')
    _, samples = stacks._samples(text)
    assert [s[0] for s in samples] == [("vllm/entrypoints/openai/api_server.py:5", "serve", False)]
    assert stacks._role(samples) == "API server"
    # a main thread waiting in the standard library: the innermost frame outside it says where in the program
    text = ("# forge stacks pid 9 ppid 1 every 1 s from 0\nTimeout (0:00:01)!\nThread 0x1 (most recent call first):\n"
            '  File "/usr/lib/python3.12/selectors.py", line 415 in select\n'
            '  File "/usr/lib/python3.12/asyncio/base_events.py", line 1949 in _run_once\n'
            '  File "/v/lib/python3.12/site-packages/uvloop/x.py", line 3 in run\n'
            '  File "<frozen runpy>", line 198 in _run_module_as_main\n')
    folder = tmp_path / "stacks" / "api"
    folder.mkdir(parents=True)
    (folder / "stacks-9.txt").write_text(text * 5)
    p, = stacks.collect(tmp_path)["api"]
    assert [tuple(x) for x in p["top"]] == [("select (3.12/selectors.py:415)", 5)]
    assert [tuple(x) for x in p["top_code"]] == [("run (uvloop/x.py:3)", 5)]
    assert "run (uvloop/x.py:3) 100 %" in "\n".join(stacks.summary_lines(stacks.read(tmp_path)))


def test_without_the_option_nothing_is_set_or_sampled(tmp_path):
    assert stacks.server_env(tmp_path, "prof", None, "/x") == {}
    env = stacks.server_env(tmp_path, "prof", 2.0, "/site")
    assert env["PYTHONPATH"] == f"{stacks.SITE}{os.pathsep}/site" and env["FORGE_STACK_EVERY"] == "2"
    assert not (tmp_path / "stacks").exists()          # the server's start makes the folder, not the plan
    assert stacks.collect(tmp_path) == {} and not (tmp_path / "stacks.json").exists()
    assert stacks.read(tmp_path) == {} and stacks.summary_lines({}) == []
    # the sampler off: a process started with the folder on its path and no FORGE_STACK_EVERY writes nothing
    folder = tmp_path / "stacks" / "prof"
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(stacks.SITE), "FORGE_STACK_DIR": str(folder)}
    env.pop("FORGE_STACK_EVERY", None)
    subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], env=env, check=True, timeout=60)
    assert list(folder.iterdir()) == []


def test_the_raw_samples_stay_out_of_the_archive_and_the_digest_goes_in(tmp_path):
    out = _run_held(tmp_path, "0.2")
    stacks.collect(out)
    dest = tmp_path / "run.tgz"
    packing.pack(out, dest, {})
    names = tarfile.open(dest).getnames()
    assert "run/stacks.json" in names and not any("/stacks/" in n for n in names), names


def test_the_option_refuses_a_period_out_of_range():
    for bad in ("0", "-1", "61", "x"):
        r = subprocess.run([sys.executable, "-m", "forge", "e2e-gpu", "--stack-every", bad], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "scripts")}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "--stack-every" in r.stderr, (bad, r.stderr[-400:])


def test_a_server_started_with_the_option_gets_the_sampler_first_on_its_path(tmp_path):
    import types

    from forge.lab import servers
    run = types.SimpleNamespace(triton_cache=None, hargs=["--load-format", "dummy"], capacity={}, out=tmp_path,
                                child_env={"PYTHONPATH": "/the/site"},
                                args=types.SimpleNamespace(profile_prefill=None, stack_every=1.5))
    _, env = servers._launch_parts(run, "upstream")
    assert env["PYTHONPATH"] == f"{stacks.SITE}{os.pathsep}/the/site"        # the bundle's site still next
    assert env["FORGE_STACK_EVERY"] == "1.5" and env["FORGE_STACK_DIR"] == str(tmp_path / "stacks" / "upstream")
    run.args.stack_every = None
    assert "FORGE_STACK_EVERY" not in servers._launch_parts(run, "upstream")[1]
