"""Inputs found to be taken wrongly in the tenth round of input hardening.

`forge plan --round preliminary --gpu-memory-utilization 0.8` (or `--max-num-batched-tokens 8192`, or
`--concurrency 4`, or `make plan UTIL=0.8`): the preliminary's start script and client lock them (0.95, 4096,
one request at a time), yet the plan was computed and printed at the value given, exit 0. A value other
than the round's own is now refused citing the rule, before anything is computed or written.

`forge submission` where build/submission-preflight.json is a folder: the whole repository was written beside
the target (.<name>.partial), then the record's write failed ("is a folder, not a file; check the path", no
`fix:` line), the repository left there. A file in the place of that staging folder, or an `--into` below a
file, failed the same way once the tree was built. Every place the submission writes is now checked before
anything is built or written: exit code 2, the path and what is there, a `fix:` line.

`forge score` of a final-round run measured with fewer requests than the finals' client sends a tier (80 / 70
/ 60: the run's --num-prompts was smaller) scored it without a word, as if comparable to the contest's. It
now warns on stderr naming each tier, its requests and the round's (the exit code unchanged), and score.json
and score.md say so too.

`MAX_NUM_SEQS=+64` (any of the final round's variables written with a sign, or a whole number with a leading
zero: `064`, `CONCURRENCY_4_8K=010`) was read as 64 and served, where the finals' start script and client get
the text as written. It is now refused naming the variable.

`make plan ROUND=final TIER=bogus` (and `make serve TIER=4-8K` without ROUND=final) named the error `--tier`,
an option the user never typed. It now names TIER when make passed it.
"""

from __future__ import annotations

import json
import sys

import pytest
from helpers import ROOT, forge
from test_bad_inputs import make, refused, writes_nothing
from test_bad_inputs_round5 import fix_line

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_bad_inputs_round6_sweep import final_run  # noqa: E402

ORGANIZERS = "(rule 'organizers')"


# --- plan --round preliminary: what the preliminary locks -------------------------------------------------

@pytest.mark.parametrize("option,value,own", [
    ("--gpu-memory-utilization", "0.8", "0.95"),
    ("--max-num-batched-tokens", "8192", "4096"),
    ("--concurrency", "4", "1"),
])
def test_plan_of_the_preliminary_refuses_what_the_round_locks(tmp_path, option, value, own):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--round", "preliminary", "--tier", "4-8K", option, value,
                  "--out", str(tmp_path / "out"))
    refused(r, f"{option} {value}", f"the preliminary round locks it at {own}", ORGANIZERS)
    assert r.stdout == "" and option in fix_line(r) and "--round final" in fix_line(r), r.stdout[-500:]
    same = forge(tmp_path, "plan", "--round", "preliminary", "--tier", "4-8K", "--kv-dtype", "bf16", option, own)
    assert same.returncode == 0 and "4-8K   TP1/DP1  bf16" in same.stdout, same.stderr   # its own value is a plan


def test_make_plan_util_of_the_preliminary_is_refused(tmp_path):
    with writes_nothing(tmp_path):
        r = make(tmp_path, "plan", "UTIL=0.8")
    refused(r, "--gpu-memory-utilization 0.8", "the preliminary round locks it at 0.95", ORGANIZERS)


# --- submission: every place it writes, checked first -----------------------------------------------------

@pytest.mark.parametrize("case,words", [
    ("record", ["build/submission-preflight.json: a folder where the submission writes its pre-flight record"]),
    ("staging", [".sub.partial: a file where the submission writes the repository"]),
    ("below-a-file", ["notes: a file where the submission writes a folder for the repository"]),
])
def test_submission_with_a_place_taken_writes_nothing(tmp_path, case, words):
    into = tmp_path / "sub"
    if case == "record":
        (tmp_path / "build" / "submission-preflight.json").mkdir(parents=True)
    elif case == "staging":
        (tmp_path / ".sub.partial").write_text("notes\n")
    else:
        (tmp_path / "notes").write_text("notes\n")
        into = tmp_path / "notes" / "sub"
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "submission", "--into", str(into), timeout=300)
    refused(r, *words, "nothing was written")
    assert "move it away" in fix_line(r), r.stderr
    assert ("--into" in fix_line(r)) is (case != "record"), r.stderr


