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
    env = {**stacks.process_env(dict(os.environ), float(every)), **stacks.server_env(out, "prof", float(every))}
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


GIL_HELD = textwrap.dedent("""
    import sys, time

    def held_in_c():                        # one C call that never lets the GIL go
        return sum(range(int(sys.argv[1])))

    def after_the_hold():
        t = time.time()
        while time.time() - t < 0.5:
            pass

    after_the_hold()
    t = time.time()
    held_in_c()
    print(time.time() - t)
    after_the_hold()
""")


def test_a_process_held_in_one_c_call_shows_as_a_late_sample(tmp_path):
    out = tmp_path / "run"
    env = {**stacks.process_env(dict(os.environ), 0.1), **stacks.server_env(out, "prof", 0.1)}
    Path(env["FORGE_STACK_DIR"]).mkdir(parents=True)
    script = tmp_path / "gil.py"
    script.write_text(GIL_HELD)
    r = subprocess.run([sys.executable, str(script), "60000000"], env=env, check=True, timeout=120,
                       capture_output=True, text=True)
    held_s = float(r.stdout.split()[-1])
    assert held_s > 0.4, "the C call was too short to show a hold on this machine"
    p, = stacks.collect(out)["prof"]
    assert len(p["late_s"]) == p["samples"] and p["held_count"] >= 1
    late, inner, code = p["held"][0]                   # the longest: the hold, sampled as the call returned
    # as late as the call was long; a busy machine may start the waiting sampler a little later still
    assert held_s - 0.25 <= late <= held_s + 0.6, (late, held_s)
    # the GIL goes to a waiting sampler as the call returns: in the function that made it (held_in_c); where the
    # machine had the sampler's thread off its cores then, a switch interval later, a line or two on
    assert code.split(" (")[0] in ("held_in_c", "<module>", "after_the_hold"), p["held"]
    md = "\n".join(stacks.summary_lines(stacks.read(out)))
    assert f"{late:.1f} s, then at `{code}`" in md


def test_roles_come_from_the_frames_a_process_was_sampled_in(tmp_path):
    text = ("# forge stacks pid 7 ppid 1 every 2 s from 0 main 0x1\n# argv x\nSample at 1.0 late 0.001\n"
            "Thread 0x1 (most recent call first):\n"
            '  File "/s/site-packages/vllm/v1/engine/core.py", line 9 in run_busy_loop\n'
            '  File "<string>", line 1 in <module>\n')
    head, samples, late = stacks._samples(text.splitlines())
    assert late == [0.001]
    assert head == {"pid": 7, "ppid": 1, "every_s": 2.0, "main": "0x1", "argv": "x"}
    assert samples == [[("vllm/v1/engine/core.py:9", "run_busy_loop", False), ("<string>:1", "<module>", False)]]
    assert stacks._role(samples) == "engine core"
    # a worker forked from the engine core keeps the engine core's outer frames: a worker all the same
    fork = [[("vllm/v1/executor/multiproc_executor.py:800", "worker_main", False), *samples[0]]]
    assert stacks._role(fork) == "worker"
    # an API server (vLLM's command line), and a program that merely has a main(): not one
    api = [[("vllm/entrypoints/cli/main.py:70", "main", False), ("<frozen runpy>:198", "_run_module_as_main", True)]]
    assert stacks._role(api) == "API server" and stacks._role([[("x.py:1", "main", False)]]) == "other"


def test_the_main_thread_is_the_one_the_header_names(tmp_path):
    # a helper thread whose outermost frames were cut (a dump keeps 100) or that C code started looks like a
    # main thread by its frames; the header's id decides, and a dump without that thread is an empty sample
    text = ("# forge stacks pid 9 ppid 1 every 1 s from 0 main 0x00000000000000aa\n# argv x\nSample at 1.0 late 0.002\n"
            "Thread 0x00000000000000bb (most recent call first):\n"
            '  File "/p/helper.py", line 3 in deep\n  ...\n\n'
            "Thread 0x00000000000000aa (most recent call first):\n"
            '  File "/p/app.py", line 8 in held\n'
            '  File ???, line ??? in <unknown>\n'
            '  File "/p/app.py", line 20 in <module>\n'
            "Sample at 1.0 late 0.002\nThread 0x00000000000000bb (most recent call first):\n"
            '  File "/p/helper.py", line 3 in deep\n')
    head, samples, late = stacks._samples(text.splitlines())
    assert head["main"] == "0x00000000000000aa" and late == [0.002, 0.002]
    assert samples == [[("/p/app.py:8", "held", False), ("???:???", "<unknown>", False), ("/p/app.py:20", "<module>",
                                                                                          False)], []]
    # a main thread waiting in the standard library: the innermost frame outside it says where in the program
    text = ("Sample at 1.0 late 0.002\nThread 0x1 (most recent call first):\n"
            '  File "/usr/lib/python3.12/selectors.py", line 415 in select\n'
            '  File "/usr/lib/python3.12/asyncio/base_events.py", line 1949 in _run_once\n'
            '  File "/v/lib/python3.12/site-packages/uvloop/x.py", line 3 in run\n'
            '  File "<frozen runpy>", line 198 in _run_module_as_main\n')
    folder = tmp_path / "stacks" / "api"
    folder.mkdir(parents=True)
    (folder / "stacks-9.txt").write_text("# forge stacks pid 9 ppid 1 every 1 s from 0 main 0x1\n" + text * 5)
    p, = stacks.collect(tmp_path)["api"]
    assert [tuple(x) for x in p["top"]] == [("select (3.12/selectors.py:415)", 5)]
    assert [tuple(x) for x in p["top_code"]] == [("run (uvloop/x.py:3)", 5)]
    assert "`run (uvloop/x.py:3)` 100 %" in "\n".join(stacks.summary_lines(stacks.read(tmp_path)))


