"""`forge serve --round final --tier T` (make serve ROUND=final TIER=T PROFILE=...): the finals' start
script with the tier's values, the final profiles (TP2, DP2 on vLLM's own data-parallel front end),
every locked option refused citing its rule, a profile's unlocked option only in the round that unlocks
it, the cards checked before anything runs, and the KV cache each data-parallel rank reported recorded
in the run (unequal caches flagged). The preliminary's behaviour is unchanged."""

import json
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import SUPPORT, forge, forge_env, free_port, tiny_model  # noqa: E402

from forge.contest import profiles, rounds  # noqa: E402
from forge.contest import rules as contest  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.run import serve, serverlog  # noqa: E402

TIERS = ["4-8K", "8-16K", "16-32K"]
ROUND_VARS = ("ROUND", "TIER", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
              "TENSOR_PARALLEL_SIZE", "DATA_PARALLEL_SIZE", "MAX_NUM_SEQS", "MAX_NUM_BATCHED_TOKENS",
              "GPU_MEMORY_UTILIZATION", "CONCURRENCY_4_8K", "CONCURRENCY_8_16K", "CONCURRENCY_16_32K")


@pytest.fixture(scope="module")
def c():
    return contest.load_contest()


@pytest.fixture(scope="module")
def final(c):
    return rounds.load_round(c, "final")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def write(tmp_path, text, name="p.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def clean_env(tmp_path, **extra):
    env = forge_env(tmp_path)
    for k in list(env):
        if k in ROUND_VARS or any(k.startswith(v + "_") for v in ROUND_VARS[5:10]):
            env.pop(k)
    env.update(extra)
    return env


def arg(argv, opt):
    return argv[argv.index(opt) + 1]


# --- the profiles -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,tp,dp", [("final-tp2", "2", "1"), ("final-dp2", "1", "2")])
@pytest.mark.parametrize("tier", TIERS)
def test_the_final_profiles_render_the_finals_script_per_tier(c, final, name, tp, dp, tier):
    prof = profiles.load_profile(name, c, rnd=final)
    assert prof["chain"][-2:] == ["contest", name] and prof["round"] == "final"
    r = profiles.render_round(prof, "/m", c, final, tier, environ={})
    s = rounds.Settings(**r["settings"])
    n = len(rounds.start_argv(final, s, "/m"))
    assert r["argv"][:n] == rounds.start_argv(final, s, "/m")
    assert (arg(r["argv"], "--tensor-parallel-size"), arg(r["argv"], "--data-parallel-size")) == (tp, dp)
    assert arg(r["argv"], "--max-model-len") == "32768"
    extra = r["argv"][n:]
    assert extra == (["--data-parallel-backend", "mp"] if dp == "2" else [])
    assert r["tier_env"][f"CONCURRENCY_{tier.replace('-', '_')}"] == "10"
    assert {k: v["value"] for k, v in prof["env"].items()}.items() <= r["env"].items()


def test_the_final_profiles_are_listed_for_their_round_only():
    assert {"final-tp2", "final-dp2"} <= set(profiles.profile_names("final"))
    assert not {"final-tp2", "final-dp2"} & set(profiles.profile_names())
    assert {"final-tp2", "contest"} <= set(profiles.profile_names(None))


def test_a_final_profile_in_the_preliminary_is_refused(c):
    with pytest.raises(ForgeError, match="profile final-tp2 is for the final round") as e:
        profiles.load_profile("final-tp2", c)
    assert "--round final" in e.value.hint


@pytest.mark.parametrize("option,value", [("--tensor-parallel-size", 2), ("--data-parallel-size", 2),
                                          ("--max-num-seqs", 64), ("--max-num-batched-tokens", 8192),
                                          ("--gpu-memory-utilization", 0.9)])
def test_the_preliminary_still_refuses_what_the_final_unlocks(tmp_path, c, final, option, value):
    text = f"description: x\noptions:\n  {option}:\n    value: {value}\n    effect: e\n"
    p = write(tmp_path, text)
    with pytest.raises(ForgeError) as e:
        profiles.load_profile(str(p), c)
    # as before the final round existed: set by the organizers (citing the rule), or not reviewed
    assert option in e.value.message
    assert ("rule 'organizers'" in e.value.message) != (option == "--data-parallel-size")
    assert ("has not been reviewed" in e.value.message) == (option == "--data-parallel-size")
    # the same profile, declared for the final round, loads there and sets the value
    q = write(tmp_path, "round: final\n" + text, "q.yaml")
    prof = profiles.load_profile(str(q), c, rnd=final)
    environ = {"TENSOR_PARALLEL_SIZE": "1"} if option == "--data-parallel-size" else {}   # DP2 needs TP1
    r = profiles.render_round(prof, "/m", c, final, "8-16K", environ=environ)
    assert arg(r["argv"], option) == str(value) and r["argv"].count(option) == 1


@pytest.mark.parametrize("option,value,rule", [
    ("--max-model-len", "65536", "final_locked"),
    ("--port", "8002", "final_locked"),
    ("--served-model-name", "x", "final_locked"),
    ("--dtype", "float16", "final_locked"),
    ("--trust-remote-code", True, "final_locked"),
    ("--reasoning-parser", "none", "final_locked"),
    ("--default-chat-template-kwargs", '{"enable_thinking": true}', "final_locked"),
    ("--speculative-config", '{"method": "mtp"}', "spec_decode"),
    ("--quantization", "fp8", "weight_quant"),
    ("--scheduling-policy", "priority", "scheduler"),
    ("--max-num-partial-prefills", "2", "scheduler"),
    ("--hf-overrides", "{}", "model_integrity"),
    ("--generation-config", "vllm", "sampling"),
    ("--host", "0.0.0.0", "interface"),
    ("--data-parallel-backend", "ray", "final_topology"),
])
def test_every_locked_option_is_refused_in_the_final_citing_its_rule(tmp_path, c, final, option, value, rule):
    v = "true" if value is True else json.dumps(value)
    p = write(tmp_path, f"round: final\ndescription: x\noptions:\n  {option}:\n    value: {v}\n    effect: e\n")
    with pytest.raises(ForgeError) as e:
        profiles.load_profile(str(p), c, rnd=final)
    assert option in e.value.message and f"(rule '{rule}')" in e.value.message
    assert c["rules"][rule]["text"] in e.value.message


def test_an_unreviewed_option_is_refused_in_the_final_too(tmp_path, c, final):
    p = write(tmp_path, "round: final\ndescription: x\noptions:\n  --pipeline-parallel-size:\n    value: 2\n    effect: e\n")
    with pytest.raises(ForgeError, match="has not been reviewed"):
        profiles.load_profile(str(p), c, rnd=final)


@pytest.mark.parametrize("body,words", [
    ("options:\n  --tensor-parallel-size:\n    value: 3\n    effect: e\n", "--tensor-parallel-size 3 is not allowed"),
    ("options:\n  --gpu-memory-utilization:\n    value: 1.2\n    effect: e\n", "--gpu-memory-utilization 1.2 is out of bounds"),
    ("options:\n  --max-num-seqs:\n    value: {8-16K: 0}\n    effect: e\n", "value.8-16K: --max-num-seqs 0 is out of bounds"),
    ("options:\n  --max-num-seqs:\n    value: {9-17K: 8}\n    effect: e\n", "'9-17K' is not a tier of the final round"),
    ("env:\n  CONCURRENCY_8_16K:\n    value: '0'\n    effect: e\n", "concurrency 0 is out of bounds"),
    ("env:\n  MAX_NUM_SEQS:\n    value: '64'\n    effect: e\n", "a profile sets --max-num-seqs under options"),
    ("env:\n  DATA_PARALLEL_SIZE_4_8K:\n    value: '2'\n    effect: e\n", "a profile sets --data-parallel-size under options"),
])
def test_a_bad_final_profile_is_refused_on_load(tmp_path, c, final, body, words):
    p = write(tmp_path, "round: final\ndescription: x\n" + body)
    with pytest.raises(ForgeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        profiles.load_profile(str(p), c, rnd=final)


def test_per_tier_profile_values_and_concurrency(tmp_path, c, final):
    p = write(tmp_path, "round: final\ndescription: x\nextends: final-dp2\noptions:\n  --max-num-seqs:\n"
                        "    value: {4-8K: 64, 16-32K: 12}\n    effect: e\nenv:\n  CONCURRENCY_16_32K:\n"
                        "    value: '8'\n    effect: e\n")
    prof = profiles.load_profile(str(p), c, rnd=final)
    got = {t: profiles.render_round(prof, "/m", c, final, t, environ={})["settings"] for t in TIERS}
    assert [got[t]["max_num_seqs"] for t in TIERS] == [64, 128, 12]
    assert [got[t]["concurrency"] for t in TIERS] == [10, 10, 8]
    assert all(got[t]["data_parallel_size"] == 2 for t in TIERS)


def test_a_concurrency_variable_in_a_preliminary_profile_is_refused(tmp_path, c):
    p = write(tmp_path, "description: x\nenv:\n  CONCURRENCY_4_8K:\n    value: '8'\n    effect: e\n")
    with pytest.raises(ForgeError, match=r"concurrency is locked at 1 in the preliminary round .*rule 'organizers'"):
        profiles.load_profile(str(p), c)


def test_the_final_needs_a_tier(c, final):
    prof = profiles.load_profile("final-tp2", c, rnd=final)
    with pytest.raises(ForgeError, match="one server per tier: no tier given"):
        profiles.render_round(prof, "/m", c, final, None, environ={})
    with pytest.raises(ForgeError, match="not a tier of the final round"):
        profiles.render_round(prof, "/m", c, final, "1-2K", environ={})


def test_the_preliminary_render_is_unchanged(c):
    prelim = rounds.load_round(c, "preliminary")
    for name in profiles.profile_names():
        prof = profiles.load_profile(name, c)
        assert profiles.load_profile(name, c, rnd=prelim) == prof and "round" not in prof
        assert profiles.render_round(prof, "/m", c, prelim, "8-16K") == profiles.render(prof, "/m", c)
        assert serve.render(prof, Path("/m"), c, prelim, None) == profiles.render(prof, "/m", c)


# --- the cards, before anything runs -------------------------------------------------------------

@pytest.mark.parametrize("devices,words", [("0", "needs 2 cards, 1 visible"),
                                           ("0,0", "would put two ranks on device 0")])
def test_serve_refuses_a_start_the_cards_cannot_hold_before_anything_runs(tmp_path, model, devices, words):
    env = clean_env(tmp_path, HIP_VISIBLE_DEVICES=devices)
    r = forge(tmp_path, "serve", "--round", "final", "--tier", "8-16K", "--profile", "final-dp2", "--model", str(model),
              "--vllm", "false", "--port", str(free_port()), env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert words in r.stderr and "rule 'final_topology'" in r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "build" / "serve").exists()


def test_make_serve_round_final_takes_the_environment(tmp_path, model):
    env = clean_env(tmp_path, HIP_VISIBLE_DEVICES="0,1", MAX_NUM_SEQS_16_32K="24", GPU_MEMORY_UTILIZATION="0.9")
    r = forge(tmp_path, "serve", "--round", "final", "--tier", "16-32K", "--profile", "final-tp2", "--model",
              str(model), "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if " vllm serve " in l)
    argv = shlex.split(line.split(" vllm serve ", 1)[1])
    assert (arg(argv, "--max-num-seqs"), arg(argv, "--gpu-memory-utilization"), arg(argv, "--tensor-parallel-size")) == \
        ("24", "0.9", "2")
    assert "cards visible here: 2" in r.stdout
    # ROUND and TIER from the environment, as make passes them
    r = forge(tmp_path, "serve", "--profile", "final-tp2", "--model", str(model), "--dry-run",
              env={**env, "ROUND": "final", "TIER": "4-8K"})
    assert r.returncode == 0 and "the final round, tier 4-8K" in r.stdout, r.stderr
    r = forge(tmp_path, "serve", "--profile", "final-tp2", "--model", str(model), "--dry-run",
              env={**env, "ROUND": "final"})
    assert r.returncode == 2 and "no tier given" in r.stderr


# --- the KV cache each rank reported --------------------------------------------------------------

LOG_DP2_UNEQUAL = """\
(APIServer pid=100) INFO 12-04 17:00:00 [api_server.py:1] vLLM API server version 0.18.1
(EngineCore_DP0 pid=101) INFO 12-04 17:00:40 [kv_cache_utils.py:1318] GPU KV cache size: 28,224 tokens
(EngineCore_DP0 pid=101) INFO 12-04 17:00:40 [kv_cache_utils.py:1324] Maximum concurrency for 32,768 tokens per request: 3.45x
\x1b[36m(EngineCore_DP1 pid=102)\x1b[0m INFO 12-04 17:00:41 [kv_cache_utils.py:1318] GPU KV cache size: 24,304 tokens
"""
LOG_DP2_EQUAL = LOG_DP2_UNEQUAL.replace("24,304", "28,224")
LOG_TP2 = "(EngineCore pid=7) INFO 12-04 17:00:40 [kv_cache_utils.py:1318] GPU KV cache size: 268,128 tokens\n"


def test_the_kv_cache_per_rank_is_read_from_the_log():
    assert serverlog.kv_cache_sizes(LOG_DP2_UNEQUAL) == {0: 28224, 1: 24304}
    assert serverlog.kv_cache_sizes(LOG_TP2) == {0: 268128}
    assert serverlog.kv_cache_sizes("INFO GPU KV cache size: 1,000 tokens\nINFO GPU KV cache size: 2,000 tokens\n") == {0: 2000}
    assert serverlog.kv_cache_sizes("no such line") == {}


def test_unequal_kv_caches_of_dp_ranks_are_flagged():
    r = serverlog.kv_cache_report(LOG_DP2_UNEQUAL, 2)
    assert r["tokens"] == {"0": 28224, "1": 24304} and r["equal"] is False
    assert "unequal KV caches" in r["flag"] and "DP0 28,224" in r["flag"] and "DP1 24,304" in r["flag"]
    assert serverlog.kv_cache_report(LOG_DP2_EQUAL, 2) == {"tokens": {"0": 28224, "1": 28224}, "equal": True, "flag": None}
    assert serverlog.kv_cache_report(LOG_TP2, 1)["flag"] is None
    assert "1 of 2 data-parallel ranks" in serverlog.kv_cache_report(LOG_TP2, 2)["flag"]


@pytest.mark.parametrize("log,flagged", [(LOG_DP2_UNEQUAL, True), (LOG_DP2_EQUAL, False)])
def test_a_dp2_start_records_its_ranks_kv_caches(tmp_path, model, log, flagged):
    """A DP2 server (the fake server behind a launcher that first prints the ranks' log lines) started
    by `forge serve --round final`: serve.json carries the round, tier, settings and the KV report."""
    (tmp_path / "log.txt").write_text(log)
    launcher = tmp_path / "launch.sh"
    launcher.write_text(f'#!/bin/sh\ncat {tmp_path / "log.txt"}\nexec {sys.executable} {SUPPORT / "fakeserver.py"} "$@"\n')
    env = clean_env(tmp_path, HIP_VISIBLE_DEVICES="0,1")
    port = free_port()
    r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", "final-dp2", "--model", str(model),
              "--vllm", f"sh {launcher}", "--port", str(port), "--run-id", "dp2", "--timeout", "30", env=env)
    try:
        assert r.returncode == 0, r.stderr
        rec = json.loads((tmp_path / "runs" / "dp2" / "serve.json").read_text())
        assert rec["round"] == "final" and rec["tier"] == "4-8K"
        assert rec["settings"]["data_parallel_size"] == 2 and rec["tier_env"]["CONCURRENCY_4_8K"] == "10"
        assert rec["kv_cache"]["tokens"] == ({"0": 28224, "1": 24304} if flagged else {"0": 28224, "1": 28224})
        assert (rec["kv_cache"]["flag"] is not None) is flagged
        assert ("unequal KV caches" in r.stderr) is flagged
    finally:
        forge(tmp_path, "stop", env=env)


def test_serve_with_no_round_stays_the_preliminary(tmp_path, model):
    env = clean_env(tmp_path)
    r = forge(tmp_path, "serve", "--profile", "contest", "--model", str(model), "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    assert "the final round" not in r.stdout and "--tensor-parallel-size 1" in r.stdout and "--max-model-len" not in r.stdout
    assert "variables" not in r.stderr


def test_a_preliminary_serve_says_the_final_rounds_variables_it_does_not_read(tmp_path, model):
    # a team that exported its per-tier environment and forgot --round final would otherwise serve the
    # preliminary's command thinking its values were taken
    env = clean_env(tmp_path, MAX_NUM_SEQS_16_32K="4", TENSOR_PARALLEL_SIZE="2", CONCURRENCY_8_16K="6", MAX_NUM_SEQS="")
    r = forge(tmp_path, "serve", "--profile", "contest", "--model", str(model), "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    assert "CONCURRENCY_8_16K, MAX_NUM_SEQS_16_32K, TENSOR_PARALLEL_SIZE set: the final round's variables" in r.stderr
    assert "--max-num-seqs 4" not in r.stdout
    r = forge(tmp_path, "serve", "--round", "final", "--tier", "16-32K", "--profile", "final-tp2", "--model",
              str(model), "--dry-run", env={**env, "HIP_VISIBLE_DEVICES": "0,1"})
    assert r.returncode == 0 and "variables" not in r.stderr, r.stderr


def test_the_all_reduce_backend_switch_is_reviewed_for_the_final_only(tmp_path, c, final):
    body = "description: x\noptions:\n  --disable-custom-all-reduce:\n    value: true\n    effect: e\n"
    prof = profiles.load_profile(str(write(tmp_path, "round: final\n" + body)), c, rnd=final)
    r = profiles.render_round(prof, "/m", c, final, "4-8K", environ={})
    assert r["argv"][-1] == "--disable-custom-all-reduce"
    with pytest.raises(ForgeError, match="has not been reviewed"):
        profiles.load_profile(str(write(tmp_path, body, "prelim.yaml")), c)
