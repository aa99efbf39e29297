"""int8 KV cache: CLI/config plumbing and hybrid page accounting, inside the patched vLLM.

Runs vLLM's own code (argument parser, EngineArgs -> VllmConfig, the Qwen3.5 hybrid
page-size hook, Attention.get_kv_cache_spec, get_kv_cache_groups) on the Qwen3.5-27B
config.json in configs/models/qwen3.5-27b. Expected numbers are derived in the test from
the model shape (GDN state bytes, per-token attention bytes), not copied from a run.
"""

import json
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "configs" / "models" / "qwen3.5-27b"

# Shared prelude: build the engine config for the 27B config.json on the CPU platform.
PRELUDE = textwrap.dedent(
    f"""
    import json, math, types
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def engine_config(*extra):
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", {str(MODEL_DIR)!r}, "--max-model-len", "32768",
                                  "--skip-tokenizer-init", *extra])
        return EngineArgs.from_cli_args(args).create_engine_config()
    """
)


def _hybrid_snippet(dtype: str) -> str:
    return PRELUDE + textwrap.dedent(
        f"""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype, kv_cache_scale_bytes
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups, unify_kv_cache_spec_page_size
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

        # The CPU platform resets cache_config.block_size for its own backend after the
        # hybrid hook ran, so record what the hook itself picked.
        from vllm.model_executor.models import config as mconf
        picked = []
        _orig = mconf.HybridAttentionMambaModelConfig.verify_and_update_config.__func__
        def _rec(cls, vllm_config):
            _orig(cls, vllm_config)
            picked.append(vllm_config.cache_config.block_size)
        mconf.HybridAttentionMambaModelConfig.verify_and_update_config = classmethod(_rec)

        cfg = engine_config("--kv-cache-dtype", {dtype!r})
        cc, mc, pc = cfg.cache_config, cfg.model_config, cfg.parallel_config
        hf = json.load(open({str(MODEL_DIR / "config.json")!r}))["text_config"]

        # expected numbers from the model shape
        Hkv, D = hf["num_key_value_heads"], hf["head_dim"]
        conv_dim = hf["linear_key_head_dim"] * hf["linear_num_key_heads"] * 2 + \\
            hf["linear_value_head_dim"] * hf["linear_num_value_heads"]
        conv_bytes = (hf["linear_conv_kernel_dim"] - 1) * conv_dim * 2           # bf16
        ssm_bytes = hf["linear_num_value_heads"] * hf["linear_key_head_dim"] * \\
            hf["linear_value_head_dim"] * 4                                          # fp32
        mamba_page = conv_bytes + ssm_bytes
        elt = 1 if {dtype!r} == "int8" else 2
        scale = 4 if {dtype!r} == "int8" else 0
        per_token = 2 * Hkv * (D * elt + scale)
        exp_block = 16 * math.ceil(mamba_page / (16 * per_token))

        # vLLM's own GDN state shapes must give the same mamba page
        model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        shapes = model_cls.get_mamba_state_shape_from_config(cfg)
        dtypes = model_cls.get_mamba_state_dtype_from_config(cfg)
        vllm_mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes

        # the real attention spec, from the patched Attention.get_kv_cache_spec
        cc.block_size = 16          # what the ROCm platform hook leaves for a hybrid model
        layer = types.SimpleNamespace(
            attn_type="decoder", sliding_window=None, num_kv_heads=Hkv, head_size=D,
            head_size_v=D, kv_cache_dtype=cc.cache_dtype,
            kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc))
        attn_spec = Attention.get_kv_cache_spec(layer, cfg)
        gdn_spec = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=cc.mamba_block_size,
                             page_size_padded=cc.mamba_page_size_padded,
                             mamba_type="gdn_attention", mamba_cache_mode=cc.mamba_cache_mode)
        specs = {{}}
        for i in range(hf["num_hidden_layers"]):
            name = f"model.layers.{{i}}.attn"
            specs[name] = attn_spec if hf["layer_types"][i] == "full_attention" else gdn_spec
        unified = unify_kv_cache_spec_page_size(dict(specs))
        with set_current_vllm_config(cfg):
            groups = get_kv_cache_groups(cfg, dict(specs))
        attn_groups = [g for g in groups if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        print("JSON" + json.dumps(dict(
            picked=picked, mamba_page=mamba_page, vllm_mamba_page=vllm_mamba_page,
            padded=cc.mamba_page_size_padded, per_token=per_token, exp_block=exp_block,
            spec_type=type(attn_spec).__name__, spec_scale=attn_spec.kv_scale_bytes,
            spec_page16=attn_spec.page_size_bytes,
            scale_helper=kv_cache_scale_bytes({dtype!r}),
            unified_block=unified["model.layers.3.attn"].block_size,
            unified_page=unified["model.layers.3.attn"].page_size_bytes,
            n_groups=len(groups), n_attn_groups=len(attn_groups),
            group_block=attn_groups[0].kv_cache_spec.block_size,
            group_spec_type=type(attn_groups[0].kv_cache_spec).__name__,
            gdn_page=gdn_spec.page_size_bytes)))
        """
    )


