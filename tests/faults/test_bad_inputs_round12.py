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

`forge score --round final --run RUN` where RUN's manifest.json records `"round": ["final"]` (or "semi", or 1):
the value was taken as a round's name ("run RUN was measured in the ['final'] round, not the final round",
fix: "score it with --round ['final']", a round that does not exist), and `forge compare` compared the run
without a word. The key is now refused as damaged, naming the file, the key and the rounds. A run whose
manifest records no round (or that has none) is of the preliminary; the refusal no longer cites a
"manifest.json round" that is not there.

`forge compare --a <final-round run> --b <preliminary run>` printed the deltas of tok/s, TTFT and TPOT with
verdicts, exit 0, though the rounds' clients send other requests at another concurrency (only the score row
was left out). Runs of two rounds are now refused, naming one run of each.

`forge sweep --round final --tiers ,` was refused as "--tiers: none not a tier of the final round", as if a
tier called "none" had been typed. It now says "--tiers names no tier", as bench-all-tiers does.

`forge e2e-gpu --gpu-memory-utilization 0` (or 1.0, 0.995) was refused without a `fix:` line, and --help did not
say the share runs from 0.05 to 0.99 (one server at 1.0 meets the rule it states, servers x F at most 1). The
refusal now says what to give, and --help names the bounds.
"""

from __future__ import annotations

import sys

import pytest
from helpers import FIXTURE_RUNS, ROOT, forge, free_port, tiny_model
from test_bad_inputs import edit_json, refused, writes_nothing
from test_bad_inputs_round5 import fix_line

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_bad_inputs_round6_sweep import final_run  # noqa: E402
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


# --- score / compare: a manifest's round that names no round; runs of two rounds -------------------------

@pytest.mark.parametrize("value", [["final"], "semi", 1])
@pytest.mark.parametrize("verb", ["score", "compare"])
def test_a_damaged_manifest_round_is_refused_naming_the_key(tmp_path, value, verb):
    """It was taken as a round's name: score said "measured in the ['final'] round" with the fix `score it
    with --round ['final']`, compare compared the run without a word."""
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    edit_json(run / "manifest.json", lambda m: {**m, "round": value})
    args = (["score", "--round", "final", "--run", str(run), "--baseline", str(base)] if verb == "score"
            else ["compare", "--a", str(base), "--b", str(run)])
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, f"{run / 'manifest.json'}: key 'round' is {value!r}", "not a round of the contest (preliminary, final)")
    assert "manifest.json is damaged" in fix_line(r) and "--round" not in fix_line(r), r.stderr


def test_score_of_a_run_without_a_round_names_no_key_it_lacks(tmp_path):
    """The refusal cited "manifest.json round" for a manifest that records none (or no manifest at all)."""
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    edit_json(run / "manifest.json", lambda m: {k: v for k, v in m.items() if k != "round"})
    r = forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline", str(base))
    refused(r, "run run was measured in the preliminary round, not the final round",
            "no round recorded in its manifest.json")
    assert "manifest.json round)" not in r.stderr, r.stderr


def test_compare_refuses_runs_of_two_rounds(tmp_path):
    """A final-round run (the finals' client: its concurrency, its requests) was compared with a preliminary
    run (one request at a time) as if the deltas were the build's, exit 0."""
    final = final_run(tmp_path, "final", "fast")
    for a, b in ((str(final), str(FIXTURE_RUNS / "base")), (str(FIXTURE_RUNS / "base"), str(final))):
        r = forge(tmp_path, "compare", "--a", a, "--b", b)
        refused(r, "of the final round", "of the preliminary round", "not comparable")
        assert r.stdout == "" and "one round per call" in fix_line(r), r.stdout
    two = final_run(tmp_path, "final2")
    same = forge(tmp_path, "compare", "--a", str(two), "--b", str(final))
    assert same.returncode == 0 and "4-8K tok/s" in same.stdout, same.stderr


@pytest.mark.parametrize("tiers", [",", " , "])
def test_sweep_final_tiers_naming_none_says_so(tmp_path, tiers):
    """`--tiers ,` was refused as "--tiers: none not a tier of the final round", as if a tier "none" had been
    typed; bench-all-tiers says "--tiers names no tier"."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "sweep", "--round", "final", "--tiers", tiers, "--baseline-profile", "upstream")
    err = refused(r, "--tiers names no tier")
    assert "none" not in err and "4-8K, 8-16K, 16-32K" in fix_line(r), r.stderr


# --- e2e-gpu --gpu-memory-utilization: its bounds in the refusal and in --help ----------------------------

@pytest.mark.parametrize("value", ["0", "1.0", "0.995"])
def test_e2e_gpu_share_out_of_bounds_has_a_fix_and_help_names_the_bounds(tmp_path, value):
    """The refusal had no `fix:` line, and --help did not say the share is 0.05 to 0.99 (1.0 for one server
    fits its own rule, servers x F at most 1, yet is refused)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--out", str(tmp_path / "e2e"), "--gpu-memory-utilization", value)
    refused(r, "--gpu-memory-utilization", "outside 0.05-0.99")
    assert "from 0.05 to 0.99" in fix_line(r), r.stderr
    text = " ".join(forge(tmp_path, "e2e-gpu", "--help").stdout.split())
    assert "every server's share of the GPU, 0.05 to 0.99," in text, text[-3000:]
