"""Paths that meet something other than what a verb expects, found only once it had started writing, and a
record's path refused with a fix that does not fit.

`forge unpack-run` in place, into a run folder that holds a file where a member of raw.tgz needs a folder, or a
folder where a member is a file: the members sorted before it were moved in, then it failed with a message
naming the staging folder; a link in the folder on a member's path (`logs` -> elsewhere) had the member written
wherever the link led, outside the folder. `forge plan --out DIR --force` (and every result written with
forge.paths.write_files) where DIR holds a folder named as one of the result's files: plan.json was replaced,
then the rename of plan.md failed. An --out below a file (`--out notes.txt/cal`) was refused by the tool's
generic message for an OSError, without the option and without a fix. A record read through a symlink loop
or below a file (`forge report --round final --tier-env`, any JSON record) was refused with the fix "check the
file's permissions". Each is now refused before anything is written: exit code 2, one error line naming the
path and what is there, a `fix:` line, every file as it was.
"""

from __future__ import annotations

import json
import tarfile

import pytest
from helpers import forge
from test_bad_inputs import member, refused, tgz, writes_nothing
from test_bad_inputs_round5 import fix_line

# --- unpack-run: the folder unpacked into ---------------------------------------------------------------

def _run_folder(tmp_path, members):
    run = tmp_path / "run"
    run.mkdir()
    tgz(run / "raw.tgz", members)
    return run


def test_unpack_refuses_a_file_where_a_member_needs_a_folder(tmp_path):
    run = _run_folder(tmp_path, [member("0first.txt"), member("a", tarfile.DIRTYPE), member("a/b")])
    (run / "a").write_text("a file of the folder\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "unpack-run", str(run))
    refused(r, "run/a: a file", "member 'a'", "nothing was extracted")
    assert ".part-" not in r.stderr and "--to" in fix_line(r)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_unpack_refuses_a_folder_where_a_member_is_a_file(tmp_path, force):
    run = _run_folder(tmp_path, [member("0first.txt"), member("x")])
    (run / "x").mkdir()
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "unpack-run", str(run), *force)
    refused(r, "run/x: a folder", "member 'x'", "is a file", "nothing was extracted")


def test_unpack_never_writes_through_a_link_of_the_folder(tmp_path):
    run = _run_folder(tmp_path, [member("logs", tarfile.DIRTYPE), member("logs/evil")])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "logs").symlink_to(elsewhere)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "unpack-run", str(run))
    refused(r, "run/logs: a link", "member 'logs'", "nothing was extracted")
    assert not list(elsewhere.iterdir())


def test_unpack_into_a_folder_of_the_same_files_still_works(tmp_path):
    run = _run_folder(tmp_path, [member("a", tarfile.DIRTYPE), member("a/b"), member("c")])
    (run / "a").mkdir()
    (run / "a" / "b").write_bytes(b"x")
    r = forge(tmp_path, "unpack-run", str(run))
    assert r.returncode == 0, r.stderr
    assert (run / "c").read_bytes() == b"x"


# --- results written together: a folder in place of one of the files ---------------------------------------

@pytest.mark.parametrize("taken", ["plan.md", "plan.json"])
def test_plan_out_with_a_folder_named_as_a_file_writes_nothing(tmp_path, taken):
    out = tmp_path / "plan"
    (out / taken).mkdir(parents=True)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--out", str(out), "--force")
    refused(r, f"plan/{taken}: a folder", "nothing was written")
    assert ".part-" not in r.stderr


# --- a folder to write into below a file ------------------------------------------------------------------

@pytest.mark.parametrize("verb", [["calibrate", "--smoke", "--families", "write"], ["plan"]])
def test_an_out_below_a_file_names_the_option(tmp_path, verb):
    (tmp_path / "notes.txt").write_text("notes\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *verb, "--out", str(tmp_path / "notes.txt" / "out"))
    refused(r, "--out", "notes.txt is a file, not a folder")
    assert fix_line(r)


# --- a record's path: a loop or a file on the way ---------------------------------------------------------

def test_a_tier_env_through_a_symlink_loop_says_so(tmp_path):
    loop = tmp_path / "te.json"
    loop.symlink_to(loop)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(loop), "--out", str(tmp_path / "rep"))
    refused(r, "te.json: a symlink loop")
    assert "permissions" not in r.stderr and "link" in fix_line(r)


