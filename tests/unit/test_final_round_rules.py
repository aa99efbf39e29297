"""The final round as data (configs/contest.yaml rounds.final, forge.contest.rounds): what it unlocks
per tier and within which bounds, what stays locked (each refusal citing a rule of `rules:`), its
client per tier, its baseline, and the cards a server of it needs; the preliminary unchanged."""

import math
import re

import pytest

from forge.contest import cards, rounds
from forge.contest import rules as contest
from forge.errors import ForgeError

TIERS = ["4-8K", "8-16K", "16-32K"]


@pytest.fixture(scope="module")
def c():
    return contest.load_contest()


@pytest.fixture(scope="module")
def final(c):
    return rounds.load_round(c, "final")


@pytest.fixture(scope="module")
def prelim(c):
    return rounds.load_round(c, "preliminary")


def cites(c, err, rule):
    """The refusal is one line, names the rule and quotes its text."""
    msg = err.value.message
    assert "\n" not in msg
    assert f"(rule '{rule}')" in msg and c["rules"][rule]["text"] in msg, msg


def arg(argv, opt):
    return argv[argv.index(opt) + 1]


# --- the data -----------------------------------------------------------------------------------

def test_the_rounds_and_the_default(c):
    assert rounds.ROUNDS == ("preliminary", "final") and rounds.DEFAULT_ROUND == "preliminary"
    assert c["rounds"]["default"] == "preliminary"
    with pytest.raises(ForgeError, match="not a round of the contest"):
        rounds.load_round(c, "semifinal")


def test_the_preliminary_is_the_organizers_script_unchanged(c, prelim):
    assert prelim.command == c["server"]["start_script"]["command"] and prelim.unlocked == ()
    assert prelim.topologies == ((1, 1),) and prelim.cards == 1
    assert prelim.baseline == rounds.Settings(1, 1, 128, 4096, 0.95, 1)
    for t in TIERS:
        cl = prelim.client(t)
        assert (cl.concurrency, cl.request_rate, cl.output_len, cl.num_prompts, cl.warmups, cl.concurrency_env) == \
            (1, 1.0, 1024, None, 2, None)
    # its view of the contest is the contest itself: every check stays as it was
    assert rounds.contest_view(c, prelim, prelim.baseline) is c
    assert rounds.start_argv(prelim, prelim.baseline, "/m") == contest.organizers_argv(c, "/m")
    assert rounds.tier_env(prelim, "4-8K", prelim.baseline) == {}


def test_the_finals_start_script_client_baseline_and_tier_order(final):
    argv = rounds.start_argv(final, final.baseline, "/m")
    assert argv[:3] == ["vllm", "serve", "/m"]
    for opt, val in [("--tensor-parallel-size", "2"), ("--data-parallel-size", "1"), ("--max-num-seqs", "128"),
                     ("--max-num-batched-tokens", "4096"), ("--gpu-memory-utilization", "0.95"),
                     ("--max-model-len", "32768"), ("--dtype", "bfloat16"), ("--port", "8001"),
                     ("--served-model-name", "Qwen3.5-27B"), ("--reasoning-parser", "qwen3"),
                     ("--tool-call-parser", "qwen3_coder")]:
        assert arg(argv, opt) == val, opt
    assert "--trust-remote-code" in argv and "--enable-auto-tool-choice" in argv
    assert final.cards == 2 and set(final.topologies) == {(2, 1), (1, 2)}
    assert final.tier_order == tuple(TIERS)
    want = {"4-8K": (80, "CONCURRENCY_4_8K"), "8-16K": (70, "CONCURRENCY_8_16K"), "16-32K": (60, "CONCURRENCY_16_32K")}
    for t, (n, var) in want.items():
        cl = final.client(t)
        assert (cl.concurrency, cl.num_prompts, cl.concurrency_env, cl.output_len, cl.warmups) == (10, n, var, 1024, 2)
        assert math.isinf(cl.request_rate)
    assert final.baseline == rounds.Settings(2, 1, 128, 4096, 0.95, 10)
    assert {u.env for u in final.unlocked} == {"TENSOR_PARALLEL_SIZE", "DATA_PARALLEL_SIZE", "MAX_NUM_SEQS",
                                               "MAX_NUM_BATCHED_TOKENS", "GPU_MEMORY_UTILIZATION"}
    assert all(u.names_ours for u in final.unlocked)          # the server side's names are ours
    assert rounds.tier_env(final, "8-16K", final.baseline) == {
        "TENSOR_PARALLEL_SIZE": "2", "DATA_PARALLEL_SIZE": "1", "MAX_NUM_SEQS": "128",
        "MAX_NUM_BATCHED_TOKENS": "4096", "GPU_MEMORY_UTILIZATION": "0.95", "CONCURRENCY_8_16K": "10"}


