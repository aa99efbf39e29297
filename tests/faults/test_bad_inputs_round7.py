"""`forge e2e-gpu` inputs found bad only after the results folder was written, a run that measured no comparison
reported as a success, and `forge plan --against` reading a run it should flag or refuse.

e2e-gpu: a model folder without config.json, a --vllm or --client program that is not there (or a client
command with an unbalanced quote, or one $FORGE_BENCH_CLIENT names), a server port another process holds,
vLLM's own CLI where vLLM is not installed, a machine where no card tool answers and torch sees no GPU (or the
device variable hides every card), and a --profile-prefill longer than the servers' --max-model-len: each made
the results folder (its prompts, logs and summary) and then failed ('no server came up', exit 2) or exited 0:
the client's run with nothing measured, the profile's with its request refused after the tiers. Each is now
refused before anything is written: exit code 2, one error line naming the option and what is wrong, a `fix:`
line, no --out folder. A run where one profile's server never came up exited 0 with nothing scored; it now
exits 1 naming the server, its error and its log. So does a run whose client failed a (tier, profile): it
exits 1 naming each, its error and its client log.

plan --against: a run served at a topology no contest round runs (TP4, DP3, TP2 x DP2) was priced without a
word: it is checked (the page math is the planner's at any topology) under a note citing the final round's
rule; a garbled "GPU KV cache size" line was reported as no report at all: it is refused, quoted, with its
file named.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
from helpers import args_with, e2e_fake, forge, forge_env, free_port_pair, tiny_model
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line

VLLM_CLI = f"{sys.executable} -m vllm.entrypoints.cli.main"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round7-model"))


def e2e(tmp_path, model, *extra, env=None):
    base = ["e2e-gpu", "--bundle", "", "--model", str(model), "--profiles", "contest,upstream", "--out",
            str(tmp_path / "out"), "--vllm", "false", "--client", "false", "--no-plumbing", "--no-fault",
            "--start-guess-s", "0", "--tier-order", "4-8K", "--num-prompts", "1"]
    return forge(tmp_path, *args_with(base, extra), env=env)


def no_card_tools(tmp_path: Path, answer: str | None = None) -> str:
    """nvidia-smi, hy-smi and rocm-smi first on PATH, failing as on a machine without a driver (or, with
    `answer`, nvidia-smi printing it); returns that PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("nvidia-smi", "hy-smi", "rocm-smi"):
        body = f"echo '{answer}'" if answer and tool == "nvidia-smi" else "echo 'NVIDIA-SMI has failed' >&2; exit 9"
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod((bin_dir / tool).stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def stand_in_packages(root: Path, torch_body: str) -> Path:
    """A `vllm` whose CLI exits at once (as vLLM does on a machine without a GPU) and a `torch` of
    `torch_body`, for the Python the servers run."""
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (d / "__init__.py").write_text("")
    (cli / "main.py").write_text("raise SystemExit('RuntimeError: Failed to infer device type')\n")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text(torch_body)
    return root


TORCH_SEES = "class cuda:\n    @staticmethod\n    def device_count():\n        return {n}\n"


def gpu_env(tmp_path: Path, torch_body: str, path: str | None = None, **extra: str) -> dict:
    """The environment of a machine whose card tools do not answer (or answer on `path`), the stand-in
    packages first on PYTHONPATH, no device variable but those `extra` sets."""
    pkgs = stand_in_packages(tmp_path / "pkgs", torch_body)
    env = forge_env(tmp_path, **extra)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{pkgs}"
    env["PATH"] = path or no_card_tools(tmp_path)
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "FORGE_BENCH_CLIENT"):
        if var not in extra:
            env.pop(var, None)
    return env


# --- e2e-gpu: refused before the results folder -------------------------------------------------------------

