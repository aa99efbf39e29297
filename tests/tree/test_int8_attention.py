"""int8 KV cache through the PATCHED TRITON_ATTN write and unified attention kernels (2D and 3D),
under Triton's interpreter on the CPU, against float64 references.

Each case (tests/tree/helpers/int8_attention_case.py): fresh random inputs, random non-overlapping
block tables, a cache allocation poisoned with 0xFF (int8 -1 / fp32 NaN) and a NaN-poisoned output;
K/V written by TritonAttentionImpl.do_kv_cache_update, attention by TritonAttentionImpl.forward.
Gates: vs float64 attention over the dequantized cache: relative (Frobenius) error <= 1e-3;
int8 vs unquantized cache (the same kernels with a 16-bit cache in one case, else float64 on the
same bf16-rounded K/V): max abs error <= 1e-2 * max|V|. The norm-relative int8-vs-16-bit error of
iid Gaussian data is ~1-1.5 % by construction (per-element int8 error ~0.66 % of sigma and random V
averages out of the output as fast as the error does), so it only gets a loose 3e-2 bound.
The "scales ignored" mutant must be far off, which shows the metric can fail.
"""

import json
import textwrap

import pytest
import torch

SNIPPET = textwrap.dedent(
    """
    import os, sys, json
    os.environ["TRITON_INTERPRET"] = "1"       # before triton is imported
    os.environ["CUDA_VISIBLE_DEVICES"] = ""    # vLLM keeps Triton enabled with no GPU driver
    sys.path.insert(0, "tests/tree/helpers")
    import torch
    from int8_attention_case import run_case
    import vllm.v1.attention.ops.triton_unified_attention as ua
    launches = []

    class Spy:  # records the 2D kernel's tile choice (BLOCK_M, TILE_SIZE) per launch
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            def go(*a, **kw):
                launches.append(dict(kv_int8=bool(kw.get("KV_INT8")), BLOCK_M=kw.get("BLOCK_M"),
                                     TILE_SIZE=kw.get("TILE_SIZE"), grid0=grid[0]))
                return self.k[grid](*a, **kw)
            return go

    ua.kernel_unified_attention_2d = Spy(ua.kernel_unified_attention_2d)
    kw = {kwargs}
    kw.setdefault("run_unquantized", False)
    r = run_case(**kw)
    r["launches_2d"] = launches
    print("JSON" + json.dumps(r))
    """
)

# (id, kwargs). Real Qwen3.5-27B attention shape (24 q / 4 kv heads, head_dim 256) throughout;
# block sizes 16 and the hybrid sizes 784 (bf16) / 1552 (int8) with few blocks.
CASES = [
    ("decode_3d_block1552", dict(seq_lens=[1600, 700], query_lens=[1, 1], block_size=1552,
                                 seq_threshold_3D=8, num_segments=16, seed=1)),
    ("decode_2d_block784", dict(seq_lens=[850, 300], query_lens=[1, 1], block_size=784, seed=2,
                                run_unquantized=True)),
    ("chunked_prefill_cached_prefix_block784",
     dict(seq_lens=[800], query_lens=[24], block_size=784, seed=3)),
    ("chunked_prefill_cached_prefix_block1552",
     dict(seq_lens=[1570], query_lens=[12], block_size=1552, seed=4)),
    ("mixed_batch_block16", dict(seq_lens=[300, 140, 48], query_lens=[1, 16, 48], block_size=16,
                                 seed=5)),
    # a prefill-sized chunk (>= 256 query tokens) takes the int8 prefill tiles (BLOCK_M 64,
    # 10 tokens per program, last program partial); the chunk crosses a block boundary and a
    # decode row shares the launch. Compared with float64 on the same bf16-rounded K/V, not with
    # a second kernel run on an fp32 cache: that run takes upstream's 16-row tiles and costs ~5x
    # the int8 run under the interpreter (~580 s on two cores, past the snippet's time limit);
    # the fp32 cache's launch choice is checked without running it (test_prefill_launch_choice)
    ("long_chunk_mixed_block1552", dict(seq_lens=[1700, 400], query_lens=[300, 1],
                                        block_size=1552, seed=6, run_unquantized=False)),
]
CASES.append(
    # the same long-query launch with a 16-bit cache (the fp16 comparison run of this case goes
    # through the 64-row tiles too); fp16 queries: the interpreter's 16-bit arithmetic is exact
    # enough for the 1e-3 gates, bf16's would not be
    ("long_chunk_fp16_block784", dict(seq_lens=[1000, 300], query_lens=[300, 1], block_size=784,
                                      seed=7, run_unquantized=True, q_dtype=torch.float16)))
# cases whose 2D launches must use the prefill tiles (int8, and 16-bit caches)
LONG_QUERY = {"long_chunk_mixed_block1552", "long_chunk_fp16_block784"}
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _result(res) -> dict:
    """The JSON a snippet printed last (its "JSON"-prefixed line)."""
    return json.loads([l for l in res.stdout.splitlines() if l.startswith("JSON")][-1][4:])


def _run(run_in_vllm, kwargs, env=None):
    return _result(run_in_vllm(SNIPPET.replace("{kwargs}", repr(kwargs)), env=env))


