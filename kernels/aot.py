#!/usr/bin/env python3
"""Ahead-of-time compile of the forge Triton kernels for GPU targets, without a GPU.

    python kernels/aot.py --target hip:gfx90a --target hip:gfx942 --target cuda:90 --json PATH

Compiles representative specializations (head_dim 256, 24 q / 4 kv heads; bf16 cache with
blocks of 784 and 16 tokens, int8 cache with blocks of 1552 and 16 tokens, the LSE reduce, the
quantize-on-write, the skinny GEMM's built-in launch at four per-rank shapes) with ``triton.compile(ASTSource(...), target=GPUTarget(...))`` using the
launch configuration the launchers pick for that backend, and records per kernel/target:
shared memory (LDS) bytes, registers, spills, matrix-unit instructions (MFMA / wgmma / mma). Exit code 1, with a message naming kernel and
target, when shared memory exceeds 65536 bytes or the code spills registers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import forge_triton
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

LDS_LIMIT = 65536           # gfx9 LDS per workgroup: the DCU-portability gate
# sm_90's opt-in shared memory per block (227 KiB). On CUDA a spill is reported, not a failure:
# CUDA launches are chosen by measured speed on the GPU machine (the prefill kernel's fastest
# H200 launch spills a few registers); the portability gate (64 KiB, no spills) is the HIP one.
CUDA_SMEM_LIMIT = {90: 232448}
HEAD = 256
HQ, HKV = 24, 4


def load_kernels():
    """Load the kernel files as real JIT functions, even inside a TRITON_INTERPRET=1 process
    (the interpreter's stand-ins cannot be compiled), under module names of their own."""
    return tuple(forge_triton.fresh(m) for m in ("int8_kv_write", "split_kv_decode", "prefill_attention"))


def parse_target(s: str) -> GPUTarget:
    backend, arch = s.split(":", 1)
    if backend == "hip":
        return GPUTarget("hip", arch, 64)
    if backend == "cuda":
        return GPUTarget("cuda", int(arch), 32)
    raise ValueError(f"unknown target {s!r} (want hip:gfxNNN or cuda:NN)")


def _source(fn, args: dict, constexprs: dict):
    """Signature like the JIT would specialize: ints == 1 become constexpr, ints % 16 == 0 and
    pointers get the divisibility-16 attribute."""
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, str):                      # pointer type, e.g. "*bf16"
            sig[name] = v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, sig, constexprs=consts, attrs=attrs)


def _decode_spec(dec, kv: str, block_size: int, num_segments: int, is_hip: bool,
                 fused: bool | None = None, launch: tuple | None = None):
    import torch
    kv_dtype = torch.int8 if kv == "int8" else torch.bfloat16
    tile_n, warps, stages = launch or dec.default_launch_config(kv_dtype, HEAD, is_hip=is_hip)
    elt = 1 if kv == "int8" else 2
    dp = HEAD + 4 if kv == "int8" else HEAD
    page = 2 * block_size * HKV * dp * (1 if kv == "int8" else 2) // elt   # in elements
    ks_b = 2 * block_size * HKV * (HEAD + 4) // 4
    max_blocks = 32768 // block_size + 1
    S = num_segments
    ptr_kv = "*i8" if kv == "int8" else "*bf16"
    args = dict(
        q_ptr="*bf16", k_ptr=ptr_kv, v_ptr=ptr_kv,
        ks_ptr="*fp32" if kv == "int8" else ptr_kv, vs_ptr="*fp32" if kv == "int8" else ptr_kv,
        bt_ptr="*i32", seq_lens_ptr="*i32", po_ptr="*fp32", pl_ptr="*fp32", cnt_ptr="*i32",
        out_ptr="*bf16", scale_log2=0.09, num_segments=S, min_seg=tile_n,
        sq_s=HQ * HEAD, sq_h=HEAD, sq_d=1,
        sk_b=page, sk_o=HKV * HEAD, sk_h=HEAD, sk_d=1,
        sv_b=page, sv_o=HKV * HEAD, sv_h=HEAD, sv_d=1,
        sks_b=ks_b if kv == "int8" else 0, sks_h=block_size if kv == "int8" else 0,
        sks_o=1 if kv == "int8" else 0,
        svs_b=ks_b if kv == "int8" else 0, svs_h=block_size if kv == "int8" else 0,
        svs_o=1 if kv == "int8" else 0,
        sbt_s=max_blocks, sbt_b=1,
        spo_s=HQ * S * HEAD, spo_h=S * HEAD, spo_g=HEAD, spo_d=1,
        spl_s=HQ * S, spl_h=S, spl_g=1, scnt_s=HQ,
        so_s=HQ * HEAD, so_h=HEAD, so_d=1,
    )
    if fused is None:
        fused = S <= dec.FUSE_MAX_SEGMENTS
    s_pad, merge_d = dec.merge_tile(S, HEAD)
    # zero strides: the JIT does not specialize 0, mark them as plain ints
    const = dict(QUERIES_PER_KV=HQ // HKV, BLOCK_M=16, HEAD_SIZE=HEAD, D_PAD=HEAD,
                 BLOCK_SIZE=block_size, TILE_N=tile_n, KV_INT8=(kv == "int8"),
                 DIRECT_OUT=(S == 1), FUSED=(fused and S > 1), S_PAD=s_pad, MERGE_D=merge_d,
                 IEEE=False, QK_INT8=(kv == "int8" and dec.QK_INT8_DOT),
                 BT_AHEAD=stages >= dec.BT_AHEAD_STAGES)
    return dec._split_kv_decode_kernel, args, const, warps, stages, dict(tile_n=tile_n)


