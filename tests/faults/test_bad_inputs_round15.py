"""Inputs found to be taken wrongly in the fifteenth round of input hardening.

`forge plan --force` (and `plan --against RUN --force`, `predict --round final --force`, `--validate --force`)
without --out: nothing is written without --out, yet the flag was taken and ignored without a word, as if a
recorded result had been replaced. It is now refused, naming --force (FORCE=1 where make passed it) and how to
write (--out DIR); FORCE=1 left in the environment alone is still taken, as every verb takes it.

`forge score --tok-s a,b,c --force` (`make score TOK_S=... FORCE=1`): a what-if score is printed, never recorded,
so the flag was ignored the same way. It is now refused, saying how a score is recorded (--run RUN --force).

`forge import-throughput` of result files measured by another client than the preliminary's (the organizers'
run_throughput.sh sends one request at a time at rate 1; a result recording `"max_concurrency": 10,
"request_rate": "inf"`, the finals' client, or no concurrency limit): imported as a run of the preliminary and
then scored against the preliminary's baselines without a word (a 97.4 from 31 tok/s against 12.95). Such a
result is now refused before anything is written, naming the file, the keys and the client of configs/contest.yaml.

`forge calibrate` with a Python that has no torch (the default interpreter on a machine without it, or
`--python PY`): the device query's failure was one error line followed by the child's whole traceback; with
`--smoke --out DIR` the device was not asked at all, so DIR and a family's log were written, the family's
traceback printed, and only then "no family ran, so the device is unknown". The device is now asked before any
family runs (--smoke too), and its failure is one line naming the Python and the child's error; nothing is
written.

`forge score --tok-s a,b,c --baseline RUN` where RUN is a final-round run and --round was left out: refused as
"the what-if tok/s is of the preliminary round" with the fix "give a baseline run of the preliminary round",
never naming the option that was left out. It now says the round defaulted and gives `--round final`.

`forge predict --out configs` (the preliminary's prediction, from --speedup, --run, --e2e, --ttft-s or
--calibration) wrote predict.json and predict.md among the tool's own files (configs/, tests/data/, the
checkout's root with "."), where `predict --round final --out` refuses them. It is now refused the same way,
before anything is priced or written.

`forge plan --kv-dtype bf16,` (and `predict --round final --kv-dtype ,`, `sweep --round final --kv-dtypes bf16,,int8`,
`--max-num-seqs 16,,32`) said "'' not a KV cache dtype" or "'' is not a whole number": a comma too many read as a
value named ''. It is now refused as an empty item, naming the option and the value as typed.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import FIXTURE_RUNS, ROOT, forge
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_records import CAL_ARGS, organizers_folder
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round6_sweep import final_run
from test_bad_inputs_round11 import fake_python

TIERS = ["4-8K", "8-16K", "16-32K"]


# --- --force where nothing is written ---------------------------------------------------------------------

@pytest.mark.parametrize("args,files", [
    (["plan"], "plan.json"),
    (["plan", "--round", "final", "--tier", "4-8K"], "plan.json"),
    (["plan", "--against", "some-run"], "plan-check.json"),
    (["predict", "--round", "final", "--speedup", "gemv=1.2"], "predict-final.json"),
    (["predict", "--round", "final", "--validate"], "validation.json"),
])
def test_force_without_out_is_refused(tmp_path, args, files):
    """Taken and ignored: without --out nothing is written, so nothing was replaced."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--force")
    refused(r, "--force without --out", "nothing is written")
    assert "give --out DIR" in fix_line(r) and files in fix_line(r) and "leave out --force" in fix_line(r), r.stderr


