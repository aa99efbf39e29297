"""Talking to the servers from the harness: a small loopback HTTP client for completions (a streamed
one read on a thread of its own), and vLLM's own `vllm bench serve` kept in one long-lived worker
process (benchworker) so its imports are paid once, not per tier."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import socket
import threading
import time
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


def get_text(url: str, timeout: float) -> str:
    """GET (vLLM's /v1/models, /metrics): the body as text."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.read().decode(errors="replace")
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


class TokenStream:
    """One streamed completion (/v1/completions, temperature 0, end-of-text ignored) read on a thread of
    its own: the tokens the server has sent so far (vLLM's continuous usage figures, else one per
    chunk), its prompt's length as the server counted it, when the first token came, how it ended.
    stop() closes the connection, and vLLM then aborts the request."""

    def __init__(self, state: dict, prompt: str, max_tokens: int, timeout: float = 900):
        self.host, self.port, self.timeout = state["host"], int(state["port"]), timeout
        self.body = {"model": state["served_model_name"], "prompt": prompt, "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        self.tokens = 0
        self.prompt_tokens: int | None = None
        self.first_token_s: float | None = None
        self.finish: str | None = None
        self.error: str | None = None
        self.ended = False
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> TokenStream:
        self._thread.start()
        return self

    def _read(self) -> None:
        url = f"http://{self.host}:{self.port}/v1/completions"
        try:
            self._conn = conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            sent = time.monotonic()
            conn.request("POST", "/v1/completions", body=json.dumps(self.body),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                self.error = f"{url}: HTTP {r.status}: {r.read()[:500].decode(errors='replace')}"
                return
            for raw in r:
                if self._stop.is_set():
                    return
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if not isinstance(chunk, dict) or "error" in chunk:
                    self.error = f"{url}: {str(chunk)[:500]}"
                    return
                usage, choices = chunk.get("usage") or {}, chunk.get("choices") or []
                if isinstance(usage.get("prompt_tokens"), int):
                    self.prompt_tokens = usage["prompt_tokens"]
                if choices:
                    n = usage.get("completion_tokens")
                    self.tokens = n if isinstance(n, int) else self.tokens + 1
                    if self.first_token_s is None:
                        self.first_token_s = time.monotonic() - sent
                    self.finish = choices[0].get("finish_reason") or self.finish
        except (OSError, ValueError, http.client.HTTPException) as e:
            if not self._stop.is_set():
                self.error = f"{url}: {type(e).__name__}: {e}"
        finally:
            self.ended = True
            if self._conn is not None:
                self._conn.close()

    def stop(self, wait_s: float = 30) -> None:
        """Close the connection (the server aborts the request) and wait for the reader to end."""
        self._stop.set()
        sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=wait_s)


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
