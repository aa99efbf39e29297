"""The final round's inputs, as a user types them or a file holds them: one profile's --capacity in
`forge e2e-gpu`, the numbers of `forge plan` / `predict --round final` / `sweep --round final`, the start
script's and the client's variables (MAX_NUM_SEQS, CONCURRENCY_4_8K, ...), configs/contest.yaml's
`rounds.final` section, and a tuned table's degree and heads. Each bad value is refused before anything is
written or started: exit code 2, one error line naming the option, variable, file or key (a value the
round bounds cites its rule) and a `fix:` line, `git status` as it was."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from checkout_copy import forge_in, make_checkout, status
from helpers import ROOT, args_with, forge, free_port
from project import make_project
from project import run as run_in
from test_bad_inputs import refused, writes_nothing

RULE = "(rule 'final_unlocked')"


def fix_line(r: subprocess.CompletedProcess) -> str:
    return next((x for x in r.stderr.splitlines() if x.startswith("  fix: ")), "")


# --- e2e-gpu --capacity: the values one profile's server gets are ones vLLM and the round accept -----------

@pytest.mark.parametrize("spec,words,fix", [
    # each value within its bounds, together one vLLM refuses (fewer batched tokens than sequences)
    ("contest:max-num-seqs=1024,max-num-batched-tokens=256",
     ["--capacity contest", "--max-num-batched-tokens 256 is below --max-num-seqs 1024", RULE], "at least"),
    # the fix's example is a value the round accepts (it offered max-num-batched-tokens=4, below 256)
    ("contest:max-num-batched-tokens=100", ["--max-num-batched-tokens 100 is out of bounds (256..32768)", RULE],
     "contest:max-num-batched-tokens=256"),
])
def test_capacity_values_are_ones_the_server_accepts(tmp_path, spec, words, fix):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(tmp_path / "model"), "--round", "final",
                  "--profiles", "contest,upstream", "--out", str(tmp_path / "out"), "--capacity", spec)
    refused(r, *words)
    assert fix in fix_line(r), r.stderr


def test_a_profile_given_twice_is_refused(tmp_path):
    """--profiles contest,contest gave both the same port and run folder (a --capacity of 'contest' both)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(tmp_path / "model"), "--round", "final",
                  "--profiles", "contest,upstream,contest", "--out", str(tmp_path / "out"),
                  "--capacity", "contest:max-num-seqs=4")
    refused(r, "--profiles", "contest given twice")


def test_a_model_folder_that_is_not_there_is_refused_before_the_results_folder(tmp_path):
    """It was found when the prompts were made, after the results folder and its summary were written."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(tmp_path / "model"), "--round", "final",
                  "--profiles", "contest,upstream", "--out", str(tmp_path / "out"), "--capacity", "contest:max-num-seqs=4")
    refused(r, "--model", "no such folder")


# --- the start script's and the client's variables ------------------------------------------------------------

@pytest.mark.parametrize("var,value,words", [
    # the start script hands the text to vLLM, which reads it with int(): "1e3" fails there
    ("MAX_NUM_SEQS_16_32K", "1e3", ["MAX_NUM_SEQS_16_32K='1e3'", "whole number in plain digits"]),
    # the refusal names the variable that was set, and its fix sets that one (it named MAX_NUM_SEQS)
    ("MAX_NUM_SEQS_16_32K", "0", ["MAX_NUM_SEQS_16_32K='0'", "out of bounds (1..1024)", RULE]),
    ("CONCURRENCY_16_32K", "1e1", ["CONCURRENCY_16_32K='1e1'", "whole number in plain digits"]),
])
def test_a_variable_of_the_finals_is_named_when_refused(tmp_path, var, value, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "16-32K", "--dry-run", "--model", "/m",
                  **{var: value})
    refused(r, *words)
    assert f"set {var} " in fix_line(r), r.stderr


def test_a_tier_without_the_final_round_is_not_dropped(tmp_path):
    """make serve TIER=4-8K without ROUND=final served the preliminary's server and said nothing."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--dry-run", "--model", "/m", TIER="4-8K")
    refused(r, "--tier 4-8K", "preliminary")
    assert "--round final" in fix_line(r), r.stderr