def test_the_final_round_rules_are_public_and_unofficial(c):
    for r in ("final_locked", "final_topology", "final_unlocked"):
        assert "public, unofficial" in c["rules"][r]["text"] and "The final round" in c["rules"][r]["text"]


# --- every unlocked option, per tier ----------------------------------------------------------

@pytest.mark.parametrize("key,env,value,shown", [
    ("tensor_parallel_size", "TENSOR_PARALLEL_SIZE", "1", "1"),
    ("max_num_seqs", "MAX_NUM_SEQS", "32", "32"),
    ("max_num_batched_tokens", "MAX_NUM_BATCHED_TOKENS", "8192", "8192"),
    ("gpu_memory_utilization", "GPU_MEMORY_UTILIZATION", "0.9", "0.9"),
])
@pytest.mark.parametrize("tier", TIERS)
def test_each_unlocked_value_is_taken_per_tier_from_the_environment(final, key, env, value, shown, tier):
    environ = {env: value}
    if key == "tensor_parallel_size":
        environ["DATA_PARALLEL_SIZE"] = "2"              # TP1 alone is no topology of the final
    s, src = rounds.tier_settings(final, tier, environ=environ)
    u = next(u for u in final.unlocked if u.key == key)
    assert arg(rounds.start_argv(final, s, "/m"), u.option) == shown and src[key] == f"env {env}"
    assert rounds.tier_env(final, tier, s)[env] == shown
    # the tier's own variable comes first, the profile after the environment, the baseline last
    other = {"4-8K": "8-16K", "8-16K": "16-32K", "16-32K": "4-8K"}[tier]
    suffix = other.replace("-", "_")
    s2, src2 = rounds.tier_settings(final, tier, environ={**environ, f"{env}_{suffix}": "999"})
    assert s2 == s
    s3, src3 = rounds.tier_settings(final, tier, profile_values={"max_num_seqs": {tier: 48}}, environ={})
    assert s3.max_num_seqs == 48 and src3["max_num_seqs"] == "profile" and src3["max_num_batched_tokens"] == "baseline"


def test_the_tiers_own_variable_wins_and_the_concurrency_is_per_tier(final):
    environ = {"MAX_NUM_SEQS": "64", "MAX_NUM_SEQS_16_32K": "16", "CONCURRENCY_16_32K": "6", "CONCURRENCY_4_8K": "12"}
    s, src = rounds.tier_settings(final, "16-32K", environ=environ)
    assert (s.max_num_seqs, s.concurrency) == (16, 6) and src["max_num_seqs"] == "env MAX_NUM_SEQS_16_32K"
    s, _ = rounds.tier_settings(final, "8-16K", environ=environ)
    assert (s.max_num_seqs, s.concurrency) == (64, 10)
    s, _ = rounds.tier_settings(final, "4-8K", environ=environ)
    assert s.concurrency == 12


def test_the_dp2_topology(final):
    s, _ = rounds.tier_settings(final, "8-16K", environ={"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2"})
    argv = rounds.start_argv(final, s, "/m")
    assert (arg(argv, "--tensor-parallel-size"), arg(argv, "--data-parallel-size")) == ("1", "2") and s.cards == 2