def test_force_from_make_is_named_as_make_was_given_it(tmp_path):
    """`make plan FORCE=1` passes --force with FORCE=1 in the environment: the refusal names FORCE=1."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--force", MAKELEVEL="1", FORCE="1")
    refused(r, "FORCE=1 without --out")
    assert "make plan OUT=DIR" in fix_line(r) and "leave out FORCE=1" in fix_line(r), r.stderr


def test_force_left_in_the_environment_alone_is_still_taken(tmp_path):
    """The check is on the flag: FORCE=1 kept in a shell (no --force) plans as before, and --force with --out writes."""
    r = forge(tmp_path, "plan", "--round", "final", "--tier", "4-8K", FORCE="1")
    assert r.returncode == 0 and "planned seqs" in r.stdout, r.stderr
    out = tmp_path / "out"
    for _ in range(2):         # the second replaces the first
        r = forge(tmp_path, "plan", "--round", "final", "--tier", "4-8K", "--out", str(out), "--force")
        assert r.returncode == 0, r.stderr
    assert (out / "plan.json").is_file()


def test_score_refuses_force_with_what_if_tok_s(tmp_path):
    """A what-if is printed, never recorded: --force was ignored."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--tok-s", "15,14,11", "--force")
    refused(r, "--force with --tok-s", "nothing is written")
    assert "--run RUN --force" in fix_line(r), r.stderr
    ok = forge(tmp_path, "score", "--tok-s", "15,14,11")
    assert ok.returncode == 0 and "throughput only" in ok.stdout, ok.stderr


# --- import-throughput: results of another client -------------------------------------------------------