def test_the_clients_concurrency_variable_is_read_as_the_client_reads_it(tmp_path):
    """CONCURRENCY_4_8K=1e1 was taken as 10; the finals' client passes it to --max-concurrency as is."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "bench-all-tiers", "--round", "final", "--tiers", "4-8K", "--port", str(free_port()),
                  "--model", "/m", CONCURRENCY_4_8K="1e1")
    refused(r, "CONCURRENCY_4_8K", "'1e1'", "whole number")
    assert "1..256" in fix_line(r) and "locked" not in r.stderr, r.stderr


# --- plan, predict --round final, sweep --round final: plain digits, the round's bounds ------------------------

@pytest.mark.parametrize("args,words", [
    (["plan", "--gpu-memory-utilization", "\uff10.\uff19\uff15"], ["--gpu-memory-utilization"]),      # full-width
    (["plan", "--round", "final", "--kv-dtype", "bf16,int8,bf16"], ["--kv-dtype", "given twice"]),
    (["plan", "--round", "final", "--concurrency", "300"], ["--concurrency", "out of bounds (1..256)", RULE]),
    (["plan", "--round", "final", "--max-num-batched-tokens", "100"], ["--max-num-batched-tokens 100", RULE]),
    # no configuration fits at all: it ended in a traceback after the model had run
    (["predict", "--round", "final", "--speedup", "gemv=1.2", "--max-num-batched-tokens", "99999999"],
     ["--max-num-batched-tokens 99999999 is out of bounds (256..32768)", RULE]),
    (["predict", "--round", "final", "--speedup", "gemv=1.2", "--top", "0"], ["--top", "'0'"]),
])
def test_plan_and_predict_numbers_are_plain_digits_in_the_rounds_bounds(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--out", str(tmp_path / "out"))
    refused(r, *words)


def test_an_out_that_is_a_file_is_refused_before_the_model_runs(tmp_path):
    """predict --round final ran the finals' model over every configuration before its --out was found a file."""
    (tmp_path / "out").write_text("a file\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--round", "final", "--speedup", "gemv=1.2", "--out", str(tmp_path / "out"))
    refused(r, "--out", "a file, not a folder")
    assert "configurations" not in r.stderr, r.stderr


SWEEP = ["sweep", "--round", "final", "--baseline-profile", "upstream", "--top", "1", "--tiers", "4-8K",
         "--kv-dtypes", "bf16", "--topologies", "tp2", "--max-num-batched-tokens", "4096"]


@pytest.mark.parametrize("args,words,fix", [
    (["--max-num-seqs", "\uff14"], ["--max-num-seqs", "whole number in plain digits"], "--max-num-seqs"),
    # the fix names the option given, not the start script's variable
    (["--max-num-seqs", "0"], ["--max-num-seqs 0 is out of bounds", RULE], "--max-num-seqs within 1..1024"),
    (["--tiers", "4-8K,8-16K,4-8K"], ["--tiers", "4-8K given twice"], "once"),
    # every option good, the model folder not there: it was found at the first server, the record written
    ([], ["--model", "no such folder"], "--model DIR"),
])
def test_a_sweep_value_is_refused_before_the_sweep_is_written(tmp_path, args, words, fix):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args_with([*SWEEP, "--model", str(tmp_path / "model")], args))
    refused(r, *words)
    assert fix in fix_line(r) and "MAX_NUM_SEQS" not in r.stderr, r.stderr


def test_a_tier_environment_file_that_cannot_be_written_is_refused_first(tmp_path):
    """--tier-env naming a folder was found when the winners were written, after every tier was served."""
    (tmp_path / "winners").mkdir()
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(tmp_path / "model"), "--tier-env", str(tmp_path / "winners"))
    refused(r, "--tier-env", "is a folder")


@pytest.mark.parametrize("var,value,words", [
    ("MAX_NUM_SEQS", "1e3", ["tiers.4-8K.environment", "MAX_NUM_SEQS='1e3'", "whole number"]),   # vLLM's int()
])
def test_a_tier_environment_file_ships_only_what_the_finals_take(tmp_path, var, value, words):
    """The submission's ENVIRONMENT.md lists the file's values as the team's per tier; an edited one was
    shipped as it was."""
    env = {"TENSOR_PARALLEL_SIZE": "2", "DATA_PARALLEL_SIZE": "1", "MAX_NUM_SEQS": "64", "MAX_NUM_BATCHED_TOKENS": "4096",
           "GPU_MEMORY_UTILIZATION": "0.95", "CONCURRENCY_4_8K": "10", var: value}
    f = tmp_path / "tier-environment.json"
    f.write_text(json.dumps({"round": "final", "tiers": {"4-8K": {"environment": env, "sweep": "s1", "run": "r"}}}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(f), "--out", str(tmp_path / "report"))
    refused(r, "tier-environment.json", *words)


def _sweep_record(tmp_path, edit) -> None:
    """sweeps/s1/sweep.json as the SWEEP command line above records it (its ranking of one configuration),
    changed by `edit`: a record a resume reads back."""
    cand = {"kv_dtype": "bf16", "tensor_parallel_size": 2, "data_parallel_size": 1, "max_num_seqs": 128,
            "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.95, "concurrency": 10, "planned": False}
    rec = {"sweep": "s1", "round": "final",
           "space": {"topologies": "tp2", "kv_dtypes": "bf16", "max_num_seqs": None, "max_num_batched_tokens": "4096",
                     "gpu_memory_utilization": None, "concurrency": None},
           "top": 1, "base_profile": "contest", "baseline": None, "baseline_profile": "upstream", "num_prompts": None,
           "model_build": "best-public", "harness": False, "created": "2026-12-04T00:00:00+00:00",
           "tiers": {"4-8K": {"ranking": [{"key": "tp2dp1-bf16-s128-b4096-u0.95-c10", "candidate": cand,
                                           "predicted": {"tok_s": 100.0}, "why": "within the SLA"}]}}}
    edit(rec["tiers"]["4-8K"]["ranking"][0])
    (tmp_path / "sweeps" / "s1").mkdir(parents=True)
    (tmp_path / "sweeps" / "s1" / "sweep.json").write_text(json.dumps(rec))


def _model_folder(tmp_path):
    """A model folder the sweep takes (its config.json is checked before the sweep's folder is read)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}\n")


def test_a_sweep_id_whose_folder_holds_other_files_is_refused(tmp_path):
    """A folder without a sweep record was taken as a new sweep's, and its files of the same names replaced."""
    (tmp_path / "sweeps" / "s1" / "profiles").mkdir(parents=True)
    (tmp_path / "sweeps" / "s1" / "profiles" / "4-8K-baseline.yaml").write_text("description: mine\n")
    _model_folder(tmp_path)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(tmp_path / "model"), "--sweep-id", "s1")
    refused(r, "sweeps/s1", "no sweep record")


@pytest.mark.parametrize("edit,words", [
    # an edited record would serve a configuration the round refuses
    (lambda r: r["candidate"].update(max_num_seqs=5000), ["ranking[0].candidate", "--max-num-seqs 5000", RULE]),
])
def test_a_resumed_sweep_reads_its_record_strictly(tmp_path, edit, words):
    _sweep_record(tmp_path, edit)
    _model_folder(tmp_path)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(tmp_path / "model"), "--sweep-id", "s1")
    refused(r, "sweeps/s1/sweep.json", *words)


# --- configs/contest.yaml's final round: a mistyped or missing value is named on load ---------------------------

@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return make_checkout(tmp_path_factory.mktemp("final-round") / "checkout")


