"""CPU cost of vLLM's streaming detokenizer per generated token (a benchmark: prints a table, writes JSON).

vLLM's API process decodes each request's new token with its FastIncrementalDetokenizer, whose decode stream is
primed with the whole prompt. While no new text comes out, the stream keeps every id since the last text and
decodes them all again at the next token, the prompt included. A token that decodes to nothing is one such: a
special token with `skip_special_tokens` (the API's default). The harness's random-weight model repeats one
token, often a special one, so each step of such a request decodes the whole prompt. This times vLLM's own
detokenizer (the same tokenizer load as the server's) per token at several prompt lengths, for a special token
skipped, the same token not skipped (the harness's client asks for that), and a word (what a real model's tokens
do). Run it with a Python that has the patched vLLM installed (the rehearsal's venv):

    build/rehearsal/venv/bin/python harness/gpu/detok_cost.py --model build/gpu-bundle/model --out /tmp/detok.json
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from _vllm_probe import no_vllm, ran_on, write_json

PROMPTS = (4096, 8192, 16384, 21370, 31744)


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: prompt lengths are whole numbers, comma-separated") from None
    if not out or any(not 1 <= n <= 262144 for n in out):
        raise argparse.ArgumentTypeError(f"{text!r}: each prompt length is 1 to 262144 tokens")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="a model folder with the tokenizer (the bundle's)")
    ap.add_argument("--prompts", type=_lengths, default=list(PROMPTS),
                    help=f"prompt lengths in tokens (default {','.join(map(str, PROMPTS))})")
    ap.add_argument("--steps", type=int, default=200, help="generated tokens timed per case (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    a = ap.parse_args(argv)
    if not 1 <= a.steps <= 4096:
        ap.error(f"--steps {a.steps}: 1 to 4096")
    if not (a.model / "tokenizer.json").is_file():
        ap.error(f"--model {a.model}: no tokenizer.json there")
    try:
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.tokenizers import get_tokenizer
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
    except ImportError as e:
        return no_vllm("detok_cost", e)
    tok = get_tokenizer(str(a.model))
    special = tok.eos_token_id
    word = next(i for i in range(1, 1000) if i not in tok.all_special_ids)
    rng = random.Random(0)
    cases = (("special, skipped", special, True), ("special, not skipped", special, False), ("a word", word, True))
    rows = []
    for n in a.prompts:
        prompt = [rng.choice((word, word + 1, word + 2)) for _ in range(n)]
        for label, tid, skip in cases:
            req = EngineCoreRequest(request_id="r", prompt_token_ids=prompt, mm_features=None,
                                    sampling_params=SamplingParams(max_tokens=a.steps, ignore_eos=True,
                                                                   skip_special_tokens=skip),
                                    pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
                                    data_parallel_rank=None)
            det = IncrementalDetokenizer.from_new_request(tok, req)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                det.update([tid], False)
            ms = (time.perf_counter() - t0) * 1e3 / a.steps
            rows.append({"prompt_tokens": n, "case": label, "token_id": tid, "skip_special_tokens": skip,
                         "ms_per_token": round(ms, 4), "text_chars": len(det.output_text)})
    print("| prompt tokens | " + " | ".join(f"{c[0]}, ms a token" for c in cases) + " |")
    print("|---:|" + "---:|" * len(cases))
    for n in a.prompts:
        print(f"| {n} | " + " | ".join(f"{r['ms_per_token']:.3f}" for r in rows if r["prompt_tokens"] == n) + " |")
    write_json(a.out, {"steps": a.steps, "rows": rows, "detokenizer": type(det).__name__,
                       **ran_on(vllm.__version__)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
