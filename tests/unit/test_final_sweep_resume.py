"""A resume of `forge sweep --round final --sweep-id S` (final_resume.state): the sweep's space is compared as its
values (sorted, a topology by its full name, the defaults filled in), not as the options' text; a record that holds
the options' text (as the sweep wrote its space before it recorded the values) resumes the same way; another space
is refused naming each option that differs and what the record holds."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from forge.contest import rounds, rules  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.run import final_resume, final_space  # noqa: E402

RND = rounds.load_round(rules.load_contest(), "final")
# the record's other keys, as sweep_final writes them for a sweep that measures its baseline
SETTINGS = {"round": "final", "top": 1, "base_profile": "contest", "baseline": None, "baseline_profile": "upstream",
            "num_prompts": None, "model_build": "best-public", "harness": False}
# the space as the sweep recorded it before: {option: its text, None where left out (the default)}
TEXT_SPACE = {"topologies": "tp2", "kv_dtypes": "bf16", "max_num_seqs": None, "max_num_batched_tokens": "4096",
              "gpu_memory_utilization": "0.95,0.97", "concurrency": "8,10"}


def _state(tmp_path: Path, recorded_space: dict, given: dict) -> dict:
    """final_resume.state over sweeps/s1/sweep.json holding `recorded_space`, for a rerun given `given` ({key: text})."""
    sdir = tmp_path / "sweeps" / "s1"
    sdir.mkdir(parents=True, exist_ok=True)
    (sdir / "sweep.json").write_text(json.dumps({"sweep": "s1", **SETTINGS, "space": recorded_space, "tiers": {},
                                                 "created": "2026-12-04T00:00:00+00:00"}))
    record = {**SETTINGS, "space": final_space.canonical_space(RND, given)}
    return final_resume.state(sdir, "s1", record, RND)


# TEXT_SPACE written otherwise: the defaults listed, an alias, blanks, order, trailing zeros
SAME = [{"topologies": "tp2dp1"}, {"kv_dtypes": " bf16"}, {"max_num_seqs": "16,32,64,128"},
        {"max_num_batched_tokens": " 4096 "}, {"gpu_memory_utilization": "0.970,0.950"}, {"concurrency": "10, 8"}]


@pytest.mark.parametrize("change", [*SAME, {k: v for c in SAME for k, v in c.items()}], ids=str)
def test_a_record_of_the_options_text_resumes_with_the_same_space_written_otherwise(tmp_path, change):
    given = {k: v for k, v in TEXT_SPACE.items() if v is not None}
    st = _state(tmp_path, TEXT_SPACE, {**given, **change})
    assert st["sweep"] == "s1" and st["space"] == TEXT_SPACE          # the record as it was, resumed


def test_a_record_of_the_values_resumes_however_the_options_are_written(tmp_path):
    recorded = final_space.canonical_space(RND, {"topologies": "tp2,dp2", "concurrency": "8,12"})
    assert recorded == {"topologies": ["tp1dp2", "tp2dp1"], "kv_dtypes": ["bf16", "int8"],
                        "max_num_seqs": [16, 32, 64, 128], "max_num_batched_tokens": [2048, 4096, 8192, 16384],
                        "gpu_memory_utilization": [0.95, 0.97], "concurrency": [8, 12]}
    assert json.loads(json.dumps(recorded)) == recorded                     # as the record reads back
    st = _state(tmp_path, recorded, {"topologies": "dp2, tp2dp1", "kv_dtypes": "int8,bf16", "concurrency": "12,8",
                                     "gpu_memory_utilization": "0.97,0.95", "max_num_seqs": "128,16,32,64"})
    assert st["space"] == recorded


def test_a_record_of_a_repeat_the_sweep_took_resumes_with_the_value_once(tmp_path):
    """The sweep took --concurrency 8,8 (one value) before it refused a repeat: its record resumes as that value."""
    st = _state(tmp_path, {**TEXT_SPACE, "concurrency": "8,8"}, {**TEXT_SPACE, "concurrency": "8"})
    assert st["space"]["concurrency"] == "8,8"


@pytest.mark.parametrize("as_values", [False, True], ids=["text", "values"])
def test_another_space_is_refused_naming_each_option_and_the_records_values(tmp_path, as_values):
    recorded = final_space.canonical_space(RND, TEXT_SPACE) if as_values else TEXT_SPACE
    with pytest.raises(ForgeError) as e:
        _state(tmp_path, recorded, {**TEXT_SPACE, "concurrency": "8,12", "max_num_seqs": "16,32,64,128",
                                    "topologies": "tp2,dp2"})
    msg = e.value.message
    assert msg.startswith("sweep s1 was started with another space") and "sweeps/s1/sweep.json" in msg
    assert "--topologies tp2dp1 in its record, tp1dp2,tp2dp1 now; --concurrency 8,10 in its record, 8,12 now" in msg
    assert "--max-num-seqs" not in msg and "--gpu-memory-utilization" not in msg
    assert "(--topologies tp2dp1 --concurrency 8,10)" in e.value.hint and "omit --sweep-id" in e.value.hint


@pytest.mark.parametrize("space,words", [
    ({**TEXT_SPACE, "concurrency": "8,x"}, ["key 'space.concurrency'", "'x' is not a whole number"]),
    ({**TEXT_SPACE, "concurrency": 8}, ["key 'space.concurrency'", "neither a list"]),
    ({k: v for k, v in TEXT_SPACE.items() if k != "topologies"}, ["key 'space'", "not the sweep's space"]),
])
def test_a_record_whose_space_cannot_be_read_is_named(tmp_path, space, words):
    with pytest.raises(ForgeError) as e:
        _state(tmp_path, space, TEXT_SPACE)
    assert all(w in e.value.message for w in words), e.value.message
    assert "omit --sweep-id" in e.value.hint


@pytest.mark.parametrize("option,value", [("max_num_seqs", "16,16"), ("concurrency", "8,8"),
                                          ("gpu_memory_utilization", "0.9,0.90"), ("kv_dtypes", "int8,int8")])
def test_the_space_refuses_a_value_given_twice(option, value):
    with pytest.raises(ForgeError) as e:
        final_space.space(RND, **{option: value})
    assert e.value.message == f"--{option.replace('_', '-')} {value}: a value given twice " \
                              "(its configurations would be searched once)"
    assert e.value.hint == "give each value once"
