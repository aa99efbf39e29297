"""The split-KV decode plan the real metadata builder (TRITON_ATTN) makes from a tuned table (patch "tuned:
split-KV decode plans with the rank's KV heads, its max-model-len and the int8 cache's own segments"): an
int8 KV cache plans each batch with the table's int8 count (decode.segments_int8), a 16-bit cache with the
16-bit one, a batch the int8 map lacks with the 16-bit count, a batch the table lacks with the built-in
heuristic; a table measured at other KV heads than the rank's is not applied (built-in heuristic). Before the
patch the builder asked by batch alone: an int8 cache took the 16-bit counts, and a table of 2 KV heads
planned a 4-head rank."""

import json
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "configs" / "models" / "qwen3.5-27b"

SNIPPET = textwrap.dedent(
    f"""
    import json, os
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["VLLM_FORGE_DECODE"] = "1"
    import torch
    import vllm.forge_tuned as T
    heads = json.loads(os.environ["TABLE_HEADS"])
    kv = str(heads[1])
    ident = T.device_identity()
    table = {{"schema": T.SCHEMA, "validators": {{**{{k: ident[k] for k in T.MATCH}}, "tp": 1, "heads": heads}},
             "provenance": {{}},
             "decode": {{"segments": {{kv: {{"1": {{"32768": 8}}, "4": {{"32768": 16}}}}}},
                        "segments_int8": {{kv: {{"1": {{"32768": 64}}}}}}}}}}
    path = os.path.join(os.environ["TMP"], "table.json")
    with open(path, "w") as f:
        json.dump(table, f)
    os.environ["VLLM_FORGE_TUNED"] = path
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.attention.ops.forge_split_kv_decode import choose_num_segments
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    out = {{}}
    for name, dtype, block, scale in (("int8", torch.int8, 1552, 4), ("auto", torch.bfloat16, 784, 0)):
        cfg = EngineArgs(model={str(MODEL_DIR)!r}, max_model_len=32768, skip_tokenizer_init=True,
                         kv_cache_dtype=name).create_engine_config()
        spec = FullAttentionSpec(block_size=block, num_kv_heads=4, head_size=256, dtype=dtype,
                                 **({{"kv_scale_bytes": scale}} if scale else {{}}))
        b = TritonAttentionMetadataBuilder(spec, ["attn"], cfg, torch.device("cpu"))
        out[name] = {{n: b.forge_decode_plan[n] for n in (1, 2, 4)}}
    from vllm.platforms import current_platform
    try:                                 # the compute units the builder planned with (as it reads them)
        cus = current_platform.num_compute_units(0)
    except (NotImplementedError, RuntimeError, AssertionError):
        cus = 16
    out["builtin"] = {{n: choose_num_segments(cus, n, 4, 32768) for n in (1, 2, 4)}}
    out["table"] = T.active() is not None
    print("RESULT" + json.dumps(out))
    """
)


def plan(run_in_vllm, tmp_path, heads):
    res = run_in_vllm(SNIPPET, env={"TMP": str(tmp_path), "TABLE_HEADS": json.dumps(heads)})
    return json.loads(next(x for x in res.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])


def test_an_int8_cache_plans_with_the_tables_int8_segments(run_in_vllm, tmp_path):
    r = plan(run_in_vllm, tmp_path, [24, 4])
    assert r["table"], r
    assert r["auto"] == {"1": 8, "2": r["builtin"]["2"], "4": 16}, r
    assert r["int8"] == {"1": 64, "2": r["builtin"]["2"], "4": 16}, r      # 4: not measured in int8


@pytest.mark.parametrize("heads", [[12, 2]])
def test_a_table_of_other_kv_heads_does_not_plan_this_rank(run_in_vllm, tmp_path, heads):
    r = plan(run_in_vllm, tmp_path, heads)
    assert r["table"], r
    assert r["auto"] == r["builtin"] and r["int8"] == r["builtin"], r
