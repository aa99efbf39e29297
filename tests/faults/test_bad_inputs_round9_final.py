"""The final round's verbs on a CPU machine, given inputs found to be taken wrongly in the ninth round of input
hardening.

`forge sweep --round final`, every configuration served for a tier failing to start (each recorded and not
retried): it warned "no served configuration stayed within the SLA", printed the tier-environment file as where
the winners went (none was written) and exited 0. It now says no configuration was measured and exits 1 naming
the sweep, the tier, each configuration's error and its server log, and a `fix:` line (a new sweep: these are
not retried).

`forge report --round final --out DIR` where DIR holds a file named `submission` (or a folder where one of the
documents goes): env-vars.md, optimization-plan.md and submission-readme.md were written, then the write of the
submission's documents failed ("already exists as a file", no `fix:` line), a partial set of documents left. It
is now refused before any document is written: exit code 2, the path and what is there, a `fix:` line.

`--out` a symbolic link to a folder that is not there (a removed folder, an unmounted disk) in `forge plan`,
`forge plan --against`, `forge predict --round final` and `forge report`: the model ran and its tables were
printed, then the write failed with "already exists; check the path" and no `fix:` line. It is now refused
before the work, naming the option, the link and where it leads.

`forge sweep --round final --num-prompts 1000000000` (and bench-all-tiers', e2e-gpu's): taken, the first server
was started and the benchmark then built a list of a billion requests until memory ran out (a MemoryError
traceback where memory is capped). A count past what any round sends a tier (at most 10,000) is now refused
before anything is written or started.

`forge predict --round final --calibration DIR --speedup gemv=1.2` (or `--speedups FILE`): the speed-ups were
dropped without a word, the product priced from the calibration alone, exit 0 (the preliminary's prediction
refuses the pair). It is now refused: one source of the product's speed-ups.

`forge predict --round final --calibration DIR` (and the preliminary's) of a calibration that measured nothing
(its one family failed, so no prefill, decode or GEMV decision): every factor was taken as 1 and the upstream
build's prediction printed and written as the calibration's, exit 0. It is now refused naming the folder and
each family's failure, before anything is written.

A `--speedups` file (any YAML the tool reads) that is not valid YAML, or gives a key twice: the error named the
file, line and column but gave no `fix:` line. It now says how to fix it.

`forge plan --against RUN` whose serve.json records `--data-parallel-size 100000000`: every rank was checked
one by one (the verb hung); a rank written "00" in kv_cache.tokens was taken as a rank, then reported as none
(exit 1, "rank 0 reported no KV cache"); a tensor-parallel size the model cannot run (3) was refused without
naming the record it came from. Each is now refused naming serve.json and the value.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
from helpers import ROOT, forge, tiny_model
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_bad_inputs_round6_sweep import ONE, final_run  # noqa: E402
from test_final_sweep import _sweep  # noqa: E402

CALIBRATION = ROOT / "reports" / "calibration" / "2026-12-05-h200-tp1-gemv-mma"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round9-final-model"))


def failed(r, *words: str) -> str:
    """Exit 1 (the work ran and failed), no traceback, one error line holding `words`, a `fix:` line."""
    assert r.returncode == 1, (r.returncode, r.stdout[-1500:], r.stderr[-2500:])
    assert "Traceback" not in r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if re.match(r"^forge [\w-]+: error: ", x)]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], (w, r.stderr)
    assert fix_line(r), r.stderr
    return errors[0]


# --- sweep --round final: a tier with nothing measured ------------------------------------------------------

def test_a_sweep_whose_every_configuration_failed_to_start_fails(tmp_path, model):
    final_run(tmp_path / "runs", "base")
    r = _sweep(tmp_path, model, "--baseline", "base", *ONE, top="1", env={"FAKE_FAIL_START": "boom: no card"})
    err = failed(r, "measured no configuration of tier(s) 4-8K", "tp2dp1-bf16-s64-b4096-u0.95-c8 failed to start",
                 "server.log")
    assert "within the SLA" not in r.stderr and "omit --sweep-id" in fix_line(r), r.stderr
    assert "winners: none recorded" in r.stdout and not (tmp_path / "tier-env.json").exists(), r.stdout
    log = re.search(r"its log: (\S+server\.log)", err).group(1)
    assert "boom: no card" in open(log).read()


# --- report --round final --out: every document's place checked first ----------------------------------------

@pytest.mark.parametrize("taken,words", [
    ("submission", ["out/submission: a file where the report writes a folder of documents"]),
    ("submission/ENVIRONMENT.md/", ["out/submission/ENVIRONMENT.md: a folder where the report writes its document"]),
    ("env-vars.md/", ["out/env-vars.md: a folder where the report writes its document env-vars.md"]),
])
def test_report_with_a_documents_place_taken_writes_no_document(tmp_path, taken, words):
    out = tmp_path / "out"
    if taken.endswith("/"):
        (out / taken).mkdir(parents=True)
    else:
        out.mkdir()
        (out / taken).write_text("notes\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "report", "--round", "final", "--out", str(out))
    refused(r, *words, "nothing was written")
    assert "--out" in fix_line(r)


# --- --out: a link to a folder that is not there --------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["plan", "--round", "final", "--tier", "4-8K"],
    ["plan", "--against", "{tmp}/served"],
    ["predict", "--round", "final", "--speedup", "gemv=1.2", "--kv-dtype", "bf16", "--concurrency", "8",
     "--max-num-batched-tokens", "4096"],
    ["report", "--round", "final"],
])
def test_an_out_linking_to_no_folder_is_refused_before_the_work(tmp_path, args):
    (tmp_path / "served").mkdir()                  # a run a DCU card served at TP1, as forge serve records it
    (tmp_path / "served" / "serve.json").write_text(json.dumps({"profile": "contest", "kv_cache": {"tokens": {"0": 28224}},
                                                              "launch": ["vllm", "serve", "/m", "--max-num-batched-tokens",
                                                                         "4096", "--gpu-memory-utilization", "0.95"]}))
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path / "out"))
    refused(r, "--out", "out: a link to", "gone, which is not there")
    assert r.stdout == "" and "--out" in fix_line(r), r.stdout[-500:]


# --- --num-prompts: at most what a round sends a tier ----------------------------------------------------------

def test_a_sweep_of_a_billion_prompts_is_refused_before_a_server_starts(tmp_path, model):
    final_run(tmp_path / "runs", "base")
    with writes_nothing(tmp_path):         # (a server that fails to start: had the count been taken, no list is built)
        r = _sweep(tmp_path, model, "--baseline", "base", *ONE, "--num-prompts", "1000000000", top="1",
                   env={"FAKE_FAIL_START": "not started"})
    refused(r, "--num-prompts", "'1000000000' is more than any round sends a tier (at most 10000)")


@pytest.mark.parametrize("verb", [["bench-all-tiers", "--round", "final"], ["e2e-gpu"]])
def test_the_other_benchmarks_take_no_more_prompts_than_a_round_sends(tmp_path, verb):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *verb, "--num-prompts", "10001")
    refused(r, "--num-prompts", "'10001' is more than any round sends a tier (at most 10000)")


# --- predict --round final: one source of the product's speed-ups ----------------------------------------------

@pytest.mark.parametrize("speedup", [["--speedup", "gemv=1.2"], ["--speedups", "{tmp}/sp.yaml"]])
def test_predict_final_refuses_a_calibration_and_speedups_together(tmp_path, speedup):
    (tmp_path / "sp.yaml").write_text("gemv: 1.2\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--round", "final", "--calibration", str(CALIBRATION),
                  *[a.format(tmp=tmp_path) for a in speedup], "--out", str(tmp_path / "out"))
    refused(r, "not --calibration and --speedup/--speedups")
    assert "--calibration DIR" in fix_line(r) and r.stdout == ""


# --- predict --calibration: a calibration that measured nothing ------------------------------------------------

@pytest.mark.parametrize("rnd", [["--round", "final"], []])
def test_a_calibration_that_measured_nothing_is_refused(tmp_path, rnd):
    cal = tmp_path / "cal"
    shutil.copytree(CALIBRATION, cal)
    doc = json.loads((cal / "calibration.json").read_text())
    doc["families"]["gemv"]["failed"] = "the GEMV extension did not build"
    doc["selection"] = {}
    (cal / "calibration.json").write_text(json.dumps(doc))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", *rnd, "--calibration", str(cal), "--out", str(tmp_path / "out"))
    refused(r, f"--calibration {cal}", "no component of the time model was measured",
            "gemv failed: the GEMV extension did not build")
    assert "--redo" in fix_line(r) and r.stdout == ""


# --- a YAML file that is not valid: the fix -------------------------------------------------------------------

@pytest.mark.parametrize("text,words,fix", [
    ("gemv: 1.2\ngemv: 1.3\n", ["sp.yaml: not valid YAML: line 2, column 1: key 'gemv' is given twice"], "key once"),
    ("gemv: [1.2\n", ["sp.yaml: not valid YAML: line 2, column 1"], "line and column named"),
])
def test_a_speedups_file_that_is_not_valid_yaml_says_how_to_fix_it(tmp_path, text, words, fix):
    (tmp_path / "sp.yaml").write_text(text)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--round", "final", "--speedups", str(tmp_path / "sp.yaml"))
    refused(r, *words)
    assert fix in fix_line(r), r.stderr


# --- plan --against: the recorded command and report, read within what a server runs --------------------------

@pytest.mark.parametrize("extra,tokens,words", [
    (["--data-parallel-size", "100000000"], {"0": 28224}, ["--data-parallel-size '100000000'", "<= 1024"]),
    ([], {"00": 28224}, ["kv_cache.tokens is not a map of data-parallel rank"]),
    (["-tp", "3"], {"0": 28224}, ["the recorded command: tensor parallel size 3 does not divide"]),
])
def test_plan_against_reads_the_recorded_server_within_what_it_runs(tmp_path, extra, tokens, words):
    run = tmp_path / "served"
    run.mkdir()
    (run / "serve.json").write_text(json.dumps({"profile": "contest", "kv_cache": {"tokens": tokens}, "launch": [
        "vllm", "serve", "/m", "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.95", *extra]}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--against", str(run), "--out", str(tmp_path / "out"), timeout=30)
    refused(r, "served/serve.json", *words)
    assert fix_line(r) and r.stdout == ""