def test_a_tier_env_below_a_file_says_so(tmp_path):
    (tmp_path / "te.json").write_text(json.dumps({"round": "final", "tiers": {}}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(tmp_path / "te.json" / "x"),
                  "--out", str(tmp_path / "rep"))
    refused(r, "te.json/x: a part of this path is a file, not a folder")
    assert "permissions" not in r.stderr


# --- unpack-run: an archive past what a run record holds ----------------------------------------------------

def test_unpack_refuses_an_archive_of_more_members_than_a_record_holds(tmp_path):
    """20,001 empty files: unpacked they cost little, but no run record holds so many (a bomb of tiny files
    fills a disk's inodes as a bomb of large ones fills its blocks); refused before anything is extracted."""
    from forge.run import archive
    run = _run_folder(tmp_path, [member(f"f{i}", body=b"") for i in range(archive.MAX_MEMBERS + 1)])
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "unpack-run", str(run), "--to", str(tmp_path / "out"))
    refused(r, "20,001 members", "more than a run record holds", "nothing was extracted")
    assert not (tmp_path / "out").exists()


def test_the_unpacked_bytes_are_bounded_before_anything_is_written():
    """Members whose sizes add up past MAX_UNPACKED_BYTES are refused on their headers alone (the
    check reads the members' sizes, never their bytes); at the limit they pass."""
    from forge.errors import ForgeError
    from forge.run import archive

    def files(*sizes):
        out = []
        for i, n in enumerate(sizes):
            info = tarfile.TarInfo(f"f{i}")
            info.size = n
            out.append(info)
        return out
    half = archive.MAX_UNPACKED_BYTES // 2
    archive.check_unpacked_size(files(half, half), "raw.tgz")
    with pytest.raises(ForgeError, match="more than a run record holds"):
        archive.check_unpacked_size(files(half, half, 1), "raw.tgz")


# --- a link that leads back to itself is no missing input; the runs folder in use is the one named -------------

def test_a_calibration_through_a_symlink_loop_says_so(tmp_path):
    loop = tmp_path / "cal"
    loop.symlink_to(loop)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--calibration", str(loop))
    refused(r, "--calibration", "cal: a symlink loop")
    assert "no calibration.json" not in r.stderr and "link" in fix_line(r)


def test_a_run_id_through_a_symlink_loop_says_so(tmp_path):
    (tmp_path / "runs").mkdir()
    loop = tmp_path / "runs" / "r1"
    loop.symlink_to(loop)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", "r1")
    refused(r, f"{loop}: a symlink loop")
    assert "not found" not in r.stderr and "link" in fix_line(r)


def test_a_run_not_found_names_the_runs_folder_in_use(tmp_path):
    """FORGE_RUNS_DIR (tmp/runs here) is where a run id is looked for, so it is the folder to list."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", "nosuch")
    refused(r, "run 'nosuch' not found", f"{tmp_path / 'runs' / 'nosuch'}")
    assert f"ls {tmp_path / 'runs'}/" in fix_line(r) and "reports/runs" not in r.stderr


def test_plan_out_with_a_folder_named_plan_json_is_no_recorded_plan(tmp_path):
    out = tmp_path / "plan"
    (out / "plan.json").mkdir(parents=True)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--out", str(out))
    refused(r, "plan/plan.json: a folder, not a file", "nothing was written")
    assert "recorded" not in r.stderr and "--force" not in fix_line(r)


@pytest.mark.parametrize("extra,record", [(["--calibration", "reports/calibration/2026-12-02-h200"], "predict-final.json"),
                                          (["--validate"], "validation.json")])
def test_predict_final_out_with_a_folder_named_as_its_record_is_no_recorded_result(tmp_path, extra, record):
    out = tmp_path / "pred"
    (out / record).mkdir(parents=True)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--round", "final", "--out", str(out), *extra)
    refused(r, f"pred/{record}: a folder, not a file", "nothing was written")
    assert "recorded" not in r.stderr and "--force" not in fix_line(r)
