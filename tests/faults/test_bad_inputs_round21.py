"""Inputs found to be taken wrongly in the twenty-first round of input hardening.

`forge sweep --round final --max-num-seqs +4,04` (or --max-num-batched-tokens 04096, --concurrency 08,
--gpu-memory-utilization +0.95; `forge predict --round final --concurrency 08` or --max-num-batched-tokens
+4096; `forge plan --round final --concurrency 08`, --max-num-batched-tokens +4096, --gpu-memory-utilization
+0.95): taken as the number, the sweep started, where the final round's variables (MAX_NUM_SEQS=+4,
CONCURRENCY_4_8K=08) and e2e-gpu --capacity refuse the same text. Each is now refused as they refuse it, naming
the option and the value, with the plain numbers as the fix.

Every whole-number option of the command line (`sweep --top 04`, `predict --round final --top 05`,
`bench-all-tiers --num-prompts 08`, `sweep --num-prompts +2`, `sweep --kv-cache-memory-bytes 0123`, `serve --port
08001`, `calibrate --seed 01`): taken as the number. It is now refused the same way, naming the option, with the
plain number as the fix; a value the option's own range refuses ("+0" for a count) is refused by that range.

`forge bench-all-tiers --round final` with CONCURRENCY_4_8K=08 (or +8) in the environment: taken, the client given
--max-concurrency 8, where `forge serve --round final` refuses the same variable (the finals' client gets the text
as written). It is now refused as serve refuses it, naming the variable, with its bounds as the fix.

`forge serve --round final --profile mine.yaml` where the profile sets `--max-num-seqs: {value: 064}`: YAML read
the octal 52, and the server was given --max-num-seqs 52; `value: +64`, `0x40`, `1_024` (or "064" quoted, or a
tier's value of a mapping) were served as 64, 64, 1024 and 64; `CONCURRENCY_4_8K: {value: "+8"}` (or "08") was
taken and put in the server's environment as written. A profile's value of the final round is now read as the file
writes it, refused as the round's variables refuse it, naming the file and key, with the plain number as the fix.
"""

from __future__ import annotations

import pytest
from helpers import forge, free_port, tiny_model
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line

CARDS = {"CUDA_VISIBLE_DEVICES": "0,1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round21-model"))


# one configuration of one tier, nothing that could start (false for vLLM and the client)
SWEEP = ["sweep", "--round", "final", "--baseline-profile", "upstream", "--tiers", "4-8K", "--topologies", "tp2",
         "--kv-dtypes", "bf16", "--vllm", "false", "--client", "false", "--timeout", "1"]
ONE = {"--max-num-seqs": "64", "--max-num-batched-tokens": "4096", "--gpu-memory-utilization": "0.95",
       "--concurrency": "8", "--top": "1"}


def sweep_writes_nothing(tmp_path, model, **given):
    """`forge sweep --round final` of one configuration, with `given` ({option: value}) in place of its value."""
    values = {**ONE, **{k.replace("_", "-"): v for k, v in given.items()}}
    with writes_nothing(tmp_path):
        return forge(tmp_path, *SWEEP, "--model", str(model), "--tier-env", str(tmp_path / "te.json"),
                     *[x for kv in values.items() for x in kv], **CARDS)


# --- the final round's list options: a number with a sign or a leading zero -------------------------------------------

@pytest.mark.parametrize("option,value,words,fix", [
    ("--max-num-seqs", "+4,04", "'+4': a sign before the number", "write the plain numbers, e.g. --max-num-seqs 4"),
    ("--max-num-seqs", "8,064", "'064': a leading zero before the number", "e.g. --max-num-seqs 8,64"),
    ("--max-num-batched-tokens", "04096", "a leading zero before the number", "e.g. --max-num-batched-tokens 4096"),
    ("--concurrency", "08", "a leading zero before the number", "write the plain number, e.g. --concurrency 8"),
    ("--gpu-memory-utilization", "+0.95", "a sign before the number", "e.g. --gpu-memory-utilization 0.95"),
])
def test_sweep_final_refuses_a_value_not_written_plainly(tmp_path, model, option, value, words, fix):
    """Taken before as the number: the sweep began (its record and the baseline's run folder written)."""
    r = sweep_writes_nothing(tmp_path, model, **{option: value})
    refused(r, f"{option} {value!r}: {words}")
    assert fix in fix_line(r), r.stderr


