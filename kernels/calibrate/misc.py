# SPDX-License-Identifier: Apache-2.0
"""Calibration families `write` and `gemm`.

write: the int8 KV cache's quantize-on-write (our Triton kernel, and the compiled one where the
installed vLLM has `_C_cache_ops.forge_int8_kv_write`) at blocks 784 and 1552, a decode token and a
4096-token chunk: codes within one step of the float64 quantization, scales exact to 1e-6, the
slots not written left untouched (poisoned cache); timed. Not a table entry (the write is chosen by
VLLM_FORGE_INT8_WRITE); recorded so a failure on the device is seen before serving.

gemm: the prefill GEMMs (every linear layer's (N, K) at M = 4096 tokens, the chunk the organizers'
server cuts) through F.linear with the platform's default library call, then with PyTorch TunableOp
tuning that GEMM (rocBLAS / hipBLASLt solutions on ROCm, cuBLAS / cuBLASLt on CUDA) and its result
replayed. Decision `gemm.NxK`: TunableOp is adopted where it beats the default by more than the
measured spread (the tool's selection rule); its results file is kept beside the report.
"""

from __future__ import annotations

import math
import os

from . import common as C


def write(torch, args, emit) -> dict:
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    if args.kernels == "installed":
        from vllm.v1.attention.ops import forge_int8_kv_write as W
    else:
        from forge_triton import int8_kv_write as W
    dev = "cuda" if C.on_gpu(torch) else "cpu"
    hkv, d = (C.HKV, C.D) if not args.smoke else (2, 64)
    writers = {"triton": lambda k, v, kd, vd, ks, vs, sl: W.int8_kv_write(k, v, kd, vd, ks, vs, sl)}
    try:
        import vllm._C  # noqa: F401
        if hasattr(torch.ops._C_cache_ops, "forge_int8_kv_write"):
            writers["compiled"] = lambda k, v, kd, vd, ks, vs, sl: torch.ops._C_cache_ops.forge_int8_kv_write(
                k, v, kd, vd, ks, vs, sl)
    except (ImportError, AttributeError, RuntimeError):
        pass
    L = args.ledger
    g = torch.Generator(device=dev).manual_seed(args.seed + 2)
    cases = [(b, t) for b in (C.BLOCK_BF16, C.BLOCK_INT8) for t in ((1, 37) if args.smoke else (1, C.CHUNK))]
    for n, (block, tokens) in enumerate(cases, 1):
        emit(n, len(cases), f"write block {block}, {tokens} token(s)")
        nb = math.ceil((tokens + 5) / block) + 2
        key = torch.randn(tokens, hkv, d, generator=g, device=dev).bfloat16()
        val = torch.randn(tokens, hkv, d, generator=g, device=dev).bfloat16()
        slots = (torch.randperm(nb * block, generator=torch.Generator().manual_seed(block + tokens))[:tokens]).to(dev)
        xf = key.double()
        sref = (xf.abs().amax(-1) / 127.0).clamp_min(1e-10)
        qref = (xf / sref[..., None]).round().clamp(-127, 127)
        for name, fn in writers.items():
            cache = torch.full((nb, 2, block, hkv, d + 4), -99, dtype=torch.int8, device=dev)
            kd, vd, ks, vs = W.int8_kv_views(cache, hkv, d)
            dec = f"write.b{block}.t{tokens}"
            if not L.begin(dec, name, "ours"):
                continue
            r = C.record(dec, name, "ours", point=f"block={block} tokens={tokens}", tol=1.0)
            try:
                fn(key, val, kd, vd, ks, vs, slots)
                flat = kd.reshape(nb * block, hkv, d)
                got_q = flat[slots.long()].double()
                got_s = ks.permute(0, 2, 1).reshape(nb * block, hkv)[slots.long()].double()
                lsb = (got_q - qref).abs().max().item()
                srel = ((got_s - sref) / sref).abs().max().item()
                untouched = torch.ones(nb * block, dtype=torch.bool, device=dev)
                untouched[slots.long()] = False
                poison_ok = bool((flat[untouched] == -99).all())
                r.update(err=lsb, ok=lsb <= 1 and srel < 1e-6 and poison_ok,
                         error=None if poison_ok else "wrote outside its slots")
                if r["ok"] and dev == "cuda":
                    r["us"] = C.time_graph(torch, [lambda: fn(key, val, kd, vd, ks, vs, slots)], reps=10)
            except Exception as e:  # noqa: BLE001
                r.update(ok=False, error=C.short_error(e))
            L.add(r)
    return {"records": L.records, "notes": [f"writers: {', '.join(writers)}"]}


def gemm(torch, args, emit) -> dict:
    import torch.nn.functional as F
    if not C.on_gpu(torch):
        return {"records": [], "notes": ["skipped: TunableOp tunes GPU GEMM libraries"]}
    tun = getattr(torch.cuda, "tunable", None)
    if tun is None:
        return {"records": [], "notes": ["skipped: this torch has no torch.cuda.tunable"]}
    m = C.CHUNK
    per_rank = C.linear(getattr(args, "tp", 1))          # --tp: one rank's shapes
    shapes = per_rank[:2] if args.quick else [s for s in per_rank if s[0] != "lm_head"]
    results = os.path.join(args.workdir, "tunableop_results.csv")
    L, notes = args.ledger, ["lm_head runs once per prefill (the last token only): not a prefill GEMM"]
    g = torch.Generator(device="cuda").manual_seed(args.seed + 3)
    for n, (layer, N, K) in enumerate(shapes, 1):
        emit(n, len(shapes), f"gemm {layer} {m}x{N}x{K}")
        x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
        ref = (x[:64].double() @ w.double().T)
        dec = f"gemm.{N}x{K}"
        weight = C.CALLS_PER_TOKEN[layer]
        for name, kind in (("F.linear (default)", "upstream"), ("F.linear (TunableOp)", "ours")):
            if not L.begin(dec, name, kind):
                continue
            r = C.record(dec, name, kind, point=f"M={m}", weight=weight, tol=2e-2)
            try:
                if kind == "ours":
                    tun.enable(True)
                    tun.tuning_enable(True)
                    tun.set_filename(results)
                    tun.set_max_tuning_duration(30)
                    F.linear(x, w)               # tunes this GEMM once
                    tun.tuning_enable(False)
                y = F.linear(x, w)
                torch.cuda.synchronize()
                r["err"] = C.rel_err(torch, y[:64], ref)
                r["ok"] = r["err"] <= 2e-2
                if r["ok"]:
                    r["us"] = C.time_events(torch, lambda: F.linear(x, w), reps=10)
            except Exception as e:  # noqa: BLE001
                r.update(ok=False, error=C.short_error(e))
            finally:
                if kind == "ours":
                    tun.enable(False)
            L.add(r)
        x = w = None
    try:
        tun.write_file(results)
        notes.append(f"TunableOp results: {os.path.basename(results)}")
    except Exception as e:  # noqa: BLE001
        notes.append(f"TunableOp results not written: {C.short_error(e)}")
    return {"records": L.records, "notes": notes}