@pytest.mark.parametrize("case_id,kwargs", CASES, ids=[c[0] for c in CASES])
def test_int8_unified_attention_matches_reference(run_in_vllm, case_id, kwargs):
    r = _run(run_in_vllm, kwargs)
    int8_2d = [l for l in r["launches_2d"] if l["kv_int8"]]
    if case_id in LONG_QUERY:
        # prefill-sized queries: 64-row tiles for the int8 cache, and for the unquantized run of
        # the same case when its cache is 16-bit (an fp32 cache keeps upstream's launch)
        assert int8_2d and all(l["BLOCK_M"] == 64 for l in int8_2d), r["launches_2d"]
        if kwargs.get("run_unquantized"):
            other = [l for l in r["launches_2d"] if not l["kv_int8"]]
            sixteen = kwargs.get("q_dtype", torch.float32) in SIXTEEN_BIT
            assert other and all(l["BLOCK_M"] == (64 if sixteen else 16) for l in other), r["launches_2d"]
    else:
        assert all(l["BLOCK_M"] == 16 for l in r["launches_2d"]), r["launches_2d"]
    assert not r["nan"], r
    assert r["poison_kept"], r                       # slot -1 rows and unused blocks untouched
    assert r["err_deq"] <= 1e-3, r                   # kernel vs float64 on the cached int8 K/V
    if "err_unq_kernel" in r:
        assert r["err_unq_kernel"] <= 1e-3, r        # same kernels, unquantized cache
    # int8 cache vs unquantized: max abs error relative to max |V|
    assert r["err_int8_vs_unq"] <= 1e-2, r
    assert r["err_int8_vs_unq_normrel"] <= 3e-2, r   # loose regression bound, see module doc
    assert r["err_mutant"] >= 0.1, r                 # ignoring per-token scales is detectable


def test_prefill_tiles_switch_restores_upstream_launch_for_16bit(run_in_vllm):
    """VLLM_FORGE_PREFILL_TILES=0: the 16-bit cache takes upstream's 16-row tiles again (int8 keeps
    its own), with the same accuracy."""
    # a smaller long-query case than long_chunk_fp16_block784 (260 query tokens, still prefill-sized,
    # the chunk still crossing the 784-token block boundary): its 16-row comparison run costs ~3.5x
    # the 64-row one under the interpreter, and the launch choice alone is test_prefill_launch_choice's
    kwargs = dict(seq_lens=[800, 300], query_lens=[260, 1], block_size=784, seed=8, run_unquantized=True,
                  q_dtype=torch.float16)
    r = _run(run_in_vllm, kwargs, env={"VLLM_FORGE_PREFILL_TILES": "0"})
    bf16 = [l for l in r["launches_2d"] if not l["kv_int8"]]
    assert bf16 and all(l["BLOCK_M"] == 16 for l in bf16), r["launches_2d"]
    assert all(l["BLOCK_M"] == 64 for l in r["launches_2d"] if l["kv_int8"]), r["launches_2d"]
    assert r["err_unq_kernel"] <= 1e-3 and r["err_deq"] <= 1e-3, r


LAUNCH_SNIPPET = textwrap.dedent(
    """
    import json, os
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import vllm.v1.attention.ops.triton_unified_attention as ua
    seen = []

    class Record:  # stands in for the 2D kernel: records its launch, runs nothing
        def __getitem__(self, grid):
            def go(*a, **kw):
                seen.append(dict(BLOCK_M=kw["BLOCK_M"], grid0=grid[0]))
            return go

    ua.kernel_unified_attention_2d = Record()
    H, HKV, D, BS = 24, 4, 256, 16
    out = {}
    for name, qlen in {cases}:
        kv = getattr(torch, name)
        seq = qlen + 100
        nblk = -(-seq // BS)
        q = torch.zeros(qlen, H, D, dtype=kv if kv in (torch.float16, torch.bfloat16) else torch.float32)
        k = torch.zeros(nblk, BS, HKV, D, dtype=kv)
        extra = {}
        if kv == torch.int8:
            extra = dict(k_scale_cache=torch.ones(nblk, HKV, BS), v_scale_cache=torch.ones(nblk, HKV, BS))
        seen.clear()
        ua.unified_attention(q, k, torch.zeros_like(k), torch.empty_like(q),
                             torch.tensor([0, qlen], dtype=torch.int32), qlen,
                             torch.tensor([seq], dtype=torch.int32), seq, D ** -0.5, True, (-1, -1),
                             torch.arange(nblk, dtype=torch.int32)[None], 0, None, None, None, **extra)
        out[f"{name}/{qlen}"] = list(seen)
    print("JSON" + json.dumps(out))
    """
)


@pytest.mark.parametrize("tiles", ["1", "0"])
def test_prefill_launch_choice(run_in_vllm, tiles):
    """Which 2D launch unified_attention() makes, by cache dtype and query length, with the kernel
    replaced by a recorder (nothing runs, so a 300-token query costs nothing on the CPU): prefill-
    sized queries (>= 256) take 64-row tiles for int8 always and for 16-bit caches while
    VLLM_FORGE_PREFILL_TILES is on; an fp32 cache and shorter queries keep upstream's 16 rows."""
    cases = [("float32", 300), ("float16", 300), ("bfloat16", 300), ("int8", 300),
             ("bfloat16", 255), ("int8", 255)]
    got = _result(run_in_vllm(LAUNCH_SNIPPET.replace("{cases}", repr(cases)), env={"VLLM_FORGE_PREFILL_TILES": tiles}))
    want = {"float32/300": 16, "float16/300": 64 if tiles == "1" else 16,
            "bfloat16/300": 64 if tiles == "1" else 16, "int8/300": 64, "bfloat16/255": 16, "int8/255": 16}
    for case, block_m in want.items():
        launches = got[case]
        assert len(launches) == 1, (case, launches)
        assert launches[0]["BLOCK_M"] == block_m, (case, launches)
        # one program per BLOCK_M // 6 query tokens (+ one per sequence): the grid follows the tile
        assert launches[0]["grid0"] == int(case.split("/")[1]) // (block_m // 6) + 1, (case, launches)