# --- bad values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("values,rule,words", [
    ({"tensor_parallel_size": 3}, "final_topology", "--tensor-parallel-size 3"),
    ({"data_parallel_size": 0}, "final_topology", "--data-parallel-size 0"),
    ({"tensor_parallel_size": 1}, "final_topology", "TP=1/DP=1"),
    ({"tensor_parallel_size": 2, "data_parallel_size": 2}, "final_topology", "TP=2/DP=2"),
    ({"gpu_memory_utilization": 1.2}, "final_unlocked", "--gpu-memory-utilization 1.2"),
    ({"gpu_memory_utilization": 0.05}, "final_unlocked", "--gpu-memory-utilization 0.05"),
    ({"concurrency": 0}, "final_unlocked", "concurrency 0"),
    ({"concurrency": 257}, "final_unlocked", "concurrency 257"),
    ({"max_num_seqs": 0}, "final_unlocked", "--max-num-seqs 0"),
    ({"max_num_seqs": 2048}, "final_unlocked", "--max-num-seqs 2048"),
    ({"max_num_batched_tokens": 100}, "final_unlocked", "--max-num-batched-tokens 100"),
    ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "final_unlocked", "below --max-num-seqs"),
])
def test_bad_values_are_refused_citing_the_rule(c, final, values, rule, words):
    with pytest.raises(ForgeError) as e:
        rounds.check_settings(final, values, where="here")
    assert e.value.message.startswith("here: ") and words in e.value.message
    cites(c, e, rule)


@pytest.mark.parametrize("raw", ["abc", "1.5", "", "nan", "inf", True, "1_000", " 12", "\u0661\u0662", None])
def test_a_value_that_is_not_a_whole_number_is_refused(final, raw):
    with pytest.raises(ForgeError, match="--max-num-seqs"):
        rounds.check_settings(final, {"max_num_seqs": raw})


def test_a_bad_value_in_the_environment_names_the_variable_source(final):
    with pytest.raises(ForgeError, match=r"tier 8-16K: --gpu-memory-utilization 1.2 is out of bounds"):
        rounds.tier_settings(final, "8-16K", environ={"GPU_MEMORY_UTILIZATION": "1.2"})
    with pytest.raises(ForgeError, match="concurrency 0"):
        rounds.tier_settings(final, "4-8K", environ={"CONCURRENCY_4_8K": "0"})
    with pytest.raises(ForgeError, match="not a tier of the final round"):
        rounds.tier_settings(final, "32-64K", environ={})


def test_a_pair_the_server_refuses_names_where_each_value_came_from(final):
    """--max-num-batched-tokens below --max-num-seqs: the refusal names the variables that set them,
    and the fix names the one to raise."""
    with pytest.raises(ForgeError) as e:
        rounds.tier_settings(final, "8-16K", environ={"MAX_NUM_SEQS": "1024", "MAX_NUM_BATCHED_TOKENS_8_16K": "512"})
    assert "--max-num-batched-tokens 512 (env MAX_NUM_BATCHED_TOKENS_8_16K) is below --max-num-seqs 1024 " \
           "(env MAX_NUM_SEQS)" in e.value.message
    assert "MAX_NUM_BATCHED_TOKENS_8_16K" in e.value.hint
    with pytest.raises(ForgeError) as e:
        rounds.tier_settings(final, "8-16K", {"max_num_batched_tokens": 256}, environ={"MAX_NUM_SEQS": "300"})
    assert "--max-num-batched-tokens 256 (profile) is below --max-num-seqs 300 (env MAX_NUM_SEQS)" in e.value.message


def test_the_preliminary_unlocks_nothing(c, prelim):
    for values, words in [({"tensor_parallel_size": 2}, "--tensor-parallel-size is locked at 1"),
                          ({"max_num_seqs": 64}, "--max-num-seqs is locked at 128"),
                          ({"concurrency": 2}, "concurrency is locked at 1")]:
        with pytest.raises(ForgeError) as e:
            rounds.check_settings(prelim, values)
        assert words in e.value.message
        cites(c, e, "organizers")
    # and reads no variable
    s, src = rounds.tier_settings(prelim, "4-8K", environ={"MAX_NUM_SEQS": "4", "TENSOR_PARALLEL_SIZE": "2"})
    assert s == prelim.baseline and set(src.values()) == {"baseline"}


# --- the cards ----------------------------------------------------------------------------------

