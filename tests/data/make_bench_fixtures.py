"""Regenerate tests/data/runs/: real `vllm bench serve` result files, made by `forge bench-all-tiers`
running vLLM's own client against tests/support/fakeserver.py on 127.0.0.1.

    PYTHONPATH=scripts .venv/bin/python tests/data/make_bench_fixtures.py --client "build/rehearsal/venv/bin/vllm"

The client's interpreter needs vLLM (pure Python is enough) and pandas (the custom dataset reader).
Runs: base (slower fake server), fast (faster), died (the server exits in the middle of the second
tier: tier 2 has failed requests, tier 3 is recorded as all failed). Synthetic prompt files are
removed afterwards to keep the fixtures small (their hashes stay in each manifest)."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
import tinymodel  # noqa: E402

PROMPTS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(port: int, limit_s: float = 20) -> None:
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            with opener.open(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("fake server did not come up")


def one(name: str, env: dict, client: str, model: Path, out: Path) -> None:
    port = free_port()
    senv = {**os.environ, "FAKE_OUTPUT_TOKENS": "32", **env}
    srv = subprocess.Popen([sys.executable, str(ROOT / "tests/support/fakeserver.py"), "serve", str(model),
                            "--port", str(port), "--served-model-name", "Qwen3.5-27B"], env=senv,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_health(port)
        fenv = {**os.environ, "PYTHONPATH": str(ROOT / "scripts"), "FORGE_RUNS_DIR": str(out)}
        subprocess.run([sys.executable, "-m", "forge", "bench-all-tiers", "--port", str(port), "--model", str(model),
                        "--num-prompts", str(PROMPTS), "--client", client, "--run-id", name, "--profile", "fixture"],
                       env=fenv, check=True, timeout=600)
    finally:
        srv.terminate()
        srv.wait(timeout=10)
    shutil.rmtree(out / name / "datasets", ignore_errors=True)
    for log in (out / name).glob("*.client.log"):
        log.unlink()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--client", required=True, help="command that runs vLLM's CLI")
    args = ap.parse_args()
    out = HERE / "runs"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    model = tinymodel.build(Path("/tmp") / f"forge-fixture-model-{os.getpid()}")
    # per-request work: 40 ms to the first token and 4 ms per token (base); half of that (fast)
    one("base", {"FAKE_TTFT_MS": "40", "FAKE_TOKEN_MS": "4"}, args.client, model, out)
    one("fast", {"FAKE_TTFT_MS": "20", "FAKE_TOKEN_MS": "2"}, args.client, model, out)
    # FAKE_DIE_AFTER counts streamed chat requests (ready check, warm-ups, prompts): this lands in tier 2's main run
    die = (3 + PROMPTS) + 3 + 2
    one("died", {"FAKE_TTFT_MS": "20", "FAKE_TOKEN_MS": "2", "FAKE_DIE_AFTER": str(die)}, args.client, model, out)
    shutil.rmtree(model)


if __name__ == "__main__":
    main()
