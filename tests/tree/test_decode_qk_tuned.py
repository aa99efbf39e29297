"""The int8 cache's Q.K path the real TRITON_ATTN backend runs from a tuned table (patch "tuned: the
table's decode.qk_int8 picks the int8 cache's Q.K path"): a table whose `decode.qk_int8` is false (forge
calibrate measured the int8 dot slower on the device, or it did not build there) makes every int8 decode
launch run converted K tiles (QK_INT8 off); a table saying true, or none, keeps the kernel's built-in
int8 dot; a 16-bit cache never takes the int8 dot. Before the patch the backend never passed the choice,
so a device where the int8 dot is slow ran it whatever the table said. The launches are spied on (the real
kernel still runs, under Triton's interpreter), and the outputs checked against float64."""

import json
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "configs" / "models" / "qwen3.5-27b"

SNIPPET = textwrap.dedent(
    f"""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["VLLM_FORGE_DECODE"] = "1"
    sys.path.insert(0, "tests/tree/helpers")
    import torch
    import vllm.forge_tuned as T
    qk = json.loads(os.environ["TABLE_QK"])
    ident = T.device_identity()
    table = {{"schema": T.SCHEMA, "validators": {{**{{k: ident[k] for k in T.MATCH}}, "tp": 1, "heads": [24, 4]}},
             "provenance": {{}}, "decode": {{"launch": {{"int8": [64, 4, 2]}}, **({{"qk_int8": qk}} if qk is not None else {{}})}}}}
    path = os.path.join(os.environ["TMP"], "table.json")
    with open(path, "w") as f:
        json.dump(table, f)
    os.environ["VLLM_FORGE_TUNED"] = path
    from int8_attention_case import run_case
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.attention.ops import forge_split_kv_decode as skd
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg = EngineArgs(model={str(MODEL_DIR)!r}, max_model_len=32768, skip_tokenizer_init=True,
                     kv_cache_dtype="int8").create_engine_config()
    spec = FullAttentionSpec(block_size=1552, num_kv_heads=4, head_size=256, dtype=torch.int8, kv_scale_bytes=4)
    builder = TritonAttentionMetadataBuilder(spec, ["attn"], cfg, torch.device("cpu"))
    seen = []
    real = skd._split_kv_decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **k):
                seen.append([bool(k["KV_INT8"]), bool(k["QK_INT8"]), k["TILE_N"]])
                return real[grid](*a, **k)
            return launch

    skd._split_kv_decode_kernel = Spy()
    try:
        res = run_case(seq_lens=[1600, 700], query_lens=[1, 1], block_size=1552, seed=5, q_dtype=torch.bfloat16,
                       builder=builder, run_unquantized=True)
    finally:
        skd._split_kv_decode_kernel = real
    print("RESULT" + json.dumps(dict(seen=seen, err=res["err_deq"], err_unq=res["err_unq_kernel"], nan=res["nan"],
                                     table=T.active() is not None)))
    """
)


def launches(run_in_vllm, tmp_path, qk):
    res = run_in_vllm(SNIPPET, env={"TABLE_QK": json.dumps(qk), "TMP": str(tmp_path)})
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")][-1]
    out = json.loads(line[len("RESULT"):])
    assert out["table"], "the table was not taken"
    assert not out["nan"] and out["err"] < 3e-2 and out["err_unq"] < 1e-2, out
    int8 = [s for s in out["seen"] if s[0]]
    bf16 = [s for s in out["seen"] if not s[0]]
    assert int8 and bf16, out["seen"]           # both caches decoded through the split-KV kernel
    assert all(s[2] == 64 for s in int8), int8  # the table's int8 launch reached the kernel
    assert not any(s[1] for s in bf16), bf16    # a 16-bit cache never takes the int8 dot
    return {s[1] for s in int8}


@pytest.mark.parametrize("qk, expect", [(False, {False}), (True, {True}), (None, {True})])
def test_the_tables_qk_choice_reaches_every_int8_decode_launch(run_in_vllm, tmp_path, qk, expect):
    assert launches(run_in_vllm, tmp_path, qk) == expect