@pytest.mark.parametrize("old,new,words", [
    ("choices: [1, 2], rule: final_topology, names_ours: true}\n      - {key: data",
     "choices: ['1', '2'], rule: final_topology, names_ours: true}\n      - {key: data",
     ["rounds.final.unlocked[0].choices", "not a list of whole numbers"]),
    ("key: data_parallel_size, option: --data-parallel-size",
     "key: tensor_parallel_size, option: --data-parallel-size", ["rounds.final.unlocked[1].key", "unlocked twice"]),
    ("concurrency_env: CONCURRENCY_8_16K", "concurrency_env: CONCURRENCY_4_8K",
     ["rounds.final.client.tiers.8-16K.concurrency_env", "CONCURRENCY_4_8K"]),
    ("{concurrency: 10, concurrency_env: CONCURRENCY_4_8K, num_prompts: 80}",
     "{concurrency: 999, concurrency_env: CONCURRENCY_4_8K, num_prompts: 80}",
     ["rounds.final.client.tiers.4-8K.concurrency", "999"]),
    ("baseline: {tensor_parallel_size: 2,", "baseline: {tensor_parallel_size: '2',",
     ["rounds.final.baseline.tensor_parallel_size", "not a number"]),
])
def test_a_mistyped_final_round_config_is_named_on_load(tmp_path, checkout, old, new, words):
    cfg = checkout / "configs" / "contest.yaml"
    good = cfg.read_text()
    assert good.count(old) == 1, old
    try:
        cfg.write_text(good.replace(old, new))
        with writes_nothing(tmp_path):
            r = forge_in(checkout, tmp_path, "plan", "--round", "final", "--tier", "4-8K")
        refused(r, "configs/contest.yaml", *words)
    finally:
        cfg.write_text(good)
    assert status(checkout) == ""


# --- a tuned table's degree and heads are one rank of the served model ------------------------------------------

@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    p = make_project(tmp_path_factory.mktemp("final-round-tree") / "proj", n_modules=10, n_patches=2)
    shutil.copytree(ROOT / "kernels" / "forge_tuned", p["root"] / "kernels" / "forge_tuned", dirs_exist_ok=True)
    overlay = p["root"] / "kernels" / "overlay.yaml"
    overlay.write_text(overlay.read_text() + "  - src: configs/kernels/tuned/*.json\n    dst: vllm/forge_tuned/\n")
    r = run_in(p, "tree")
    assert r.returncode == 0, r.stderr
    return p


def tree_refuses_table(proj, table: dict, *words: str) -> str:
    """`make tree` with `table` as a tuned table of the project: refused (one line naming the file and `words`)
    before the tree is touched; the table removed afterwards. Returns the error line."""
    bad = proj["root"] / "configs" / "kernels" / "tuned" / "bw-gfx936-80cu-tp2.json"
    bad.parent.mkdir(parents=True, exist_ok=True)
    tree = proj["root"] / "build" / "vllm"
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    try:
        bad.write_text(json.dumps(table))
        r = run_in(proj, "tree")
        line = refused(r, "configs/kernels/tuned/bw-gfx936-80cu-tp2.json", *words)
        assert subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout == head          # the tree was not touched
    finally:
        bad.unlink(missing_ok=True)
    return line


@pytest.mark.parametrize("tp,heads,words", [
    (1, [12, 2], ["key 'validators.heads'", "[12, 2]", "at tp 1", "[24, 4]"]),     # TP2's heads named TP1
    (3, [8, 2], ["key 'validators.tp'", "3 does not divide", "GDN key heads"]),      # a degree vLLM cannot run
])
def test_a_tuned_table_of_another_geometry_never_enters_the_tree(proj, tp, heads, words):
    table = json.loads((ROOT / "configs" / "kernels" / "tuned" / "nvidia-h200-sm_90-132cu-tp2.json").read_text())
    table["validators"].update(tp=tp, heads=heads)
    table["decode"]["segments"] = {str(heads[1]): v for v in table["decode"]["segments"].values()}
    line = tree_refuses_table(proj, table, *words)
    assert re.search(r"configs/models/qwen3\.5-27b/config\.json", line), line
    assert run_in(proj, "tree").returncode == 0