@pytest.mark.parametrize("extra,words,fix", [
    (["--vllm", "/nonexistent/vllm serve"], ["--vllm '/nonexistent/vllm serve'", "'/nonexistent/vllm' is not installed"],
     "--vllm 'python3 -m vllm.entrypoints.cli.main'"),
    (["--client", "/nonexistent/vllm"], ["--client '/nonexistent/vllm'", "is not installed"], "--client"),
    (["--client", "vllm 'bench"], ["--client \"vllm 'bench\"", "an unbalanced quote"], "quote the command"),
    # vLLM's own CLI on a Python without site-packages: no vLLM there, and --bundle '' installs none
    (["--vllm", f"{sys.executable} -S -m vllm.entrypoints.cli.main"], ["vLLM is not installed for", " -S"],
     "--bundle"),
    (["--client", f"{sys.executable} -S -m vllm.entrypoints.cli.main"], ["--client", "vLLM is not installed for"],
     "--bundle"),
    # the servers' --max-model-len is the harness's 32768: vLLM refused the request after the tiers
    (["--profile-prefill", "40000"], ["--profile-prefill 40000", "--max-model-len 32768", "at most 32703 tokens"],
     "--profile-prefill 32703 or less"),
    (["--profile-prefill", "32300", "--profile-decode", "512"], ["--profile-prefill 32300 --profile-decode 512", "at most 32191 tokens"],
     "or a lower --profile-decode"),
])
def test_a_server_or_client_command_that_cannot_run_is_refused_before_the_results_folder(tmp_path, model, extra,
                                                                                         words, fix):
    with writes_nothing(tmp_path):
        r = e2e(tmp_path, model, *extra)
    refused(r, *words)
    assert fix in fix_line(r), r.stderr
    assert not (tmp_path / "out").exists()


def test_the_client_of_forge_bench_client_is_named_when_its_program_is_not_there(tmp_path, model):
    r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(model), "--profiles", "contest,upstream",
              "--out", str(tmp_path / "out"), "--vllm", "false", "--no-plumbing", "--no-fault", "--start-guess-s", "0",
              env=forge_env(tmp_path, FORGE_BENCH_CLIENT="/nonexistent/bench"))
    refused(r, "$FORGE_BENCH_CLIENT '/nonexistent/bench'", "is not installed")
    assert not (tmp_path / "out").exists()


def test_a_model_folder_without_config_json_is_refused_before_the_results_folder(tmp_path, model):
    """Each server's start refused it ('no config.json here'), after the folder and its prompts were written."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model.iterdir():
        if f.name != "config.json":
            (bare / f.name).write_bytes(f.read_bytes())
    with writes_nothing(tmp_path):
        r = e2e(tmp_path, model, "--model", str(bare))
    refused(r, f"--model {bare}", "no config.json")
    assert "config.json" in fix_line(r)


def test_a_port_another_process_holds_is_refused_naming_it(tmp_path, model):
    port = free_port_pair()
    with socket.socket() as s:                    # the second profile's port: upstream's server's
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port + 1))
        s.listen()
        with writes_nothing(tmp_path):
            r = e2e(tmp_path, model, "--first-port", str(port))
    refused(r, f"--first-port {port}", f"port {port + 1}, the upstream server's, is in use by another process")
    assert "another --first-port" in fix_line(r)


@pytest.mark.parametrize("torch_body,words", [
    (TORCH_SEES.format(n=0), ["none of nvidia-smi, hy-smi or rocm-smi answered", "torch.cuda.device_count() is 0"]),
    ("raise ImportError('libcuda.so.1: cannot open shared object file')",
     ["none of nvidia-smi, hy-smi or rocm-smi answered", "torch does not import", "libcuda.so.1"]),
])
def test_a_machine_with_no_card_tool_and_no_gpu_is_refused_before_the_results_folder(tmp_path, model, torch_body,
                                                                                      words):
    """The servers are vLLM's own CLI: with no card tool answering, the GPU's memory was not checked, the
    folder was written, and every server failed to start ('no server came up')."""
    env = gpu_env(tmp_path, torch_body)
    with writes_nothing(tmp_path):
        r = e2e(tmp_path, model, "--vllm", VLLM_CLI, env=env)
    refused(r, f"--vllm '{VLLM_CLI}'", "no GPU for the servers", *words)
    assert "GPU machine" in fix_line(r)


def test_a_device_variable_that_hides_every_card_is_refused(tmp_path, model):
    env = gpu_env(tmp_path, TORCH_SEES.format(n=1), path=no_card_tools(tmp_path, answer="143771"),
                  CUDA_VISIBLE_DEVICES="")
    with writes_nothing(tmp_path):
        r = e2e(tmp_path, model, "--vllm", VLLM_CLI, env=env)
    refused(r, "no GPU visible to the servers", "CUDA_VISIBLE_DEVICES= leaves none")


def test_a_gpu_torch_sees_passes_and_servers_that_never_come_up_fail_the_run(tmp_path, model):
    """No card tool, one card torch sees: past the checks (the memory not checked, the cards recorded); the
    stand-in vLLM exits at once, so no server comes up: the run fails with exit 1 (it ran), not a refusal,
    naming each server's error and log."""
    r = e2e(tmp_path, model, "--vllm", VLLM_CLI, env=gpu_env(tmp_path, TORCH_SEES.format(n=1)))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    err = next(x for x in r.stderr.splitlines() if x.startswith("forge e2e-gpu: error: "))
    for name in ("contest", "upstream"):
        assert f"{name}: the server exited (code 1) before it became ready" in err, err
        assert str(tmp_path / "out" / "runs" / name / "server.log") in err, err
    assert err.endswith("nothing was measured"), err
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["gpu_fit"]["cards"]["cards"] == 1 and not s["gpu_fit"]["checked"]
    assert s["error"] in err
    assert "(1 card(s) visible: torch.cuda.device_count() in" in (tmp_path / "out" / "summary.md").read_text()


