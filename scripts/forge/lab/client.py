"""Talking to the servers from the harness: a small loopback HTTP client for completions, and vLLM's
own `vllm bench serve` kept in one long-lived worker process (benchworker) so its imports are paid
once, not per tier."""

from __future__ import annotations

import http.client
import json
import os
import queue
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from .. import paths, proc
from ..errors import ForgeError
from ..run import bench
from .benchworker import MARKER

if TYPE_CHECKING:
    from .session import Run


# --- small HTTP client (no proxies: loopback only) --------------------------------------------------

def post_json(url: str, body: dict, timeout: float) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ForgeError(f"{url}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        raise ForgeError(f"{url}: {type(e).__name__}: {e}")


def post_empty(url: str, timeout: float) -> int:
    """POST with no body (vLLM's /start_profile, /stop_profile); the HTTP status."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        raise ForgeError(f"{url}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}")
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise ForgeError(f"{url}: {type(e).__name__}: {e}")


def complete(state: dict, prompt: str, max_tokens: int, *, logprobs: int | None = None,
             timeout: float = 600) -> dict:
    body = {"model": state["served_model_name"], "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = logprobs
    return post_json(f"http://{state['host']}:{state['port']}/v1/completions", body, timeout)


# --- vLLM's client, imported once ------------------------------------------------------------------

class ClientWorker:
    """scripts/forge/lab/benchworker.py under `python`: one process runs every tier's `vllm bench serve`
    (vLLM's own parser and main), so the client's imports are paid once, not per tier."""

    def __init__(self, python: str, log: Path, timeout: float = 300, env: dict[str, str] | None = None):
        self.marker = MARKER
        self.log = log
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        env = dict(env or {})
        pypath = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = str(paths.ROOT / "scripts") + (os.pathsep + pypath if pypath else "")
        self.err = open(log, "a")
        self.p = proc.start_piped([python, "-m", "forge.lab.benchworker"], stderr_log=log, env=env,
                                  what="the benchmark client worker")
        threading.Thread(target=self._read, daemon=True).start()
        if self._reply(timeout) is None:
            self.close()
            raise ForgeError(f"the benchmark client worker did not start\n{proc.tail(log, 30)}",
                             hint="its log says why; --client-per-tier runs a fresh client per tier instead")

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith(self.marker):
                self.lines.put(line[len(self.marker):])
            else:
                self.err.write(line)
                self.err.flush()
        self.lines.put(None)

    def _reply(self, timeout: float) -> dict | None:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        return json.loads(line) if line else None

    def run(self, argv: list[str], log: Path, timeout: float = 1800) -> int:
        if self.p.poll() is not None:
            return 1
        try:
            self.p.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
            self.p.stdin.flush()
        except OSError:
            self.close()
            return 1
        r = self._reply(timeout)
        if r is None:                     # hung or died: never reuse it
            self.close()
            return 1
        return int(r.get("rc", 1))

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
                self.p.wait(timeout=10)
            except Exception:             # OSError or subprocess.TimeoutExpired: it does not answer
                proc.kill_group(self.p.pid)
                self.p.wait()


def client_runner(run: Run):
    """How tiers run their client: a worker process when the client is this vLLM's own CLI module,
    else (a custom --client, or --client-per-tier) a fresh process per tier."""
    if run.args.client_per_tier:
        return None
    launcher = bench.client_launcher(run.args.client)
    if launcher[1:] != ["-m", "vllm.entrypoints.cli.main"]:
        return None
    pre = run.worker_thread
    if pre is not None and pre is not threading.current_thread():
        pre.join()                        # the worker started early, while the servers started
        run.worker_thread = None
    if run.worker_failed:
        return None
    if run.worker is None or run.worker.p.poll() is not None:
        try:
            run.worker = ClientWorker(launcher[0], run.out / "logs" / "bench-worker.log", env=run.child_env)
        except ForgeError as e:
            run.worker_failed = True
            run.summary["skipped"].append(f"client worker: {e.message.splitlines()[0]}; a client per tier instead")
            return None

    def runner(argv: list[str], log: Path) -> int:
        w = run.worker
        if w.p.poll() is not None:
            try:
                run.worker = w = ClientWorker(launcher[0], run.out / "logs" / "bench-worker.log", env=run.child_env)
            except ForgeError:
                return 1
        return w.run(argv, log, timeout=max(5.0, run.left()))
    return runner
