"""The decode family measures a batch the way the server runs it: under vLLM's default compilation
config a pure-decode step runs the FULL CUDA graph of the smallest capture size that holds it, padded
with rows of length 0 (block-table rows -1), where that size is at most the server's --max-num-seqs
(vLLM registers FULL decode graphs only up to it); otherwise a PIECEWISE graph runs and the attention
sees the real batch. The attention backend plans its split-KV segments per batch it sees, so the
calibration's decisions carry that batch, and its inputs hold the padding."""

import ast
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
from calibrate import attention, decode_inputs  # noqa: E402
from calibrate import common as C  # noqa: E402

VLLM_CONFIG = ROOT / "build" / "vllm" / "vllm" / "config" / "vllm.py"


def capture_sizes() -> list[int]:
    """vLLM 0.18.1's default capture sizes (`_set_cudagraph_sizes`, up to max-num-seqs x 2, at most 512):
    1, 2, 4, multiples of 8 below 256, then multiples of 16."""
    return [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def test_graph_batch_is_the_smallest_capture_size_that_holds_the_batch():
    sizes = capture_sizes()
    for b in range(1, 513):
        assert C.graph_batch(b) == min(s for s in sizes if s >= b), b
    with pytest.raises(ValueError):
        C.graph_batch(0)


def full_decode_graphs(max_num_seqs: int) -> list[int]:
    """The batch sizes vLLM captures FULL decode graphs for: the default capture sizes up to
    min(2 x max-num-seqs, 512), of those the ones at most max-num-seqs (vllm/v1/cudagraph_dispatcher.py)."""
    top = min(2 * max_num_seqs, 512)
    return [s for s in capture_sizes() if s <= top and s <= max_num_seqs]


@pytest.mark.parametrize("seqs", [1, 4, 5, 7, 8, 10, 14, 16, 128, 256])
def test_decode_key_is_the_batch_the_attention_backend_sees(seqs):
    full = full_decode_graphs(seqs)
    for b in range(1, seqs + 1):
        fits = [s for s in full if s >= b]
        assert C.decode_key(b, seqs) == (min(fits) if fits else b), (b, seqs)
    with pytest.raises(ValueError):
        C.decode_key(seqs + 1, seqs)


def test_the_rounds_decode_steps_and_the_batches_they_are_planned_at():
    # 5 requests: at 5 under the planner's cap 5, at 8 (padded) under the baseline's 128; 10 and 16 both at 16
    assert C.decode_plan(C.DECODE_SERVED) == {1: [1], 4: [4], 5: [5], 7: [7], 8: [5], 16: [10, 16], 24: [24]}
    assert C.decode_plan(C.DECODE_SERVED_QUICK) == {1: [1], 16: [10]}
    assert attention.decode_points(True, False) == ({1: [1], 4: [3]}, (97,))
    assert [attention.decode_point(P, B, 7189) for P, B in ((16, 10), (16, 16), (5, 5))] == [
        "n=10 ctx=7189", "ctx=7189", "ctx=7189"]


def test_the_capture_sizes_are_the_pinned_sources():
    """Where the patched tree is built: vLLM's own default list is still built that way."""
    if not VLLM_CONFIG.is_file():
        pytest.skip(f"{VLLM_CONFIG.relative_to(ROOT)} is missing: run `make tree` first")
    src = VLLM_CONFIG.read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "_set_cudagraph_sizes")
    body = ast.get_source_segment(src, fn)
    for piece in ("for i in [1, 2, 4] if i <= max_cudagraph_capture_size",
                  "range(8, min(max_cudagraph_capture_size + 1, 256), 8)",
                  "range(256, max_cudagraph_capture_size + 1, 16)"):
        assert piece in body, piece
    assert "self.scheduler_config.max_num_seqs * decode_query_len * 2, 512" in body
    dispatcher = (VLLM_CONFIG.parents[1] / "v1" / "cudagraph_dispatcher.py").read_text()
    # FULL decode graphs only up to max-num-seqs tokens of one query token each
    assert "* self.vllm_config.scheduler_config.max_num_seqs" in dispatcher
    assert "if x <= max_num_tokens and x >= uniform_decode_query_len" in dispatcher


def test_a_padded_decode_batch_holds_the_padding_rows_as_vllm_does():
    sh = attention.Shape(True)
    gen = torch.Generator().manual_seed(3)
    c = decode_inputs.decode_batch(torch, sh, batch=3, context=97, kv="int8", block=16, gen=gen, seed=5, pad_to=8)
    assert c["q"].shape[0] == 8 and c["bt"].shape[0] == 8 and c["sl"].tolist()[3:] == [0] * 5
    assert (c["bt"][3:] == -1).all() and (c["bt"][:3] >= 0).all()
    assert len(c["lens"]) == 3 and c["sl"].tolist()[:3] == c["lens"] and c["lens"][-1] == 97
    # unpadded, as the benchmark and the launch sweep build it
    u = decode_inputs.decode_batch(torch, sh, batch=3, context=97, kv="16bit", block=16, gen=gen, seed=5)
    assert u["q"].shape[0] == 3 and u["sl"].tolist() == u["lens"]
