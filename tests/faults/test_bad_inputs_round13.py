"""Inputs found to be taken wrongly in the thirteenth round of input hardening.

`forge predict --e2e DIR` where no profile beside the reference has every tier's result was refused without a
`fix:` line. It now says what a profile needs (runs/<profile>/<tier>.json, each tier).

`forge score --round final --baseline RUN` (and `sweep --baseline RUN`) where RUN's recorded server values are of
another type than the baseline's: `max_num_seqs: 128.0` was refused as "--max-num-seqs 128 (baseline; the
baseline's 128)", a value named as the baseline's own, and a server value recorded as null was named "unlimited"
(what a client without a concurrency limit is). The value is now named as recorded (128.0, null).

`forge unpack-run` of an archive two members of which cannot both be on disk (a folder and a file of one name,
or a member under a file of the archive): the extraction failed midway with an error naming its temporary folder
(".<run>.part-XXXX/a: is a folder, not a file; check the path") and no `fix:` line; `predict --e2e` of such a
packed record did the same. Such an archive is now refused before anything is extracted, naming the member, as
the other unsafe members are (the archive checks now live in forge/tarsafe.py).

`forge pack-run` of a run folder holding a link to one of its folders wrote raw.tgz, removed the raw files, then
failed at the link ("a part of this path is a file, not a folder; check the path"), exit 2 with the folder half
packed and the link left out of the record. Such a folder is now refused before anything is packed.

`forge sweep --round final --sweep-id ID` resuming a configuration whose tier-score.json records a negative tok/s
or contribution took it: picked as the tier's winner and written into the tier-environment file ("tok_s": -5).
It is now refused as damaged, naming the file and the key, before a server starts.

`forge plan --help` said --gpu-memory-utilization is "in (0, 1]", yet the final round refuses 0.05 (its bounds
are 0.1 to 1), and named no bounds for --max-num-batched-tokens or --concurrency. It now names the final round's.

`forge compare --reference RUN` of another round than the runs compared: the refusal's fix said "(--baseline
RUN)", an option compare does not have; it now names --reference. And a final-round RUN not served at the finals'
baseline configuration (--max-num-seqs 4, say) was taken: every score delta against a weaker baseline, where
`forge score --round final --baseline` refuses the same run. It is now refused the same way.

`forge score --round final` (or compare) of a final-round run missing a tier's result said "fix: finish the run:
forge bench-all-tiers --run-id RUN", a command that refuses the run (it is resumed only by the final round's
client, after the tier's own server starts). The fix now gives both commands with --round final.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tarfile

import pytest
from helpers import FIXTURE_RUNS, ROOT, forge
from test_bad_inputs import edit_json, refused, writes_nothing
from test_bad_inputs_round5 import fix_line

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_bad_inputs_round6_sweep import CONFIG, copy_sweep, final_run, model, resume, swept  # noqa: E402,F401

from forge.contest import rounds, rules  # noqa: E402

TIERS = ("4-8K", "8-16K", "16-32K")


# --- predict --e2e: no profile with every tier ----------------------------------------------------------

def test_predict_e2e_without_a_complete_profile_says_what_it_needs(tmp_path):
    e2e = tmp_path / "e2e"
    shutil.copytree(FIXTURE_RUNS / "base", e2e / "runs" / "upstream")
    (e2e / "runs" / "fast").mkdir()
    shutil.copy(FIXTURE_RUNS / "fast" / "4-8K.json", e2e / "runs" / "fast")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--e2e", str(e2e), "--out", str(tmp_path / "out"))
    refused(r, f"{e2e}: no profile with all tiers besides upstream")
    assert "runs/<profile>/<tier>.json" in fix_line(r) and "4-8K, 8-16K, 16-32K" in fix_line(r), r.stderr


# --- score --round final --baseline RUN: a recorded value of another type -------------------------------

@pytest.mark.parametrize("key,value,words", [
    ("max_num_seqs", 128.0, "--max-num-seqs 128.0 (baseline; the baseline's 128)"),
    ("max_num_batched_tokens", None, "--max-num-batched-tokens null (baseline; the baseline's 4096)"),
])
def test_a_final_baseline_value_of_another_type_is_named_as_recorded(tmp_path, key, value, words):
    """128.0 was named "--max-num-seqs 128 (...; the baseline's 128)", null a server value "unlimited"."""
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    edit_json(base / "manifest.json", lambda m: {**m, "servers_by_tier": {
        t: {**s, "settings": {**s["settings"], key: value}} for t, s in m["servers_by_tier"].items()}})
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--round", "final", "--run", str(run), "--baseline", str(base))
    refused(r, "baseline run base was not served at the finals' baseline configuration", words)


# --- unpack-run: members that cannot both be on disk ----------------------------------------------------

def _member(name: str, kind: bytes = tarfile.REGTYPE, body: bytes = b"x") -> tuple:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(body) if kind == tarfile.REGTYPE else 0
    return info, body if kind == tarfile.REGTYPE else None


def packed(tmp_path, members: list):
    """A run folder whose raw.tgz holds summary.json and then `members` ([(TarInfo, body)]), in that order."""
    run = tmp_path / "run"
    run.mkdir()
    with tarfile.open(run / "raw.tgz", "w:gz") as tf:
        for info, body in [_member("summary.json", body=b"{}"), *members]:
            tf.addfile(info, io.BytesIO(body) if body is not None else None)
    return run


def unpack_args(tmp_path, run, verb: str) -> list[str]:
    return ["unpack-run", str(run), "--to", str(tmp_path / "out")] if verb == "unpack-run" else ["predict", "--e2e", str(run)]


@pytest.mark.parametrize("members,bad,why", [
    ([_member("a", tarfile.DIRTYPE), _member("a/b"), _member("a")], "'a'", "is a folder and a file of the archive"),
    ([_member("a/b"), _member("a")], "'a'", "is a folder and a file of the archive"),
    ([_member("a"), _member("a/b")], "'a/b'", "lies under 'a', a file of the archive"),
])
@pytest.mark.parametrize("verb", ["unpack-run", "predict"])
def test_archive_members_that_clash_are_refused_before_extracting(tmp_path, members, bad, why, verb):
    """The extraction failed midway, naming its temporary folder, with no fix."""
    run = packed(tmp_path, members)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *unpack_args(tmp_path, run, verb))
    refused(r, f"{run / 'raw.tgz'}: member {bad} {why}; nothing was extracted")
    assert ".part-" not in r.stderr and "not one of ours" in fix_line(r), r.stderr


# --- pack-run: a link to a folder of the run --------------------------------------------------------------

def test_pack_run_refuses_a_link_to_a_folder_before_packing(tmp_path):
    """raw.tgz was written and the raw files removed, then the removal failed at the link (exit 2, half packed)."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    (run / "logs").mkdir()
    (run / "logs" / "server.log").write_text("log\n")
    os.symlink("logs", run / "latest-logs")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "pack-run", str(run))
    refused(r, f"{run / 'latest-logs'}: a link to a folder (logs)", "nothing was packed")
    assert "remove the link" in fix_line(r), r.stderr
    (run / "latest-logs").unlink()                 # as the fix says: the folder then packs as it is
    r = forge(tmp_path, "pack-run", str(run))
    assert r.returncode == 0 and sorted(p.name for p in run.iterdir()) == ["raw.tgz"], r.stderr


