"""A long-lived `vllm bench serve`: imports vLLM's benchmark client once, then runs one client
invocation per request line, each exactly as `vllm bench serve <argv>` would (vLLM's own argument
parser and `main`), with its output in that invocation's log file.

Used by `forge e2e-gpu`, where importing vLLM takes about 20 s per process on the GPU machine and a
tier's request takes about 25 s: a fresh client per tier would spend most of the run importing.

Protocol: one JSON request per line on stdin, {"argv": ["bench", "serve", ...], "log": PATH}; replies
on stdout as lines starting with MARKER, then {"rc": 0} or {"rc": 1, "error": "..."} ({"ready": true}
once vLLM's client is imported). Other stdout lines (a logger bound to the original stdout) are
not replies.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback

MARKER = "@@forge-bench-worker@@ "


def main() -> int:
    # vLLM: heavy (about 20 s) and only in the venv this worker runs in
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = sys.stdout
    out.write(MARKER + json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        argv = req["argv"]
        reply: dict = {"rc": 0}
        with open(req["log"], "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            print("$ vllm " + " ".join(argv) + "   (forge bench worker: one process for all tiers)", flush=True)
            try:
                if argv[:2] != ["bench", "serve"]:
                    raise SystemExit(f"the bench worker runs `bench serve` only, not {argv[:2]}")
                parser = FlexibleArgumentParser(prog="vllm bench serve")
                add_cli_args(parser)
                bench_main(parser.parse_args(argv[2:]))
            except SystemExit as e:                     # argparse errors and explicit exits
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                reply = {"rc": code} if code == 0 else {"rc": code, "error": str(e.code)}
            except BaseException as e:                  # the client failed: report, stay alive
                traceback.print_exc()
                reply = {"rc": 1, "error": f"{type(e).__name__}: {e}"}
                if isinstance(e, KeyboardInterrupt):
                    out.write(MARKER + json.dumps(reply) + "\n")
                    out.flush()
                    raise
        out.write(MARKER + json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