# --- score: a final-round run of fewer requests than the finals' -----------------------------------------

def _sent(run, counts: dict[str, int]) -> None:
    """Each tier's result as if it had sent `counts[tier]` requests (its per-request lists repeated)."""
    for tier, n in counts.items():
        res = json.loads((run / f"{tier}.json").read_text())
        for k, v in list(res.items()):
            if isinstance(v, list):
                res[k] = (v * n)[:n]
        res.update(completed=n, failed=0, num_prompts=n)
        (run / f"{tier}.json").write_text(json.dumps(res))


def test_score_warns_of_a_final_run_with_fewer_requests_than_the_finals(tmp_path):
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    _sent(run, {"4-8K": 80, "8-16K": 12})         # 16-32K keeps the fixture's 4
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(base))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    warned = [x for x in r.stderr.splitlines() if "fewer requests" in x]
    assert len(warned) == 1 and warned[0].startswith("[forge] warning: run run: "), r.stderr
    for words in ("tier 8-16K: 12 requests, the round's 70", "tier 16-32K: 4 requests, the round's 60",
                  "not comparable to the contest's"):
        assert words in warned[0], (words, warned[0])
    assert "4-8K" not in warned[0], warned[0]                     # it sent the finals' 80
    note = json.loads((run / "score.json").read_text())["requests_note"]
    assert note in warned[0] and f"- note: {note}" in (run / "score.md").read_text()
    _sent(run, {"8-16K": 70, "16-32K": 60})
    again = forge(tmp_path, "score", "--run", str(run), "--baseline", str(base), "--force")
    assert again.returncode == 0 and "fewer requests" not in again.stderr, again.stderr
    assert json.loads((run / "score.json").read_text())["requests_note"] is None


# --- the final round's variables: the text the finals' scripts get ---------------------------------------

@pytest.mark.parametrize("var,value,words", [
    ("MAX_NUM_SEQS", "+64", ["a sign before the number"]),
    ("MAX_NUM_SEQS_4_8K", "064", ["a leading zero before the number"]),
    ("CONCURRENCY_4_8K", "010", ["a leading zero before the number"]),
    ("GPU_MEMORY_UTILIZATION", "+0.9", ["a sign before the number"]),
])
def test_a_final_variable_not_in_plain_digits_is_refused(tmp_path, var, value, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", "upstream", "--dry-run",
                  **{var: value})
    refused(r, f"{var}={value!r} (environment)", *words, "get the value as written")
    assert f"set {var} to" in fix_line(r), r.stderr


def test_a_tier_environment_file_with_a_signed_value_is_not_shipped(tmp_path):
    env = {"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2", "MAX_NUM_SEQS": "+32",
           "MAX_NUM_BATCHED_TOKENS": "8192", "GPU_MEMORY_UTILIZATION": "0.9", "CONCURRENCY_8_16K": "12"}
    (tmp_path / "te.json").write_text(json.dumps({"round": "final", "tiers": {"8-16K": {
        "environment": env, "engine_options": {}, "kv_dtype": "bf16", "run": "r", "sweep": "s", "tok_s": 120.5,
        "lift": 0.25}}}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(tmp_path / "te.json"),
                  "--out", str(tmp_path / "report"))
    refused(r, "te.json: key 'tiers.8-16K.environment'", "MAX_NUM_SEQS='+32'", "a sign before the number")


# --- make ... TIER=: the variable named, not the option ----------------------------------------------------

def test_make_plan_with_a_bad_tier_names_tier(tmp_path):
    with writes_nothing(tmp_path):
        r = make(tmp_path, "plan", "ROUND=final", "TIER=bogus")
        direct = forge(tmp_path, "plan", "--round", "final", "--tier", "bogus", TIER="bogus")
    err = refused(r, "TIER 'bogus': not a tier of the final round")
    assert "--tier" not in err, err
    refused(direct, "--tier 'bogus': not a tier of the final round")     # typed as the option, named so


def test_make_serve_with_a_tier_in_the_preliminary_names_tier(tmp_path):
    with writes_nothing(tmp_path):
        r = make(tmp_path, "serve", "TIER=4-8K", f"MODEL={tmp_path}")
    err = refused(r, "TIER 4-8K: the preliminary round's one server serves every tier")
    assert "--tier" not in err and fix_line(r).endswith("or drop TIER"), r.stderr
