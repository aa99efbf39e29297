"""CPU cost of the organizers' output parsers on one streamed answer (a benchmark: prints a table, writes JSON).

The finals' start script serves with `--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser
qwen3_coder`; for a streamed delta the API server runs the reasoning parser until the reasoning ends, then the
tool-call parser, over the text so far. This times both on every delta (an upper bound of the two together) of
an answer of --tokens deltas of --word each (the harness's random-weight model answers with one word over and
over), and the non-streaming tool-call extraction once at the end. Run it with a Python that
has the patched vLLM installed (the rehearsal's venv: build/rehearsal/venv/bin/python):

    build/rehearsal/venv/bin/python harness/gpu/parser_cost.py --tokenizer build/gpu-bundle/model/tokenizer.json \
        --word " w24009" --tokens 1024 --out /tmp/parser-cost.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _vllm_probe import no_vllm, ran_on, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json (the harness model's)")
    ap.add_argument("--word", default=" w24009", help="the text of one delta (default: %(default)r)")
    ap.add_argument("--tokens", type=int, default=1024, help="deltas in the answer (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    a = ap.parse_args(argv)
    if a.tokens < 1:
        ap.error(f"--tokens {a.tokens}: the answer needs at least one delta")
    if not Path(a.tokenizer).is_file():
        ap.error(f"--tokenizer {a.tokenizer}: no such file")
    try:
        import vllm
        from transformers import PreTrainedTokenizerFast
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser
    except ImportError as e:
        return no_vllm("parser_cost", e)
    tok = PreTrainedTokenizerFast(tokenizer_file=a.tokenizer)
    ids = tok.encode(a.word)
    tool = Qwen3CoderToolParser(tok)
    reasoning = ReasoningParserManager.get_reasoning_parser("qwen3")(tok)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tool_choice="auto",
                                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    prev, prev_ids, t_reason, t_tool, last = "", [], 0.0, 0.0, 0.0
    for _ in range(a.tokens):
        cur, cur_ids = prev + a.word, prev_ids + ids
        t0 = time.perf_counter()
        reasoning.extract_reasoning_streaming(prev, cur, a.word, prev_ids, cur_ids, ids)
        t1 = time.perf_counter()
        tool.extract_tool_calls_streaming(prev, cur, a.word, prev_ids, cur_ids, ids, req)
        t2 = time.perf_counter()
        t_reason, t_tool, last = t_reason + t1 - t0, t_tool + t2 - t1, t2 - t0
        prev, prev_ids = cur, cur_ids
    t0 = time.perf_counter()
    tool.extract_tool_calls(prev, req)
    final = time.perf_counter() - t0
    res = {"deltas": a.tokens, "word": a.word, "answer_chars": len(prev), "reasoning_stream_ms": t_reason * 1e3,
           "tool_stream_ms": t_tool * 1e3, "last_delta_us": last * 1e6, "final_extract_ms": final * 1e3,
           **ran_on(vllm.__version__)}
    print(f"| deltas | answer chars | reasoning parser, all deltas | tool parser, all deltas | last delta | final extract |\n"
          f"|---:|---:|---:|---:|---:|---:|\n| {a.tokens} | {len(prev)} | {t_reason * 1e3:.1f} ms | "
          f"{t_tool * 1e3:.1f} ms | {last * 1e6:.0f} us | {final * 1e3:.2f} ms |")
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
