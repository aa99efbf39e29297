"""The two CPU probes of the API process's per-token work (harness/gpu/detok_cost.py, harness/gpu/parser_cost.py)
run with the patched vLLM at small sizes: what they report is what vLLM's own detokenizer and parsers did (a
special token skipped gives no text, not skipped it does; the parsers see the whole answer), and bad arguments
are refused before vLLM is imported. Their timings are benchmarks, never asserted here."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge.lab import gpu_bundle  # noqa: E402

DETOK = ROOT / "harness" / "gpu" / "detok_cost.py"
PARSER = ROOT / "harness" / "gpu" / "parser_cost.py"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    gpu_bundle.write_model_dir(gpu_bundle.harness_config(), out)
    return out


def _run(python, script, *args):
    return subprocess.run([str(python), str(script), *map(str, args)], capture_output=True, text=True, timeout=600)


def test_detok_cost_reports_what_the_detokenizer_gave(vllm_python, model, tmp_path):
    r = _run(vllm_python, DETOK, "--model", model, "--prompts", "64,300", "--steps", "8", "--out", tmp_path / "d.json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "d.json").read_text())
    assert res["detokenizer"] == "FastIncrementalDetokenizer" and res["steps"] == 8
    rows = {(x["prompt_tokens"], x["case"]): x for x in res["rows"]}
    assert set(rows) == {(n, c) for n in (64, 300) for c in ("special, skipped", "special, not skipped", "a word")}
    for n in (64, 300):
        assert rows[n, "special, skipped"]["text_chars"] == 0
        assert rows[n, "special, not skipped"]["text_chars"] >= 8 * len("<|endoftext|>")
        assert rows[n, "a word"]["text_chars"] >= 8
    assert r.stdout.count("\n| ") == 3                                          # the header row and one per length


def test_parser_cost_feeds_the_whole_answer(vllm_python, model, tmp_path):
    r = _run(vllm_python, PARSER, "--tokenizer", model / "tokenizer.json", "--word", " w17", "--tokens", "16",
             "--out", tmp_path / "p.json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["deltas"] == 16 and res["answer_chars"] == 16 * len(" w17")


@pytest.mark.parametrize("script,args,named", [
    (DETOK, ["--steps", "0"], "--steps 0"),
    (DETOK, ["--prompts", "64,0"], "each prompt length"),
    (DETOK, ["--prompts", "64,x"], "whole numbers"),
    (DETOK, ["--model", "{tmp}"], "no tokenizer.json"),
    (PARSER, ["--tokens", "0"], "--tokens 0"),
    (PARSER, ["--tokenizer", "{tmp}/none.json"], "no such file"),
])
def test_the_probes_refuse_bad_arguments_before_importing_vllm(vllm_python, model, tmp_path, script, args, named):
    base = ["--model", model] if script == DETOK else ["--tokenizer", model / "tokenizer.json"]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = tmp_path / "never.json"
    r = _run(vllm_python, script, *base, *args, "--out", out)
    assert r.returncode == 2 and named in r.stderr, r.stderr
    assert not out.exists()
