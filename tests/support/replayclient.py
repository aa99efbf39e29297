"""A test double for `vllm bench serve` used only to exercise forge's tier loop (resume, kill,
failure paths) quickly: it replays a real result file recorded by vLLM's client (tests/data/runs/)
for the tier named by --dataset-path. The real client is exercised in tests/tree/.

Environment: REPLAY_FROM (run folder with <tier>.json; REPLAY_FROM_<port> for a server on that
port), REPLAY_LOG (append one line per call),
REPLAY_HANG_TIER (sleep on that tier, REPLAY_HANG_S seconds, default 60, to be interrupted),
REPLAY_FAIL (exit 1, no file), REPLAY_KILL_PORT (on that port's server, started with FAKE_EXIT_ROUTE: end
the server through GET /fake/exit, then exit 1 with no file, as the client of a server that died mid-tier)."""

import json
import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path


def opt(argv, name):
    return argv[argv.index(name) + 1]


def main(argv):
    assert argv[:2] == ["bench", "serve"], argv
    tier = Path(opt(argv, "--dataset-path")).stem.replace("_throughput", "")
    with open(os.environ["REPLAY_LOG"], "a") as f:
        f.write(json.dumps({"tier": tier, "argv": argv}) + "\n")
    if os.environ.get("REPLAY_HANG_TIER") == tier:
        for _ in range(int(10 * float(os.environ.get("REPLAY_HANG_S", "60")))):
            time.sleep(0.1)
    port = opt(argv, "--port")
    if os.environ.get("REPLAY_KILL_PORT") == port:
        try:
            urllib.request.urlopen(f"http://{opt(argv, '--host')}:{port}/fake/exit", timeout=5)
        except OSError:
            pass                                   # the server is gone before it answers
        for _ in range(50):                        # until it no longer answers /health
            try:
                urllib.request.urlopen(f"http://{opt(argv, '--host')}:{port}/health", timeout=1)
            except OSError:
                break
            time.sleep(0.1)
        print("replay: the server went away mid-tier", file=sys.stderr)
        return 1
    if os.environ.get("REPLAY_FAIL"):
        print("replay: failing as told", file=sys.stderr)
        return 1
    out = Path(opt(argv, "--result-dir")) / opt(argv, "--result-filename")
    src = os.environ.get(f"REPLAY_FROM_{port}") or os.environ["REPLAY_FROM"]
    shutil.copyfile(Path(src) / f"{tier}.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
