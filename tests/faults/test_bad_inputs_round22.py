"""Inputs found to be taken wrongly in the twenty-second round of input hardening.

`forge sweep --round final --sweep-id S` resuming a sweep whose space is the rerun's, written otherwise: the
defaults left out then listed (`--max-num-seqs 16,32,64,128`), `--topologies tp2` then `tp2dp1`,
`--gpu-memory-utilization 0.95` then `0.950`, `--concurrency 8,10` then `10,8`, ` bf16 ` with blanks. Refused as
"started with other space": the record's options were compared as text. The values are compared now (sorted, a
topology by its full name, the defaults filled in), so the resume goes on, a record written before as the options'
text included; the record holds the values now. A record's space that cannot be read (`"concurrency": "8,x"`,
edited) was refused as another space; it is named by its key now.

The same with another space (`--concurrency 8,12` where the sweep ran 8,10): refused as "started with other space",
naming neither the option nor what the sweep ran. It is refused naming each option that differs, the record's
values and the rerun's, with the record's values (or a new sweep) as the fix; nothing written.

`forge sweep --round final --concurrency 8,8` (or --max-num-seqs 16,16, --max-num-batched-tokens 4096,4096,
--gpu-memory-utilization 0.95,0.950, --kv-dtypes bf16,bf16): the repeat was dropped silently and the sweep started,
where `forge predict --round final --concurrency 8,8` refuses it. It is now refused by the same rule ("a value given
twice"), naming the option and its value; nothing written. A topology named twice (`tp2,tp2dp1`) is one, as before.
"""

from __future__ import annotations

import json

import pytest
from helpers import args_with, forge, tiny_model
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_final_round import SWEEP, _model_folder, _sweep_record
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round21 import CARDS, ONE
from test_bad_inputs_round21 import SWEEP as ONE_CONFIGURATION


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round22-model"))


# --- a value given twice in a list of the space ----------------------------------------------------------------------

@pytest.mark.parametrize("option,value", [
    ("--concurrency", "8,8"),
    ("--max-num-seqs", "16,16"),
    ("--max-num-batched-tokens", "4096, 4096"),
    ("--gpu-memory-utilization", "0.95,0.950"),     # one number, written twice
    ("--kv-dtypes", "bf16,bf16"),
])
def test_sweep_final_refuses_a_value_given_twice(tmp_path, model, option, value):
    """Dropped silently before: the sweep began (its record and the baseline's run folder written)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args_with([*ONE_CONFIGURATION, *[x for kv in ONE.items() for x in kv], "--model", str(model),
                                        "--tier-env", str(tmp_path / "te.json")], [option, value]), **CARDS)
    refused(r, f"{option} {value}: a value given twice")
    assert "give each value once" in fix_line(r), r.stderr


# --- a resume: the space's values compared, not the options' text ----------------------------------------------------

def _resume(tmp_path, *space: str, **env: str):
    """`forge sweep --round final --sweep-id s1` over the record _sweep_record writes (the options' text, as the
    sweep recorded its space before: tp2, bf16, 4096, the other options' defaults), with `space` given again."""
    _sweep_record(tmp_path, lambda r: None)
    _model_folder(tmp_path)
    with writes_nothing(tmp_path):
        return forge(tmp_path, *args_with([*SWEEP, "--model", str(tmp_path / "model"), "--sweep-id", "s1"], space),
                     **env)


# the record's space written otherwise: aliases, blanks, order, trailing zeros, the defaults listed
SAME = [["--topologies", "tp2dp1"], ["--kv-dtypes", " bf16 "], ["--max-num-batched-tokens", "4096 "],
        ["--max-num-seqs", "128,64,32,16"], ["--gpu-memory-utilization", "0.970,0.950"],
        ["--concurrency", "16, 12,10,8"]]


@pytest.mark.parametrize("space", [*SAME, [x for s in SAME for x in s]], ids=lambda s: " ".join(s))
def test_a_resume_of_the_same_space_written_otherwise_goes_on(tmp_path, space):
    """Refused before as "started with other space"; now the resume reads the record's tiers and goes on to the
    machine's cards (none visible here: the first refusal after the record, before anything is written)."""
    r = _resume(tmp_path, *space)
    refused(r, "sweep: TP=2/DP=1 needs 2 cards, 0 visible")


def test_a_resume_of_another_space_names_the_option_and_the_records_values(tmp_path):
    """Refused before naming the key 'space' only; now each option that differs, the record's values, the rerun's."""
    r = _resume(tmp_path, "--concurrency", "8,12", "--max-num-seqs", "16,32,64,128")
    refused(r, "sweep s1 was started with another space", "sweeps/s1/sweep.json",
            "--concurrency 8,10,12,16 in its record, 8,12 now")
    assert "--max-num-seqs" not in r.stderr.splitlines()[0], r.stderr
    fix = fix_line(r)
    assert "--concurrency 8,10,12,16" in fix and "omit --sweep-id" in fix, r.stderr


def test_a_record_whose_space_cannot_be_read_is_named(tmp_path):
    """Refused before as "started with other space"; now named by its key and what is wrong with it."""
    _sweep_record(tmp_path, lambda r: None)
    sj = tmp_path / "sweeps" / "s1" / "sweep.json"
    rec = json.loads(sj.read_text())
    rec["space"]["concurrency"] = "8,x"
    sj.write_text(json.dumps(rec))
    _model_folder(tmp_path)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(tmp_path / "model"), "--sweep-id", "s1")
    refused(r, "sweeps/s1/sweep.json", "key 'space.concurrency'", "'x' is not a whole number")