# --- e2e-gpu: a profile whose server never came up fails the run -------------------------------------------

def test_a_reference_whose_server_never_came_up_fails_the_run_naming_its_log(tmp_path):
    """upstream's server exits at its start; fast-int8's tier is measured and kept, but nothing is scored
    against the reference: the run exited 0 with 'profiles whose server did not come up' among its skips."""
    port = free_port_pair()
    r, port, out = e2e_fake(tmp_path, "--no-fault", "--tier-order", "4-8K", port=port, env_extra={
        "FAKE_FAIL_START": "RuntimeError: CUDA error: out of memory", "FAKE_FAIL_START_PORT": str(port + 1)})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    err = [x for x in r.stderr.splitlines() if x.startswith("forge e2e-gpu: error: ")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    log = out / "runs" / "upstream" / "server.log"
    assert "the upstream server did not come up" in err[0] and f"its log: {log}" in err[0], err
    assert "no profile is scored against the reference (upstream)" in err[0], err
    assert "CUDA error: out of memory" in log.read_text()
    assert "run the same --out again" in fix_line(r)
    s = json.loads(out.joinpath("summary.json").read_text())
    assert s["skipped"] == ["profiles whose server did not come up: upstream"] and not s.get("scores")
    assert (out / "runs" / "fast-int8" / "4-8K.json").is_file()          # what it measured is kept
    assert "## Error" in (out / "summary.md").read_text()


def test_a_client_that_fails_its_tiers_fails_the_run_naming_each_tier_and_its_log(tmp_path):
    """Both servers up, the client exits 1 on every tier: nothing is measured or scored, and the run exited 0
    with the failures only in summary.json. It now exits 1 naming each (tier, profile), its error and its
    client log; a rerun of the same folder with a working client measures them and exits 0."""
    r, port, out = e2e_fake(tmp_path, "--no-fault", "--tier-order", "4-8K,8-16K", env_extra={"REPLAY_FAIL": "1"})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    err = [x for x in r.stderr.splitlines() if x.startswith("forge e2e-gpu: error: ")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "4 (tier, profile) run(s) failed and are not measured" in err[0], err
    for name in ("fast-int8", "upstream"):
        for tier in ("4-8K", "8-16K"):       # each with its own error, as recorded when it failed
            assert f"tier {tier} of {name}: tier {tier}: vllm bench serve failed" in err[0], err
            assert str(out / "runs" / name / f"{tier}.client.log") in err[0], err
    assert "replay: failing as told" in (out / "runs" / "upstream" / "4-8K.client.log").read_text()
    assert "run the same --out again" in fix_line(r)
    s = json.loads(out.joinpath("summary.json").read_text())
    assert s["error"] in err[0] and not s.get("scores")
    r2, _, _ = e2e_fake(tmp_path, "--no-fault", "--tier-order", "4-8K,8-16K", port=port)
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
    s2 = json.loads(out.joinpath("summary.json").read_text())
    assert all((out / "runs" / name / f"{t}.json").is_file() for name in ("fast-int8", "upstream") for t in ("4-8K", "8-16K"))
    assert "error" not in s2, s2.get("error")


def test_servers_still_starting_at_the_deadline_under_keep_servers_are_left_up_not_failed(tmp_path):
    """The documented start-them-now run: --keep-servers with a deadline that holds no tier starts the servers
    for the next invocation. Servers still starting at the deadline are left up, the run exits 0 saying so
    (a server that never came up would fail it), and --stop-servers stops them."""
    port = free_port_pair()
    r, port, out = e2e_fake(tmp_path, "--no-fault", "--tier-order", "4-8K", "--deadline-s", "6", "--keep-servers",
                            port=port, env_extra={"FAKE_STARTUP_S": "60"})
    try:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        s = json.loads(out.joinpath("summary.json").read_text())
        assert ("servers still starting at the deadline, left up for the next invocation (--keep-servers): "
                "fast-int8, upstream") in s["skipped"], s["skipped"]
        assert "error" not in s and set(s["servers_left_up"]) == {"fast-int8", "upstream"}
    finally:
        stop = forge(tmp_path, "e2e-gpu", "--out", str(out), "--stop-servers")
    assert stop.returncode == 0, stop.stderr[-2000:]


# --- plan --against --------------------------------------------------------------------------------------------

START = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/models/qwen", "--served-model-name", "Qwen3.5-27B",
         "--port", "8001", "--max-num-seqs", "128", "--max-num-batched-tokens", "4096", "--gpu-memory-utilization",
         "0.95"]


def served(tmp_path: Path, name: str, args: list[str], tokens: dict | None = None, log: str | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    rec = {"profile": "contest", "launch": START + args}
    if tokens is not None:
        rec["kv_cache"] = {"tokens": tokens, "equal": True, "flag": None}
    (d / "serve.json").write_text(json.dumps(rec))
    if log is not None:
        (d / "server.log").write_text(log)
    return d


@pytest.mark.parametrize("args,tokens,topology", [
    (["--tensor-parallel-size", "4"], {"0": 700000}, "TP4/DP1"),
    (["--data-parallel-size", "3"], {"0": 28224, "1": 28224, "2": 28224}, "TP1/DP3"),
    (["-tp", "2", "-dp", "2"], {"0": 268128, "1": 268128}, "TP2/DP2"),
])
def test_a_topology_no_round_runs_is_checked_under_a_note_citing_the_final_rounds_rule(tmp_path, args, tokens,
                                                                                         topology):
    """A GPU machine's server may run any topology, and the planner's page math is still checked against it;
    the check said nothing of the topology being none the contest runs."""
    d = served(tmp_path, "run", args, tokens)
    r = forge(tmp_path, "plan", "--against", str(d), "--out", str(tmp_path / "check"))
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr and "error:" not in r.stderr, r.stdout + r.stderr
    note = next((x for x in r.stdout.splitlines() if x.startswith("note: ")), "")
    assert f"{topology} is not a topology of the contest" in note, r.stdout
    assert "the final round runs TP2/DP1 or TP1/DP2" in note and "(rule 'final_topology')" in note, note
    assert "the preliminary TP1/DP1" in note, note
    res = json.loads((tmp_path / "check" / "plan-check.json").read_text())
    assert res["topology_note"] == note[len("note: "):]
    assert note in (tmp_path / "check" / "plan-check.md").read_text()
    rows = [x for x in r.stdout.splitlines() if x.strip().startswith("DP")]
    assert len(rows) == len(tokens), r.stdout


@pytest.mark.parametrize("args,tokens", [([], {"0": 28224}), (["-dp", "2"], {"0": 28224, "1": 28224}),
                                         (["-tp", "2"], {"0": 268128})])
def test_a_topology_of_the_contest_gets_no_note(tmp_path, args, tokens):
    d = served(tmp_path, "run", args, tokens)
    r = forge(tmp_path, "plan", "--against", str(d))
    assert r.returncode == 0 and "note:" not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("line", ["GPU KV cache size: 12,3x4 tokens", "GPU KV cache size: 12,34 tokens",
                                  "GPU KV cache size: tokens"])
def test_a_garbled_kv_cache_line_is_refused_quoted_with_its_file(tmp_path, line):
    """It read as no report at all: 'no server log beside it says "GPU KV cache size"', where the log did."""
    d = served(tmp_path, "run", [], log=f"(EngineCore_DP0 pid=7) INFO 12-04 10:00:00 [kv_cache_utils.py:1087] {line}\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--against", str(d))
    err = refused(r, f"{d / 'server.log'}: a KV cache report that cannot be read", line)
    assert "no KV cache report" not in err
    assert "serve the run again" in fix_line(r)


def test_e2e_and_plan_help_say_what_they_check(tmp_path):
    e2e_help = " ".join(forge(tmp_path, "e2e-gpu", "--help").stdout.split())
    for words in ("the servers' ports free", "vLLM installed for its Python unless the bundle installs it",
                  "torch's device count in that Python", "a refusal (exit code 2) leaves no results folder",
                  "where a profile's server never came up",
                  "or where a (tier, profile) failed: its client failed, or its server died during the tier",
                  "the line names each, its error and its logs"):
        assert words in e2e_help, words
    plan_help = " ".join(forge(tmp_path, "plan", "--help").stdout.split())
    assert "a topology no contest round runs, e.g. TP4, is checked with a note saying so" in plan_help
    assert "refused, quoted with its file" in plan_help

