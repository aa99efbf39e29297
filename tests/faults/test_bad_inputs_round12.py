"""Inputs found to be taken wrongly in the twelfth round of input hardening.

`forge sweep --round final ... --vllm "python fakeserver.py 'serve"` (a quote left open) wrote the sweep's
record (sweeps/<id>/sweep.json with the first tier's ranking) before the command was split, then refused it;
with `--client "benchclient.py 'x"` the baseline's server was started and its run folder written before the
client's command was read. `forge sweep upstream --client ...` (the preliminary's sweep) started the first
profile's server the same way. Both are now refused before anything is written or started, naming the option.

`forge sweep --round final ... --model-build best` (a build the time model does not know) was read only when
the ranking began: on a machine without the two cards the refusal named the cards ("TP=2/DP=1 needs 2 cards,
0 visible"), never the option typed wrong. It is now refused with the other inputs, before the cards are
counted, naming --model-build and the builds.
DOC
"""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT, forge, free_port, tiny_model
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_final_sweep import BENCH, FAKE  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round12-model"))


# --- sweep: --vllm and --client checked before the record is written or a server starts -----------------

SWEEP_ONE = ["--tiers", "4-8K", "--topologies", "tp2", "--kv-dtypes", "bf16", "--max-num-seqs", "64",
             "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.95", "--concurrency", "8",
             "--num-prompts", "2", "--timeout", "30"]


@pytest.mark.parametrize("option,value", [("--vllm", f"{FAKE} 'serve"), ("--client", f"{BENCH} 'x")])
def test_sweep_final_with_a_quote_left_open_writes_nothing(tmp_path, model, option, value):
    """The sweep's record (its ranking) was written first; --client's quote failed once a server was up."""
    launch = {"--vllm": FAKE, "--client": BENCH, option: value}
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "sweep", "--round", "final", "--model", str(model), "--baseline-profile", "upstream",
                  *SWEEP_ONE, "--vllm", launch["--vllm"], "--client", launch["--client"], "--port", str(free_port()),
                  "--tier-env", str(tmp_path / "tier-env.json"), timeout=120, CUDA_VISIBLE_DEVICES="0,1")
    refused(r, option, "No closing quotation (an unbalanced quote)")


def test_sweep_of_profiles_with_a_client_quote_left_open_starts_no_server(tmp_path, model):
    """The preliminary's sweep started the first profile's server (and wrote its run folder) before the
    client's command was read."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "sweep", "upstream", "--model", str(model), "--vllm", FAKE, "--client", f"{BENCH} 'x",
                  "--port", str(free_port()), "--num-prompts", "2", "--timeout", "30", timeout=120)
    refused(r, "--client", "No closing quotation (an unbalanced quote)")


def test_sweep_final_model_build_is_refused_before_the_cards_are_counted(tmp_path, model):
    """--model-build was read only when the ranking began: on a machine without the two cards the refusal
    named the cards, not the option typed wrong."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "sweep", "--round", "final", "--model", str(model), "--baseline-profile", "upstream",
                  *SWEEP_ONE, "--model-build", "best", CUDA_VISIBLE_DEVICES="")
    refused(r, "--model-build 'best': not a build the model knows")
    assert "best-public, upstream" in fix_line(r), r.stderr
