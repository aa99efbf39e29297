"""vLLM's own verdict on `vllm serve` argument lists, in the rehearsal venv: each list parsed by the
patched vLLM's make_arg_parser + FlexibleArgumentParser, validated as `vllm serve` validates it, and
turned into engine arguments; the requested fields come back per list (engine arguments first, then
the parsed namespace), or {"error": "exit N"} where the parser refused it. Shared by the tree tests of
the preliminary's and the final round's server commands."""

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SNIPPET = r"""
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
argvs, fields = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = []
for argv in argvs:
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        out.append({"error": f"exit {e.code}"})
        continue
    validate_parsed_serve_args(ns)
    ns.model = ns.model_tag
    ea = AsyncEngineArgs.from_cli_args(ns)
    got = {k: getattr(ea, k) if hasattr(ea, k) else getattr(ns, k) for k in fields}
    got["compilation_default"] = repr(ea.compilation_config) == repr(type(ea.compilation_config)())
    out.append(got)
print(json.dumps(out))
"""


def parse_serve(vllm_python, argvs: list[list[str]], fields: list[str]) -> tuple[list[dict], str]:
    """(one dict per argument list, vLLM's stderr)."""
    res = subprocess.run([str(vllm_python), "-c", SNIPPET, json.dumps(argvs), json.dumps(fields)],
                         capture_output=True, text=True, env={"VLLM_LOGGING_LEVEL": "ERROR", "PATH": "/usr/bin:/bin"},
                         timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr
