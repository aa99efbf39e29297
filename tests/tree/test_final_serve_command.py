"""The final round's server commands (profiles final-tp2 and final-dp2, every tier, and one with the
capacity values changed through the environment) are accepted by the patched vLLM's own `vllm serve`
argument parser and land on the values the round gives them: the topology, the capacity options,
--max-model-len 32768 and, for DP2, vLLM's data-parallel front end with the mp backend."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "tree" / "helpers"))

from serve_parse import parse_serve  # noqa: E402

from forge.contest import profiles, rounds  # noqa: E402
from forge.contest import rules as contest  # noqa: E402

FIELDS = ["tensor_parallel_size", "data_parallel_size", "data_parallel_backend", "max_num_seqs",
          "max_num_batched_tokens", "gpu_memory_utilization", "max_model_len", "dtype", "port",
          "data_parallel_external_lb", "data_parallel_hybrid_lb"]

ENV = {"MAX_NUM_SEQS_16_32K": "24", "MAX_NUM_BATCHED_TOKENS": "8192", "GPU_MEMORY_UTILIZATION": "0.9"}
CASES = [(name, tier, {}) for name in ("final-tp2", "final-dp2") for tier in ("4-8K", "8-16K", "16-32K")] + \
    [("final-dp2", "16-32K", ENV)]


def rendered(name, tier, environ):
    c = contest.load_contest()
    rnd = rounds.load_round(c, "final")
    return profiles.render_round(profiles.load_profile(name, c, rnd=rnd), "/models/Qwen3.5-27B", c, rnd, tier,
                                 environ=environ)


@pytest.fixture(scope="module")
def parsed(vllm_python):
    argvs = [rendered(*case)["argv"][2:] for case in CASES] + [["/m", "--data-parallel-size", "two"]]
    return parse_serve(vllm_python, argvs, FIELDS)[0]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{n}-{t}{'-env' if e else ''}" for n, t, e in CASES])
def test_the_final_commands_parse_in_patched_vllm(parsed, i):
    got, r = parsed[i], rendered(*CASES[i])
    assert "error" not in got, f"vLLM rejected {r['argv']}"
    s = r["settings"]
    assert (got["tensor_parallel_size"], got["data_parallel_size"]) == (s["tensor_parallel_size"], s["data_parallel_size"])
    assert (got["max_num_seqs"], got["max_num_batched_tokens"], got["gpu_memory_utilization"]) == \
        (s["max_num_seqs"], s["max_num_batched_tokens"], s["gpu_memory_utilization"])
    assert got["max_model_len"] == 32768 and got["dtype"] == "bfloat16" and got["port"] == 8001
    # DP2: vLLM's own front end, one local process per rank, its internal load balancer
    assert got["data_parallel_backend"] == "mp"
    assert got["data_parallel_external_lb"] is False and got["data_parallel_hybrid_lb"] is False


def test_the_parser_check_can_fail(parsed):
    assert "error" in parsed[-1]
