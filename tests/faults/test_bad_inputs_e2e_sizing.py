"""`forge e2e-gpu`'s sizing refused before anything is written or started: a deadline that holds no tier, a
bundle pip cannot install, a batch profile the servers' command lines cannot decode at once, a KV cache
larger than any card the capacity planner knows, and servers that do not fit the GPU they share (the GPU
a stand-in `nvidia-smi` reports: an H200's 143,771 MiB). Each refusal: exit code 2, one error line naming
the option with its numbers and a `fix:` line, no results folder (a folder being resumed stays as it was:
every file's size and modification time), no server started. The sizing of the day's final-round runs is
accepted."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from helpers import e2e_fake, health
from test_bad_inputs import refused, writes_nothing

from forge.errors import ForgeError
from forge.lab import gpu_bundle, gpufit

H200_MIB = 143771                 # what nvidia-smi reports for an H200 ("141 GB")
H200_BYTES = 150_754_820_096      # H200_MIB x 2**20
TP1_WEIGHTS = 53_791_996_928      # the planner's bf16 weights per rank at TP1, no vision tower
DCU_TP1_KV = 7_501_512_704        # `forge plan`: a DCU card's TP1 cache (the day's command)
DCU_TP2_KV = 35_067_002_880       # ... per rank at TP2


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    gpu_bundle.write_model_dir({"model": {"config": "configs/models/qwen3.5-27b/config.json",
                                          "vocab_size": 248320, "eos_token_id": 248044}}, model)
    return model


def _fake_smi(tmp_path: Path, mib: int = H200_MIB, cards: int = 1) -> dict:
    """A stand-in nvidia-smi first on PATH: `cards` cards of `mib` MiB each."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n  --query-gpu=memory.total) "
                   + "".join(f"echo {mib}; " for _ in range(cards))
                   + ";;\n  *) echo 'NVIDIA H200, 550.00';;\nesac\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _refused_nothing_started(tmp_path, *args, env_extra=None):
    """e2e-gpu against the fakes (fast-int8 and upstream, one prompt per tier): nothing under tmp_path
    written or changed (a results folder there already included), no server started, no client run."""
    _model(tmp_path)
    with writes_nothing(tmp_path):
        r, port, out = e2e_fake(tmp_path, "--no-fault", "--no-plumbing", *args, env_extra=env_extra, timeout=120)
    assert not (tmp_path / "pack").exists()
    assert not health(port) and not health(port + 1) and not (tmp_path / "replay.log").exists()
    return r


# --- refusals before the results folder --------------------------------------------------------------------

def test_a_deadline_that_holds_no_tier_leaves_no_results_folder(tmp_path):
    """It was refused before any server started, after the folder, its logs/ and the prompts were written."""
    r = _refused_nothing_started(tmp_path, "--deadline-s", "30", "--reserve-s", "0")
    refused(r, "--deadline-s 30", "no tier would be measured")
    assert not (tmp_path / "out").exists()


def test_a_folder_being_resumed_stays_as_it_was_when_refused(tmp_path):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "summary.json").write_text(json.dumps({"started": "2026-12-05T07:00:00+00:00", "steps": []}))
    r = _refused_nothing_started(tmp_path, "--deadline-s", "30", "--reserve-s", "0")
    refused(r, "--deadline-s 30", "no tier would be measured")
    assert sorted(p.name for p in out.iterdir()) == ["runs", "summary.json"]


def test_a_bundle_pip_cannot_install_leaves_no_results_folder(tmp_path):
    """A wheel pip refuses: the bundle verifies (its manifest's sha256 match), the install fails; the folder
    and its logs/ were made before."""
    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    whl = bundle / "wheels" / "vllm-0.18.1-py3-none-any.whl"
    whl.write_bytes(b"not a zip archive")
    (bundle / "manifest.json").write_text(json.dumps({
        "version": "test", "vllm_wheel": whl.name, "python": "3.12",
        "files": {f"wheels/{whl.name}": {"sha256": hashlib.sha256(whl.read_bytes()).hexdigest()}}}))
    r = _refused_nothing_started(tmp_path, "--bundle", str(bundle), "--site", str(tmp_path / "site"))
    refused(r, f"--bundle {bundle}: pip could not install its wheels", "is invalid")
    assert not (tmp_path / "out").exists()


