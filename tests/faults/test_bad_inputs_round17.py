"""Inputs found to be taken wrongly in the seventeenth round of input hardening.

An option the verb does not have, typed after an option's one value (`forge score --run R --bogus`, `forge plan
--tier 4-8K --max-num-seqs 16`, `forge predict --round final --max-num-seqs 16`, `forge bench-all-tiers --round
final --concurrency 10`): refused as "--run takes one value, given 1 words ('R')" (or "--round takes one value,
given 2 words ('final' '16')"), as if a value with a blank had been split into words; the option typed was never
named. It is now refused naming it: "--max-num-seqs: not an option of forge predict". A value split into words
(`make score RUN="a b"`) is still said to be one, a word that reads as a negative number ("a -5") among them.

`forge compare --noise-pct 1e-300` (any value above 0): taken, a band of nothing under the table's two decimals,
so every difference read "B higher" or "B lower" however small. --noise-pct now takes 0.1 to 100 (a tenth of a
percent is below any run-to-run noise of a served benchmark); 0.1 itself is taken.

`forge sweep --round final --topologies tp2,` (and `,tp2`): refused as "'' is not a topology of the final round", a
comma too many read as a topology named ''. It is now refused as an empty item, naming the option and the value as
typed, as the sweep's other lists refuse theirs (the round-5 test of "," and "tp2,,dp2" says so too).

`forge sweep --round final --tiers 4-8K,` and `forge bench-all-tiers --tiers 4-8K,,8-16K`: the empty item was
skipped (bench-all-tiers went on to ask for a server), where every other list option refuses one. It is now
refused as an empty item before anything is asked or written; a list of nothing ("," or " , ") still says "--tiers
names no tier".

`forge predict --round final --concurrency 10,,12` (or `--max-num-batched-tokens 8192,`): refused as "whole
numbers in plain digits within the final round's bounds (1..256)", where every value typed was one. It is now
refused as an empty item, as `--kv-dtype bf16,` of the same verb is.

`forge e2e-gpu --profiles upstream,,fast` (or `upstream,`): refused as "'' is '' is not a name (empty or not
text)". It is now refused as an empty item, naming --profiles and the value typed, before anything is written.
"""

from __future__ import annotations

import pytest
from helpers import FIXTURE_RUNS, forge, free_port
from test_bad_inputs import make, refused, writes_nothing
from test_bad_inputs_round4 import _model
from test_bad_inputs_round5 import CARDS, SWEEP, fix_line

# --- an option the verb does not have, after an option's value -------------------------------------------------

@pytest.mark.parametrize("args,option", [
    (["score", "--run", "R", "--bogus"], "--bogus"),
    (["score", "--run", "R", "--bogus=3"], "--bogus"),
    (["plan", "--tier", "4-8K", "--max-num-seqs", "16"], "--max-num-seqs"),
    (["predict", "--round", "final", "--max-num-seqs", "16"], "--max-num-seqs"),
    (["bench-all-tiers", "--round", "final", "--concurrency", "10"], "--concurrency"),
])
def test_an_unknown_option_after_a_value_is_named(tmp_path, args, option):
    """It was "--run takes one value, given 1 words ('R')": the option typed never named."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, f"{option}: not an option of forge {args[0]}")
    assert "takes one value" not in r.stderr and f"forge {args[0]} --help" in fix_line(r), r.stderr


def test_a_value_split_into_words_is_still_said_to_be_one(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", "R", "-5")
        m = make(tmp_path, "score", "RUN=a b")
    refused(r, "--run takes one value, given 2 words ('R' '-5')")
    refused(m, "--run takes one value, given 2 words ('a' 'b')")


# --- compare --noise-pct: a band of nothing ------------------------------------------------------------------------

@pytest.mark.parametrize("pct", ["1e-300", "0.05", "0.0999"])
def test_compare_refuses_a_noise_band_of_nothing(tmp_path, pct):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(FIXTURE_RUNS / "fast"),
                  "--noise-pct", pct)
    refused(r, "--noise-pct", f"{pct!r} is not a percentage >= 0.1 and <= 100")


def test_compare_takes_a_tenth_of_a_percent(tmp_path):
    r = forge(tmp_path, "compare", "--a", str(FIXTURE_RUNS / "base"), "--b", str(FIXTURE_RUNS / "fast"),
              "--noise-pct", "0.1")
    assert r.returncode == 0 and "assumed 0.1 % (one run per side)" in r.stdout, r.stderr


# --- sweep --round final --topologies, --tiers; bench-all-tiers --tiers: an empty item ----------------------------

def _sweep(option: str, value: str) -> list[str]:
    args = [*SWEEP]
    args[args.index(option) + 1] = value
    return args


@pytest.mark.parametrize("topologies", ["tp2,", ",tp2"])
def test_sweep_refuses_an_empty_topology_as_an_empty_item(tmp_path, topologies):
    """It said "'' is not a topology of the final round"."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *_sweep("--topologies", topologies), "--model", str(tmp_path / "model"), **CARDS)
    refused(r, f"--topologies {topologies!r}: an empty item")
    assert "'' is not" not in r.stderr and "tp2, tp2dp1" in fix_line(r), r.stderr


