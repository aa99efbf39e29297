"""A small OpenAI-compatible streaming chat server for tests, started like vLLM:

    python fakeserver.py serve MODEL_DIR --port N [--served-model-name NAME] [other options ignored]

Loopback only. Deterministic: the reply to a prompt is a fixed sequence of vocabulary words
(`w<k>`), one per streamed chunk, derived from the prompt's bytes; it stops at the requested
max_completion_tokens (or FAKE_OUTPUT_TOKENS). Behaviour for tests, from the environment:
  FAKE_STARTUP_S     seconds before /health answers 200 (default 0.2)
  FAKE_TOKEN_MS      delay per streamed token in ms (default 1)
  FAKE_TTFT_MS       delay before the first token in ms (default 5)
  FAKE_OUTPUT_TOKENS cap on reply length (default: as requested)
  FAKE_DIE_AFTER     exit the whole process in the middle of streaming chat request number N
  FAKE_EXIT_ROUTE    when set, GET /fake/exit ends the whole process (code 3), as a server that dies
  FAKE_FAIL_START    print this text and exit with code 1 instead of serving (with FAKE_FAIL_START_PORT:
                     only the server on that port)
  FAKE_GARBAGE_PORT  on this port, /v1/completions logprobs are NaN; FAKE_COLLAPSE_PORT: on this
                     port, one token repeated; FAKE_LOGPROB_SHIFT: added to each chosen token's logprob
A streamed /v1/completions sends one token per chunk with vLLM's continuous usage figures until
max_tokens or the client closes it. Started with vLLM's `--profiler-config` (a torch_profiler_dir),
it answers /start_profile and /stop_profile, which writes a Chrome trace there: one step prefilling a
request beside the decoding ones, then three steps decoding the requests that were streaming at
/start_profile (execute_context_0(0)_generation_N(N)).
Non-streaming chat replies answer accuracy prompts: the text after the last "Answer key:" in the
prompt (up to the line end), else the first ten words of the streamed reply.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 2000
STATE = {"chat_requests": 0, "ready_at": 0.0, "streaming": 0, "profiled_batch": 0}
LOCK = threading.Lock()


def reply_words(prompt: str, n: int) -> list[str]:
    seed = sum(prompt.encode()) % VOCAB
    return [f"w{(seed + 7 * i) % VOCAB}" for i in range(n)]


def prompt_text(body: dict) -> str:
    parts = []
    for m in body.get("messages", []):
        c = m.get("content")
        if isinstance(c, list):
            parts += [x.get("text", "") for x in c if isinstance(x, dict)]
        elif isinstance(c, str):
            parts.append(c)
    return "\n".join(parts)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fakeserver/1"

    def log_message(self, fmt, *args):  # quiet, but keep a trace in the server log
        sys.stdout.write("%s %s\n" % (self.command, self.path))
        sys.stdout.flush()

    def _json(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            if time.monotonic() >= STATE["ready_at"]:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._json(503, {"error": "loading"})
        elif self.path == "/fake/exit" and os.environ.get("FAKE_EXIT_ROUTE"):
            sys.stdout.write("fakeserver: exiting as told (GET /fake/exit)\n")
            sys.stdout.flush()
            os._exit(3)
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": self.server.served_name, "object": "model", "root": self.server.model, "owned_by": "fake",
                 "max_model_len": 32768}]})
        else:
            self._json(404, {"error": "not found"})

    def _chunk(self, payload: str) -> None:
        data = payload.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream_completion(self, body: dict) -> None:
        """Streamed /v1/completions: a token per chunk, usage in each, until max_tokens or the client closes."""
        n_in = len((body.get("prompt") or "").split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with LOCK:
            STATE["streaming"] += 1
        try:
            time.sleep(float(os.environ.get("FAKE_TTFT_MS", "5")) / 1000)
            want = int(body.get("max_tokens") or 16)
            for i, w in enumerate(reply_words(body.get("prompt") or "", want)):
                chunk = {"choices": [{"index": 0, "text": " " + w, "finish_reason": "length" if i + 1 == want else None}],
                         "usage": {"prompt_tokens": n_in, "completion_tokens": i + 1, "total_tokens": n_in + i + 1}}
                self._chunk("data: " + json.dumps(chunk) + "\n\n")
                time.sleep(float(os.environ.get("FAKE_TOKEN_MS", "1")) / 1000)
            self._chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:                        # the client closed the stream: the request is aborted
            pass
        finally:
            with LOCK:
                STATE["streaming"] -= 1

    def _profile(self) -> None:
        """/start_profile and /stop_profile (only with --profiler-config); the stop writes the trace."""
        tdir = self.server.profiler_dir
        if not tdir:
            return self._json(404, {"error": "not found"})
        if self.path == "/start_profile":
            with LOCK:
                STATE["profiled_batch"] = STATE["streaming"]
            return self._json(200, {})
        b, ev = STATE["profiled_batch"], []
        steps = [(1000, 1, 4096, b - 1)] + [(2000 + 1000 * k, 0, 0, b) for k in range(3)]
        for j, (ts, cr, ct, gr) in enumerate(steps):
            ev += [{"ph": "X", "cat": "user_annotation", "name": f"execute_context_{cr}({ct})_generation_{gr}({gr})",
                    "ts": ts, "dur": 10},
                   {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts + 1, "dur": 1,
                    "args": {"correlation": j}},
                   {"ph": "X", "cat": "kernel", "name": "gemv_kernel<128>", "ts": ts + 100, "dur": 10.0,
                    "args": {"correlation": j}}]
        os.makedirs(tdir, exist_ok=True)
        with gzip.open(os.path.join(tdir, "fake.pt.trace.json.gz"), "wt") as f:
            json.dump({"traceEvents": ev}, f)
        return self._json(200, {})

    def _completion(self, body: dict) -> None:
        """Non-streaming /v1/completions with OpenAI-style logprobs (top-k per position)."""
        if body.get("model") != self.server.served_name:
            return self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
        if body.get("stream"):
            return self._stream_completion(body)
        prompt = body.get("prompt") or ""
        n_out = int(body.get("max_tokens") or 16)
        words = reply_words(prompt, n_out)
        if os.environ.get("FAKE_COLLAPSE_PORT") == str(self.server.server_address[1]):
            words = [words[0]] * n_out
        shift = float(os.environ.get("FAKE_LOGPROB_SHIFT", "0"))
        k = int(body.get("logprobs") or 0)
        lp = None
        if k:
            tops, own = [], []
            for w in words:
                top = {w: -12.40 + shift}
                for j in range(1, k):
                    top[f"w{(int(w[1:]) + j) % VOCAB}"] = -12.40 - 0.01 * j
                if os.environ.get("FAKE_GARBAGE_PORT") == str(self.server.server_address[1]):
                    top = {t: float("nan") for t in top}
                tops.append(top)
                own.append(top[w])
            lp = {"tokens": words, "token_logprobs": own, "top_logprobs": tops}
        n_in = len(prompt.split())
        text = " " + " ".join(words)
        # json.dumps writes NaN for float('nan'), as vLLM's server does
        return self._json(200, {"id": "cmpl-fake", "object": "text_completion", "model": body["model"],
                                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": "length"}],
                                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                          "total_tokens": n_in + n_out}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        if self.path == "/v1/completions":
            return self._completion(body)
        if self.path in ("/start_profile", "/stop_profile"):
            return self._profile()
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": "not found"})
        if time.monotonic() < STATE["ready_at"]:
            return self._json(503, {"error": "loading"})
        if body.get("model") != self.server.served_name:
            return self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
        prompt = prompt_text(body)
        want = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        cap = os.environ.get("FAKE_OUTPUT_TOKENS")
        n_out = min(want, int(cap)) if cap else want
        words = reply_words(prompt, n_out)
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n_out,
                 "total_tokens": len(prompt.split()) + n_out}
        if not body.get("stream"):
            text = " ".join(words[:10])
            if "Answer key:" in prompt:
                text = prompt.rsplit("Answer key:", 1)[1].split("\n", 1)[0].strip()
            return self._json(200, {"id": "chatcmpl-fake", "object": "chat.completion", "model": body["model"],
                                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                 "finish_reason": "stop"}], "usage": usage})
        with LOCK:
            STATE["chat_requests"] += 1
            number = STATE["chat_requests"]
        die_after = int(os.environ.get("FAKE_DIE_AFTER", "0"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        time.sleep(float(os.environ.get("FAKE_TTFT_MS", "5")) / 1000)
        tok_s = float(os.environ.get("FAKE_TOKEN_MS", "1")) / 1000
        for i, w in enumerate(words):
            if die_after and number == die_after and i == len(words) // 2:
                sys.stdout.write("fakeserver: dying mid-request as told (FAKE_DIE_AFTER)\n")
                sys.stdout.flush()
                os._exit(3)
            delta = {"content": " " + w}
            if i == 0:
                delta["role"] = "assistant"
            self._chunk("data: " + json.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                                               "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
                        + "\n\n")
            if tok_s:
                time.sleep(tok_s)
        self._chunk("data: " + json.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                                           "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}) + "\n\n")
        self._chunk("data: " + json.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                                           "choices": [], "usage": usage}) + "\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fakeserver")
    ap.add_argument("verb", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    args, rest = ap.parse_known_args(argv)
    if os.environ.get("FAKE_FAIL_START") and os.environ.get("FAKE_FAIL_START_PORT", str(args.port)) == str(args.port):
        print(os.environ["FAKE_FAIL_START"], flush=True)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print("fakeserver: loopback only", flush=True)
        return 2
    print(f"fakeserver: model {args.model}, options {rest}, env VLLM_FORGE_DECODE="
          f"{os.environ.get('VLLM_FORGE_DECODE')} PYTHONPATH={os.environ.get('PYTHONPATH')}", flush=True)
    STATE["ready_at"] = time.monotonic() + float(os.environ.get("FAKE_STARTUP_S", "0.2"))
    srv = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    srv.daemon_threads = True
    srv.served_name = args.served_model_name or args.model
    srv.model = args.model
    cfg = rest[rest.index("--profiler-config") + 1] if "--profiler-config" in rest[:-1] else None
    srv.profiler_dir = json.loads(cfg).get("torch_profiler_dir") if cfg else None
    print(f"fakeserver: listening on 127.0.0.1:{args.port}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
