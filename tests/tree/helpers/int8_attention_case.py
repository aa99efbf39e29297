"""One attention case through the patched TRITON_ATTN impl (write + forward), vs float64 references.

Runs inside the patched vLLM (CPU: under TRITON_INTERPRET=1, GPU: natively). Used by the tree
tests and by kernels/bench/bench_unified_int8.py's correctness pass, so every number they assert
comes from this one code path:

  cache  = a raw int8 allocation of num_blocks * page_size_bytes (the page size of the patched
           FullAttentionSpec), viewed with TritonAttentionBackend.get_kv_cache_shape(...), as
           vLLM's model runner does; poisoned with 0xFF bytes (int8 -1, fp32 NaN) first.
  write  = TritonAttentionImpl.do_kv_cache_update for every token of every sequence (context and
           new tokens), with some slot_mapping entries -1 (padding) that must be skipped.
  read   = TritonAttentionImpl.forward for the new tokens (query_len per sequence), with
           TritonAttentionMetadata built from random, non-overlapping block tables.
  refs   = float64 causal attention over (a) the K/V the int8 cache actually holds (dequantized
           through the int8 views) and (b) the same impl run with an unquantized cache
           (kv_cache_dtype "auto"; fp32 cache holding the bf16-rounded K/V on CPU, bf16 on GPU).

Metric: relative Frobenius error ||out - ref|| / ||ref|| over the new tokens.
"""

from __future__ import annotations

import math
import os
import types

import torch


def _import_vllm():
    from vllm.utils.torch_utils import kv_cache_scale_bytes
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
        TritonAttentionMetadata,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return TritonAttentionBackend, TritonAttentionImpl, TritonAttentionMetadata, FullAttentionSpec, kv_cache_scale_bytes


def make_block_tables(seq_lens, block_size, gen):
    need = [max(1, math.ceil(l / block_size)) for l in seq_lens]
    num_blocks = sum(need) + 2  # two spare blocks nobody owns (stay poisoned)
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[pos:pos + n].to(torch.int32)
        bt[i, n:] = perm[-1].to(torch.int32)  # padding entries point at a poisoned block
        pos += n
    return bt, num_blocks


def layer_stub(device):
    one = torch.ones((), dtype=torch.float32, device=device)
    return types.SimpleNamespace(_k_scale=one, _v_scale=one, _q_scale_float=1.0,
                                 _k_scale_float=1.0, _v_scale_float=1.0)


def build_metadata(Meta, *, seq_lens, query_lens, block_table, slot_mapping, device,
                   seq_threshold_3D=None, num_segments=16, num_q_heads=None, head_size=None,
                   extra=None):
    num_seqs = len(seq_lens)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    hp = 1 << (head_size - 1).bit_length()
    thr = num_seqs if seq_threshold_3D is None else seq_threshold_3D
    so = torch.empty((max(thr, 1), num_q_heads, num_segments, hp), dtype=torch.float32, device=device)
    sm = torch.empty((max(thr, 1), num_q_heads, num_segments), dtype=torch.float32, device=device)
    se = torch.empty_like(sm)
    kw = dict(
        num_actual_tokens=int(sum(query_lens)), max_query_len=int(max(query_lens)),
        query_start_loc=qsl.to(device), max_seq_len=int(max(seq_lens)),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device), slot_mapping=slot_mapping.to(device),
        seq_threshold_3D=thr, num_par_softmax_segments=num_segments,
        softmax_segm_output=so, softmax_segm_max=sm, softmax_segm_expsum=se,
        use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None,
        prefix_kv_lens=None, suffix_kv_lens=None,
    )
    kw.update(extra or {})
    return Meta(**kw)


def ref_attention(q, k_tok, v_tok, seq_lens, query_lens, scale):
    """float64 causal GQA attention. q: (T, Hq, D); k_tok/v_tok: list per seq of (L, Hkv, D)."""
    outs = []
    t0 = 0
    for i, (L, ql) in enumerate(zip(seq_lens, query_lens)):
        qi = q[t0:t0 + ql].double()                      # (ql, Hq, D)
        k = k_tok[i][:L].double()
        v = v_tok[i][:L].double()
        g = qi.shape[1] // k.shape[1]
        k = k.repeat_interleave(g, dim=1)                # (L, Hq, D)
        v = v.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        qpos = torch.arange(L - ql, L)[:, None]
        kpos = torch.arange(L)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        t0 += ql
    return torch.cat(outs, 0)


def rel_err(out, ref):
    out = out.double()
    return float((out - ref).norm() / ref.norm())


