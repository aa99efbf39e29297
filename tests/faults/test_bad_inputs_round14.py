"""Inputs found to be taken wrongly in the fourteenth round of input hardening.

`forge score` of a run whose manifest.json records `"scored_port": "yes"` (any value but true or false) scored it
without a word: the warning that a run was not served on the locked port 8001 is given only for `false`, so a
damaged flag hid it. It is now refused as damaged, naming the file and the key, as `harness` is.

`forge unpack-run` (and `predict --e2e` of a packed record) of an archive holding one file twice extracted both,
the last silently replacing the first: which copy of a record the tools read depended on the archive's order.
Such an archive is now refused before anything is extracted, naming the member, as the other clashing members are.
"""

from __future__ import annotations

import sys
import tarfile

import pytest
from helpers import ROOT, forge
from test_bad_inputs import edit_json, refused, writes_nothing
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round13 import _member, packed, unpack_args

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_bad_inputs_round6_sweep import final_run  # noqa: E402


@pytest.mark.parametrize("value", ["yes", 1, "true"])
def test_score_refuses_a_scored_port_that_is_not_true_or_false(tmp_path, value):
    """A "yes" hid the warning a run off the locked port gets."""
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    edit_json(run / "manifest.json", lambda m: {**m, "scored_port": value})
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(base))
    refused(r, f"{run / 'manifest.json'}: key 'scored_port' is {value!r}", "expected true or false")
    assert "manifest.json is damaged" in fix_line(r), r.stderr


def test_score_still_warns_of_a_run_off_the_locked_port(tmp_path):
    """The check is on the flag's type: false is still taken, with its warning."""
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    edit_json(run / "manifest.json", lambda m: {**m, "scored_port": False})
    r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(base))
    assert r.returncode == 0, r.stderr
    assert "did not listen on the locked port 8001" in r.stderr, r.stderr


@pytest.mark.parametrize("twice", [
    [_member("runs/a/4-8K.json", body=b"{}"), _member("runs/a/4-8K.json", body=b"[]")],
    [_member("summary.md"), _member("x", tarfile.DIRTYPE), _member("summary.md")],
])
@pytest.mark.parametrize("verb", ["unpack-run", "predict"])
def test_an_archive_holding_a_file_twice_is_refused_before_extracting(tmp_path, twice, verb):
    """Both copies were extracted, the last replacing the first."""
    run = packed(tmp_path, twice)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *unpack_args(tmp_path, run, verb))
    refused(r, f"{run / 'raw.tgz'}: member {twice[-1][0].name!r} is in the archive twice", "nothing was extracted")
    assert "not one of ours" in fix_line(r), r.stderr


def test_an_archive_listing_a_folder_twice_is_still_taken(tmp_path):
    """A folder named twice writes nothing twice: unpacked as before."""
    run = packed(tmp_path, [_member("runs", tarfile.DIRTYPE), _member("runs", tarfile.DIRTYPE),
                            _member("runs/x.json", body=b"{}")])
    r = forge(tmp_path, "unpack-run", str(run), "--to", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "runs" / "x.json").read_text() == "{}"
