"""Round 6 of bad inputs: `forge predict`, above all the finals' time model (`--round final`), given a
speed-up no kernel change comes near (`--speedup`, a `--speedups` file, a calibration whose records were
doctored), a `--speedups` file writing its numbers as YAML 1.1 reads them (`1_000`, `0x10`) but the
command line does not, an option the round's prediction does not read given at its default value, and a
list option's value that is no number. Each is refused before anything is written: exit code 2, one error
line naming the option, file and key, or component, and a `fix:` line, `git status` as it was. The model
itself never ranks or picks a configuration whose tok/s or latency is no finite number (NaN > limit is
false, so such a row looked inside the SLA), and a time past the float range is refused naming the
speed-ups, not printed as nan."""

from __future__ import annotations

import argparse
import json
import math
import shutil

import pytest
from helpers import ROOT, forge
from test_bad_inputs import refused, writes_nothing

from forge.contest import rules
from forge.errors import ForgeError
from forge.model import finals
from forge.run import predict_final, synth

FINAL = ["predict", "--round", "final"]
SMALL = ["--kv-dtype", "bf16", "--concurrency", "8", "--max-num-batched-tokens", "4096"]   # one configuration a topology
CALIBRATION = ROOT / "reports" / "calibration" / "2026-12-02-h200"


def fix_line(r) -> str:
    return next((x for x in r.stderr.splitlines() if x.startswith("  fix: ")), "")


# --- finding 5: a speed-up past any plausible one ------------------------------------------------------

@pytest.mark.parametrize("rnd,factor", [
    # past the float range: every TPOT P99 was nan, shown "SLA ok" and picked (score 0.0, exit 0)
    (FINAL, "gemv=1e-308"),
    # within the float range, still no kernel change: priced and picked without a word
    (FINAL, "prefill_attn=1e9"),
    (FINAL, "decode_attn=0.001"),
    (["predict"], "gemv=1000"),
])
def test_a_speedup_past_the_plausible_range_is_refused(tmp_path, rnd, factor):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *rnd, "--speedup", factor, "--out", str(tmp_path / "out"))
    refused(r, f"--speedup '{factor}'", "outside the plausible range 0.01 to 100")
    assert "0.01 to 100" in fix_line(r), r.stderr


def test_a_speedups_file_past_the_plausible_range_is_refused(tmp_path):
    # 1.0e-320 (YAML 1.1 reads it as a float) reached the model: nan rows, "SLA ok", exit 0
    (tmp_path / "sp.yaml").write_text("prefill_attn: 2\ngemv: 1.0e-320\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *FINAL, "--speedups", str(tmp_path / "sp.yaml"), "--out", str(tmp_path / "out"))
    refused(r, "sp.yaml", "key 'gemv'", "1.0e-320", "outside the plausible range")


def _doctored(tmp_path, us: float):
    """The committed H200 calibration with every upstream time of the three families set to `us` (p10 =
    median = p90: each record alone passes the reader's checks)."""
    cal = tmp_path / "cal"
    cal.mkdir()
    for p in CALIBRATION.glob("*.json"):
        shutil.copy(p, cal / p.name)
    for fam in ("gemv", "decode", "prefill"):
        doc = json.loads((cal / f"{fam}.json").read_text())
        for rec in doc["records"]:
            if rec["kind"] == "upstream" and isinstance(rec.get("us"), dict):
                rec["us"].update(median=us, p10=us, p90=us)
        (cal / f"{fam}.json").write_text(json.dumps(doc))
    return cal


@pytest.mark.parametrize("rnd", [FINAL, ["predict"]])
@pytest.mark.parametrize("us", [1e300, 1e-300])
def test_a_doctored_calibration_is_refused_naming_the_component(tmp_path, rnd, us):
    """Upstream times of 1e300 claimed a predicted score of 97.1 (a speed-up of ~1e298); 1e-300 read nan."""
    cal = _doctored(tmp_path, us)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *rnd, "--calibration", str(cal), "--out", str(tmp_path / "out"))
    refused(r, f"--calibration {cal}", "prefill.16bit", "prefill_attn", "outside the plausible range")
    assert "calibrate" in fix_line(r), r.stderr


def _row(tok_s, ttft, tpot, label):
    return {"tok_s": tok_s, "ttft_p99_ms": ttft, "tpot_p99_ms": tpot, "failed": 0, "label": label}


LIMITS = {"ttft_p99_ms": 100_000.0, "tpot_p99_ms": 100.0}


