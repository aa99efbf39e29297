"""Inputs found to be taken wrongly in the twentieth round of input hardening.

`forge e2e-gpu --round final --capacity contest:max-num-seqs=+4` (or `=04`, or max-num-batched-tokens written so):
taken, the server given --max-num-seqs 4, where the same value in the final round's variables (MAX_NUM_SEQS=+4,
MAX_NUM_SEQS_4_8K=04) is refused as not written plainly. It is now refused as they are, naming the item, with the
plain number as the fix.

`forge e2e-gpu --out DIR --triton-cache DIR/triton` (or the results folder itself; or `--site DIR/site`): taken;
the servers' compiled kernels (the bundle's installed wheels) were written into the results folder, which --pack
and pack-run pack whole (pack-run then removes what it packed), so the run's archive held the Triton cache (the
site). A --triton-cache or --site inside --out is now refused before anything is written, with a folder beside it.

`forge serve --round final --tier 4-8K --dry-run` with MAX_NUM_SEQS_4_8k=64 in the environment (or MAX_NUM_SEQS_48K,
CONCURRENCY_16_32k, max_num_seqs: a round's variable mistyped): taken; nothing read the variable, and the server got
the baseline's --max-num-seqs 128 without a word. A variable that reads as one of the round's in other letter case,
or a round's variable with a suffix that names no tier, is now refused naming it, with the name it reads as.

`forge score --run DIR` (or `--baseline DIR`) with DIR a folder that holds no run (the model's folder, an empty
one): refused as "tier 4-8K has no result", fix "finish the run: forge bench-all-tiers --run-id DIR's name", which
starts another run under the runs folder. It is now said to be no run folder, as compare says it. And a run folder
outside the runs folder missing a tier: the same fix named a run under the runs folder, not this one; it now says to
move the folder there first.

`forge serve --profile ../contest` (or `sweep ../upstream`; any profile name holding a path): the name was joined
to configs/serve/, so configs/contest.yaml was read as a profile and refused as "configs/contest.yaml: unknown key
'rules'", and `--profile ../serve/upstream` was served as upstream. Such a name is now refused as not a plain name
(as e2e-gpu --profiles refuses it), with the profiles' names as the fix; a profile file's path (.yaml) is taken.
"""

from __future__ import annotations

import shutil

import pytest
from helpers import FIXTURE_RUNS, forge
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round17 import e2e_gpu_writes_nothing

# --- e2e-gpu --capacity: a value with a sign or a leading zero --------------------------------------------------------

@pytest.mark.parametrize("item,words,fix", [
    ("max-num-seqs=+4", "a sign before the number", "contest:max-num-seqs=4"),
    ("max-num-seqs=04", "a leading zero before the number", "contest:max-num-seqs=4"),
    ("max-num-batched-tokens=02048", "a leading zero before the number", "contest:max-num-batched-tokens=2048"),
])
def test_e2e_gpu_capacity_refuses_a_value_not_written_plainly(tmp_path, item, words, fix):
    """Taken before as the number (the final round's variables refuse "+64" and "064")."""
    spec = f"contest:{item}"
    r = e2e_gpu_writes_nothing(tmp_path, "--round", "final", "--profiles", "contest,upstream", "--capacity", spec)
    refused(r, f"--capacity {spec!r}: {item}: {words}")
    assert f"write the plain number, e.g. --capacity {fix}" in fix_line(r), r.stderr


def test_e2e_gpu_capacity_takes_a_plain_value(tmp_path):
    """The plain number passes --capacity; the deadline is what refuses this run."""
    r = e2e_gpu_writes_nothing(tmp_path, "--round", "final", "--profiles", "contest,upstream", "--capacity",
                               "contest:max-num-seqs=4", "--deadline-s", "30", "--reserve-s", "0")
    refused(r, "--deadline-s 30", "no tier would be measured")


# --- e2e-gpu --triton-cache: inside the results folder ---------------------------------------------------------------

@pytest.mark.parametrize("opt,what", [("--triton-cache", "the Triton cache"), ("--site", "the installed bundle")])
@pytest.mark.parametrize("where", ["out/sub", "out"])
def test_e2e_gpu_refuses_a_cache_or_site_inside_the_results_folder(tmp_path, opt, what, where):
    """Taken before: the compiled kernels (or the installed wheels) went into the results folder, and with it into
    the run's archive."""
    r = e2e_gpu_writes_nothing(tmp_path, opt, str(tmp_path / where))
    refused(r, f"{opt} {tmp_path / where}: inside the results folder {tmp_path / 'out'}",
            f"the run's archive would hold {what}")
    assert f"{opt} {tmp_path.resolve() / ('out-' + opt[2:])}" in fix_line(r), r.stderr


# --- serve --round final: a round's variable mistyped -----------------------------------------------------------------

@pytest.mark.parametrize("var,near", [("MAX_NUM_SEQS_4_8k", "MAX_NUM_SEQS_4_8K"), ("MAX_NUM_SEQS_48K", "MAX_NUM_SEQS_4_8K"),
                                      ("CONCURRENCY_16_32k", "CONCURRENCY_16_32K"), ("max_num_seqs", "MAX_NUM_SEQS"),
                                      ("GPU_MEMORY_UTILIZATION_16K", None)])
def test_serve_final_refuses_a_mistyped_round_variable(tmp_path, var, near):
    """Taken before: nothing read it, and the server got the baseline's value (--max-num-seqs 128) without a word."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", "upstream", "--dry-run",
                  **{var: "0.9" if var.startswith("GPU") else "12"})
    refused(r, f"{var}=", "(environment)", "not a variable of the final round, so nothing reads it")
    assert (f"rename it {near}, or unset it" if near else "end in _4_8K, _8_16K, _16_32K") in fix_line(r), r.stderr


def test_serve_final_takes_another_tiers_variable(tmp_path):
    """A variable of another tier is the finals' own: not read for this tier, and not refused."""
    r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", "upstream", "--dry-run",
              MAX_NUM_SEQS_8_16K="12", MAX_NUM_SEQS_4_8K="64")
    assert r.returncode == 0 and "--max-num-seqs 64 " in r.stdout, r.stderr


# --- score: a folder that holds no run, and a run outside the runs folder -----------------------------------------

@pytest.mark.parametrize("side", ["--run", "--baseline"])
def test_score_says_a_folder_without_a_run_is_not_a_run_folder(tmp_path, side):
    """It said "tier 4-8K has no result", fix "finish the run: forge bench-all-tiers --run-id model", which starts
    another run under the runs folder (compare says it is no run folder)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}\n")
    args = ["--run", str(folder)] if side == "--run" else ["--tok-s", "1,2,3", "--baseline", str(folder)]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", *args)
    refused(r, f"{folder}: no tier results (<tier>.json) and no manifest.json: not a run folder")
    assert "bench-all-tiers (or e2e-gpu) wrote, or a run id under" in fix_line(r), r.stderr
    assert "--run-id" not in r.stderr, r.stderr


def test_score_of_a_run_outside_the_runs_folder_says_to_move_it_first(tmp_path):
    """The fix named `forge bench-all-tiers --run-id prelim`, which names a run under the runs folder: it started
    another one there, leaving this one as it was."""
    prelim = tmp_path / "prelim"
    shutil.copytree(FIXTURE_RUNS / "base", prelim)
    (prelim / "8-16K.json").unlink()
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", str(prelim))
    refused(r, f"{prelim}: tier 8-16K has no result (8-16K.json)")
    assert fix_line(r) == (f"  fix: finish the run: move {prelim} into {tmp_path / 'runs'}/ (--run-id names a run "
                           "there), then forge bench-all-tiers --run-id prelim"), r.stderr


# --- serve, sweep: a profile named with a path --------------------------------------------------------------------

@pytest.mark.parametrize("args,name", [
    (["serve", "--profile", "../contest", "--dry-run"], "../contest"),
    (["serve", "--round", "final", "--tier", "4-8K", "--profile", "../serve/upstream", "--dry-run"], "../serve/upstream"),
    (["sweep", "../upstream", "--model", "/m", "--num-prompts", "2"], "../upstream"),
])
def test_a_profile_named_with_a_path_is_refused(tmp_path, args, name):
    """`../contest` read configs/contest.yaml as a profile (refused as "configs/contest.yaml: unknown key 'rules'");
    `../serve/upstream` was served as upstream. e2e-gpu --profiles refused such a name already."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, f"profile {name!r}: not a plain name")
    assert "name a profile of configs/serve/ by its name" in fix_line(r) and "upstream" in fix_line(r), r.stderr
    assert "unknown key" not in r.stderr, r.stderr


def test_a_profile_file_path_is_still_taken(tmp_path):
    r = forge(tmp_path, "serve", "--profile", "configs/serve/upstream.yaml", "--dry-run")
    assert r.returncode == 0 and "--served-model-name" in r.stdout, r.stderr
