"""The final round's newest surfaces, given what a user types or keeps by mistake: `forge plan`,
`forge predict --round final` and `forge report` writing their files (--out), predict reading its options
(an empty value, an option the round's prediction does not read), `forge sweep --round final`'s topology
list and its tier-environment file (read first under --force, not among the tool's sources, FORCE=1 read),
the tier-environment file `forge report` / `forge submission` ship (its round), `forge e2e-gpu`'s
--tier-order and --capacity messages and the cards of --finals-servers, and a few values of serve,
bench-all-tiers and calibrate kept as regression cases. Each mistake is refused before anything is written
or started: exit code 2, one error line naming the option, variable, file or key and a `fix:` line, `git
status` as it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SUPPORT, forge, free_port, tiny_model
from test_bad_inputs import refused, writes_nothing

RULE = "(rule 'final_unlocked')"
CARDS = {"CUDA_VISIBLE_DEVICES": "0,1"}


def fix_line(r: subprocess.CompletedProcess) -> str:
    return next((x for x in r.stderr.splitlines() if x.startswith("  fix: ")), "")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round5-model"))


# --- plan / predict --round final / report: the files go where results go ----------------------------

@pytest.mark.parametrize("args", [
    # plan.json and plan.md were written among the tool's sources (and into the checkout's root with ".")
    ["plan", "--round", "final", "--out", "scripts/forge/plan-out"],
    ["plan", "--round", "final", "--out", "."],
    # predict-final.json / validation.json likewise
    ["predict", "--round", "final", "--speedup", "gemv=1.2", "--out", "scripts/forge/predict-out"],
    ["predict", "--round", "final", "--validate", "--out", "."],
    # the submission's documents, env-vars.md and the plan likewise
    ["report", "--round", "final", "--out", "scripts/forge/report-out"],
    ["report", "--out", "."],
])
def test_an_out_among_the_tools_sources_is_refused(tmp_path, args):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, "--out", "inside this checkout, outside build/ and reports/")


@pytest.mark.parametrize("util,tp1_only", [("0.1", False), ("0.842", True), ("0.844", True)])
def test_plan_gives_no_cache_size_for_a_gpu_run_where_a_dcu_card_holds_none(tmp_path, util, tp1_only):
    """At --gpu-memory-utilization 0.1 (within the round's bounds) plan told a GPU run to pass
    --kv-cache-memory-bytes 0, and at 0.842-0.844 (1-4 blocks at TP1) a size under 256 MiB: `sweep --harness`
    and `e2e-gpu` refuse both."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--round", "final", "--tier", "4-8K", "--gpu-memory-utilization", util)
    assert r.returncode == 0, r.stderr
    gpu = [x for x in r.stdout.splitlines() if x.startswith("GPU run, ")]
    none = [x for x in gpu if "holds no KV cache" in x and "--kv-cache-memory-bytes" not in x]
    sized = [int(x.split("--kv-cache-memory-bytes ")[1].split()[0]) for x in gpu if x not in none]
    assert len(gpu) == 4 and all(b >= 1 << 28 for b in sized), gpu
    assert (sorted(x.split(" at TP")[1][0] for x in none) == ["1", "1"]) if tp1_only else len(none) == 4, gpu


# --- predict: every option read, none silently dropped ---------------------------------------------------

@pytest.mark.parametrize("args,words", [
    # the final round's options (an argument group) took an empty value as omitted: every KV dtype, the
    # default concurrencies and budgets were modelled
    (["--round", "final", "--speedup", "gemv=1.2", "--kv-dtype", ""], ["--kv-dtype", "an empty value"]),
    (["--round", "final", "--speedup", "gemv=1.2", "--concurrency", ""], ["--concurrency", "an empty value"]),
    (["--round", "final", "--speedup", "gemv=1.2", "--max-num-batched-tokens", ""],
     ["--max-num-batched-tokens", "an empty value"]),
    # the finals' model priced the speed-ups and said nothing of the DCU times or the label given
    (["--round", "final", "--speedup", "gemv=1.2", "--ttft-s", "1,2,3", "--tpot-ms", "1,2,3"],
     ["--ttft-s, --tpot-ms", "not read by the final round's prediction"]),
    (["--round", "final", "--speedup", "gemv=1.2", "--label", "mine"], ["--label", "not read by the final round"]),
    # the preliminary's prediction ignored the finals' options it was given
    (["--speedup", "gemv=1.2", "--kv-dtype", "int8", "--link", "oneshot"],
     ["--kv-dtype, --link", "not read by the preliminary round's prediction", "--round final"]),
])
def test_predict_reads_every_option_it_is_given(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", *args, "--out", str(tmp_path / "out"))
    refused(r, *words)


def test_a_long_whole_number_is_out_of_bounds_not_a_fraction(tmp_path):
    """20 digits were called 'not a whole number' (the check compared it with its float, which rounds)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--round", "final", "--concurrency", "99999999999999999999")
    refused(r, "--concurrency", "99999999999999999999 is out of bounds (1..256)", RULE)


# --- the tier-environment file: the final round's, checked before it is shipped or added to ---------------

def _tier_env(path, **top) -> None:
    env = {"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2", "MAX_NUM_SEQS": "32",
           "MAX_NUM_BATCHED_TOKENS": "8192", "GPU_MEMORY_UTILIZATION": "0.9", "CONCURRENCY_8_16K": "12"}
    doc = {"round": "final", "tiers": {"8-16K": {"environment": env, "engine_options": {}, "kv_dtype": "bf16",
                                                 "run": "r-8-16K", "sweep": "s1", "tok_s": 120.5, "lift": 0.25}}}
    doc.update(top)
    for k in [k for k, v in top.items() if v is None]:
        del doc[k]
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("verb", [["report", "--out", "{tmp}/report"], ["submission", "--into", "{tmp}/sub"]])
@pytest.mark.parametrize("round_value", ["preliminary", None])
def test_a_tier_environment_file_of_another_round_is_not_shipped(tmp_path, verb, round_value):
    """Its environment went into the submission's ENVIRONMENT.md as the finals' (the 'round' key was never read)."""
    _tier_env(tmp_path / "te.json", round=round_value)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, verb[0], "--round", "final", "--tier-env", str(tmp_path / "te.json"),
                  *[a.replace("{tmp}", str(tmp_path)) for a in verb[1:]])
    refused(r, "te.json: key 'round'", "not the final round's tier environment")


SWEEP = ["sweep", "--round", "final", "--baseline-profile", "upstream", "--tiers", "4-8K", "--topologies", "tp2",
         "--kv-dtypes", "bf16", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
         "--gpu-memory-utilization", "0.95", "--concurrency", "8", "--top", "1", "--vllm", "false", "--client", "false",
         "--timeout", "1"]


@pytest.mark.parametrize("content,words", [
    ("MAX_NUM_SEQS=32\n", ["te.json: not valid JSON"]),
    ("PRELIMINARY", ["te.json: key 'round'", "'preliminary'"]),
])
def test_a_forced_sweep_reads_its_tier_environment_file_first(tmp_path, model, content, words):
    """With --force the file was read only when the winners were added to it, after every tier was served."""
    if content == "PRELIMINARY":
        _tier_env(tmp_path / "te.json", round="preliminary")
    else:
        (tmp_path / "te.json").write_text(content)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(model), "--tier-env", str(tmp_path / "te.json"), "--force", **CARDS)
    refused(r, *words)


@pytest.mark.parametrize("force,words", [
    # the refusal of a recorded winner says "--force (FORCE=1) replaces it", and FORCE=1 was not read: refused again
    ("1", ["--model", "no such folder"]),
    # FORCE=yes was read as no, where every other verb refuses it
    ("yes", ["FORCE='yes'", "1 (yes) or 0 (no)"]),
])
def test_a_sweep_reads_force_from_the_environment_as_its_refusal_says(tmp_path, force, words):
    env = {"TENSOR_PARALLEL_SIZE": "2", "DATA_PARALLEL_SIZE": "1", "MAX_NUM_SEQS": "64",
           "MAX_NUM_BATCHED_TOKENS": "4096", "GPU_MEMORY_UTILIZATION": "0.95", "CONCURRENCY_4_8K": "8"}
    (tmp_path / "te.json").write_text(json.dumps({"round": "final", "tiers": {"4-8K": {
        "environment": env, "engine_options": {}, "run": "r-4-8K", "sweep": "another"}}}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(tmp_path / "model"), "--tier-env", str(tmp_path / "te.json"),
                  FORCE=force, **CARDS)
    refused(r, *words)


@pytest.mark.parametrize("where", ["scripts/forge/tier-environment.json", "tier-environment.json"])
def test_a_sweeps_tier_environment_file_among_the_tools_sources_is_refused(tmp_path, where):
    """The winners were to be written there at the end of the sweep (the checkout's root with a bare name)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(tmp_path / "model"), "--tier-env", where, **CARDS)
    refused(r, f"--tier-env {where}", "inside this checkout, outside build/ and reports/")


# --- sweep --round final: the space's lists -------------------------------------------------------------------

@pytest.mark.parametrize("topologies", [",", "tp2,,dp2"])
def test_an_empty_topology_is_refused_as_the_other_lists_empty_items_are(tmp_path, topologies):
    """"tp2,,dp2" skipped the empty item (--max-num-seqs 16,,32 is refused); "," was refused as 'every
    --max-num-batched-tokens is below every --max-num-seqs'."""
    args = [*SWEEP]
    args[args.index("--topologies") + 1] = topologies
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--model", str(tmp_path / "model"), **CARDS)
    refused(r, f"--topologies {topologies!r}", "an empty item")         # round 17: it said "'' is not a topology"
    assert "tp2, tp2dp1" in fix_line(r), r.stderr


# --- e2e-gpu --round final: the messages say what was given and how to give it ------------------------------

@pytest.mark.parametrize("args,words,fix", [
    # "no tier named  in configs/contest.yaml": the empty name printed as nothing (then "no tier named ''";
    # since round 18 an empty item, as every list option refuses one)
    (["--tier-order", "4-8K,,8-16K"], ["--tier-order", "an empty item"], "4-8K, 8-16K, 16-32K"),
    # the fix said what the other options do, not how to write this one
    (["--capacity", "contest:bogus=4"], ["--capacity", "'bogus=4' is not one of max-num-seqs=N"],
     "e.g. --capacity contest:max-num-seqs=4"),
])
def test_e2e_gpu_final_round_messages(tmp_path, model, args, words, fix):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(model), "--round", "final", "--profiles",
                  "contest,upstream", "--out", str(tmp_path / "out"), "--vllm", "false", "--client", "false",
                  "--no-plumbing", "--no-fault", "--start-guess-s", "0", *args)
    refused(r, *words)
    assert fix in fix_line(r), r.stderr


@pytest.mark.parametrize("visible", ["", "0"])
def test_e2e_gpu_finals_servers_short_of_cards_is_refused_before_the_results_folder(tmp_path, model, visible):
    """--help says the cards are checked before anything starts; each server's start found it, after the results
    folder, its prompts and summary were written ('no server came up')."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(model), "--round", "final", "--finals-servers",
                  "--profiles", "contest,upstream", "--out", str(tmp_path / "out"), "--vllm", "false", "--client",
                  "false", "--no-plumbing", "--no-fault", "--start-guess-s", "0", CUDA_VISIBLE_DEVICES=visible)
    refused(r, "profile contest", f"TP=2/DP=1 needs 2 cards, {len(visible)} visible")


# --- regression cases: values the verbs already refuse by name ----------------------------------------------

@pytest.mark.parametrize("args,env,words", [
    (["calibrate", "--tp", "3", "--smoke", "--families", "gemv", "--out", "{tmp}/cal"], {},
     ["--tp 3", "does not divide"]),
    (["bench-all-tiers", "--round", "final", "--tiers", "16-32K", "--port", "{port}", "--model", "/m"],
     {"CONCURRENCY_16_32K": "10.0"}, ["CONCURRENCY_16_32K", "'10.0' is not a whole number"]),
    (["serve", "--round", "final", "--tier", "8-16K", "--dry-run", "--model", "/m"], {"TENSOR_PARALLEL_SIZE": "3"},
     ["TENSOR_PARALLEL_SIZE='3'", "one of 1, 2"]),
    (["plan", "--round", "final", "--gpu-memory-utilization", "0.95.1"], {}, ["--gpu-memory-utilization", "'0.95.1'"]),
])
def test_values_refused_by_name(tmp_path, args, env, words):
    args = [a.replace("{tmp}", str(tmp_path)).replace("{port}", str(free_port())) for a in args]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, **env)
    refused(r, *words)


# --- forge sweep --round final's own inputs: the model folder, the profiles, the tiers, a resumed record ------

def test_a_model_folder_without_a_config_is_refused_before_the_sweep_is_written(tmp_path):
    (tmp_path / "model").mkdir()
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(tmp_path / "model"), **CARDS)
    refused(r, "config.json")


@pytest.mark.parametrize("option", ["--baseline-profile", "--base-profile"])
def test_a_profile_that_is_not_there_is_refused_before_the_sweep_is_written(tmp_path, model, option):
    args = [*SWEEP, "--model", str(model)]
    if option in args:
        args[args.index(option) + 1] = "nonexist"
    else:
        args += [option, "nonexist"]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, **CARDS)
    refused(r, "'nonexist'")


def test_a_tiers_list_of_nothing_is_refused(tmp_path, model):
    args = [*SWEEP]
    args[args.index("--tiers") + 1] = ","
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--model", str(model), **CARDS)
    refused(r, "--tiers")


def test_a_resumed_ranking_entry_without_its_prediction_is_named(tmp_path, model):
    base = [*SWEEP, "--model", str(model), "--sweep-id", "s1", "--num-prompts", "2", "--port", str(free_port())]
    forge(tmp_path, *base, **CARDS)                  # --vllm false: ranks, then the baseline fails to start
    sj = tmp_path / "sweeps" / "s1" / "sweep.json"
    st = json.loads(sj.read_text())
    del st["tiers"]["4-8K"]["ranking"][0]["predicted"]
    sj.write_text(json.dumps(st))
    served = [*base]
    served[served.index("--vllm") + 1] = f"{sys.executable} {SUPPORT / 'fakeserver.py'}"
    served[served.index("--client") + 1] = f"{sys.executable} {SUPPORT / 'benchclient.py'}"
    r = forge(tmp_path, *served, timeout=120, FAKE_TTFT_MS="50", FAKE_TOKEN_MS="1", **CARDS)
    refused(r, "sweep.json", "predicted")


def test_two_new_sweeps_in_one_second_get_two_ids(tmp_path, monkeypatch, model):
    """A new sweep's id is one no sweep folder has: with the clock stopped, a sweep folder of that second
    already there (another sweep's), the new sweep takes the next id; before, the runs' folders alone were
    checked, so it took the other's id and was refused ("started with other ...") or resumed it."""
    import datetime as dt

    from forge.errors import ForgeError
    from forge.run import final_sweep, runs

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 12, 5, 12, 0, 0)
    monkeypatch.setattr(runs._dt, "datetime", Frozen)
    monkeypatch.setenv("FORGE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    taken = final_sweep.sweeps_root() / "20261205-120000-final-sweep"
    taken.mkdir(parents=True)
    (taken / "sweep.json").write_text(json.dumps({"sweep": taken.name, "round": "final", "top": 9, "tiers": {}}))
    with pytest.raises(ForgeError, match="the baseline server did not start"):     # --vllm false
        final_sweep.sweep_final(["4-8K"], model=str(model), top=1, baseline_profile="upstream",
                                space_args={"topologies": "tp2", "kv_dtypes": "bf16", "max_num_seqs": "64",
                                            "max_num_batched_tokens": "4096", "gpu_memory_utilization": "0.95",
                                            "concurrency": "8"},
                                tier_env=str(tmp_path / "reports" / "te.json"), vllm_cmd="false", client="false",
                                timeout=1, port=free_port())
    assert sorted(p.name for p in final_sweep.sweeps_root().iterdir()) == [taken.name, taken.name + "-2"]
    assert json.loads((taken / "sweep.json").read_text())["top"] == 9           # the other sweep's, untouched


def test_a_kv_size_too_large_is_named_so(tmp_path, model):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(model), "--harness", "--kv-cache-memory-bytes", "9" * 40, **CARDS)
    refused(r, "--kv-cache-memory-bytes", "too large a number of bytes")