def test_a_batch_profile_over_the_servers_max_num_seqs_is_refused_before_any_server(tmp_path):
    """It was found after the tiers, when the batch was about to be sent (a server error in the summary)."""
    r = _refused_nothing_started(tmp_path, "--round", "final", "--capacity", "fast-int8:max-num-seqs=4",
                                 "--profile-prefill", "2000",
                                 "--profile-decode", "16", "--profile-batch", "8")
    refused(r, "--profile-batch 8", "the fast-int8 server runs at most 4 requests at once (--max-num-seqs 4)")


def test_a_batch_profile_longer_than_the_servers_max_model_len_is_refused_before_any_server(tmp_path):
    r = _refused_nothing_started(tmp_path, "--profile-prefill", "32600", "--profile-decode", "64",
                                 "--profile-batch", "2")
    refused(r, "--profile-prefill 32600 --profile-decode 64", "--max-model-len 32768", "104 output tokens")


def test_a_batch_profile_the_servers_kv_cache_cannot_hold_is_refused_before_any_server(tmp_path):
    """harness.yaml's 5 GiB: 102 usable blocks of 1552 tokens with the int8 KV cache (fast-int8), 16 for a
    request of 20,064 tokens (13 attention blocks and 3 GDN ones). It was found after the tiers, from the
    server's log."""
    r = _refused_nothing_started(tmp_path, "--profile-prefill", "20000", "--profile-decode", "64",
                                 "--profile-batch", "8")
    refused(r, "--profile-batch 8 --profile-prefill 20000 --profile-decode 64", "the fast-int8 server's KV cache",
            "holds 102 blocks of 1552 tokens", "8 requests of 20000 + 64 tokens need 128")


def test_a_kv_cache_larger_than_any_card_is_refused_with_the_card_it_cites(tmp_path):
    r = _refused_nothing_started(tmp_path, "--kv-cache-memory-bytes", "200000000000")
    refused(r, "--kv-cache-memory-bytes 200000000000", "largest card the capacity planner knows",
            "h200: 150109880320 bytes")


# --- the servers on the GPU they share (a stand-in nvidia-smi) -----------------------------------------------

def test_kv_caches_that_do_not_fit_their_share_beside_the_weights_are_refused_with_the_numbers(tmp_path):
    r = _refused_nothing_started(tmp_path, "--kv-cache-memory-bytes", "20000000000", "--gpu-memory-utilization",
                                 "0.47", env_extra=_fake_smi(tmp_path))
    err = refused(r, "--kv-cache-memory-bytes 20,000,000,000", "2 servers side by side (fast-int8, upstream)",
                  f"{H200_BYTES:,} bytes (nvidia-smi)", "70,854,765,445 bytes", f"{TP1_WEIGHTS:,} bytes per rank",
                  "17,062,768,517 bytes are left")
    assert "--kv-cache-memory-bytes 17062768517 or less" in r.stderr, (err, r.stderr)


def test_shares_of_the_gpu_over_the_whole_card_are_refused(tmp_path):
    r = _refused_nothing_started(tmp_path, "--gpu-memory-utilization", "0.6", env_extra=_fake_smi(tmp_path))
    refused(r, "--gpu-memory-utilization 0.6", "2 servers side by side", "1.20 of its")
    assert "--gpu-memory-utilization 0.5 or less" in r.stderr


def test_the_days_final_round_sizing_is_accepted_and_recorded(tmp_path):
    """Two servers at 0.47 with a DCU card's TP1 cache each, on an H200: the command of the day's runs."""
    _model(tmp_path)
    r, port, out = e2e_fake(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K",
                            "--kv-cache-memory-bytes", str(DCU_TP1_KV), "--gpu-memory-utilization", "0.47",
                            env_extra=_fake_smi(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    fit = json.loads((out / "summary.json").read_text())["gpu_fit"]
    assert fit["checked"] and fit["card_bytes"] == H200_BYTES and fit["servers"] == 2
    assert {n: s["kv_room_bytes"] for n, s in fit["per_server"].items()} == \
        {"fast-int8": 17_062_768_517, "upstream": 17_062_768_517}
    assert f"GPU memory checked before the start (nvidia-smi): {H200_BYTES:,} bytes, 2 server(s)" in \
        (out / "summary.md").read_text()


# --- the check itself --------------------------------------------------------------------------------------------

def _launch(*extra: str) -> list[str]:
    return ["python", "-m", "vllm", "serve", "m", "--language-model-only", "--max-model-len", "32768", *extra]


@pytest.mark.parametrize("launch,utilization,kv,cards", [
    # the day's command: two TP1 servers at 0.47, a DCU card's TP1 cache each, one H200
    (_launch(), 0.47, DCU_TP1_KV, 1),
    # README's two-GPU command: two TP2 servers at 0.47, a DCU card's TP2 cache per rank, two H200s
    # (35 GB each, over what 2 x kv <= share - weights would allow: each server has a share of its own)
    (_launch("--tensor-parallel-size", "2"), 0.47, DCU_TP2_KV, 2),
])
def test_the_documented_sizings_fit(tmp_path, launch, utilization, kv, cards):
    model = _model(tmp_path)
    rec = gpufit.check_fit({"a": launch, "b": launch}, utilization, kv, model, ([H200_BYTES] * cards, "nvidia-smi"))
    assert rec["checked"] and all(s["kv_room_bytes"] >= kv for s in rec["per_server"].values())


def test_the_first_card_of_a_two_card_server_bounds_it_and_an_unknown_card_is_not_checked(tmp_path):
    model = _model(tmp_path)
    tp2 = _launch("--tensor-parallel-size", "2")
    with pytest.raises(ForgeError, match="64,000,000,000 bytes"):
        gpufit.check_fit({"a": tp2}, 0.95, DCU_TP2_KV, model, ([H200_BYTES, 64_000_000_000], "nvidia-smi"))
    assert not gpufit.check_fit({"a": tp2}, 0.95, DCU_TP2_KV, model, ([H200_BYTES], "nvidia-smi"))["checked"]
    assert not gpufit.check_fit({"a": tp2}, 0.95, DCU_TP2_KV, model, None)["checked"]


def _tool(name: str, text: str):
    """A stand-in for the management tools: `name` answers `text`, the others are not there."""
    def run(cmd):
        if cmd[0] != name:
            raise ForgeError(f"{cmd[0]}: not found")
        return text
    return run


@pytest.mark.parametrize("extra,batch,tokens,fits", [
    # the batch profile test's server: 4 requests of 16,000 + 64 in 5 GiB, bf16 (96 of 103 blocks) and int8
    ((), 4, 16000, True), (("--kv-cache-dtype", "int8"), 4, 16000, True),
    ((), 5, 16000, False),                          # 120 blocks of bf16
    (("--kv-cache-dtype", "int8"), 7, 16000, True),    # 7 x 14 = 98 of 102
    (("--kv-cache-dtype", "int8"), 8, 16000, False),   # 112
    (("--data-parallel-size", "2"), 8, 16000, True),    # 4 per rank, each rank its own cache
])
def test_a_batch_is_counted_in_the_planners_blocks(tmp_path, extra, batch, tokens, fits):
    model = _model(tmp_path)
    call = (lambda: gpufit.kv_holds_batch(_launch(*extra), 5 << 30, model, tokens, 64, batch, "the a server"))
    if fits:
        assert call()["blocks_needed"] <= call()["usable_blocks"]
    else:
        with pytest.raises(ForgeError, match="never decode together"):
            call()


def test_card_memory_reads_each_tool_and_the_cards_a_server_sees():
    def smi(text):
        return _tool("nvidia-smi", text)
    two = "143771\n81559\n"
    assert gpufit.card_memory({}, smi(two)) == ([H200_BYTES, 81559 << 20], "nvidia-smi")
    assert gpufit.card_memory({"CUDA_VISIBLE_DEVICES": "1"}, smi(two)) == \
        ([81559 << 20], "nvidia-smi, CUDA_VISIBLE_DEVICES=1")
    # a negative index ends the list, as CUDA and forge.contest.cards read it: card 1 alone is seen (not both)
    assert gpufit.card_memory({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, smi(two)) == \
        ([81559 << 20], "nvidia-smi, CUDA_VISIBLE_DEVICES=1,-1,0")
    assert gpufit.card_memory({"HIP_VISIBLE_DEVICES": "-1"}, smi(two)) == ([], "nvidia-smi, HIP_VISIBLE_DEVICES=-1")
    # ids the tool's order does not give: every card counted
    assert gpufit.card_memory({"CUDA_VISIBLE_DEVICES": "GPU-5d3"}, smi(two)) == ([H200_BYTES, 81559 << 20], "nvidia-smi")

    rocm = _tool("rocm-smi", "GPU[0]\t\t: VRAM Total Memory (B): 68702699520\n"
                             "GPU[0]\t\t: VRAM Total Used Memory (B): 1\n")
    assert gpufit.card_memory({}, rocm) == ([68_702_699_520], "rocm-smi")
    assert gpufit.card_memory({}, _tool("none", "")) is None
