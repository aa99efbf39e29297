"""Every shipped profile's rendered server command is accepted by the patched vLLM's own `vllm serve`
argument parser (make_arg_parser + FlexibleArgumentParser, then vLLM's own validation and engine
arguments), and lands on the locked values."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge.run import contest, profiles  # noqa: E402

PARSE = r"""
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.argv[1]):
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        out.append({"error": f"exit {e.code}"})
        continue
    validate_parsed_serve_args(ns)
    ns.model = ns.model_tag
    ea = AsyncEngineArgs.from_cli_args(ns)
    out.append({"model": ea.model, "port": ns.port, "host": ns.host, "max_model_len": ea.max_model_len,
                "served_model_name": ea.served_model_name, "kv_cache_dtype": ea.kv_cache_dtype,
                "max_num_seqs": ea.max_num_seqs, "max_num_batched_tokens": ea.max_num_batched_tokens,
                "speculative_config": ea.speculative_config, "quantization": ea.quantization})
print(json.dumps(out))
"""


NAMES = profiles.profile_names()
BOGUS = ["/models/q", "--port", "8001", "--kv-cache-dtype", "int4-nonsense"]


def rendered(name):
    c = contest.load_contest()
    prof = profiles.load_profile(name, c)
    return prof, profiles.render(prof, "/models/Qwen3.5-27B", c)


@pytest.fixture(scope="module")
def parsed(vllm_python):
    """vLLM's verdict on every profile's command (and on one bogus command), in one interpreter."""
    import subprocess
    argvs = [rendered(n)[1]["argv"][2:] for n in NAMES] + [BOGUS]
    env = {"VLLM_LOGGING_LEVEL": "ERROR", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([str(vllm_python), "-c", PARSE, json.dumps(argvs)], capture_output=True, text=True,
                         env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return dict(zip(NAMES + ["<bogus>"], out)), res.stderr


@pytest.mark.parametrize("name", NAMES)
def test_profile_command_parses_in_patched_vllm(parsed, name):
    prof, r = rendered(name)
    assert r["argv"][:2] == ["vllm", "serve"]
    got = parsed[0][name]
    assert "error" not in got, f"vLLM rejected the {name} command {r['argv']}:\n{parsed[1][-3000:]}"
    assert got["model"] == "/models/Qwen3.5-27B"
    assert got["port"] == 8001 and got["host"] is None
    assert got["max_model_len"] == 32768
    assert got["served_model_name"] in (["Qwen3.5-27B"], "Qwen3.5-27B")
    # the scheduler, speculative decoding and weight quantization stay at vLLM's defaults
    assert got["max_num_seqs"] is None and got["max_num_batched_tokens"] is None
    assert got["speculative_config"] is None and got["quantization"] is None
    want_kv = prof["options"].get("--kv-cache-dtype", {}).get("value", "auto")
    assert got["kv_cache_dtype"] == want_kv


def test_parser_check_can_fail(parsed):
    """The same check rejects what vLLM does not know, so a passing profile means something."""
    assert "error" in parsed[0]["<bogus>"] and "int4-nonsense" in parsed[1]
