"""The capacity planner (scripts/forge/model/capacity.py) against vLLM 0.18.1's own code, run in the
patched tree on the CPU: for TP1 and TP2, bf16 and int8 KV, the engine config of the Qwen3.5-27B
config.json (the hybrid hook's block and padded GDN page), the real layer specs, `get_kv_cache_configs`
with the planner's available bytes (num_blocks, and the "GPU KV cache size" line vLLM logs), the block
pool's free blocks, and the blocks the KV cache manager's coordinator allocates for requests of
several lengths. Every number the planner gives is compared with vLLM's."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from forge.model.capacity import capacity  # noqa: E402
from forge.model.shape import load_shape  # noqa: E402

MODEL_DIR = ROOT / "configs" / "models" / "qwen3.5-27b"
CASES = [(1, "bf16"), (1, "int8"), (2, "bf16"), (2, "int8")]
LENGTHS = [1, 783, 784, 785, 9058, 23425, 32767]


def _snippet(cases: list[tuple[int, str, int]]) -> str:
    return textwrap.dedent(f"""
        import io, json, logging, re, types
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import MambaSpec

        hf = json.load(open({str(MODEL_DIR / "config.json")!r}))["text_config"]
        out = []
        for tp, dtype, available in {cases!r}:
            parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
            a = parser.parse_args(["--model", {str(MODEL_DIR)!r}, "--max-model-len", "32768", "--skip-tokenizer-init",
                                   "--tensor-parallel-size", str(tp), "--kv-cache-dtype",
                                   "auto" if dtype == "bf16" else dtype])
            cfg = EngineArgs.from_cli_args(a).create_engine_config()
            cc, mc, pc = cfg.cache_config, cfg.model_config, cfg.parallel_config
            cc.block_size = 16          # what the ROCm platform hook leaves for a hybrid model
            model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
            shapes = model_cls.get_mamba_state_shape_from_config(cfg)
            dtypes = model_cls.get_mamba_state_dtype_from_config(cfg)
            layer = types.SimpleNamespace(
                attn_type="decoder", sliding_window=None, num_kv_heads=mc.get_num_kv_heads(pc),
                head_size=hf["head_dim"], head_size_v=hf["head_dim"], kv_cache_dtype=cc.cache_dtype,
                kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc))
            attn = Attention.get_kv_cache_spec(layer, cfg)
            gdn = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=cc.mamba_block_size,
                            page_size_padded=cc.mamba_page_size_padded, mamba_type="gdn_attention",
                            mamba_cache_mode=cc.mamba_cache_mode)
            specs = {{f"model.layers.{{i}}.attn": attn if hf["layer_types"][i] == "full_attention" else gdn
                     for i in range(hf["num_hidden_layers"])}}
            buf = io.StringIO()
            handler = logging.StreamHandler(buf)
            logging.getLogger("vllm").addHandler(handler)
            logging.getLogger("vllm").setLevel(logging.INFO)
            with set_current_vllm_config(cfg):
                kcfg = kv_cache_utils.get_kv_cache_configs(cfg, [specs], [available])[0]
            logging.getLogger("vllm").removeHandler(handler)
            m = re.search(r"GPU KV cache size: ([0-9,]+) tokens", buf.getvalue())
            mgr = KVCacheManager(kcfg, max_model_len=32768, hash_block_size=16, enable_caching=False)
            groups = len(kcfg.kv_cache_groups)
            need = {{}}
            for t in {LENGTHS!r}:
                need[t] = mgr.coordinator.get_num_blocks_to_allocate(
                    request_id="r", num_tokens=t, new_computed_blocks=tuple(() for _ in range(groups)),
                    num_encoder_tokens=0, total_computed_tokens=0, num_tokens_main_model=t)
            out.append(dict(tp=tp, dtype=dtype, num_blocks=kcfg.num_blocks, groups=groups,
                            block=min(g.kv_cache_spec.block_size for g in kcfg.kv_cache_groups),
                            page=kcfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
                            tensors=len(kcfg.kv_cache_tensors),
                            reported=int(m.group(1).replace(",", "")) if m else None,
                            free=mgr.block_pool.get_num_free_blocks(), need=need))
        print("JSON" + json.dumps(out))
        """)


@pytest.fixture(scope="module")
def vllm_numbers(run_in_vllm):
    shape = load_shape()
    caps = {(tp, dt): capacity(shape, tp=tp, kv_dtype=dt) for tp, dt in CASES}
    res = run_in_vllm(_snippet([(tp, dt, caps[(tp, dt)].kv_bytes) for tp, dt in CASES]), timeout=900)
    line = [x for x in res.stdout.splitlines() if x.startswith("JSON")][-1]
    return caps, {(r["tp"], r["dtype"]): r for r in json.loads(line[4:])}


@pytest.mark.parametrize("tp,dtype", CASES)
def test_the_planner_gives_vllms_blocks_and_reported_tokens(vllm_numbers, tp, dtype):
    caps, got = vllm_numbers
    cap, v = caps[(tp, dtype)], got[(tp, dtype)]
    assert (v["block"], v["page"], v["groups"], v["tensors"]) == \
        (cap.block_size, cap.page_bytes, cap.attn_groups + cap.gdn_groups, cap.group_size)
    assert v["num_blocks"] == cap.num_blocks
    assert v["reported"] == cap.reported_tokens
    assert v["free"] == cap.usable_blocks


@pytest.mark.parametrize("tp,dtype", CASES)
def test_the_planner_counts_a_requests_blocks_as_vllms_manager_does(vllm_numbers, tp, dtype):
    caps, got = vllm_numbers
    cap, v = caps[(tp, dtype)], got[(tp, dtype)]
    assert {int(t): n for t, n in v["need"].items()} == {t: cap.blocks_for(t) for t in LENGTHS}