# --- sweep --round final --sweep-id: a negative tier score ---------------------------------------------------

@pytest.mark.parametrize("key", ["tok_s", "contribution"])
def test_a_resume_refuses_a_negative_tier_score(tmp_path, swept, model, key):  # noqa: F811
    """It was picked as the tier's winner and written into the tier-environment file."""
    copy_sweep(tmp_path, swept)
    f = tmp_path / "runs" / CONFIG / "tier-score.json"
    edit_json(f, lambda d: {**d, key: -5.0})
    with writes_nothing(tmp_path):
        r = resume(tmp_path, model)
    refused(r, f"{CONFIG}/tier-score.json", f"key '{key}': -5.0 is not a finite number >= 0")
    assert "delete it" in fix_line(r) and "server ready" not in r.stdout + r.stderr
    assert not (tmp_path / "tier-env.json").exists()


# --- plan --help: the final round's bounds ----------------------------------------------------------------

def test_plan_help_names_the_final_rounds_bounds(tmp_path):
    """--help said "in (0, 1]" for the share, which the final round refuses below 0.1."""
    rnd = rounds.load_round(rules.load_contest(), "final")
    text = " ".join(forge(tmp_path, "plan", "--help").stdout.split())
    assert "in (0, 1]" not in text, text
    bounds = {u.key: u for u in rnd.unlocked}
    util, mnbt = bounds["gpu_memory_utilization"], bounds["max_num_batched_tokens"]
    assert f"the final round's {util.min:g} to {util.max:g};" in text, text
    assert f"the final round's {mnbt.min:g} to {mnbt.max:g};" in text, text
    assert "requests in flight, the final round's 1 to 256" in text, text
    below = forge(tmp_path, "plan", "--round", "final", "--gpu-memory-utilization", f"{util.min / 2:g}")
    refused(below, "--gpu-memory-utilization", f"out of bounds ({util.min:g}..{util.max:g})")


