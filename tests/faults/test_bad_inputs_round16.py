"""Inputs found to be taken wrongly in the sixteenth round of input hardening.

`forge plan --against RUN --round final` (`make plan AGAINST=RUN ROUND=final`): the check reads the
configuration from the run's own command, and refused --tier, --kv-dtype and the other options of a plan as
ignored, but --round was taken and ignored without a word (the output the same for either round). It is now
refused with them, naming --round; a plan without --against still defaults to the preliminary.

`forge predict --calibration DIR` (and `predict --round final --calibration DIR`) of a smoke calibration
(`forge calibrate --smoke`: tiny shapes under Triton's interpreter on a CPU, whose table `--install` refuses):
the product was priced from its times without a word (a predicted 90.1). It is now refused, naming the folder
and how to measure one.

`forge predict --calibration DIR` of a calibration measured at another tensor-parallel degree (`forge calibrate
--tp 2`: one rank's shapes at TP2, a table the server takes only at TP2): the preliminary round's one-card TP1
server was priced from it without a word. It is now refused, naming the degree; `--round final`, whose
topologies include TP2 and which says what it applies, still takes it.

`forge e2e-gpu --kv-cache-memory-bytes BYTES --kv-why ' '`: a blank reason was recorded as the reason of the
change to the organizers' command (harness.yaml refuses one), and '' was replaced by the default reason as if
the option had been left out. Both are now refused before anything is written or started.

A tuned table (configs/kernels/tuned/*.json) holding a number key not written as the loader reads it (batch
"010", KV heads "02", a shape "4096X5120"): `make tree` (and `forge report`, which lists the tables) took it;
the loader reads "010" as 10, so beside a batch "10" one of the two counts silently replaced the other. It is
now refused, naming the file and the key, before the tree is touched.

`forge calibrate --families decode,,gemv` (or `decode,`): the empty item was skipped, where plan, predict and
sweep refuse theirs as a comma too many. It is now refused the same way, before the device is asked.

`forge calibrate --python python3` (a name on PATH, as a shell takes it): refused as "not an executable file";
only a path was taken. A name is now looked up on PATH as the shell does; one found nowhere is refused, saying so.

`forge score --tok-s a,b,c --baseline-name final` with --round left out: "the run is of the preliminary round",
where there is no run (a what-if), and the fix never named --round. It now says the score is of the preliminary
round and names `--round final`.

`forge sweep upstream --top 3` (or `--base-profile contest`, `--model-build best-public`): the preliminary's sweep
refuses the final round's options, but one typed with its default value was taken and ignored (the check compared
against the defaults). It is now refused whatever the value, as the others are.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import ROOT, forge, forge_env
from project import run as run_in
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_e2e_sizing import _refused_nothing_started
from test_bad_inputs_final_round import proj, tree_refuses_table  # noqa: F401  (proj: a project with a built tree)
from test_bad_inputs_records import CAL_ARGS, OPTIONS, family_doc, family_records
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round7 import served
from test_bad_inputs_round15 import no_torch_python

# --- calibrate --families: an empty item --------------------------------------------------------------------

@pytest.mark.parametrize("fams", ["decode,,gemv", "decode,", ",decode"])
def test_calibrate_refuses_an_empty_family(tmp_path, fams):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "calibrate", "--families", fams, "--out", str(tmp_path / "cal"))
    refused(r, "--families", "an empty item")


# --- calibrate --python: a name on PATH ---------------------------------------------------------------------

def test_calibrate_finds_a_python_named_on_path(tmp_path):
    """The name is looked up on PATH: the Python it names is asked for the device (here one without torch)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    py = no_torch_python(bindir)
    env = forge_env(tmp_path, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "calibrate", "--families", "write", "--python", py.name, *CAL_ARGS, env=env)
    refused(r, f"--python {py}", "No module named 'torch'")


def test_calibrate_refuses_a_python_found_nowhere(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "calibrate", "--python", "no-such-python-here", *CAL_ARGS)
    refused(r, "--python no-such-python-here", "not an executable file nor a program on PATH")


# --- score --tok-s against a set of the other round -----------------------------------------------------------

def test_what_if_against_a_set_of_the_final_round_names_the_round(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--tok-s", "40,40,40", "--baseline-name", "final")
    refused(r, "baseline set 'final' is of the final round", "this score is of the preliminary round")
    assert "--round final" in fix_line(r), r.stderr


# --- the preliminary's sweep: a final-round option typed with its default value ------------------------------

@pytest.mark.parametrize("opt,value", [("--top", "3"), ("--base-profile", "contest"), ("--model-build", "best-public")])
def test_the_preliminary_sweep_refuses_a_final_option_at_its_default(tmp_path, opt, value):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "sweep", "upstream", "--model", str(tmp_path / "model"), opt, value)
    refused(r, f"{opt}: the final round's search options")
    assert "--round final" in fix_line(r), r.stderr


# --- plan --against: the round is the run's own -------------------------------------------------------------

@pytest.mark.parametrize("round_name", ["final", "preliminary"])
def test_plan_against_a_run_refuses_a_round(tmp_path, round_name):
    """--round was taken and ignored: the run's command gives the configuration."""
    d = served(tmp_path, "run", ["-tp", "2"], {"0": 268128})
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--against", str(d), "--round", round_name)
    refused(r, f"--against {d} with --round", "the run's own command gives the configuration")
    assert "drop them" in fix_line(r), r.stderr


