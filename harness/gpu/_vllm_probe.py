"""What the CPU cost probes (detok_cost.py, parser_cost.py) share: the refusal when the Python running them
lacks the patched vLLM, and the record of what they ran on and the writing of their figures as JSON.
Not a script: they import it from this folder (the folder of the script being run is on sys.path)."""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

NO_VLLM = ("run it with a Python that has the patched vLLM installed "
           "(build/rehearsal/venv/bin/python after `make rehearsal`)")


def no_vllm(script: str, e: ImportError) -> int:
    """Say that this Python cannot import what `script` needs of vLLM; the exit code (2)."""
    print(f"{script}: {e}; {NO_VLLM}", file=sys.stderr)
    return 2


def ran_on(vllm_version: str) -> dict:
    """The versions, the CPU and the command line of this run, for its JSON."""
    return {"versions": {"python": platform.python_version(), "vllm": vllm_version},
            "cpu": platform.processor() or platform.machine(), "command": " ".join(sys.argv)}


def write_json(out: Path | None, res: dict) -> None:
    """Write `res` to `out` as JSON, when --out was given."""
    if out:
        out.write_text(json.dumps(res, indent=1) + "\n")
