"""Inputs found to be taken wrongly in the twenty-third round of input hardening.

A --gpu-memory-utilization with more than 6 significant digits (`forge sweep --round final
--gpu-memory-utilization 0.95,0.9500000001`, `forge predict --round final` or `forge plan --round final` with
0.9500000001, GPU_MEMORY_UTILIZATION=0.9500000001 for `forge serve --round final`, a tier-environment file's
0.97000001): taken, and named with 6 digits wherever forge writes it (the sweep's run folders and ranking, the
model's labels, the headroom's lines). The sweep kept one of 0.95 and 0.9500000001 under the other's name (one
configuration ranked and served); predict listed two rows "util 0.95"; serve warned that "3.20 GiB outside vLLM's
budget at utilization 0.95" does not hold the pool, "set GPU_MEMORY_UTILIZATION to 0.95 or less". Each is now
refused by the round's reader, naming the option (or the variable, or the file and key), with at most 6
significant digits as the fix; nothing written.
"""

from __future__ import annotations

import json

import pytest
from helpers import forge, tiny_model
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round21 import CARDS, ONE, SWEEP


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round23-model"))


# --- a utilization with more digits than forge writes ----------------------------------------------------------------

LONG = "more than 6 significant digits: forge's runs, records and lines would name it 0.95, as they name 0.95 itself"


def test_sweep_final_refuses_a_utilization_its_runs_would_name_otherwise(tmp_path, model):
    """Taken before: the two utilizations were one candidate (tp1dp2-bf16-s8-b4096-u0.95-c8), 0.95 dropped."""
    values = {**ONE, "--gpu-memory-utilization": "0.95,0.9500000001"}
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(model), "--tier-env", str(tmp_path / "te.json"),
                  *[x for kv in values.items() for x in kv], **CARDS)
    refused(r, "--gpu-memory-utilization 0.9500000001 has " + LONG)
    assert fix_line(r) == "  fix: write at most 6 significant digits, e.g. 0.95", r.stderr


@pytest.mark.parametrize("args", [
    ["plan", "--round", "final", "--gpu-memory-utilization", "0.9500000001"],
    ["predict", "--round", "final", "--speedup", "gemv=1.1", "--gpu-memory-utilization", "0.95,0.9500000001"],
])
def test_plan_and_predict_refuse_a_utilization_their_rows_would_name_otherwise(tmp_path, args):
    """Taken before: plan's rows and predict's labels said "util 0.95" (predict twice, for two configurations)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, "--gpu-memory-utilization 0.9500000001 has " + LONG)
    assert "e.g. 0.95" in fix_line(r), r.stderr


def test_serve_final_refuses_a_utilization_variable_its_warning_would_name_otherwise(tmp_path):
    """Taken before, with the warning "at utilization 0.95 does not hold ...: set GPU_MEMORY_UTILIZATION to 0.95
    or less"."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "16-32K", "--dry-run", "--profile", "contest",
                  GPU_MEMORY_UTILIZATION="0.9500000001", TENSOR_PARALLEL_SIZE="1", DATA_PARALLEL_SIZE="2")
    refused(r, "GPU_MEMORY_UTILIZATION='0.9500000001' (environment)", "'0.9500000001' has " + LONG)
    assert "set GPU_MEMORY_UTILIZATION to a number of at most 6 significant digits within 0.1..1" in fix_line(r)


def test_a_tier_environment_files_utilization_with_more_digits_is_refused(tmp_path):
    """Taken before: ENVIRONMENT.md shipped GPU_MEMORY_UTILIZATION=0.97000001 with a note "at utilization 0.97"."""
    env = {"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2", "MAX_NUM_SEQS": "6",
           "MAX_NUM_BATCHED_TOKENS": "4096", "GPU_MEMORY_UTILIZATION": "0.97000001", "CONCURRENCY_8_16K": "10"}
    te = tmp_path / "te.json"
    te.write_text(json.dumps({"round": "final", "tiers": {"8-16K": {
        "environment": env, "engine_options": {}, "kv_dtype": "bf16", "run": "r-8", "sweep": "s1"}}}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(te), "--out", str(tmp_path / "o"))
    refused(r, "te.json: key 'tiers.8-16K.environment'", "'0.97000001' has more than 6 significant digits")


def test_a_utilization_of_six_digits_is_taken(tmp_path):
    r = forge(tmp_path, "plan", "--round", "final", "--tier", "4-8K", "--gpu-memory-utilization", "0.951234")
    assert r.returncode == 0 and "--gpu-memory-utilization 0.951234," in r.stdout, r.stderr