def test_without_the_option_nothing_is_set_or_sampled(tmp_path):
    assert stacks.server_env(tmp_path, "prof", None) == {}
    assert stacks.process_env({"PYTHONPATH": "/site"}, None) == {"PYTHONPATH": "/site"}
    env = stacks.server_env(tmp_path, "prof", 2.0)
    assert env == {"FORGE_STACK_EVERY": "2", "FORGE_STACK_DIR": str(tmp_path / "stacks" / "prof")}
    assert stacks.process_env({"PYTHONPATH": "/site"}, 2.0) == {"PYTHONPATH": f"{stacks.SITE}{os.pathsep}/site"}
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
    # what the run records: the period and the folder; the path (the private site folder) only in the process
    assert env["FORGE_STACK_EVERY"] == "1.5" and env["FORGE_STACK_DIR"] == str(tmp_path / "stacks" / "upstream")
    assert "PYTHONPATH" not in env
    assert stacks.process_env(run.child_env, 1.5)["PYTHONPATH"] == f"{stacks.SITE}{os.pathsep}/the/site"
    run.args.stack_every = None
    assert "FORGE_STACK_EVERY" not in servers._launch_parts(run, "upstream")[1]


MOVED = textwrap.dedent("""
    import os, sys, time

    def spin(s):
        t = time.time()
        while time.time() - t < s:
            pass

    def parent_after_fork():
        spin(1.0)

    def child_work():
        spin(0.6)

    folder = os.environ["FORGE_STACK_DIR"]
    spin(0.3)
    os.rename(folder, folder + "-moved")          # a child cannot arm now; the parent's file stays open
    pid = os.fork()
    if pid == 0:
        child_work()
        g = os.fork()                             # the child forks too: never into its parent's file
        if g == 0:
            child_work()
            os._exit(0)
        os.waitpid(g, 0)
        os._exit(0)
    parent_after_fork()
    os.waitpid(pid, 0)
""")


def test_a_child_that_cannot_arm_never_writes_into_its_parents_file(tmp_path):
    out = tmp_path / "run"
    env = {**stacks.process_env(dict(os.environ), 0.1), **stacks.server_env(out, "prof", 0.1)}
    Path(env["FORGE_STACK_DIR"]).mkdir(parents=True)
    script = tmp_path / "moved.py"
    script.write_text(MOVED)
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60)
    files = list((out / "stacks" / "prof-moved").glob("stacks-*.txt"))
    assert len(files) == 1                        # the parent's only
    text = files[0].read_text()
    assert "child_work" not in text
    assert text.count("parent_after_fork") >= 5   # and the parent sampled on after the fork


def test_a_new_start_and_an_unsampled_run_keep_earlier_samples_out_of_the_digest(tmp_path):
    # an earlier sampled run into the same folder: its raw files and its digest
    out = _run_held(tmp_path, "0.2")
    first = stacks.collect(out)
    old_pids = {p["pid"] for p in first["prof"]}
    # the same server started again with the option: the earlier start's files move aside, nothing is deleted
    folder = out / "stacks" / "prof"
    stacks.fresh_folder(folder)
    assert list(folder.glob("stacks-*.txt")) == []
    moved = sorted(f.name for f in (folder / "earlier" / "1").iterdir())
    assert moved == sorted(f"stacks-{pid}.txt" for pid in old_pids)
    (folder / "stacks-4242.txt").write_text("# forge stacks pid 4242 ppid 1 every 1 s from 0 main 0x1\n"
                                           "# argv new\n"
                                           "Sample at 1.0 late 0.002\nThread 0x1 (most recent call first):\n"
                                           '  File "/p/app.py", line 8 in held\n' * 5)
    assert [p["pid"] for p in stacks.settle(out, 1.0)["prof"]] == [4242]
    stacks.fresh_folder(folder)                        # a third start: the next number, the first kept
    assert (folder / "earlier" / "2" / "stacks-4242.txt").is_file() and (folder / "earlier" / "1").is_dir()
    # a later run without the option: the digest it did not take leaves the folder's top, the archive and summary.md
    assert stacks.read(out) and stacks.settle(out, None) == {}
    assert stacks.read(out) == {} and stacks.summary_lines(stacks.read(out)) == []
    assert json.loads((out / "stacks" / "earlier-1.json").read_text())["prof"][0]["pid"] == 4242
    # numbered past the highest kept, not by count: with earlier-1 removed by hand, earlier-2 is never replaced
    (out / "stacks" / "earlier-1.json").rename(out / "stacks" / "earlier-2.json")
    for pid in (4243, 4244):
        (out / "stacks.json").write_text(json.dumps({"prof": [{"pid": pid}]}))
        stacks.settle(out, None)
    kept = {f.name: json.loads(f.read_text())["prof"][0]["pid"] for f in (out / "stacks").glob("earlier-*.json")}
    assert kept == {"earlier-2.json": 4242, "earlier-3.json": 4243, "earlier-4.json": 4244}
    dest = tmp_path / "run.tgz"
    packing.pack(out, dest, {})
    assert not any("stacks" in n for n in tarfile.open(dest).getnames())
