"""Chunked-prefill wiring in TRITON_ATTN (VLLM_FORGE_PREFILL): prefill and mixed batches go to
forge_prefill_attention, and VLLM_FORGE_PREFILL=0 restores the unified kernel. Checked on the CPU
under Triton's interpreter through the patched TritonAttentionImpl (write + forward), int8 and
unquantized caches, 24 q / 4 kv heads, head_dim 256, against float64 attention: a batch that
mixes a long chunk over a cached prefix, a decode row, and a chunk with no prefix."""

import json
import textwrap

SNIPPET = textwrap.dedent(
    """
    import os, sys, json
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, "tests/tree/helpers")
    import torch
    from int8_attention_case import run_case
    from vllm.v1.attention.ops import forge_prefill_attention as fpa
    from vllm.v1.attention.ops import triton_unified_attention as tua

    calls = dict(prefill=0, unified=0)
    real_p, real_u = fpa.prefill_attention, tua.unified_attention
    import vllm.v1.attention.backends.triton_attn as ta
    def rec_p(*a, **k):
        calls["prefill"] += 1
        return real_p(*a, **k)
    def rec_u(*a, **k):
        calls["unified"] += 1
        return real_u(*a, **k)
    ta.prefill_attention, ta.unified_attention = rec_p, rec_u
    r = run_case(seq_lens=[PREFIX + 70, 300, 40], query_lens=[70, 1, 40], block_size=BS, seed=SEED,
                 pass_new_kv=True)
    r["calls"] = calls
    print("JSON" + json.dumps(r))
    """
)


def _run(run_in_vllm, flag, bs, seed, prefix):
    code = SNIPPET.replace("BS", str(bs)).replace("SEED", str(seed)).replace("PREFIX", str(prefix))
    res = run_in_vllm(code, env={"VLLM_FORGE_PREFILL": flag})
    return json.loads([l for l in res.stdout.splitlines() if l.startswith("JSON")][-1][4:])


def test_prefill_route_vs_float64(run_in_vllm):
    # the 70-token chunk's 830-token cached prefix crosses the 784-token block boundary
    r = _run(run_in_vllm, "1", 784, 5, prefix=830)
    # two forwards (int8 cache, unquantized cache), both through our kernel, none through unified
    assert r["calls"] == {"prefill": 2, "unified": 0}, r["calls"]
    assert not r["nan"]
    assert r["err_unq_kernel"] <= 1e-5, r        # fp32 queries/cache under the interpreter
    # int8: the prefix comes from the quantized cache, the chunk's own K/V at full precision, so
    # the output sits between the dequantized-cache reference and the unquantized one
    assert r["err_int8_vs_unq_normrel"] <= 3e-2, r


def test_prefill_switch_restores_unified(run_in_vllm):
    """The switch's route and the unified kernel's accuracy on the same batch shape. A 330-token
    prefix (one 1552-token block either way): the unified kernel under the interpreter costs in
    proportion to query x context, and the prefix's length proves nothing more here (an 830-token
    one costs about twice the time of this one, ~24 s on one core)."""
    r = _run(run_in_vllm, "0", 1552, 6, prefix=330)
    assert r["calls"] == {"prefill": 0, "unified": 2}, r["calls"]
    assert r["err_unq_kernel"] <= 1e-3 and r["err_deq"] <= 1e-3, r
