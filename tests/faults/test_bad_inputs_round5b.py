"""Round 5 of bad inputs, second part: `forge predict --round final` given a value twice in one of its
lists, or given with --validate an option the validation does not read, and the tier-environment file
`forge report` / `forge submission` ship holding a `harness` that is not true or false, a number that is
not finite, or a value the round's option does not take as written (surrounding spaces, empty). Each
mistake is refused before anything is written: exit code 2, one error line naming the option or key and a
`fix:` line, `git status` as it was."""

from __future__ import annotations

import json

import pytest
from helpers import forge
from test_bad_inputs import refused, writes_nothing

SPEEDUP = ["--speedup", "gemv=1.2"]


# --- predict --round final: every value given is modelled, every option given is read --------------------

@pytest.mark.parametrize("args,words", [
    # the dtype given twice was modelled once; plan refuses the same list
    (["--kv-dtype", "int8,int8"], ["--kv-dtype int8,int8", "given twice"]),
    (["--kv-dtype", "bf16, int8,bf16"], ["--kv-dtype bf16, int8,bf16", "given twice"]),
    (["--concurrency", "8,8"], ["--concurrency 8,8", "given twice"]),
    # 08 is 8 written with a leading zero: refused as such first (round 21), as the round's variables refuse it
    (["--concurrency", "8,12,08"], ["--concurrency '8,12,08'", "'08': a leading zero"]),
    (["--max-num-batched-tokens", "4096,4096"], ["--max-num-batched-tokens 4096,4096", "given twice"]),
])
def test_predict_final_refuses_a_value_given_twice(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--round", "final", *SPEEDUP, *args, "--out", str(tmp_path / "out"))
    refused(r, *words)


@pytest.mark.parametrize("args,named", [
    # the validation prices its own build on the public runs' settings: each of these was ignored (exit 0)
    (SPEEDUP, "--speedup"),
    (["--speedups", "{tmp}/sp.yaml"], "--speedups"),
    (["--calibration", "{tmp}"], "--calibration"),
    (["--kv-dtype", "int8"], "--kv-dtype"),
    (["--concurrency", "8", "--max-num-batched-tokens", "8192"], "--concurrency, --max-num-batched-tokens"),
    (["--outputs", "forced", "--link", "oneshot", "--top", "3"], "--outputs, --link, --top"),
])
def test_predict_validate_refuses_an_option_it_does_not_read(tmp_path, args, named):
    (tmp_path / "sp.yaml").write_text("gemv: 1.2\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--round", "final", "--validate",
                  *[a.replace("{tmp}", str(tmp_path)) for a in args], "--out", str(tmp_path / "out"))
    refused(r, named, "not read by --validate")


# --- the tier-environment file: what it holds is what is shipped --------------------------------------------

def _tier_env(path, env=None, **entry) -> None:
    environment = {"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2", "MAX_NUM_SEQS": "32",
                   "MAX_NUM_BATCHED_TOKENS": "8192", "GPU_MEMORY_UTILIZATION": "0.9", "CONCURRENCY_8_16K": "12"}
    environment.update(env or {})
    e = {"environment": environment, "engine_options": {}, "kv_dtype": "bf16", "run": "r-8-16K", "sweep": "s1",
         "tok_s": 120.5, "lift": 0.25, "score": 40.0, "harness": False}
    e.update(entry)
    path.write_text(json.dumps({"round": "final", "tiers": {"8-16K": e}}))


def _ship(tmp_path, verb):
    """`forge report` (refuses in a moment) or `forge submission` (some seconds: one case per finding)."""
    out = ["--out", str(tmp_path / "report")] if verb == "report" else ["--into", str(tmp_path / "sub")]
    with writes_nothing(tmp_path):
        return forge(tmp_path, verb, "--round", "final", "--tier-env", str(tmp_path / "te.json"), *out)


def test_a_good_tier_environment_file_is_shipped_as_written(tmp_path):
    _tier_env(tmp_path / "te.json")
    r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(tmp_path / "te.json"),
              "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    doc = (tmp_path / "report" / "submission" / "ENVIRONMENT.md").read_text()
    assert "MAX_NUM_SEQS=32 " in doc and "(120.50 output tok/s, +25.0 % against the baseline)" in doc, doc


@pytest.mark.parametrize("verb,value", [("report", "no"), ("report", 0), ("report", None), ("submission", "false")])
def test_a_harness_that_is_not_true_or_false_is_refused(tmp_path, verb, value):
    """"no" was read as a harness winner (refused as measured on a GPU machine), 0 or null as a DCU one."""
    _tier_env(tmp_path / "te.json", harness=value)
    refused(_ship(tmp_path, verb), "te.json: key 'tiers.8-16K.harness'", "not true or false")


@pytest.mark.parametrize("verb,key,text", [("report", "tok_s", "NaN"), ("report", "tok_s", "Infinity"),
                                           ("report", "lift", "-Infinity"), ("report", "score", "NaN"),
                                           ("report", "tok_s", '"120.5"'), ("submission", "tok_s", "NaN")])
def test_a_number_that_is_not_finite_is_refused(tmp_path, verb, key, text):
    """A NaN tok/s was shipped in ENVIRONMENT.md as '(nan output tok/s, ...)'."""
    _tier_env(tmp_path / "te.json", **{key: 7.0})
    (tmp_path / "te.json").write_text((tmp_path / "te.json").read_text().replace(f'"{key}": 7.0', f'"{key}": {text}'))
    refused(_ship(tmp_path, verb), f"te.json: key 'tiers.8-16K.{key}'", "not a finite number")


@pytest.mark.parametrize("verb,var,value", [("report", "MAX_NUM_SEQS", " 32"), ("report", "MAX_NUM_SEQS", "32 "),
                                            ("report", "CONCURRENCY_8_16K", "\t12"),
                                            ("submission", "GPU_MEMORY_UTILIZATION", "")])
def test_a_value_the_option_does_not_take_as_written_is_refused(tmp_path, verb, var, value):
    """' 32' passed the bounds (read stripped, as the process environment is) and was shipped as MAX_NUM_SEQS=' 32';
    an empty value was checked as the baseline's and shipped as GPU_MEMORY_UTILIZATION=''."""
    _tier_env(tmp_path / "te.json", env={var: value})
    refused(_ship(tmp_path, verb), f"te.json: key 'tiers.8-16K.environment.{var}'", repr(value))
