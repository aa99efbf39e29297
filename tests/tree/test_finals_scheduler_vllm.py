"""The finals' scheduler model (scripts/forge/model/sched.py) against vLLM 0.18.1's own Scheduler, run in
the patched tree on the CPU with the Qwen3.5-27B engine config and its real hybrid KV cache config
(get_kv_cache_configs on a small pool): the same requests sent at once, every step's scheduled
tokens per request compared, through chunked prefill, decode, preemption by recompute and
resumption. The model outputs a token where vLLM samples one; vLLM is fed one token per request
whose computed tokens reach its tokens, as its model runner would."""

import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from forge.model.capacity import capacity  # noqa: E402
from forge.model.sched import Engine, serve  # noqa: E402
from forge.model.shape import load_shape  # noqa: E402

MODEL_DIR = ROOT / "configs" / "models" / "qwen3.5-27b"
# 6 requests of 3.0-3.1K tokens, 120-200 outputs, in a pool of 39 usable blocks of 784: 8 blocks each
# once past 3,136 tokens, so the pool runs out while they decode
REQUESTS = [(3130, 150), (3100, 200), (3120, 180), (3125, 200), (3110, 200), (3000, 120)]
BLOCKS, SEQS, BUDGET = 40, 8, 2048


def _snippet(available: int) -> str:
    return textwrap.dedent(f"""
        import json, types
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.sampling_params import SamplingParams
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import MambaSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        hf = json.load(open({str(MODEL_DIR / "config.json")!r}))["text_config"]
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        a = parser.parse_args(["--model", {str(MODEL_DIR)!r}, "--max-model-len", "32768", "--skip-tokenizer-init",
                               "--max-num-seqs", "{SEQS}", "--max-num-batched-tokens", "{BUDGET}",
                               "--no-async-scheduling", "--language-model-only"])
        cfg = EngineArgs.from_cli_args(a).create_engine_config()
        cc, mc, pc = cfg.cache_config, cfg.model_config, cfg.parallel_config
        cc.block_size = 16
        model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        layer = types.SimpleNamespace(
            attn_type="decoder", sliding_window=None, num_kv_heads=mc.get_num_kv_heads(pc),
            head_size=hf["head_dim"], head_size_v=hf["head_dim"], kv_cache_dtype=cc.cache_dtype,
            kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc))
        attn = Attention.get_kv_cache_spec(layer, cfg)
        gdn = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(cfg),
                        dtypes=model_cls.get_mamba_state_dtype_from_config(cfg), block_size=cc.mamba_block_size,
                        page_size_padded=cc.mamba_page_size_padded, mamba_type="gdn_attention",
                        mamba_cache_mode=cc.mamba_cache_mode)
        specs = {{f"model.layers.{{i}}.attn": attn if hf["layer_types"][i] == "full_attention" else gdn
                 for i in range(hf["num_hidden_layers"])}}
        with set_current_vllm_config(cfg):
            kcfg = kv_cache_utils.get_kv_cache_configs(cfg, [specs], [{available}])[0]
        block = min(g.kv_cache_spec.block_size for g in kcfg.kv_cache_groups)
        cc.block_size = block
        cc.num_gpu_blocks = kcfg.num_blocks
        sched = Scheduler(vllm_config=cfg, kv_cache_config=kcfg, block_size=block, log_stats=False,
                          structured_output_manager=StructuredOutputManager(cfg))
        for i, (p, o) in enumerate({REQUESTS!r}):
            sp = SamplingParams(max_tokens=o, ignore_eos=True)
            sp.update_from_generation_config({{}}, 1)
            sched.add_request(Request(str(i), [7] * p, sp, None, arrival_time=float(i)))
        steps = []
        while sched.has_unfinished_requests():
            out = sched.schedule()
            n = out.num_scheduled_tokens
            ids = list(n)
            order = {{r.request_id: r for r in sched.running}}
            items = []
            sampled = []
            for rid in ids:
                r = order[rid]
                # schedule() has advanced num_computed_tokens by the step's tokens already
                items.append([int(rid), n[rid], r.num_computed_tokens - n[rid]])
                done = r.num_computed_tokens >= r.num_tokens
                sampled.append([7] if done else [])
            steps.append(items)
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={{r: k for k, r in enumerate(ids)}},
                                    sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={{}},
                                    pooler_output=[])
            sched.update_from_output(out, mro)
        print("JSON" + json.dumps(dict(num_blocks=kcfg.num_blocks, block=block, steps=steps)))
        """)


def test_the_scheduler_model_steps_as_vllms_scheduler(run_in_vllm):
    shape = load_shape()
    page, size = shape.page_bytes(1, "bf16"), shape.groups()[0]
    available = BLOCKS * size * page
    res = run_in_vllm(_snippet(available), timeout=900)
    got = json.loads([x for x in res.stdout.splitlines() if x.startswith("JSON")][-1][4:])
    cap = capacity(shape, tp=1, kv_cache_memory_bytes=available)
    assert (got["num_blocks"], got["block"]) == (cap.num_blocks, cap.block_size) == (BLOCKS, 784)
    log = []

    def cost(items):
        log.append(items)
        return 1.0

    eng = Engine(cap, SEQS, BUDGET, cost)
    seen = []
    orig = eng.schedule

    def recording():
        items = orig()
        seen.append([[r.rid, n, r.computed] for r, n in items])
        return items

    eng.schedule = recording
    reqs = serve(eng, REQUESTS, concurrency=len(REQUESTS))
    # vLLM lists a step's requests running first then new, as the model does; compare as sets per step
    ours = [sorted(map(tuple, s)) for s in seen if s]
    theirs = [sorted(map(tuple, s)) for s in got["steps"] if s]
    assert eng.preemptions > 0, "the case must preempt to test preemption"
    assert ours == theirs
    assert all(r.out == o for r, (_, o) in zip(reqs, REQUESTS))
