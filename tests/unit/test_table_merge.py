"""`forge calibrate --install` of a calibration of some families (scripts/forge/run/table_merge.py): the
installed table's sections of the families not measured now are kept when it was measured on the same
stack and rank geometry, a forge-tuned/1 table's decode segments written as the loader reads them; a table
of another stack is refused naming the key (or replaced whole with --force). Before, the installed table
was replaced whole and its prefill and decode launches were dropped without a word."""

import copy
import json

import pytest
from helpers import ROOT

from forge import tunedtable
from forge.errors import ForgeError
from forge.run import calibrate, table_merge

CAL = ROOT / "reports" / "calibration"
GEMV_ONLY = CAL / "2026-12-05-h200-tp1-gemv-mma" / "table.json"     # a `--families gemv` calibration, TP1
FULL_OLD = CAL / "2026-12-02-h200" / "table.json"                     # every family, forge-tuned/1


def load(p):
    return json.loads(p.read_text())


def test_the_sections_not_measured_are_kept_and_the_loader_reads_them():
    new, old = load(GEMV_ONLY), load(FULL_OLD)
    assert set(new) & {"prefill", "decode"} == set()
    out, kept = table_merge.merge(new, old, ["gemv"], "dest.json", force=False)
    assert kept == ["prefill", "decode"]
    assert out["gemv"] == new["gemv"] and out["prefill"] == old["prefill"]
    # forge-tuned/1 segments {"1": 128} were measured at 4 KV heads and 32K: the loader's reading, written out
    assert out["decode"] == {"launch": old["decode"]["launch"], "segments": {"4": {"1": {"32768": 128}}}}
    T = tunedtable.loader()
    assert T.decode_segment_table(out) == T.decode_segment_table(old)
    assert out["provenance"]["commit"] == new["provenance"]["commit"]
    assert out["provenance"]["sections"]["prefill"]["report"] == old["provenance"]["report"]
    T.validate(json.loads(json.dumps(out)))
    # the H200 table in the tree is this merge (its gemv and prefill sections), with the decode section of the
    # later decode calibration installed over it the same way (`--families decode --install --force`)
    shipped = load(ROOT / "configs" / "kernels" / "tuned" / "nvidia-h200-sm_90-132cu.json")
    assert {k: shipped[k] for k in ("gemv", "prefill", "validators")} == \
           {k: out[k] for k in ("gemv", "prefill", "validators")}
    decode_cal = load(CAL / "2026-12-06-h200-tp1-decode-qk" / "table.json")
    again, kept = table_merge.merge(decode_cal, out, ["decode"], "dest.json", force=True)
    assert kept == ["gemv", "prefill"] and shipped["decode"] == again["decode"] == decode_cal["decode"]
    assert {k: shipped[k] for k in ("gemv", "prefill")} == {k: again[k] for k in ("gemv", "prefill")}


def test_a_calibration_of_every_table_family_installs_as_it_is():
    new, old = load(GEMV_ONLY), load(FULL_OLD)
    out, kept = table_merge.merge(new, old, ["gemv", "prefill", "decode", "write"], "dest.json", force=False)
    assert kept == [] and out is new


@pytest.mark.parametrize("key,value,named", [("torch", "2.10", "validators.torch"),
                                             ("compute_units", 80, "validators.compute_units")])
def test_a_table_of_another_stack_is_refused_or_replaced_whole_with_force(key, value, named):
    new, old = load(GEMV_ONLY), load(FULL_OLD)
    old["validators"][key] = value
    with pytest.raises(ForgeError) as e:
        table_merge.merge(new, old, ["gemv"], "configs/kernels/tuned/x.json", force=False)
    assert named in str(e.value) and "prefill, decode" in str(e.value) and "--force" in e.value.hint
    out, kept = table_merge.merge(new, old, ["gemv"], "x.json", force=True)
    assert kept == [] and out is new


def test_a_table_of_another_rank_geometry_is_not_merged():
    new = load(GEMV_ONLY)
    tp2 = load(ROOT / "configs" / "kernels" / "tuned" / "nvidia-h200-sm_90-132cu-tp2.json")
    with pytest.raises(ForgeError) as e:
        table_merge.merge(new, tp2, ["gemv"], "x.json", force=False)
    assert "tp/heads" in str(e.value)


def test_install_text_merges_a_valid_table_and_replaces_an_invalid_one(tmp_path):
    new = load(GEMV_ONLY)
    doc = {"table": new, "families": {"gemv": {"failed": None}}}
    dest = tmp_path / "t.json"
    assert json.loads(calibrate._merged_text(doc, dest, False)) == new          # nothing installed yet
    dest.write_text(FULL_OLD.read_text())
    merged = json.loads(calibrate._merged_text(doc, dest, False))
    assert set(merged) >= {"gemv", "prefill", "decode"} and merged["gemv"] == new["gemv"]
    bad = copy.deepcopy(load(FULL_OLD))
    bad["prefill"]["16bit"] = [3, 3, 3, 3]                                       # not a launch the kernel has
    dest.write_text(json.dumps(bad))
    assert json.loads(calibrate._merged_text(doc, dest, False)) == new
