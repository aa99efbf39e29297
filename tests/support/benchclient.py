"""A small stand-in for `vllm bench serve` that really talks to a server: for each line of the
custom dataset ({"prompt", "output_tokens"}) it sends one streaming chat request, one at a time,
and measures TTFT and the inter-token latencies; then it writes the result file with the keys of
vLLM's own (--save-result --save-detailed), straight into the file as vLLM's client does (an
interrupted client leaves a cut-short file). Used where forge's tier loop must run against a
server with no vLLM installed (the fault-injection tests); tests/tree/ runs the real client.

    python benchclient.py bench serve --dataset-path F --num-prompts N --host H --port P
        --served-model-name NAME --result-dir D --result-filename F [--custom-output-len L]
        [--ignore-eos] [other vLLM options accepted and ignored]"""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path


def opt(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def one_request(host: str, port: int, endpoint: str, model: str, prompt: str, max_tokens: int,
                ignore_eos: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_completion_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out = {"start": time.time(), "ttft": 0.0, "itl": [], "text": "", "input_len": 0, "output_len": 0, "error": ""}
    try:
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.request("POST", endpoint, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return out
        last = t0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["input_len"] = chunk["usage"]["prompt_tokens"]
                out["output_len"] = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    if not out["text"]:
                        out["ttft"] = now - t0
                    else:
                        out["itl"].append(now - last)
                    last = now
                    out["text"] += text
        conn.close()
    except (OSError, ValueError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["latency"] = time.perf_counter() - t0
    return out


def p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    pos = (len(xs) - 1) * 0.99
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def main(argv: list[str]) -> int:
    if argv[:2] != ["bench", "serve"]:
        print(f"benchclient: expected `bench serve ...`, got {argv[:2]}", file=sys.stderr)
        return 2
    dataset = Path(opt(argv, "--dataset-path"))
    n = int(opt(argv, "--num-prompts"))
    host, port = opt(argv, "--host", "127.0.0.1"), int(opt(argv, "--port"))
    endpoint = opt(argv, "--endpoint", "/v1/chat/completions")
    model = opt(argv, "--served-model-name") or opt(argv, "--model")
    cap = int(opt(argv, "--custom-output-len", "-1"))
    lines = [json.loads(x) for x in dataset.read_text().splitlines() if x.strip()][:n]
    t0 = time.perf_counter()
    rs = [one_request(host, port, endpoint, model, x["prompt"], x["output_tokens"] if cap < 0 else cap,
                      "--ignore-eos" in argv) for x in lines]
    duration = time.perf_counter() - t0
    ok = [r for r in rs if not r["error"]]
    out_tokens = sum(r["output_len"] for r in ok)
    in_tokens = sum(r["input_len"] for r in ok)
    result = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": opt(argv, "--backend", "openai-chat"),
              "model_id": model, "num_prompts": len(lines), "duration": duration, "completed": len(ok),
              "failed": len(rs) - len(ok), "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
              "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
              "total_token_throughput": (in_tokens + out_tokens) / duration,
              "input_lens": [r["input_len"] for r in rs], "output_lens": [r["output_len"] for r in rs],
              "ttfts": [r["ttft"] for r in rs], "itls": [r["itl"] for r in rs],
              "start_times": [r["start"] for r in rs], "generated_texts": [r["text"] for r in rs],
              "errors": [r["error"] for r in rs],
              # vLLM's own P99s (--percentile-metrics ttft,tpot --metric-percentiles 99), numpy's linear percentile
              "p99_ttft_ms": p99([1000 * r["ttft"] for r in ok]),
              "p99_tpot_ms": p99([1000 * sum(r["itl"]) / len(r["itl"]) for r in ok if r["itl"]])}
    if "--save-result" in argv or "--result-filename" in argv:
        path = Path(opt(argv, "--result-dir", ".")) / opt(argv, "--result-filename")
        with open(path, "w") as f:
            json.dump(result, f)
    print(f"benchclient: {len(ok)} of {len(rs)} requests completed, {out_tokens} output tokens in {duration:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