@pytest.mark.parametrize("environ,need_ok", [
    ({"HIP_VISIBLE_DEVICES": "0,1"}, True),
    ({"CUDA_VISIBLE_DEVICES": "2,3,4"}, True),
    ({"HIP_VISIBLE_DEVICES": "0"}, False),
    ({"CUDA_VISIBLE_DEVICES": ""}, False),
    ({"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0"}, False),   # the narrower list counts
    # a negative index hides itself and every device after it (CUDA's rule; torch parses the list so)
    ({"CUDA_VISIBLE_DEVICES": "-1"}, False),
    ({"HIP_VISIBLE_DEVICES": "0,-1,1"}, False),
    ({"CUDA_VISIBLE_DEVICES": "0,1,-1"}, True),
])
def test_a_topology_needing_more_cards_than_visible_is_refused(c, final, environ, need_ok):
    v = rounds.visible_cards(environ, torch_count=lambda: 8)
    for topo in ({}, {"tensor_parallel_size": 1, "data_parallel_size": 2}):
        if need_ok:
            rounds.check_settings(final, topo, visible=v)
        else:
            with pytest.raises(ForgeError, match=r"needs 2 cards, [01] visible") as e:
                rounds.check_settings(final, topo, visible=v)
            cites(c, e, "final_topology")


def test_two_ranks_on_one_device_are_refused(c, final):
    v = rounds.visible_cards({"HIP_VISIBLE_DEVICES": "0,0"})
    with pytest.raises(ForgeError, match=r"TP=1/DP=2 would put two ranks on device 0") as e:
        rounds.check_settings(final, {"tensor_parallel_size": 1, "data_parallel_size": 2}, visible=v)
    cites(c, e, "final_topology")


def test_without_a_device_variable_torch_counts_else_the_start_is_refused(final):
    assert rounds.visible_cards({}, torch_count=lambda: 2).count == 2
    rounds.check_settings(final, {}, visible=rounds.visible_cards({}, torch_count=lambda: 2))
    with pytest.raises(ForgeError, match="needs 2 cards, 1 visible"):
        rounds.check_settings(final, {}, visible=rounds.visible_cards({}, torch_count=lambda: 1))

    def broken():
        raise RuntimeError("no driver")
    v = rounds.visible_cards({}, torch_count=broken)
    assert v.count is None
    with pytest.raises(ForgeError, match="cannot tell how many cards are visible") as e:
        rounds.check_settings(final, {}, visible=v)
    assert "HIP_VISIBLE_DEVICES" in e.value.hint
    assert cards.DEVICE_VARS == ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


# --- the round's data, checked on load -----------------------------------------------------------

@pytest.mark.parametrize("edit,words", [
    (lambda f: f["unlocked"][0].update(rule="nope"), "rounds.final.unlocked[0].rule': unknown rule 'nope'"),
    (lambda f: f["start_script"].update(command=f["start_script"]["command"].replace("$MAX_NUM_SEQS", "128")),
     "the start script does not give --max-num-seqs $MAX_NUM_SEQS"),
    (lambda f: f.update(topologies=[[2, 2]]), "rounds.final.topologies[0]"),
    (lambda f: f["client"]["tiers"].pop("8-16K"), "need exactly the tiers"),
    (lambda f: f["baseline"].update(tensor_parallel_size=3), "rounds.final.baseline"),
    (lambda f: f["client"].update(request_rate="fast"), "request_rate"),
    (lambda f: f.update(extra=1), "unknown key 'rounds.final.extra'"),
])
def test_a_mistake_in_the_rounds_data_names_its_key(c, edit, words):
    import copy
    bad = copy.deepcopy(c)
    edit(bad["rounds"]["final"])
    with pytest.raises(ForgeError, match=re.escape(words)):
        rounds.load_round(bad, "final")


def test_a_contest_without_the_final_round_says_so(c):
    bad = {**c, "rounds": {}}
    with pytest.raises(ForgeError, match=re.escape("key 'rounds.final' is missing")):
        rounds.load_round(bad, "final")
    assert rounds.load_round(bad, "preliminary").name == "preliminary"