@pytest.mark.parametrize("bad", [
    _row(0.0, 50_000.0, math.nan, "nan TPOT"),          # what gemv=1e-308 gave every row
    _row(0.0, math.nan, 50.0, "nan TTFT"),              # what a 1e-300 calibration gave
    _row(math.nan, 50_000.0, 50.0, "nan tok/s"),
    _row(20.0, math.inf, 50.0, "inf TTFT"),
])
def test_a_metric_that_is_no_number_breaks_the_sla_and_is_never_picked(bad):
    over = _row(5.0, 160_000.0, 50.0, "over the TTFT limit")
    assert finals.sla_check(bad, LIMITS), bad
    chosen = finals.pick([dict(bad), over], LIMITS)
    assert chosen["label"] == "over the TTFT limit" and chosen["pick_rule"].startswith("fastest"), chosen
    with pytest.raises(ForgeError, match="finite tok/s"):
        finals.pick([dict(bad)], LIMITS)


def test_a_model_time_past_the_float_range_is_refused_naming_the_speedup():
    """Past the command line's checks (a caller's own speed-ups), the finals' model printed nan; now the
    first row whose time is no number stops the prediction, naming the factor furthest from 1 first."""
    contest = rules.load_contest()
    workload = synth.load_workload(contest)
    args = argparse.Namespace(calibration=None, kv_dtype="bf16", concurrency="8", max_num_batched_tokens="4096",
                              outputs="eos", link="pcie")
    with pytest.raises(ForgeError) as e:
        predict_final.predict_final(args, contest, workload, {"host": 2.0, "gemv": 1e-308})
    assert "no finite number" in e.value.message and "speed-ups gemv=1e-308, host=2" in e.value.message, e.value
    assert "0.01 to 100" in e.value.hint


# --- finding 12: a --speedups file's numbers as the command line reads them --------------------------------

@pytest.mark.parametrize("text", ["1_000", "0x10", "1_5", "1:30", "0o17", ".inf"])
def test_a_speedups_file_takes_numbers_as_speedup_does(tmp_path, text):
    """YAML 1.1 read `1_000` as 1000 and `0x10` as 16 (a 1000x or 16x speed-up), where --speedup refuses them."""
    (tmp_path / "sp.yaml").write_text(f"gemv: {text}\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--speedups", str(tmp_path / "sp.yaml"), "--out", str(tmp_path / "out"))
    refused(r, "sp.yaml", "key 'gemv'", f"'{text}' is not a number in plain digits")


def test_a_speedups_file_number_is_the_speedup_options_number(tmp_path):
    """`gemv: 1e1` (a string to YAML 1.1) is the factor --speedup gemv=1e1 gives, not a refusal."""
    (tmp_path / "sp.yaml").write_text("gemv: 1e1\n")
    a = forge(tmp_path, "predict", "--speedups", str(tmp_path / "sp.yaml"), "--out", str(tmp_path / "a"))
    b = forge(tmp_path, "predict", "--speedup", "gemv=1e1", "--out", str(tmp_path / "b"))
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    got = [json.loads((tmp_path / d / "predict.json").read_text())["score"]["total"] for d in ("a", "b")]
    assert got[0] == got[1], got


# --- finding 10: an option not read is refused at its default value too ------------------------------------

@pytest.mark.parametrize("args,words", [
    ([*FINAL, "--speedup", "gemv=1.1", "--baseline-name", "official"],
     ["--baseline-name", "not read by the final round's prediction"]),
    ([*FINAL, "--validate", "--link", "pcie", "--top", "5", "--outputs", "eos"],
     ["--outputs, --link, --top", "not read by --validate"]),
    (["predict", "--speedup", "gemv=1.1", "--outputs", "eos", "--link", "pcie", "--top", "5"],
     ["--outputs, --link, --top", "not read by the preliminary round's prediction"]),
])
def test_an_option_not_read_is_refused_at_its_default_value(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--out", str(tmp_path / "out"))
    refused(r, *words)


def test_the_defaults_left_out_are_shown_and_applied(tmp_path):
    text = " ".join(forge(tmp_path, "predict", "--help").stdout.split())
    for shown in ("(default: official,", "(default eos)", "(default pcie)", "(default 5)"):
        assert shown in text, shown
    r = forge(tmp_path, *FINAL, "--speedup", "gemv=1.1", *SMALL, "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "out" / "predict-final.json").read_text())
    assert (data["outputs"], data["link"]) == ("eos", "pcie"), data["outputs"]


# --- finding 11: a list option's message states the round's bound, its fix a value it accepts ----------------

@pytest.mark.parametrize("option,value,bound", [
    ("--max-num-batched-tokens", "1_024", "256..32768"),
    ("--concurrency", "8,x", "1..256"),
])
def test_a_list_option_names_its_bound_and_hints_a_value_it_accepts(tmp_path, option, value, bound):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *FINAL, "--speedup", "gemv=1.1", option, value, "--out", str(tmp_path / "out"))
    refused(r, f"{option} '{value}'", f"the final round's bounds ({bound})")
    hint = fix_line(r).split(f"e.g. {option} ")[1].split()[0]
    small = [a for i, a in enumerate(SMALL) if a != option and (i == 0 or SMALL[i - 1] != option)]
    ok = forge(tmp_path, *FINAL, "--speedup", "gemv=1.1", *small, option, hint)
    assert ok.returncode == 0, (hint, ok.stderr)