# Optional K outlier channels (x(1+OUTLIER) on 5 % of channels); off in the gates, where the
# int8-vs-16-bit bound (1e-2) is specified for well-conditioned rows.
OUTLIER = float(os.environ.get('FORGE_TEST_K_OUTLIER', '0'))
# log-normal spread of per-token K/V magnitudes (makes per-token scales matter)
MAG_SIGMA = float(os.environ.get('FORGE_TEST_MAG_SIGMA', '0.25'))


def run_case(*, seq_lens, query_lens, block_size, num_q_heads=24, num_kv_heads=4, head_size=256,
             q_dtype=torch.float32, ref_cache_dtype=None, seed=0, device="cpu",
             seq_threshold_3D=None, num_segments=16, pad_tokens=3, impl_hook=None,
             metadata_extra=None, return_outputs=False, run_unquantized=True, builder=None,
             forward_wrapper=None, pass_new_kv=False):
    """Returns dict(err_deq, err_unq, err_noscale, err_int8_vs_unq, nan, poisoned_slots_ok, ...).

    ``pass_new_kv``: hand forward() the new tokens' K/V as vLLM's attention layer does (the
    chunked-prefill route reads them from there); by default forward gets None, as the cache-only
    paths need nothing else."""
    Backend, Impl, Meta, Spec, scale_bytes = _import_vllm()
    gen = torch.Generator().manual_seed(seed)
    ref_cache_dtype = ref_cache_dtype or q_dtype
    scale = head_size ** -0.5
    num_seqs = len(seq_lens)
    bt, num_blocks = make_block_tables(seq_lens, block_size, gen)

    # inputs: K/V for every token of every sequence (bf16-rounded so both caches see the same
    # values), queries for the last query_len tokens of each sequence. K gets a few outlier
    # channels like post-RoPE keys.
    # Token magnitudes vary (log-normal), so per-token scales matter.
    def tok_scale(L):
        return torch.exp(MAG_SIGMA * torch.randn(L, num_kv_heads, 1, generator=gen))

    k_tok = [(torch.randn(L, num_kv_heads, head_size, generator=gen) * tok_scale(L) *
              (1 + OUTLIER * (torch.rand(head_size, generator=gen) > 0.95))).to(torch.bfloat16).float()
             for L in seq_lens]
    v_tok = [(torch.randn(L, num_kv_heads, head_size, generator=gen) * tok_scale(L))
             .to(torch.bfloat16).float() for L in seq_lens]
    q = torch.randn(sum(query_lens), num_q_heads, head_size, generator=gen).to(q_dtype)

    # slot mapping over all tokens (prefix written in one call, as chunked prefill had done),
    # plus `pad_tokens` padding rows with slot -1 that carry garbage K/V.
    keys, vals, slots = [], [], []
    for i, L in enumerate(seq_lens):
        pos = torch.arange(L)
        slots.append(bt[i, pos // block_size].long() * block_size + pos % block_size)
        keys.append(k_tok[i])
        vals.append(v_tok[i])
    keys.append(torch.full((pad_tokens, num_kv_heads, head_size), 1e4))
    vals.append(torch.full((pad_tokens, num_kv_heads, head_size), 1e4))
    slots.append(torch.full((pad_tokens,), -1, dtype=torch.long))
    all_k = torch.cat(keys).to(device)
    all_v = torch.cat(vals).to(device)
    all_slots = torch.cat(slots).to(device)

    # metadata for the forward (new tokens only)
    new_slots = torch.cat([slots[i][L - ql:] for i, (L, ql) in enumerate(zip(seq_lens, query_lens))])

    results = {}
    outs = {}
    for kv_dtype in (("int8", "auto") if run_unquantized else ("int8",)):
        elt_dtype = torch.int8 if kv_dtype == "int8" else ref_cache_dtype
        spec = Spec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                    dtype=elt_dtype, kv_scale_bytes=scale_bytes(kv_dtype))
        raw = torch.full((num_blocks * spec.page_size_bytes,), -1, dtype=torch.int8, device=device)
        shape = Backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                                           cache_dtype_str=kv_dtype)
        kv_cache = raw.view(elt_dtype).view(shape)
        impl = Impl(num_heads=num_q_heads, head_size=head_size, scale=scale,
                    num_kv_heads=num_kv_heads, alibi_slopes=None, sliding_window=None,
                    kv_cache_dtype=kv_dtype)
        if impl_hook is not None:
            impl_hook(impl)
        layer = layer_stub(device)
        if kv_dtype == "int8":
            impl.do_kv_cache_update(layer, all_k.to(q_dtype), all_v.to(q_dtype), kv_cache,
                                    all_slots)
        else:
            # unquantized reference cache: plain scatter (upstream's writer is not under test)
            valid = all_slots >= 0
            sl = all_slots[valid]
            kc, vc = kv_cache.unbind(1)
            kc[sl // block_size, sl % block_size] = all_k[valid].to(elt_dtype)
            vc[sl // block_size, sl % block_size] = all_v[valid].to(elt_dtype)
        if builder is not None:
            # the real TritonAttentionMetadataBuilder (duck-typed CommonAttentionMetadata)
            qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
            qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
            common = types.SimpleNamespace(
                num_actual_tokens=int(sum(query_lens)), max_query_len=int(max(query_lens)),
                max_seq_len=int(max(seq_lens)), query_start_loc=qsl.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                block_table_tensor=bt.to(device), slot_mapping=new_slots.to(device),
                num_reqs=num_seqs)
            md = builder.build(0, common)
        else:
            md = build_metadata(Meta, seq_lens=seq_lens, query_lens=query_lens, block_table=bt,
                                slot_mapping=new_slots, device=device,
                                seq_threshold_3D=seq_threshold_3D, num_segments=num_segments,
                                num_q_heads=num_q_heads, head_size=head_size,
                                extra=metadata_extra)
        qq = q.to(ref_cache_dtype if kv_dtype == "auto" else q_dtype).to(device)
        out = torch.full((qq.shape[0], num_q_heads, head_size), float("nan"), dtype=qq.dtype,
                         device=device)
        if pass_new_kv:
            kn = torch.cat([k_tok[i][L - ql:] for i, (L, ql) in enumerate(zip(seq_lens, query_lens))])
            vn = torch.cat([v_tok[i][L - ql:] for i, (L, ql) in enumerate(zip(seq_lens, query_lens))])
            kn, vn = kn.to(qq.dtype).to(device), vn.to(qq.dtype).to(device)
        else:
            kn = vn = None
        call = lambda: impl.forward(layer, qq, kn, vn, kv_cache, md, output=out)  # noqa: E731
        if forward_wrapper is not None:
            forward_wrapper(call, md)
        else:
            call()
        outs[kv_dtype] = out.float().cpu()
        if kv_dtype == "int8":
            k_data, v_data, k_sc, v_sc = impl._int8_kv_cache_views(kv_cache)
            kd = (k_data.float() * k_sc.float().transpose(1, 2).unsqueeze(-1)).cpu()
            vd = (v_data.float() * v_sc.float().transpose(1, 2).unsqueeze(-1)).cpu()
            kraw, vraw = k_data.float().cpu(), v_data.float().cpu()
            ksc_t, vsc_t = k_sc.float().cpu().transpose(1, 2), v_sc.float().cpu().transpose(1, 2)
            k_deq, v_deq, k_ns, v_ns = [], [], [], []
            for i, L in enumerate(seq_lens):
                pos = torch.arange(L)
                b, o = bt[i, pos // block_size].long(), pos % block_size
                k_deq.append(kd[b, o])
                v_deq.append(vd[b, o])
                # "scales ignored" mutation: int8 codes times one mean scale per sequence
                k_ns.append(kraw[b, o] * ksc_t[b, o].mean())
                v_ns.append(vraw[b, o] * vsc_t[b, o].mean())
            # untouched spare block must still be poisoned (slot -1 rows skipped)
            used = set(bt.flatten().tolist())
            free = [b for b in range(num_blocks) if b not in used]
            results["poison_kept"] = bool(all((k_data[f].cpu() == -1).all() and
                                              torch.isnan(k_sc[f].cpu()).all() for f in free))
            ref_deq = ref_attention(q.float(), k_deq, v_deq, seq_lens, query_lens, scale)
            ref_ns = ref_attention(q.float(), k_ns, v_ns, seq_lens, query_lens, scale)
            results["err_deq"] = rel_err(outs["int8"], ref_deq)
            results["err_mutant"] = rel_err(ref_ns.float(), ref_deq)
    ref_unq = ref_attention(q.float(), k_tok, v_tok, seq_lens, query_lens, scale)
    # the unquantized comparison: the same kernels with a 16-bit cache, or (CPU, to halve the
    # interpreter time) the float64 reference on the same bf16-rounded K/V
    unq = outs["auto"].double() if run_unquantized else ref_unq
    if run_unquantized:
        results["err_unq_kernel"] = rel_err(outs["auto"], ref_unq)
    v_max = max(float(v.abs().max()) for v in v_tok)
    # quantization error relative to the range of the values being quantized (max |V|), the
    # usual measure for an int8 format; the norm-relative error is reported beside it
    results["err_int8_vs_unq"] = float((outs["int8"].double() - unq).abs().max()) / v_max
    results["err_int8_vs_unq_normrel"] = rel_err(outs["int8"], unq)
    results["nan"] = bool(any(torch.isnan(o).any() for o in outs.values()))
    if return_outputs:
        results["_outs"] = outs
    return results