@pytest.mark.parametrize("values,words", [
    ({"max_concurrency": 10, "request_rate": "inf"}, ["key 'max_concurrency' is 10", "key 'request_rate' is \"inf\""]),
    ({"max_concurrency": 10, "request_rate": 1.0}, ["key 'max_concurrency' is 10"]),
    ({"max_concurrency": None}, ["key 'max_concurrency' is null"]),
    ({"request_rate": 4.0}, ["key 'request_rate' is 4.0"]),
    ({"max_concurrency": "1"}, ["key 'max_concurrency' is \"1\""]),
])
def test_import_refuses_results_of_another_client(tmp_path, values, words):
    """Imported as the preliminary's run and scored against its baselines without a word."""
    src = organizers_folder(tmp_path)
    f = src / "test" / "16-32K_throughput" / "result.json"       # the last tier: the first two not written either
    f.write_text(json.dumps({**json.loads(f.read_text()), **values}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "import-throughput", str(src), "--run-id", "R")
    refused(r, "16-32K_throughput/result.json", *words, "not measured by the preliminary's client",
            "--max-concurrency 1 --request-rate 1", "configs/contest.yaml client")
    assert "run_throughput.sh" in fix_line(r) and "--round final" in fix_line(r), r.stderr


@pytest.mark.parametrize("values", [{"max_concurrency": 1, "request_rate": 1}, {}])
def test_import_still_takes_the_preliminarys_client(tmp_path, values):
    """1 and 1 (as an int or a float), or a result that records neither key, are imported as before."""
    src = organizers_folder(tmp_path)
    for t in TIERS:
        f = src / "test" / f"{t}_throughput" / "result.json"
        res = {k: v for k, v in json.loads(f.read_text()).items() if values or k not in ("max_concurrency", "request_rate")}
        f.write_text(json.dumps({**res, **values}))
    r = forge(tmp_path, "import-throughput", str(src), "--run-id", "R")
    assert r.returncode == 0, r.stderr
    assert all((tmp_path / "runs" / "R" / f"{t}.json").is_file() for t in TIERS)


# --- calibrate: a Python without torch ------------------------------------------------------------------

def no_torch_python(tmp_path):
    """A Python whose `import torch` fails: its traceback on stderr, exit 1."""
    exe = tmp_path / "python-without-torch"
    exe.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\necho '  File \"<string>\", line 1' >&2\n"
                   "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    os.chmod(exe, 0o755)
    return exe


@pytest.mark.parametrize("args", [
    ["--smoke", "--families", "write", "--out", "{tmp}/cal"],   # the device was not asked: cal/ and write.log written
    ["--families", "write", "--out", "{tmp}/cal"],
    ["--smoke"],                                                # the default --out: the device query's traceback
])
def test_calibrate_with_a_python_without_torch_is_one_line_before_anything(tmp_path, args):
    py = no_torch_python(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "calibrate", *args, "--python", str(py), *CAL_ARGS)
    refused(r, f"--python {py}", "the device query failed (exit 1)", "No module named 'torch'", "nothing was measured")
    assert "needs torch" in fix_line(r), r.stderr


def test_calibrate_smoke_with_a_python_that_answers_still_measures(tmp_path):
    """The device asked first under --smoke too: a Python that answers runs the family as before."""
    cal = tmp_path / "cal"
    r = forge(tmp_path, "calibrate", "--smoke", "--families", "write", "--out", str(cal),
              "--python", str(fake_python(tmp_path)), *CAL_ARGS)
    assert "write: measuring" in r.stderr and (cal / "write.log").is_file(), r.stderr
    assert "device query failed" not in r.stderr and "Traceback" not in r.stderr, r.stderr


# --- score --tok-s against a final-round baseline, --round left out -------------------------------------

def test_what_if_against_a_final_baseline_names_the_round_left_out(tmp_path):
    """The fix said "give a baseline run of the preliminary round", never --round final."""
    base = final_run(tmp_path, "base")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--tok-s", "40,40,40", "--baseline", str(base))
    refused(r, f"--baseline {base} is a run of the final round", "scored in the preliminary round (--round left out)")
    assert "add --round final (make score ROUND=final)" in fix_line(r), r.stderr
    ok = forge(tmp_path, "score", "--tok-s", "40,40,40", "--baseline", str(base), "--round", "final")
    assert ok.returncode == 0 and "baseline run base" in ok.stdout, ok.stderr


def test_what_if_with_the_round_given_keeps_its_refusal(tmp_path):
    """--round preliminary given: the round's own refusal, unchanged."""
    base = final_run(tmp_path, "base")
    r = forge(tmp_path, "score", "--tok-s", "40,40,40", "--baseline", str(base), "--round", "preliminary")
    refused(r, "the what-if tok/s is of the preliminary round", "the baseline run base is of the final round")


# --- predict --out among the tool's own files ------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["--speedup", "gemv=1.2", "--out", "configs"],
    ["--speedup", "gemv=1.2", "--out", "."],
    ["--ttft-s", "1,2,3", "--tpot-ms", "40,45,50", "--out", "tests/data"],
    ["--run", str(FIXTURE_RUNS / "fast"), "--reference", str(FIXTURE_RUNS / "base"), "--out", "scripts/forge/p"],
])
def test_predict_out_among_the_tools_sources_is_refused(tmp_path, args):
    """predict.json and predict.md were written there (as --round final refuses them)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", *args)
    refused(r, f"--out {args[-1]}", "inside this checkout, outside build/ and reports/")
    assert not (ROOT / args[-1] / "predict.json").exists()


def test_predict_out_outside_the_checkout_is_still_written(tmp_path):
    r = forge(tmp_path, "predict", "--speedup", "gemv=1.2", "--out", str(tmp_path / "p"))
    assert r.returncode == 0 and (tmp_path / "p" / "predict.json").is_file(), r.stderr


# --- a comma too many in a list option -------------------------------------------------------------------

@pytest.mark.parametrize("args,option,value", [
    (["plan", "--round", "final", "--kv-dtype", "bf16,"], "--kv-dtype", "bf16,"),
    (["predict", "--round", "final", "--speedup", "gemv=1.2", "--kv-dtype", ","], "--kv-dtype", ","),
    (["sweep", "--round", "final", "--baseline-profile", "upstream", "--model", "MODEL", "--kv-dtypes", "bf16,,int8"],
     "--kv-dtypes", "bf16,,int8"),
    (["sweep", "--round", "final", "--baseline-profile", "upstream", "--model", "MODEL", "--max-num-seqs", "16,,32"],
     "--max-num-seqs", "16,,32"),
])
def test_an_empty_item_in_a_list_option_is_named_as_one(tmp_path, args, option, value):
    """The empty item was refused as a dtype or number named ''."""
    args = [str(tmp_path) if a == "MODEL" else a for a in args]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    err = refused(r, f"{option} {value!r}: an empty item")
    assert "''" not in err, r.stderr


def test_a_list_option_with_blanks_around_its_items_is_still_taken(tmp_path):
    r = forge(tmp_path, "plan", "--round", "final", "--kv-dtype", " int8 , bf16")
    assert r.returncode == 0 and "int8" in r.stdout, r.stderr