# --- compare --reference: its round named by its option; a final reference at the baseline's values -----

def test_compare_reference_of_another_round_names_reference(tmp_path):
    """The fix said "(--baseline RUN)", an option compare does not have."""
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    r = forge(tmp_path, "compare", "--a", str(base), "--b", str(run), "--reference", str(FIXTURE_RUNS / "base"))
    refused(r, "the baseline run base is of the preliminary round")
    assert "(--reference RUN)" in fix_line(r) and "--baseline" not in fix_line(r), r.stderr


def test_compare_refuses_a_final_reference_not_at_the_baseline_configuration(tmp_path):
    """It was taken, every score delta against a weaker baseline that score --round final refuses."""
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    weak = final_run(tmp_path, "weak", max_num_seqs=(4, "env MAX_NUM_SEQS"))
    r = forge(tmp_path, "compare", "--a", str(base), "--b", str(run), "--reference", str(weak))
    refused(r, "baseline run weak was not served at the finals' baseline configuration",
            "--max-num-seqs 4 (env MAX_NUM_SEQS; the baseline's 128)")
    assert r.stdout == "", r.stdout
    ok = forge(tmp_path, "compare", "--a", str(base), "--b", str(run), "--reference", str(base))
    assert ok.returncode == 0 and "score (reference run)" in ok.stdout, ok.stderr


# --- score of a final-round run missing a tier: how to finish it ------------------------------------------

@pytest.mark.parametrize("verb", ["score", "compare"])
def test_a_final_run_missing_a_tier_says_how_the_final_round_finishes_it(tmp_path, verb):
    """The fix named `forge bench-all-tiers --run-id RUN`, which refuses a final-round run (another round's client)."""
    run, base = final_run(tmp_path, "run", "fast"), final_run(tmp_path, "base")
    (base / "8-16K.json").unlink()
    args = (["score", "--round", "final", "--run", str(run), "--baseline", str(base)] if verb == "score" else
            ["compare", "--a", str(base), "--b", str(run), "--reference", str(base)])
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, f"{base}: tier 8-16K has no result (8-16K.json)")
    assert ("forge serve --round final --profile fixture --tier 8-16K --run-id base, then forge bench-all-tiers "
            "--round final --run-id base") in fix_line(r), r.stderr
    prelim = tmp_path / "runs" / "prelim"           # under the runs folder, where --run-id names it (round 20)
    shutil.copytree(FIXTURE_RUNS / "base", prelim)
    (prelim / "8-16K.json").unlink()
    r = forge(tmp_path, "score", "--run", str(prelim))
    assert fix_line(r) == "  fix: finish the run: forge bench-all-tiers --run-id prelim", r.stderr
