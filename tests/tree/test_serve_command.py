"""Every shipped profile's rendered server command is accepted by the patched vLLM's own `vllm serve`
argument parser (make_arg_parser + FlexibleArgumentParser, then vLLM's own validation and engine
arguments), and lands on the values of the organizers' start script."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "tree" / "helpers"))

from serve_parse import parse_serve  # noqa: E402

from forge.contest import profiles  # noqa: E402
from forge.contest import rules as contest  # noqa: E402

FIELDS = ["model", "port", "host", "max_model_len", "served_model_name", "kv_cache_dtype", "max_num_seqs",
          "max_num_batched_tokens", "speculative_config", "quantization", "dtype", "tensor_parallel_size",
          "gpu_memory_utilization", "trust_remote_code", "reasoning_parser", "enable_auto_tool_choice",
          "tool_call_parser", "default_chat_template_kwargs"]


NAMES = profiles.profile_names()
BOGUS = ["/models/q", "--port", "8001", "--kv-cache-dtype", "int4-nonsense"]


def rendered(name):
    c = contest.load_contest()
    prof = profiles.load_profile(name, c)
    return prof, profiles.render(prof, "/models/Qwen3.5-27B", c)


@pytest.fixture(scope="module")
def parsed(vllm_python):
    """vLLM's verdict on every profile's command (and on one bogus command), in one interpreter."""
    argvs = [rendered(n)[1]["argv"][2:] for n in NAMES] + [BOGUS]
    out, stderr = parse_serve(vllm_python, argvs, FIELDS)
    return dict(zip(NAMES + ["<bogus>"], out)), stderr


@pytest.mark.parametrize("name", NAMES)
def test_profile_command_parses_in_patched_vllm(parsed, name):
    prof, r = rendered(name)
    assert r["argv"][:2] == ["vllm", "serve"]
    got = parsed[0][name]
    assert "error" not in got, f"vLLM rejected the {name} command {r['argv']}:\n{parsed[1][-3000:]}"
    assert got["model"] == "/models/Qwen3.5-27B"
    assert got["port"] == 8001 and got["host"] is None
    assert got["served_model_name"] in (["Qwen3.5-27B"], "Qwen3.5-27B")
    # the organizers' start script: its scheduler limits, memory share, parsers and template switch;
    # max-model-len and the compilation config stay vLLM's defaults (the script sets neither)
    assert got["max_model_len"] is None and got["compilation_default"] is True
    assert got["max_num_seqs"] == 128 and got["max_num_batched_tokens"] == 4096
    assert got["gpu_memory_utilization"] == 0.95 and got["tensor_parallel_size"] == 1
    assert got["dtype"] == "bfloat16" and got["trust_remote_code"] is True
    assert got["reasoning_parser"] == "qwen3" and got["enable_auto_tool_choice"] is True
    assert got["tool_call_parser"] == "qwen3_coder"
    assert got["default_chat_template_kwargs"] == {"enable_thinking": False}
    # speculative decoding and weight quantization stay at vLLM's defaults
    assert got["speculative_config"] is None and got["quantization"] is None
    want_kv = prof["options"].get("--kv-cache-dtype", {}).get("value", "auto")
    assert got["kv_cache_dtype"] == want_kv


def test_parser_check_can_fail(parsed):
    """The same check rejects what vLLM does not know, so a passing profile means something."""
    assert "error" in parsed[0]["<bogus>"] and "int4-nonsense" in parsed[1]