def _json(res):
    line = [l for l in res.stdout.splitlines() if l.startswith("JSON")][-1]
    return json.loads(line[4:])


@pytest.mark.parametrize("dtype,block,per_token", [("int8", 1552, 2080), ("auto", 784, 4096)])
def test_qwen35_hybrid_block_and_unification(run_in_vllm, dtype, block, per_token):
    r = _json(run_in_vllm(_hybrid_snippet(dtype)))
    # vLLM's GDN shapes agree with the model card arithmetic
    assert r["vllm_mamba_page"] == r["mamba_page"] == 3_207_168
    assert r["per_token"] == per_token
    # the hybrid hook picks the block size the real specs need ...
    assert r["picked"] == [r["exp_block"]] == [block]
    assert r["padded"] == block * per_token
    # ... and the real attention spec carries the same per-token bytes
    assert r["spec_type"] == "FullAttentionSpec"
    assert r["spec_page16"] == 16 * per_token
    assert r["spec_scale"] == r["scale_helper"] == (4 if dtype == "int8" else 0)
    # unification by vLLM's own code succeeds and lands on the same block
    assert r["unified_block"] == block and r["unified_page"] == r["padded"]
    assert r["gdn_page"] == r["padded"]
    assert r["n_groups"] == 4 and r["n_attn_groups"] == 1
    assert r["group_block"] == block and r["group_spec_type"] == "FullAttentionSpec"


def test_cli_accepts_int8_and_refuses_calculate_kv_scales(run_in_vllm):
    code = PRELUDE + textwrap.dedent(
        """
        from typing import get_args
        from vllm.config.cache import CacheDType
        from vllm.utils.torch_utils import kv_cache_scale_bytes
        from vllm.v1.attention.backend import is_int8_kv_cache, is_quantized_kv_cache
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        a = parser.parse_args(["--model", "x", "--kv-cache-dtype", "int8"])
        assert a.kv_cache_dtype == "int8", a.kv_cache_dtype
        assert "int8" in get_args(CacheDType)
        cfg = engine_config("--kv-cache-dtype", "int8")
        assert cfg.cache_config.cache_dtype == "int8"
        assert kv_cache_scale_bytes("int8") == 4
        assert kv_cache_scale_bytes("auto") == kv_cache_scale_bytes("fp8") == 0
        assert is_int8_kv_cache("int8") and not is_int8_kv_cache("fp8")
        assert not is_quantized_kv_cache("int8") and is_quantized_kv_cache("fp8")
        try:
            engine_config("--kv-cache-dtype", "int8", "--calculate-kv-scales")
        except Exception as e:
            msg = str(e)
            assert "--calculate-kv-scales" in msg and "int8" in msg, msg
            print("REFUSED")
        else:
            raise AssertionError("int8 + --calculate-kv-scales was accepted")
        # bf16 + --calculate-kv-scales stays accepted (only int8 is refused)
        engine_config("--calculate-kv-scales")
        """
    )
    res = run_in_vllm(code)
    assert "REFUSED" in res.stdout


def test_backend_selector_accepts_int8_only_on_triton(run_in_vllm):
    code = textwrap.dedent(
        """
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        assert TritonAttentionBackend.supports_kv_cache_dtype("int8")
        assert not FlashAttentionBackend.supports_kv_cache_dtype("int8")
        print("OK")
        """
    )
    assert "OK" in run_in_vllm(code).stdout
