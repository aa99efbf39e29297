"""The attention block size per tensor-parallel rank, from vLLM's own hybrid page rule (the Qwen3.5
hook run by EngineArgs -> VllmConfig on the CPU platform) at TP 1/2/4/8 for a bf16 and an int8 cache,
against the arithmetic of the model's shape: one attention page as large as one rank's GDN state page
(the conv and SSM state split over the ranks; KV heads split, or copied once tp exceeds them), a
multiple of 16 tokens. The kernel tests (tests/kernels/test_rank_geometry.py) run at these blocks."""

import json
import math
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "configs" / "models" / "qwen3.5-27b"

SNIPPET = textwrap.dedent(
    f"""
    import json
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.model_executor.models import config as mconf
    picked = []
    _orig = mconf.HybridAttentionMambaModelConfig.verify_and_update_config.__func__
    def _rec(cls, vllm_config):
        _orig(cls, vllm_config)
        picked.append(vllm_config.cache_config.block_size)
    mconf.HybridAttentionMambaModelConfig.verify_and_update_config = classmethod(_rec)
    out = {{}}
    for tp in (1, 2, 4, 8):
        for dt in ("auto", "int8"):
            parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
            args = parser.parse_args(["--model", {str(MODEL_DIR)!r}, "--max-model-len", "32768",
                                      "--skip-tokenizer-init", "--kv-cache-dtype", dt, "--tensor-parallel-size", str(tp)])
            picked.clear()
            cfg = EngineArgs.from_cli_args(args).create_engine_config()
            out[f"{{tp}}/{{dt}}"] = dict(block=picked[-1], kv_heads=cfg.model_config.get_num_kv_heads(cfg.parallel_config),
                                        q_heads=cfg.model_config.get_num_attention_heads(cfg.parallel_config))
    print("RESULT" + json.dumps(out))
    """
)


def expected(tp: int, int8: bool) -> dict:
    c = json.loads((MODEL_DIR / "config.json").read_text())["text_config"]
    conv_dim = (c["linear_key_head_dim"] * c["linear_num_key_heads"] * 2
                + c["linear_value_head_dim"] * c["linear_num_value_heads"]) // tp
    gdn_page = (c["linear_conv_kernel_dim"] - 1) * conv_dim * 2 + \
        c["linear_num_value_heads"] // tp * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4
    hkv = max(1, c["num_key_value_heads"] // tp)
    per_token = 2 * hkv * (c["head_dim"] + 4 if int8 else 2 * c["head_dim"])
    return dict(block=16 * math.ceil(gdn_page / (16 * per_token)), kv_heads=hkv, q_heads=c["num_attention_heads"] // tp)


def test_blocks_per_rank_follow_vllms_page_rule(run_in_vllm):
    res = run_in_vllm(SNIPPET)
    got = json.loads(next(l for l in res.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    for tp in (1, 2, 4, 8):
        for dt in ("auto", "int8"):
            assert got[f"{tp}/{dt}"] == expected(tp, dt == "int8"), (tp, dt, got)
    # the numbers the kernels are tested at: bf16 784 (400 at TP8), int8 1552 (784 at TP8, where the one
    # KV head is copied while the GDN state halves again)
    assert [got[f"{tp}/auto"]["block"] for tp in (1, 2, 4, 8)] == [784, 784, 784, 400]
    assert [got[f"{tp}/int8"]["block"] for tp in (1, 2, 4, 8)] == [1552, 1552, 1552, 784]
    assert [(got[f"{tp}/auto"]["q_heads"], got[f"{tp}/auto"]["kv_heads"]) for tp in (1, 2, 4, 8)] == \
        [(24, 4), (12, 2), (6, 1), (3, 1)]
