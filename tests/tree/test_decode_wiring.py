"""Split-KV decode wiring in TRITON_ATTN (VLLM_FORGE_DECODE): the real metadata builder plans the
segments and preallocates the workspace; TritonAttentionImpl.forward sends pure-decode batches to
forge_split_kv_decode. Checked on the CPU under Triton's interpreter:

* new path (VLLM_FORGE_DECODE=1) vs upstream's unified 3D kernel (VLLM_FORGE_DECODE=0), int8 and
  unquantized caches, 24 q / 4 kv heads, head_dim 256, block 1552, random block tables;
* the decode forward neither syncs with nor allocates on the device: it is re-run with
  Tensor.item/cpu/tolist/numpy/__bool__/__int__/__float__ and torch.empty/zeros/ones/full/tensor/
  *_like patched to raise, and the kernels replaced by recorders (so the interpreter, which
  copies tensors to the host itself, is not what is being checked).
"""

import json
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "configs" / "models" / "qwen3.5-27b"

SNIPPET = textwrap.dedent(
    f"""
    import os, sys, json, contextlib
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, "tests/tree/helpers")
    import torch
    from int8_attention_case import run_case
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.attention.ops import forge_split_kv_decode as skd
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg = EngineArgs(model={str(MODEL_DIR)!r}, max_model_len=32768, skip_tokenizer_init=True,
                     kv_cache_dtype="int8").create_engine_config()
    BS = 1552
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=256, dtype=torch.int8,
                             kv_scale_bytes=4)
    def builder(flag):
        os.environ["VLLM_FORGE_DECODE"] = flag
        return TritonAttentionMetadataBuilder(spec, ["attn"], cfg, torch.device("cpu"))
    b_new, b_old = builder("1"), builder("0")
    case = dict(seq_lens=[1600, 700], query_lens=[1, 1], block_size=BS, seed=11,
                run_unquantized=True, return_outputs=True)

    class Rec:
        def __init__(self): self.calls = 0
        def __getitem__(self, grid):
            def launch(*a, **k): self.calls += 1
            return launch

    BANNED_T = ["item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__"]
    BANNED_F = ["empty", "zeros", "ones", "full", "tensor", "empty_like", "zeros_like", "full_like"]
    @contextlib.contextmanager
    def no_sync_no_alloc():
        saved_t = {{n: getattr(torch.Tensor, n) for n in BANNED_T}}
        saved_f = {{n: getattr(torch, n) for n in BANNED_F}}
        def bad(name):
            def f(*a, **k): raise AssertionError("host sync/allocation in decode: " + name)
            return f
        try:
            for n in BANNED_T: setattr(torch.Tensor, n, bad("Tensor." + n))
            for n in BANNED_F: setattr(torch, n, bad("torch." + n))
            yield
        finally:
            for n, f in saved_t.items(): setattr(torch.Tensor, n, f)
            for n, f in saved_f.items(): setattr(torch, n, f)

    guard = dict(decode_calls=0, reduce_calls=0, segments=[])
    def checked(call, md):
        call()                                   # the real run (numbers)
        k1, k2 = skd._split_kv_decode_kernel, skd._split_kv_reduce_kernel
        r1, r2 = Rec(), Rec()
        skd._split_kv_decode_kernel, skd._split_kv_reduce_kernel = r1, r2
        try:
            with no_sync_no_alloc():
                call()                           # the same forward, kernels recorded
        finally:
            skd._split_kv_decode_kernel, skd._split_kv_reduce_kernel = k1, k2
        guard["decode_calls"] += r1.calls
        guard["reduce_calls"] += r2.calls
        guard["segments"].append(md.forge_decode_segments)

    new = run_case(builder=b_new, forward_wrapper=checked, **case)
    old = run_case(builder=b_old, **case)
    diff = {{k: float((new["_outs"][k].double() - old["_outs"][k].double()).norm()
                      / old["_outs"][k].double().norm()) for k in ("int8", "auto")}}
    out = dict(diff=diff, guard=guard, plan=b_new.forge_decode_plan, old_plan=b_old.forge_decode_plan,
               ws_shapes={{s: list(w[0].shape) for s, w in b_new.forge_decode_workspaces.items()}},
               new_err=new["err_deq"], old_err=old["err_deq"], nan=new["nan"] or old["nan"])
    print("JSON" + json.dumps(out))
    """
)


def test_split_kv_decode_matches_upstream_and_never_syncs(run_in_vllm):
    res = run_in_vllm(SNIPPET)
    r = json.loads([l for l in res.stdout.splitlines() if l.startswith("JSON")][-1][4:])
    assert not r["nan"], r
    assert r["old_plan"] == {}, r                        # VLLM_FORGE_DECODE=0: upstream only
    assert r["plan"] and all(s >= 1 for s in r["plan"].values()), r
    assert r["guard"]["decode_calls"] == 2, r            # int8 and unquantized decode took it
    assert all(s >= 2 for s in r["guard"]["segments"]), r
    assert r["diff"]["int8"] <= 1e-4 and r["diff"]["auto"] <= 1e-4, r   # same math, fp32 queries
    assert r["new_err"] <= 1e-3 and r["old_err"] <= 1e-3, r