@pytest.mark.parametrize("tiers", ["4-8K,", "4-8K,,8-16K", ",4-8K"])
def test_sweep_refuses_an_empty_tier(tmp_path, tiers):
    """The empty item was skipped: "4-8K," searched 4-8K."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *_sweep("--tiers", tiers), "--model", str(tmp_path / "model"), **CARDS)
    refused(r, f"--tiers {tiers!r}: an empty item")
    assert "4-8K, 8-16K, 16-32K" in fix_line(r), r.stderr


@pytest.mark.parametrize("tiers", ["4-8K,", "4-8K,,8-16K"])
def test_bench_refuses_an_empty_tier_before_asking_for_a_server(tmp_path, tiers):
    """The empty item was skipped, and the server asked for."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "bench-all-tiers", "--model", "/m", "--port", str(free_port()), "--tiers", tiers)
    refused(r, f"--tiers {tiers!r}: an empty item")
    assert "no server answers" not in r.stderr and "4-8K, 8-16K, 16-32K" in fix_line(r), r.stderr


@pytest.mark.parametrize("verb", [["bench-all-tiers", "--model", "/m"], _sweep("--tiers", "4-8K")])
def test_a_tier_list_of_nothing_still_names_no_tier(tmp_path, verb):
    args = [*verb]
    if "--tiers" in args:
        args[args.index("--tiers") + 1] = " , "
    else:
        args += ["--tiers", " , "]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--port", str(free_port()), **CARDS)
    refused(r, "--tiers names no tier")


# --- predict --round final --concurrency, --max-num-batched-tokens: an empty item ----------------------------------

@pytest.mark.parametrize("option,value", [("--concurrency", "10,,12"), ("--concurrency", ",10"),
                                          ("--max-num-batched-tokens", "8192,")])
def test_predict_final_refuses_an_empty_item_as_one(tmp_path, option, value):
    """It said "whole numbers in plain digits within the final round's bounds", every value typed being one."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--round", "final", "--speedup", "gemv=1.2", option, value)
    refused(r, f"{option} {value!r}: an empty item")
    assert f"e.g. {option} " in fix_line(r), r.stderr


def e2e_gpu_writes_nothing(tmp_path, *args):
    """`forge e2e-gpu` with a model and no bundle, vLLM or client (nothing it could start), and `args`; it must
    have written nothing."""
    model = _model(tmp_path)
    with writes_nothing(tmp_path):
        return forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(model), "--vllm", "false", "--client",
                     "false", "--no-plumbing", "--no-fault", "--start-guess-s", "0", "--out", str(tmp_path / "out"),
                     *args, timeout=60)


# --- e2e-gpu --profiles: an empty item --------------------------------------------------------------------------------

@pytest.mark.parametrize("profiles", ["upstream,,fast", "upstream,"])
def test_e2e_gpu_refuses_an_empty_profile_as_an_empty_item(tmp_path, profiles):
    """It said "'' is '' is not a name (empty or not text)"."""
    r = e2e_gpu_writes_nothing(tmp_path, "--profiles", profiles)
    refused(r, f"--profiles {profiles!r}: an empty item")
    assert "'' is" not in r.stderr and "fast-int8,upstream" in fix_line(r), r.stderr
