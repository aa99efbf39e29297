#!/usr/bin/env python3
"""Quick numeric self-test of the forge Triton kernels (quantize-on-write, split-KV decode, chunked prefill).

    python kernels/selftest.py [--json PATH]

Runs on the GPU when torch sees one, else under Triton's CPU interpreter at small sizes
(< 60 s on 2 cores). Fresh random inputs, poisoned outputs, float64 references. Prints a table;
exit code 0 when every check passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float("inf") if not torch.isfinite(a).all() else float((a - b).norm() / b.norm())


def ref_decode(q, kc, vc, bt, lens, scale, ks=None, vs=None):
    B, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = torch.zeros(B, hq, d, dtype=torch.float64)
    for i, L in enumerate(lens):
        blocks = bt[i, :math.ceil(L / bs)].long().cpu()
        k = kc.cpu()[blocks].reshape(-1, hkv, d)[:L].double()
        v = vc.cpu()[blocks].reshape(-1, hkv, d)[:L].double()
        if ks is not None:
            k = k * ks.cpu()[blocks].permute(0, 2, 1).reshape(-1, hkv)[:L].double().unsqueeze(-1)
            v = v * vs.cpu()[blocks].permute(0, 2, 1).reshape(-1, hkv)[:L].double().unsqueeze(-1)
        qi = q[i].cpu().double().view(hkv, hq // hkv, d)
        p = torch.softmax(torch.einsum("hgd,lhd->hgl", qi, k) * scale, -1)
        out[i] = torch.einsum("hgl,lhd->hgd", p, v).reshape(hq, d)
    return out


def ref_prefill(q, k_new, v_new, kc, vc, bt, seqs, scale, ks=None, vs=None):
    """float64 causal attention of each chunk over its paged prefix (dequantized) and itself."""
    T, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = torch.zeros(T, hq, d, dtype=torch.float64)
    start = 0
    for i, (p, n) in enumerate(seqs):
        blocks = bt[i, :math.ceil(p / bs)].long().cpu()
        kp = kc.cpu()[blocks].reshape(-1, hkv, d)[:p].double()
        vp = vc.cpu()[blocks].reshape(-1, hkv, d)[:p].double()
        if ks is not None:
            kp = kp * ks.cpu()[blocks].permute(0, 2, 1).reshape(-1, hkv)[:p].double().unsqueeze(-1)
            vp = vp * vs.cpu()[blocks].permute(0, 2, 1).reshape(-1, hkv)[:p].double().unsqueeze(-1)
        k = torch.cat([kp, k_new[start:start + n].cpu().double()])
        v = torch.cat([vp, v_new[start:start + n].cpu().double()])
        qi = q[start:start + n].cpu().double().view(n, hkv, hq // hkv, d)
        s = torch.einsum("nhgd,lhd->hgnl", qi, k) * scale
        s = s.masked_fill(torch.arange(p + n)[None, :] > (torch.arange(n) + p)[:, None], float("-inf"))
        out[start:start + n] = torch.einsum("hgnl,lhd->nhgd", torch.softmax(s, -1), v).reshape(n, hq, d)
        start += n
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    from forge_triton import int8_kv_write as wr  # after TRITON_INTERPRET is settled
    from forge_triton import prefill_attention as pre
    from forge_triton import split_kv_decode as dec
    dev = "cuda" if ON_GPU else "cpu"
    g = torch.Generator(device=dev).manual_seed(int(time.time()) & 0xFFFF)
    rows = []

    def record(name, value, tol, extra=""):
        ok = value <= tol and math.isfinite(value)
        rows.append(dict(check=name, value=value, tol=tol, ok=ok, detail=extra))

    t0 = time.time()
    H, D = (4, 256)
    hq, hkv = (24, 4) if ON_GPU else (6, 1)
    # --- quantize-on-write on a real (nb, 2, bs, H, D+4) page tensor, strided input, skipped slot
    for bs in (16, 1552):
        T = 64 if ON_GPU else 6
        nb = max(2, 2 * math.ceil(T / bs))
        qkv = torch.randn(T, 8 + 2 * H, D, generator=g, device=dev).to(torch.bfloat16) * 3
        key, value = qkv[:, 8:8 + H], qkv[:, 8 + H:]
        cache = torch.full((nb, 2, bs, H, D + 4), -99, dtype=torch.int8, device=dev)
        kd, vd, ks, vs = wr.int8_kv_views(cache, H, D)
        slots = torch.randperm(nb * bs)[:T].to(dev)
        slots[0] = -1
        wr.int8_kv_write(key, value, kd, vd, ks, vs, slots)
        if ON_GPU:
            torch.cuda.synchronize()
        v = slots >= 0
        sv = slots[v].long()
        deq = kd[sv // bs, sv % bs].double() * ks[sv // bs, :, sv % bs].double().unsqueeze(-1)
        err = ((deq - key[v].double()).abs() / ks[sv // bs, :, sv % bs].double().unsqueeze(-1)).max().item()
        record(f"write bs={bs}: max |x-deq|/scale", err, 0.5 + 1e-3)
        untouched = kd.reshape(nb * bs, H, D)[int(torch.tensor([i for i in range(nb * bs) if i not in set(sv.tolist())][:1]))]
        record(f"write bs={bs}: unwritten slot keeps poison", float((untouched != -99).sum()), 0)
    # --- decode, bf16 and int8 caches, ragged lengths, several segment counts
    cases = [("bf16", 784, [1, 300] if not ON_GPU else [1, 1000, 32768]),
             ("int8", 1552, [17, 200] if not ON_GPU else [17, 3100, 32768])]
    for kind, bs, lens in cases:
        B = len(lens)
        nb = sum(math.ceil(l / bs) for l in lens) + 1
        perm = torch.randperm(nb)
        bt = torch.zeros(B, max(math.ceil(l / bs) for l in lens), dtype=torch.int32)
        p = 0
        for i, l in enumerate(lens):
            n = math.ceil(l / bs)
            bt[i, :n] = perm[p:p + n]
            p += n
        bt = bt.to(dev)
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        if kind == "int8":
            kc = torch.randint(-127, 128, (nb, bs, hkv, D), generator=g, device=dev, dtype=torch.int8)
            vc = torch.randint(-127, 128, (nb, bs, hkv, D), generator=g, device=dev, dtype=torch.int8)
            ksc = torch.rand(nb, hkv, bs, generator=g, device=dev) * 0.03 + 0.002
            vsc = torch.rand(nb, hkv, bs, generator=g, device=dev) * 0.03 + 0.002
            qdts = (torch.float32, torch.bfloat16)
        else:
            kc, vc = torch.randn(nb, 2, bs, hkv, D, generator=g, device=dev).to(torch.bfloat16).unbind(1)
            ksc = vsc = None
            qdts = (torch.bfloat16,)
        for qdt in qdts:
            q = torch.randn(B, hq, D, generator=g, device=dev).to(qdt)
            ref = ref_decode(q, kc, vc, bt, lens, D ** -0.5, ksc, vsc)
            outs = []
            for S in (1, 4):
                out = torch.full((B, hq, D), float("nan"), dtype=qdt, device=dev)
                ws = dec.decode_workspace(B, hq, D, S, dev)
                dec.split_kv_decode(q, kc, vc, bt, sl, D ** -0.5, out, k_scale_cache=ksc,
                                    v_scale_cache=vsc, num_segments=S, workspace=ws)
                if ON_GPU:
                    torch.cuda.synchronize()
                tol = 1e-3 if qdt == torch.float32 else 1e-2
                record(f"decode {kind} bs={bs} q={str(qdt)[6:]} S={S}: rel err", rel(out, ref), tol, f"lens={lens}")
                outs.append(out)
            if qdt == torch.float32:
                record(f"decode {kind} S=1 vs S=4 (fp32)", rel(outs[1], outs[0]), 2e-6)
    # --- chunked prefill: a cached prefix (full and partial tiles, blocks straddled) and a causal
    # chunk, several sequences; bf16 cache, and int8 read inline and through the widened copy
    pcases = [("bf16", 16, [(37, 21), (0, 5)], None), ("int8", 16, [(40, 12)], "inline"),
              ("int8", 16, [(40, 12)], "widen")] if not ON_GPU else \
             [("bf16", 784, [(9000, 1500), (0, 7)], None), ("int8", 1552, [(4000, 700)], "inline"),
              ("int8", 1552, [(4000, 700)], "widen")]
    phq, phkv = (6, 1) if not ON_GPU else (24, 4)
    for kind, bs, seqs, mode in pcases:
        lens = [p + n for p, n in seqs]
        T = sum(n for _, n in seqs)
        width = max(math.ceil(l / bs) for l in lens)          # block-table columns
        nb = len(seqs) * width + 1
        bt = torch.randperm(nb)[:len(seqs) * width].view(len(seqs), width).to(torch.int32).to(dev)
        q, k_new, v_new = (torch.randn(T, h, D, generator=g, device=dev).to(torch.bfloat16)
                           for h in (phq, phkv, phkv))
        if kind == "int8":
            kc = torch.randint(-127, 128, (nb, bs, phkv, D), generator=g, device=dev, dtype=torch.int8)
            vc = torch.randint(-127, 128, (nb, bs, phkv, D), generator=g, device=dev, dtype=torch.int8)
            ksc = torch.rand(nb, phkv, bs, generator=g, device=dev) * 0.02 + 0.002
            vsc = torch.rand(nb, phkv, bs, generator=g, device=dev) * 0.02 + 0.002
        else:
            kc, vc = torch.randn(nb, 2, bs, phkv, D, generator=g, device=dev).to(torch.bfloat16).unbind(1)
            ksc = vsc = None
        cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))],
                          dtype=torch.int32, device=dev)
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        ref = ref_prefill(q, k_new, v_new, kc, vc, bt, seqs, D ** -0.5, ksc, vsc)
        out = torch.full((T, phq, D), float("nan"), dtype=torch.float32, device=dev)
        kw = {} if ON_GPU else dict(block_m=32, tile_n=16)
        if mode:
            kw.update(int8_prefix=mode, max_seqlen_k=max(lens))
        pre.prefill_attention(q, k_new, v_new, kc, vc, bt, cu, sl, D ** -0.5, out, k_scale_cache=ksc,
                              v_scale_cache=vsc, **kw)
        if ON_GPU:
            torch.cuda.synchronize()
        name = f"prefill {kind}{'/' + mode if mode else ''} bs={bs}: rel err"
        record(name, rel(out, ref), 2e-3, f"(prefix, chunk)={seqs}")
    elapsed = time.time() - t0
    print(f"forge kernel self-test ({'GPU ' + torch.cuda.get_device_name(0) if ON_GPU else 'CPU interpreter'}, {elapsed:.1f}s)")
    print(f"{'check':52s} {'value':>11s} {'tol':>9s}  result")
    for r in rows:
        print(f"{r['check']:52s} {r['value']:11.3g} {r['tol']:9.3g}  {'ok' if r['ok'] else 'FAIL'}")
    ok = all(r["ok"] for r in rows)
    if a.json:
        d = os.path.dirname(os.path.abspath(a.json))
        os.makedirs(d, exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"ok": ok, "device": "cuda" if ON_GPU else "cpu-interpreter", "seconds": elapsed,
                       "torch": torch.__version__, "checks": rows}, f, indent=1)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
