"""The patched unified 2D attention kernel, compiled ahead of time for the AMD stand-in targets
(gfx90a, gfx942; upstream Triton cannot target gfx936) with exactly the launch that
unified_attention() picks on HIP for prefill-sized queries (prefill_launch_2d): LDS within the
64 KiB of the DCU and no spills to scratch memory. No GPU needed."""

import json
import textwrap

AOT = textwrap.dedent(
    """
    import json, re, sys, torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import vllm.v1.attention.ops.triton_unified_attention as ua

    H, HKV, D = 24, 4, 256
    fn = ua.kernel_unified_attention_2d

    def source(kv, block_size, block_m, tile):
        kvp = "*i8" if kv == torch.int8 else "*bf16"
        ptr = dict(output_ptr="*bf16", query_ptr="*bf16", key_cache_ptr=kvp, value_cache_ptr=kvp,
                   sink_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32", alibi_slopes_ptr="*fp32",
                   qq_bias_ptr="*fp32", mm_prefix_range_ptr="*i32", query_start_len_ptr="*i32",
                   k_scale_cache_ptr="*fp32", v_scale_cache_ptr="*fp32")
        page = 2 * block_size * HKV * ((D + 4) if kv == torch.int8 else D)
        consts = dict(num_query_heads=H, num_queries_per_kv=H // HKV, BLOCK_SIZE=block_size, TILE_SIZE=tile,
                      HEAD_SIZE=D, HEAD_SIZE_PADDED=D, USE_ALIBI_SLOPES=False, USE_ALIBI_SQRT=False,
                      USE_QQ_BIAS=False, USE_SOFTCAP=False, USE_SINKS=False, SLIDING_WINDOW=0,
                      USE_MM_PREFIX=False, MAX_MM_RANGES=0, stride_k_cache_3=1, stride_v_cache_3=1,
                      BLOCK_Q=block_m // (H // HKV), BLOCK_M=block_m, stride_ks_2=1, stride_vs_2=1,
                      KV_INT8=kv == torch.int8, USE_FP8=False, FP8_MIN=-448.0, FP8_MAX=448.0)
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            elif name in ptr:
                sig[name] = ptr[name]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in ("scale", "k_scale", "v_scale", "out_scale", "softcap"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32" if name == "num_seqs" else "i64"
        return ASTSource(fn, sig, constexprs=consts, attrs=attrs)

    out = []
    for arch in ("gfx90a", "gfx942"):
        for kv, bs in ((torch.int8, 1552), (torch.bfloat16, 784)):
            launch = ua.prefill_launch_2d(kv, 4096, H // HKV, is_hip=True)
            block_m, tile, warps, stages = launch
            c = triton.compile(source(kv, bs, block_m, tile), target=GPUTarget("hip", arch, 64),
                               options={"num_warps": warps, "num_stages": stages})
            asm = c.asm["amdgcn"]
            get = lambda pat: max([int(x) for x in re.findall(pat, asm)] or [0])
            out.append(dict(arch=arch, kv=str(kv), launch=launch, lds=int(c.metadata.shared),
                            vgpr_spills=get(r"\\.vgpr_spill_count:\\s*(\\d+)"),
                            sgpr_spills=get(r"\\.sgpr_spill_count:\\s*(\\d+)"),
                            scratch=get(r";\\s*ScratchSize:\\s*(\\d+)"),
                            vgprs=get(r"\\.vgpr_count:\\s*(\\d+)")))
    print("JSON" + json.dumps(out))
    """
)


def test_prefill_launch_compiles_for_amd_within_lds_and_without_scratch(run_in_vllm):
    res = run_in_vllm(AOT, env={"CUDA_VISIBLE_DEVICES": ""})
    rows = json.loads([l for l in res.stdout.splitlines() if l.startswith("JSON")][-1][4:])
    assert len(rows) == 4
    for r in rows:
        print(r)   # recorded in the test log: LDS, registers, SGPR spills (to VGPR lanes, not memory)
        assert r["launch"][0] == 64, r
        assert r["lds"] <= 65536, r
        assert r["vgpr_spills"] == 0 and r["scratch"] == 0, r