def test_plan_against_a_run_and_a_plan_keep_their_meaning(tmp_path):
    d = served(tmp_path, "run", ["-tp", "2"], {"0": 268128})
    r = forge(tmp_path, "plan", "--against", str(d))
    assert r.returncode == 0 and "TP2/DP1" in r.stdout, r.stderr
    r = forge(tmp_path, "plan", "--tier", "4-8K")
    assert r.returncode == 0 and r.stdout.startswith("preliminary round"), r.stderr


# --- predict --calibration: a smoke calibration, another degree's -----------------------------------------------

def calibration(tmp_path, *args: str, **options) -> str:
    """A calibration folder made by `forge calibrate` from family documents measured with `options`."""
    cal = tmp_path / "cal"
    cal.mkdir()
    for fam, recs in family_records().items():
        doc = family_doc(fam, recs)
        doc["options"] = {**OPTIONS, **options}
        (cal / f"{fam}.json").write_text(json.dumps(doc))
    r = forge(tmp_path, "calibrate", "--out", str(cal), *CAL_ARGS, *args)
    assert r.returncode == 0, r.stderr
    return str(cal)


@pytest.mark.parametrize("round_args", [[], ["--round", "final"]])
def test_predict_refuses_a_smoke_calibration(tmp_path, round_args):
    """Its interpreter times priced the product (a predicted 90.1)."""
    cal = calibration(tmp_path, "--smoke", smoke=True)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--calibration", cal, *round_args, "--out", str(tmp_path / "p"))
    refused(r, f"--calibration {cal}: a smoke calibration", "measures nothing real")
    assert "without --smoke" in fix_line(r), r.stderr


def test_predict_of_the_preliminary_refuses_a_calibration_of_another_degree(tmp_path):
    """The preliminary's TP1 server was priced from one rank's shapes at TP2."""
    cal = calibration(tmp_path, "--tp", "2", tp=2)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--calibration", cal, "--out", str(tmp_path / "p"))
    refused(r, f"--calibration {cal}", "tensor-parallel degree 2", "the preliminary round serves one card at TP1")
    assert "--round final" in fix_line(r), r.stderr
    ok = forge(tmp_path, "predict", "--round", "final", "--calibration", cal)
    assert ok.returncode == 0 and "predicted score" in ok.stdout, ok.stderr


def test_predict_still_takes_a_tp1_calibration(tmp_path):
    cal = calibration(tmp_path)
    r = forge(tmp_path, "predict", "--calibration", cal, "--out", str(tmp_path / "p"))
    assert r.returncode == 0 and (tmp_path / "p" / "predict.json").is_file(), r.stderr


# --- e2e-gpu --kv-why: a blank reason ---------------------------------------------------------------------------

@pytest.mark.parametrize("why", [" ", ""])
def test_e2e_refuses_a_blank_kv_why(tmp_path, why):
    """' ' was recorded as the reason of --kv-cache-memory-bytes; '' was replaced by the default one."""
    r = _refused_nothing_started(tmp_path, "--kv-cache-memory-bytes", "7501512704", "--kv-why", why)
    refused(r, f"--kv-why {why!r}: an empty reason")
    assert "leave out --kv-why" in fix_line(r), r.stderr
    assert not (tmp_path / "out").exists()


# --- a tuned table's number keys ----------------------------------------------------------------------------------

def _bad_segments(table: dict) -> None:
    table["decode"]["segments"]["2"]["010"] = {"32768": 24}       # beside batch "10": read as the same batch


def _bad_heads(table: dict) -> None:
    table["decode"]["segments"] = {"02": table["decode"]["segments"]["2"]}


def _bad_context(table: dict) -> None:
    table["decode"]["segments"]["2"]["1"] = {"032768": 128}


def _bad_shape(table: dict) -> None:
    table["gemv"]["plain"]["124160X5120"] = table["gemv"]["plain"].pop("124160x5120")


@pytest.mark.parametrize("damage,words", [
    (_bad_segments, ["key 'decode.segments.2.010'", "a batch size 1-1024 (without leading zeros)"]),
    (_bad_heads, ["key 'decode.segments.02'", "the KV heads of one rank, a count >= 1 (without leading zeros)"]),
    (_bad_context, ["key 'decode.segments.2.1.032768'", "(without leading zeros)"]),
    (_bad_shape, ["key 'gemv.plain.124160X5120'", "a lower-case x between"]),
])
def test_a_tuned_table_with_a_number_key_the_loader_reads_otherwise_never_enters_the_tree(proj, damage,  # noqa: F811
                                                                                             words):
    table = json.loads((ROOT / "configs" / "kernels" / "tuned" / "nvidia-h200-sm_90-132cu-tp2.json").read_text())
    damage(table)
    tree_refuses_table(proj, table, *words)
    assert run_in(proj, "tree").returncode == 0


def test_the_committed_tuned_tables_are_written_as_the_loader_reads_them():
    from forge import tunedtable
    tables = sorted((ROOT / "configs" / "kernels" / "tuned").glob("*.json"))
    assert tables and all(tunedtable.problem(t) is None for t in tables)