@pytest.mark.parametrize("args,words,fix", [
    (["predict", "--round", "final", "--speedup", "gemv=1.1", "--concurrency", "08"],
     "--concurrency '08': a leading zero before the number", "e.g. --concurrency 8"),
    (["predict", "--round", "final", "--speedup", "gemv=1.1", "--max-num-batched-tokens", "+4096,8192"],
     "--max-num-batched-tokens '+4096,8192': '+4096': a sign before the number", "e.g. --max-num-batched-tokens 4096,8192"),
    (["plan", "--round", "final", "--concurrency", "08"], "--concurrency '08': a leading zero", "e.g. --concurrency 8"),
    (["plan", "--round", "final", "--max-num-batched-tokens", "+4096"], "--max-num-batched-tokens '+4096': a sign",
     "e.g. --max-num-batched-tokens 4096"),
    (["plan", "--round", "final", "--gpu-memory-utilization", "+0.95"], "--gpu-memory-utilization '+0.95': a sign",
     "e.g. --gpu-memory-utilization 0.95"),
])
def test_predict_and_plan_refuse_a_value_not_written_plainly(tmp_path, args, words, fix):
    """Taken before: the configurations modelled, the plan printed, at the number."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, words)
    assert f"write the plain number{'s' if ',' in args[-1] else ''}, {fix}" in fix_line(r), r.stderr


def test_plan_takes_the_plain_values(tmp_path):
    r = forge(tmp_path, "plan", "--round", "final", "--tier", "4-8K", "--concurrency", "8",
              "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.95")
    assert r.returncode == 0 and "--max-num-batched-tokens 4096" in r.stdout, r.stderr


# --- every whole-number option: a sign or a leading zero -----------------------------------------------------------

@pytest.mark.parametrize("args,option,value", [
    (["predict", "--round", "final", "--speedup", "gemv=1.1"], "--top", "05"),
    (["bench-all-tiers", "--model", "/m"], "--num-prompts", "08"),
    (["serve", "--profile", "upstream", "--dry-run"], "--port", "08001"),
    (["calibrate"], "--seed", "01"),
])
def test_a_whole_number_option_not_written_plainly_is_refused(tmp_path, args, option, value):
    """Taken before as the number (the prediction printed, the server's command printed, ...)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, option, value)
    refused(r, f"argument {option}: {value!r}: a leading zero before the number")
    assert fix_line(r) == f"  fix: write the plain number, e.g. {option} {int(value)}", r.stderr


@pytest.mark.parametrize("option,value,words", [
    ("--top", "04", "a leading zero"), ("--num-prompts", "+2", "a sign"), ("--kv-cache-memory-bytes", "0123",
                                                                          "a leading zero"),
])
def test_sweep_final_whole_number_options_not_written_plainly_are_refused(tmp_path, model, option, value, words):
    """--top 04 served the best 4, --num-prompts +2 sent 2 requests, --kv-cache-memory-bytes 0123 gave 123 bytes."""
    r = sweep_writes_nothing(tmp_path, model, **{option: value})
    refused(r, f"argument {option}: {value!r}: {words} before the number")
    assert fix_line(r) == f"  fix: write the plain number, e.g. {option} {int(value)}", r.stderr


def test_a_count_written_plus_zero_is_refused_by_its_range(tmp_path):
    """The option's own rule speaks first: "+0" is no count, whatever its sign."""
    r = forge(tmp_path, "predict", "--round", "final", "--speedup", "gemv=1.1", "--top", "+0")
    refused(r, "argument --top: '+0' is not a count")


# --- bench-all-tiers --round final: the client's concurrency variable written with a sign or a leading zero ---------

@pytest.mark.parametrize("value,words", [("08", "a leading zero"), ("+8", "a sign")])
def test_bench_final_refuses_a_concurrency_variable_not_written_plainly(tmp_path, value, words):
    """Taken before as 8 (the client given --max-concurrency 8), where `forge serve --round final` refuses the same
    variable: the finals' client gets the text as written."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "bench-all-tiers", "--round", "final", "--tiers", "4-8K", "--port", str(free_port()),
                  "--model", "/m", CONCURRENCY_4_8K=value)
    refused(r, f"CONCURRENCY_4_8K={value!r} (environment), tier 4-8K: {words} before the number",
            "the final round's start script and client get the value as written")
    assert "set CONCURRENCY_4_8K to a whole number within 1..256, or unset it" in fix_line(r), r.stderr


# --- serve --round final: a profile's value as the file writes it ---------------------------------------------------

def _profile(tmp_path, body: str):
    p = tmp_path / "mine.yaml"
    p.write_text('description: "a final-round profile"\nround: final\nextends: final-tp2\n' + body)
    return p


@pytest.mark.parametrize("value,words,fix", [
    ("064", "'064': a leading zero before the number", "e.g. value: 64"),        # YAML's octal: served as 52
    ('"064"', "'064': a leading zero before the number", "e.g. value: 64"),
    ("+64", "'+64': a sign before the number", "e.g. value: 64"),
    ("0x40", "--max-num-seqs '0x40' is not a number in plain digits", "1..1024"),
    ("1_024", "--max-num-seqs '1_024' is not a number in plain digits", "1..1024"),
    ("{4-8K: 32, 8-16K: 0100}", "value.8-16K '0100': a leading zero before the number", "e.g. 8-16K: 100"),
])
def test_serve_final_reads_a_profiles_value_as_written(tmp_path, value, words, fix):
    """`value: 064` was read by YAML as the octal 52 and served as --max-num-seqs 52; 0x40, 1_024 and +64 were
    served as 64 and 1024, "064" as 64: none is what the final round's variables take."""
    p = _profile(tmp_path, f'options:\n  --max-num-seqs:\n    value: {value}\n    effect: "x"\n')
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", str(p), "--dry-run", **CARDS)
    refused(r, f"{p.name}: key 'options.--max-num-seqs'.value", words)
    assert fix in fix_line(r), r.stderr


@pytest.mark.parametrize("value,words", [('"+8"', "a sign"), ('"08"', "a leading zero")])
def test_serve_final_refuses_a_profiles_concurrency_not_written_plainly(tmp_path, value, words):
    """Taken before, and the server's environment given CONCURRENCY_4_8K=+8 as written."""
    p = _profile(tmp_path, f'env:\n  CONCURRENCY_4_8K:\n    value: {value}\n    effect: "x"\n')
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", str(p), "--dry-run", **CARDS)
    refused(r, f"{p.name}: key 'env.CONCURRENCY_4_8K' {value.strip(chr(34))!r}: {words} before the number")
    assert "write the plain number, e.g. value: 8" in fix_line(r), r.stderr


def test_serve_final_takes_a_profiles_plain_values(tmp_path):
    p = _profile(tmp_path, 'options:\n  --max-num-seqs:\n    value: {4-8K: 64, 8-16K: "32"}\n    effect: "x"\n'
                           '  --gpu-memory-utilization:\n    value: 0.90\n    effect: "x"\n'
                           'env:\n  CONCURRENCY_4_8K:\n    value: "8"\n    effect: "x"\n')
    r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", str(p), "--dry-run", **CARDS)
    assert r.returncode == 0 and "--max-num-seqs 64 " in r.stdout and "utilization 0.9 " in r.stdout, r.stderr