def _reduce_spec(dec, num_segments: int):
    S = num_segments
    s_pad, block_d = dec.reduce_tile(S, HEAD)
    args = dict(po_ptr="*fp32", pl_ptr="*fp32", out_ptr="*bf16", num_segments=S,
                spo_s=HQ * S * HEAD, spo_h=S * HEAD, spo_g=HEAD, spo_d=1,
                spl_s=HQ * S, spl_h=S, spl_g=1, so_s=HQ * HEAD, so_h=HEAD, so_d=1)
    const = dict(HEAD_SIZE=HEAD, S_PAD=s_pad, BLOCK_D=block_d)
    return dec._split_kv_reduce_kernel, args, const, 2, 1, {}


def _write_spec(wr, block_size: int, num_tokens: int = 1):
    d_pad, block_h, block_t, warps = wr._write_launch_params(HKV, HEAD, num_tokens)
    page = 2 * block_size * HKV * (HEAD + 4)
    args = dict(key_ptr="*bf16", value_ptr="*bf16", k_data_ptr="*i8", v_data_ptr="*i8",
                k_scale_ptr="*fp32", v_scale_ptr="*fp32", slot_ptr="*i64",
                num_tokens=num_tokens + 3, num_heads=HKV,
                # key/value are strided slices of a fused qkv projection (q 24*256 + k + v)
                sk_t=(HQ + 2 * HKV) * HEAD, sk_h=HEAD, sk_d=1,
                sv_t=(HQ + 2 * HKV) * HEAD, sv_h=HEAD, sv_d=1,
                skd_b=page, skd_o=HKV * HEAD, skd_h=HEAD, skd_d=1,
                svd_b=page, svd_o=HKV * HEAD, svd_h=HEAD, svd_d=1,
                sks_b=page // 4, sks_h=block_size, sks_o=1,
                svs_b=page // 4, svs_h=block_size, svs_o=1)
    const = dict(BLOCK_SIZE=block_size, HEAD_SIZE=HEAD, D_PAD=d_pad, BLOCK_H=block_h,
                 BLOCK_T=block_t, SCALE_FLOOR=wr.SCALE_FLOOR)
    return wr._int8_kv_write_kernel, args, const, warps, 1, {}


def _prefill_spec(pre, kv: str, block_size: int, is_hip: bool):
    """kv: "bf16" (paged cache), "int8" (paged int8 cache read inline) or "int8-widened" (the
    int8 codes widened to a contiguous bf16 copy, one CONTIG_BLOCK block per sequence)."""
    import torch
    widened = kv == "int8-widened"
    kv_dtype = torch.int8 if kv == "int8" else torch.bfloat16
    block_m, tile_n, warps, stages = pre.launch_config(kv_dtype, is_hip=is_hip)
    dp = HEAD + 4 if kv == "int8" else HEAD
    page = 2 * block_size * HKV * dp                                     # elements of the dtype
    ks_b = 2 * block_size * HKV * (HEAD + 4) // 4
    if widened:
        block_size, page, ks_b = pre.CONTIG_BLOCK, 32768 * HKV * HEAD, HKV * 32768
    ptr_kv = "*i8" if kv == "int8" else "*bf16"
    qkv = (HQ + 2 * HKV) * HEAD                    # q/k/v are slices of one fused projection
    args = dict(
        q_ptr="*bf16", kn_ptr="*bf16", vn_ptr="*bf16", kc_ptr=ptr_kv, vc_ptr=ptr_kv,
        ks_ptr="*fp32" if kv == "int8" else ptr_kv, vs_ptr="*fp32" if kv == "int8" else ptr_kv,
        bt_ptr="*i32", cu_q_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16",
        scale_log2=0.09, num_seqs=1,
        sq_t=qkv, sq_h=HEAD, sq_d=1, skn_t=qkv, skn_h=HEAD, skn_d=1, svn_t=qkv, svn_h=HEAD, svn_d=1,
        skc_b=page, skc_o=HKV * HEAD, skc_h=HEAD, skc_d=1,
        svc_b=page, svc_o=HKV * HEAD, svc_h=HEAD, svc_d=1,
        sks_b=ks_b if kv != "bf16" else 0, sks_h=(32768 if widened else block_size) if kv != "bf16" else 0,
        sks_o=1 if kv != "bf16" else 0,
        svs_b=ks_b if kv != "bf16" else 0, svs_h=(32768 if widened else block_size) if kv != "bf16" else 0,
        svs_o=1 if kv != "bf16" else 0,
        sbt_s=1 if widened else 32768 // block_size + 1, sbt_b=1, so_t=HQ * HEAD, so_h=HEAD, so_d=1,
    )
    if widened:
        args["skc_b"] = args["svc_b"] = page
    g = HQ // HKV
    const = dict(G=g, BLOCK_M=block_m, BLOCK_Q=block_m // g, HEAD_SIZE=HEAD, D_PAD=HEAD,
                 BLOCK_SIZE=block_size, TILE_N=tile_n, KV_INT8=(kv != "bf16"), IEEE=False)
    return pre._prefill_attention_kernel, args, const, warps, stages, dict(
        block_m=block_m, tile_n=tile_n)


def _widen_spec(pre, block_size: int):
    page = 2 * block_size * HKV * (HEAD + 4)
    args = dict(kc_ptr="*i8", vc_ptr="*i8", ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32",
                cu_q_ptr="*i32", seq_lens_ptr="*i32", ko_ptr="*bf16", vo_ptr="*bf16",
                kso_ptr="*fp32", vso_ptr="*fp32",
                skc_b=page, skc_o=HKV * HEAD, skc_h=HEAD, skc_d=1,
                svc_b=page, svc_o=HKV * HEAD, svc_h=HEAD, svc_d=1,
                sks_b=page // 4, sks_h=block_size, sks_o=1, svs_b=page // 4, svs_h=block_size, svs_o=1,
                sbt_s=32768 // block_size + 1, sbt_b=1,
                sko_s=32768 * HKV * HEAD, sko_t=HKV * HEAD, sko_h=HEAD, sso_s=HKV * 32768, sso_h=32768)
    const = dict(BLOCK_SIZE=block_size, HEAD_SIZE=HEAD, D_PAD=HEAD, BLOCK_T=pre.WIDEN_BLOCK_T)
    return pre._widen_prefix_kernel, args, const, 4, 1, {}


def _skinny_spec(sk, N: int, K: int, fused: bool, is_hip: bool, num_cus: int, M: int = 16):
    """The skinny GEMM's built-in launch at one (N, K) per rank for M rows (the launch does not depend on M;
    the tile's padded rows do: BLOCK_M 16 up to 16 rows, 32 above)."""
    cfg = sk.launch_config(M, N, K, num_cus, fused=fused, is_hip=is_hip)
    n_out = N // 2 if fused else N
    args = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", p_ptr="*fp32" if cfg.split_k > 1 else "*bf16",
                M=17, N_OUT=n_out, K=K, k_per_split=K // cfg.split_k,   # M: not specialised (any i32)
                sx_m=K, sx_k=1, sw_n=K, sw_k=1, sy_m=n_out, sy_n=1)
    const = dict(BLOCK_M=sk.block_m(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, FUSED=fused,
                 IEEE=False)
    return sk._skinny_gemm_kernel, args, const, cfg.num_warps, cfg.num_stages, dict(launch=list(cfg))


def specs(target: GPUTarget):
    wr, dec, pre = load_kernels()
    hip = target.backend == "hip"
    out = []
    for kv, bs in (("bf16", 784), ("bf16", 16), ("int8", 1552), ("int8", 16)):
        out.append((f"split_kv_decode[{kv},bs={bs},S=64]", _decode_spec(dec, kv, bs, 64, hip)))
    out.append(("split_kv_decode[int8,bs=1552,S=1]", _decode_spec(dec, "int8", 1552, 1, hip)))
    for kv, bs in (("bf16", 784), ("int8", 1552)):
        out.append((f"split_kv_decode[{kv},bs={bs},S=16,fused]",
                    _decode_spec(dec, kv, bs, 16, hip, fused=True)))
    out.append(("split_kv_reduce[S=64]", _reduce_spec(dec, 64)))
    out.append(("split_kv_reduce[S=256]", _reduce_spec(dec, 256)))
    for bs in (1552, 16):
        out.append((f"int8_kv_write[bf16,bs={bs}]", _write_spec(wr, bs)))
    out.append(("int8_kv_write[bf16,bs=1552,prefill]", _write_spec(wr, 1552, 8192)))
    for kv, bs in (("bf16", 784), ("int8", 1552), ("int8-widened", 1552)):
        out.append((f"prefill_attention[{kv},bs={bs}]", _prefill_spec(pre, kv, bs, hip)))
    out.append(("widen_prefix[int8,bs=1552]", _widen_spec(pre, 1552)))
    sk = forge_triton.fresh("skinny_gemm")
    cus = 80 if hip else 132        # gfx936 / H200: split-K on and off among the shapes below
    for layer, n, k, fused in (("qkv_gate", 14336, 5120, False), ("down", 5120, 17408, False),
                               ("lm_head", 248320, 5120, False), ("gate_up", 34816, 5120, True)):
        out.append((f"skinny_gemm[{layer},{n}x{k}]", _skinny_spec(sk, n, k, fused, hip, cus)))
    for layer, n, k, fused in (("down", 5120, 17408, False), ("gate_up", 34816, 5120, True)):
        out.append((f"skinny_gemm[{layer},{n}x{k},M=32]", _skinny_spec(sk, n, k, fused, hip, cus, M=32)))
    return out


_RE_AMD = {k: re.compile(rf"\.?{k}:\s*(\d+)") for k in
           ("vgpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count",
            "agpr_count", "private_segment_fixed_size")}


def _amd_stats(asm: str) -> dict:
    st = {}
    for k, r in _RE_AMD.items():
        vals = [int(x) for x in r.findall(asm)]
        if vals:
            st[k] = max(vals)
    # fall back to the comment lines ("; NumVgprs: 64", "; ScratchSize: 0")
    for k, pat in (("vgpr_count", r";\s*NumVgprs:\s*(\d+)"), ("sgpr_count", r";\s*NumSgprs:\s*(\d+)"),
                   ("scratch_bytes", r";\s*ScratchSize:\s*(\d+)")):
        m = re.findall(pat, asm)
        if m and k not in st:
            st[k] = max(int(x) for x in m)
    st["registers"] = st.get("vgpr_count")
    st["spills"] = st.get("vgpr_spill_count", 0) + st.get("sgpr_spill_count", 0)
    return st


def _find_ptxas():
    try:
        from triton.backends.nvidia import compiler as nvc
        p = nvc.get_ptxas().path if hasattr(nvc, "get_ptxas") else None
        if p and os.path.exists(p):
            return p
    except Exception:
        pass
    cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if os.path.exists(cand):
        return cand
    for p in ("/usr/local/cuda/bin/ptxas", "/usr/local/bin/ptxas"):
        if os.path.exists(p):
            return p
    return None


def _cuda_stats(ptx: str, arch: int) -> dict:
    st = {"local_in_ptx": bool(re.search(r"^\s*\.local\b", ptx, re.M))}
    ptxas = _find_ptxas()
    if ptxas:
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            open(src, "w").write(ptx)
            sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            r = subprocess.run([ptxas, f"-arch={sm}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True)
            info = r.stdout + r.stderr
            st["ptxas_info"] = " ".join(l.strip() for l in info.splitlines() if "info" in l)[-600:]
            m = re.search(r"Used (\d+) registers", info)
            if m:
                st["registers"] = int(m.group(1))
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
            if m:
                st["spill_store_bytes"], st["spill_load_bytes"] = int(m.group(1)), int(m.group(2))
                st["spills"] = st["spill_store_bytes"] + st["spill_load_bytes"]
            m = re.search(r"(\d+) bytes stack frame", info)
            if m:
                st["stack_frame_bytes"] = int(m.group(1))
    if "spills" not in st:
        st["spills"] = 1 if st["local_in_ptx"] else 0
        st["spill_source"] = ".local in PTX"
    return st


def compile_one(name, spec, target: GPUTarget) -> dict:
    fn, args, const, warps, stages, extra = spec
    t0 = time.time()
    rec = {"kernel": name, "target": f"{target.backend}:{target.arch}", "num_warps": warps,
           "num_stages": stages, **extra}
    try:
        src = _source(fn, args, const)
        compiled = triton.compile(src, target=target,
                                  options={"num_warps": warps, "num_stages": stages})
        rec["shared_bytes"] = int(compiled.metadata.shared)
        code = compiled.asm.get("amdgcn" if target.backend == "hip" else "ptx", "")
        rec["matrix_ops"] = len(re.findall(r"v_mfma_|wgmma\.mma_async|mma\.sync", code))
        if target.backend == "hip":
            rec.update(_amd_stats(compiled.asm.get("amdgcn", "")))
        else:
            rec.update(_cuda_stats(compiled.asm.get("ptx", ""), int(target.arch)))
        problems = []
        hip = target.backend == "hip"
        limit = LDS_LIMIT if hip else CUDA_SMEM_LIMIT.get(int(target.arch), LDS_LIMIT)
        limit = int(os.environ.get("FORGE_AOT_LDS_LIMIT", limit))  # override: tests only
        if rec["shared_bytes"] > limit:
            problems.append(f"shared memory {rec['shared_bytes']} B > {limit} B")
        if rec.get("spills", 0):
            if hip:
                problems.append(f"register spills ({rec['spills']})")
            else:
                rec["note"] = f"register spills ({rec['spills']}), reported only on CUDA"
        rec["ok"] = not problems
        rec["problems"] = problems
    except Exception as e:  # a compile error is a failure for that kernel/target
        rec["ok"] = False
        rec["problems"] = [f"compile error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"]
    rec["compile_s"] = round(time.time() - t0, 2)
    return rec


def aot_compile_all(targets) -> list[dict]:
    """Compile every representative kernel for every target ("hip:gfx90a", "cuda:90" or a
    GPUTarget). Returns one dict per (kernel, target) with shared_bytes, registers, spills, ok."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # triton's own library functions were created as interpreter stand-ins in this process:
        # compile in a clean child process instead
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with tempfile.TemporaryDirectory() as d:
            js = os.path.join(d, "aot.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--json", js]
            for t in targets:
                cmd += ["--target", t if isinstance(t, str) else f"{t.backend}:{t.arch}"]
            subprocess.run(cmd, env=env, capture_output=True, text=True)
            return json.load(open(js))["records"]
    out = []
    for t in targets:
        tgt = parse_target(t) if isinstance(t, str) else t
        for name, spec in specs(tgt):
            out.append(compile_one(name, spec, tgt))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="append", default=[],
                    help="hip:gfx90a, hip:gfx942, cuda:90 ... (repeatable)")
    ap.add_argument("--json", help="write the records here")
    a = ap.parse_args(argv)
    targets = a.target or ["hip:gfx90a", "hip:gfx942", "cuda:90"]
    recs = aot_compile_all(targets)
    print(f"{'kernel':42s} {'target':12s} {'shared':>7s} {'regs':>5s} {'spills':>6s} {'s':>6s}  status")
    for r in recs:
        print(f"{r['kernel']:42s} {r['target']:12s} {r.get('shared_bytes', '-')!s:>7s} "
              f"{r.get('registers', '-')!s:>5s} {r.get('spills', '-')!s:>6s} {r['compile_s']:6.1f}  "
              f"{'ok' if r['ok'] else 'FAIL: ' + '; '.join(r['problems'])}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "lds_limit": LDS_LIMIT, "records": recs}, f, indent=1)
    bad = [r for r in recs if not r["ok"]]
    for r in bad:
        print(f"AOT FAIL: {r['kernel']} on {r['target']}: {'; '.join(r['problems'])}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
