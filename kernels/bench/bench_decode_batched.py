#!/usr/bin/env python3
"""GPU benchmark: batched split-KV decode attention at the final round's load, per rank's heads.

    python3 kernels/bench/bench_decode_batched.py --payload build/gpu-payload --out reports/kernels/decode-batched

One decode step of one full-attention layer (one query token per sequence) at batch 1, 4, 10 and 16
(the round's concurrency 10, and headroom), each tier's decode context (its median prompt + 512, the
middle of 1024 output tokens: ~7K, ~15K, ~22K) and 32K, on one rank's heads: 24 q / 4 KV (TP1) and
12 / 2 (TP2), head_dim 256; bf16 cache (block 784) and int8 (block 1552). A batch's contexts are
mixed: uniform in [3/4, 1] x the context, the last one exactly it.

Per point:
  forge   our split-KV kernel with the segment count the server plans without a table
          (`choose_num_segments(CUs, batch, KV heads, 32768)`) and its built-in launch ("builtin"),
          and the fastest of a sweep of segment counts (the powers of two from a quarter to four times
          that; --segment-span N: from 1/N to N times; --segments: other counts too) ("best");
  vllm    vLLM's unified attention as TRITON_ATTN runs a decode batch (its 3D kernel, 16 softmax
          segments, threshold 128 / KV heads); bf16 only unless the imported vLLM carries the int8 cache;
  bytes   the KV bytes the step must read (K and V of every cached token, + fp32 scales for int8),
          and that read rate as a fraction of the device's copy bandwidth (bytes read + written per
          second by a 2 GiB device-to-device copy).
Every timed kernel is first checked against float64 attention on two sampled sequences (NaN-poisoned
output); a failing one is recorded and not timed. Timing: a CUDA graph whose launches rotate over
disjoint caches (>= 512 MiB touched per replay, so L2 does not flatter small points), median of 30
replays.

Goals (checked and printed last; recorded in the JSON): at batch 10 and contexts >= 16K, the forge
kernel reads the KV at >= 60 % of copy bandwidth at both head geometries, and it is faster than vLLM's
unified kernel at every measured point. Writes OUT/decode-batched.json (provenance: commit, device,
versions, command) and OUT/decode-batched.md; the JSON is rewritten after every point, so a run that
is stopped keeps what it measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "kernels"))   # the import root of our kernels (forge_triton)

import torch  # noqa: E402
import triton  # noqa: E402
from forge_triton import split_kv_decode as DEC  # noqa: E402

sys.path.insert(0, HERE)
from graph_timing import copy_bandwidth, time_graph  # noqa: E402  (beside this file)

D = 256
SCALE = D ** -0.5
MiB = 1 << 20
TIER_PROMPTS = {"4-8K": 6677, "8-16K": 14156, "16-32K": 21679}       # configs/workload.yaml medians
CONTEXTS = sorted({p + 512 for p in TIER_PROMPTS.values()} | {32768})
BATCHES = (1, 4, 10, 16)
HEADS = ((24, 4), (12, 2))
BLOCK = {"bf16": 784, "int8": 1552}
MIN_TOUCH = 512 * MiB
DEV = "cuda"          # the benchmark's device (a CPU smoke of its plumbing sets "cpu")
DT = torch.bfloat16   # queries and the 16-bit cache (the CPU smoke: float32, the interpreter's bf16 dot is unreliable)
GOAL_FRAC, GOAL_BATCH, GOAL_MIN_CTX = 0.60, 10, 16384


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


REF = _load("forge_kernel_reference", os.path.join(REPO, "tests", "kernels", "reference.py"))


class Unified:
    """vLLM's unified attention, from the benchmark payload (prepare_payload.py) or the installed vLLM."""

    def __init__(self, payload: str | None):
        if payload and os.path.isdir(payload):
            sys.path.insert(0, os.path.abspath(payload))
        from vllm.v1.attention.ops import triton_unified_attention as tua
        self.tua = tua
        self.source = os.path.dirname(tua.__file__)
        self.seg = 16
        # the int8 cache: only a vLLM that carries it (the patched tree), not the pristine payload
        self.int8 = "k_scale_cache" in inspect.signature(tua.unified_attention).parameters

    def prepare(self, B, hq, hkv):
        thr = max(B, 128 // hkv)             # TRITON_ATTN: 3D below MIN_LAUNCH_GRID_SIZE_2D / KV heads
        ws = (torch.empty(thr, hq, self.seg, D, dtype=torch.float32, device=DEV),
              torch.empty(thr, hq, self.seg, dtype=torch.float32, device=DEV),
              torch.empty(thr, hq, self.seg, dtype=torch.float32, device=DEV))
        cu = torch.arange(B + 1, dtype=torch.int32, device=DEV)
        one = torch.ones(1, dtype=torch.float32, device=DEV).expand(B, hkv)
        return thr, ws, cu, one

    def call(self, prep, q, c, out, max_len):
        thr, ws, cu, one = prep
        extra = {} if c["ks"] is None else dict(k_scale_cache=c["ks"], v_scale_cache=c["vs"])
        self.tua.unified_attention(
            q=q, k=c["k"], v=c["v"], out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=c["sl"],
            max_seqlen_k=max_len, softmax_scale=SCALE, causal=True, window_size=(-1, -1), block_table=c["bt"],
            softcap=0, q_descale=None, k_descale=one, v_descale=one, seq_threshold_3D=thr,
            num_par_softmax_segments=self.seg, softmax_segm_output=ws[0], softmax_segm_max=ws[1],
            softmax_segm_expsum=ws[2], **extra)


def lengths(B, ctx, gen):
    lens = [max(1, int(ctx * (0.75 + 0.25 * float(torch.rand(1, generator=gen))))) for _ in range(B - 1)]
    return lens + [ctx]


def make_cache(kind, hkv, lens, gen):
    """One paged cache holding `lens` (random block table, 2 spare blocks); bf16 as vLLM's (nb, 2, bs, H, D)
    planes, int8 as our (nb, 2, bs, H, D + 4) pages with fp32 scales in the page tail."""
    bs = BLOCK[kind]
    need = [math.ceil(L / bs) for L in lens]
    nb = sum(need) + 2
    if kind == "bf16":
        c = torch.randn(nb, 2, bs, hkv, D, dtype=DT, device=DEV)
        k, v = c.unbind(1)
        ks = vs = None
    else:
        from forge_triton import int8_kv_write as WR
        c = torch.empty(nb, 2, bs, hkv, D + 4, dtype=torch.int8, device=DEV)
        k, v, ks, vs = WR.int8_kv_views(c, hkv, D)
        k.random_(-127, 128)
        v.random_(-127, 128)
        ks.uniform_(0.002, 0.03)
        vs.uniform_(0.002, 0.03)
    perm = torch.randperm(nb, generator=gen)
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[pos:pos + n].to(torch.int32)
        pos += n
    return dict(cache=c, k=k, v=v, ks=ks, vs=vs, bt=bt.to(DEV), sl=torch.tensor(lens, dtype=torch.int32, device=DEV),
                bytes=c.numel() * c.element_size())


def kv_bytes(kind, hkv, lens):
    per_token = 2 * hkv * (D * (2 if kind == "bf16" else 1) + (0 if kind == "bf16" else 4))
    return sum(lens) * per_token


def check(fn, q, c, rows, hq):
    """fn(out) on a NaN-poisoned output, against float64 on `rows`: the relative error (inf when unwritten)."""
    out = torch.full_like(q, float("nan"))
    fn(out)
    if DEV == "cuda":
        torch.cuda.synchronize()
    idx = torch.tensor(rows, device=DEV)
    ref = REF.decode_ref(q[idx], c["k"], c["v"], c["bt"][idx], c["sl"][idx], SCALE, c["ks"], c["vs"])
    return REF.rel_err(out[idx], ref)


def bench_point(hq, hkv, kind, B, ctx, ncu, up, copy_bw, seed, int8_launches=(), qk_paths=(True,), span=4,
                extra_segments=()):
    gen = torch.Generator().manual_seed(seed)
    lens = lengths(B, ctx, gen)
    one = make_cache(kind, hkv, lens, gen)
    R = max(1, min(16, math.ceil(MIN_TOUCH / one["bytes"])))
    caches = [one] + [make_cache(kind, hkv, lens, gen) for _ in range(R - 1)]
    qs = [torch.randn(B, hq, D, dtype=DT, device=DEV) for _ in range(R)]
    outs = [torch.empty_like(q) for q in qs]
    nbytes = kv_bytes(kind, hkv, lens)
    tol = 1e-2
    rows = sorted({0, B - 1})
    rec = dict(heads=[hq, hkv], kv=kind, block=BLOCK[kind], batch=B, context=ctx, lens=lens, kv_bytes=nbytes,
               rotate=R, results=[])

    def add(name, fn_of, launch=None):
        r = dict(kernel=name, launch=launch)
        try:
            err = check(lambda out: fn_of(0, out), qs[0], caches[0], rows, hq)
            r.update(rel_err=err, ok=err <= tol)
            if r["ok"]:
                med, lo, hi = time_graph([lambda i=i: fn_of(i, outs[i]) for i in range(R)])
                r.update(us=med, us_min=lo, us_max=hi, read_tb_s=nbytes / med * 1e-6,
                         frac_copy_bw=nbytes / (med * 1e-6) / copy_bw)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            r.update(ok=False, error=f"{type(e).__name__}: {e}"[:400])
        rec["results"].append(r)
        return r

    S0 = DEC.choose_num_segments(ncu, B, hkv, 32768)
    L0 = tuple(DEC.default_launch_config(torch.int8 if kind == "int8" else torch.bfloat16, D, num_seqs=B))
    # int8: every (launch, Q.K path) asked for; the built-in is the default launch on the default path
    launches = [L0] + [tuple(x) for x in int8_launches if tuple(x) != L0] if kind == "int8" else [L0]
    qks = sorted(set(qk_paths), key=lambda x: x != DEC.QK_INT8_DOT) if kind == "int8" else [None]
    for L in launches:
        for qk in qks:
            for S in sorted(set(segment_counts(S0, span)) | set(extra_segments)):
                ws = [DEC.decode_workspace(B, hq, D, S, DEV) for _ in range(R)]

                def ours(i, out, S=S, ws=ws, L=L, qk=qk):
                    c = caches[i]
                    DEC.split_kv_decode(qs[i], c["k"], c["v"], c["bt"], c["sl"], SCALE, out, k_scale_cache=c["ks"],
                                        v_scale_cache=c["vs"], num_segments=S, workspace=ws[i], tile_n=L[0],
                                        num_warps=L[1], num_stages=L[2], qk_int8=qk)
                builtin = S == S0 and L == L0 and qk in (None, DEC.QK_INT8_DOT)
                name = "forge builtin" if builtin else f"forge S={S}" + (
                    f" {','.join(map(str, L))} qk={'int8' if qk else 'bf16'}" if kind == "int8" else "")
                r = add(name, ours, launch=[S, *L])
                if qk is not None:
                    r["qk"] = "int8" if qk else "bf16"
    if up is not None and (kind == "bf16" or up.int8):
        prep = up.prepare(B, hq, hkv)
        add("vllm unified 3D", lambda i, out: up.call(prep, qs[i], caches[i], out, max(lens)))
    ok = [r for r in rec["results"] if r.get("us") and r["kernel"].startswith("forge")]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    rec["builtin"] = next((r for r in ok if r["kernel"] == "forge builtin"), None)
    rec["best"] = best
    rec["vllm"] = next((r for r in rec["results"] if r["kernel"].startswith("vllm") and r.get("us")), None)
    caches = qs = outs = None  # frees them (the closures above hold the cells)
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rec


def segment_counts(s0: int, span: int = 4) -> list[int]:
    """The powers of two times the built-in count s0 from s0 / span to s0 * span (span a power of two), within
    1-256: the segment counts a point times."""
    out, f = set(), 1
    while f <= span:
        out |= {s0 // f, s0 * f}
        f *= 2
    return sorted(s for s in out if 1 <= s <= 256)


def goals(points):
    """The issue's two goals over the measured points: [(goal, ok, detail)]."""
    out = []
    bf16_run = not points or any(p["kv"] == "bf16" for p in points)     # a run of the int8 cache alone: no bf16 lines
    for hq, hkv in HEADS:
        sel = [p for p in points if p["heads"] == [hq, hkv] and p["batch"] == GOAL_BATCH and p["context"] >= GOAL_MIN_CTX
               and p["kv"] == "bf16"]
        fr = [(p["context"], p["builtin"]["frac_copy_bw"] if p["builtin"] else 0.0) for p in sel]
        if bf16_run:
            out.append((f"KV read >= {GOAL_FRAC:.0%} of copy bandwidth, batch {GOAL_BATCH}, bf16, {hq}/{hkv} heads, "
                        f"contexts >= {GOAL_MIN_CTX}", bool(fr) and all(f >= GOAL_FRAC for _, f in fr),
                        ", ".join(f"{c}: {f:.1%}" for c, f in fr) or "not measured"))
        # the int8 cache: the fastest measured candidate (what a calibrated table serves)
        sel = [p for p in points if p["heads"] == [hq, hkv] and p["batch"] == GOAL_BATCH and p["context"] >= GOAL_MIN_CTX
               and p["kv"] == "int8"]
        if sel:
            fr = [(p["context"], p["best"]["frac_copy_bw"] if p["best"] else 0.0,
                   best_label(p["best"])) for p in sel]
            out.append((f"KV read >= {GOAL_FRAC:.0%} of copy bandwidth, batch {GOAL_BATCH}, int8 (fastest candidate), "
                        f"{hq}/{hkv} heads, contexts >= {GOAL_MIN_CTX}", all(f >= GOAL_FRAC for _, f, _k in fr),
                        ", ".join(f"{c}: {f:.1%} (S; launch; Q.K: {k})" for c, f, k in fr)))
    cmp = [p for p in points if p["vllm"]]
    slower = [p for p in cmp if not (p["builtin"] and p["builtin"]["us"] < p["vllm"]["us"])]
    out.append(("forge (built-in segments) faster than vLLM's unified kernel at every point", bool(cmp) and not slower,
                f"{len(cmp) - len(slower)}/{len(cmp)} points" + ("; slower at " + ", ".join(
                    f"{p['heads'][0]}/{p['heads'][1]} {p['kv']} b{p['batch']} ctx {p['context']}" for p in slower[:8])
                    if slower else "")))
    return out


def _manifest_commit(path):
    """The commit a source manifest (make gpu-bundle's build/source-manifest.json) names, marked where this
    copy's kernels/ differ from it (git blob ids)."""
    import hashlib
    with open(path) as f:
        m = json.load(f)
    differ = False
    for rel, blob in m.get("files", {}).items():
        if rel.startswith("kernels/"):
            try:
                with open(os.path.join(REPO, rel), "rb") as f:
                    data = f.read()
            except OSError:
                differ = True
                continue
            differ |= hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != blob
    return m.get("commit", "?") + (" (kernels/ differ from it)" if differ else "")


def commit():
    # a copy whose git folder is another commit's names the manifest it was copied with (FORGE_SOURCE_MANIFEST)
    if os.environ.get("FORGE_SOURCE_MANIFEST"):
        try:
            return _manifest_commit(os.environ["FORGE_SOURCE_MANIFEST"])
        except (OSError, ValueError):
            pass
    try:
        r = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "kernels"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        if r.returncode == 0:
            return r.stdout.strip() + (" (kernels/ dirty)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    manifest = os.path.join(REPO, "build", "source-manifest.json")     # a bundle without .git (make gpu-bundle)
    if os.path.isfile(manifest):
        with open(manifest) as f:
            return json.load(f).get("commit")
    return None


def best_label(r):
    """The fastest candidate as the table names it: its segment count, and for the int8 cache its launch and
    Q.K path."""
    if not r:
        return "-"
    if r.get("qk") is None:
        return str(r["launch"][0])
    return f"{r['launch'][0]}; {','.join(map(str, r['launch'][1:]))}; {r['qk']}"


def render(res):
    def num(r, k, fmt):
        return format(r[k], fmt) if r and r.get(k) is not None else "-"

    L = [f"# Batched decode attention: {res['provenance']['device']}", "",
         f"Copy bandwidth {res['copy_bw_tb_s']:.2f} TB/s (read + written). `{res['provenance']['command']}`; "
         f"commit {res['provenance']['commit']}.", "",
         "| heads | KV | batch | context | KV MiB | builtin S | us | % copy BW | best (S, int8: launch, Q.K) | us | "
         "% copy BW | "
         "vLLM unified us | vLLM / forge builtin |", "|" + "---|" * 13]
    for p in res["points"]:
        b, bb, v = p["builtin"], p["best"], p["vllm"]
        ratio = f"{v['us'] / b['us']:.2f}x" if (b and v) else "-"
        L.append(f"| {p['heads'][0]}/{p['heads'][1]} | {p['kv']} | {p['batch']} | {p['context']} | "
                 f"{p['kv_bytes'] / MiB:.0f} | {b['launch'][0] if b else '-'} | {num(b, 'us', '.1f')} | "
                 f"{num(b, 'frac_copy_bw', '.0%')} | {best_label(bb)} | {num(bb, 'us', '.1f')} | "
                 f"{num(bb, 'frac_copy_bw', '.0%')} | {num(v, 'us', '.1f')} | {ratio} |")
    L += ["", "## Goals", ""] + [f"- {'PASS' if ok else 'FAIL'}: {g} ({d})" for g, ok, d in res["goals"]]
    fails = [(p, r) for p in res["points"] for r in p["results"] if not r.get("ok")]
    if fails:
        L += ["", "## Failed candidates", ""] + [
            f"- {p['heads'][0]}/{p['heads'][1]} {p['kv']} b{p['batch']} ctx {p['context']} {r['kernel']}: "
            f"{r.get('error') or 'error %.3g' % r.get('rel_err', float('nan'))}" for p, r in fails]
    if res["errors"]:
        L += ["", "## Errors", ""] + [f"- {e.splitlines()[0]}" for e in res["errors"]]
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payload", default=os.path.join(REPO, "build", "gpu-payload"),
                    help="vLLM's reference kernels (kernels/bench/prepare_payload.py); absent: the installed vLLM")
    ap.add_argument("--out", default=os.path.join(REPO, "reports", "kernels", "decode-batched"))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--heads", default=",".join(f"{q}/{k}" for q, k in HEADS), help="q/KV heads per rank, e.g. 24/4,12/2")
    ap.add_argument("--kv", default="bf16,int8", help="cache kinds: bf16, int8")
    ap.add_argument("--int8-launches", default="",
                    help="int8 cache: TILE_N,warps,stages launches timed beside the built-in, ';'-separated, e.g. "
                         "'128,4,2;32,4,2'")
    ap.add_argument("--qk", default="default", help="int8 cache: the Q.K paths to time: int8, bf16 or both "
                    "('int8,bf16'); default: the kernel's own (split_kv_decode.QK_INT8_DOT)")
    ap.add_argument("--segment-span", type=int, default=4,
                    help="the segment counts timed: powers of two from 1/N to N times the built-in count (N a "
                         "power of two, default 4)")
    ap.add_argument("--segments", default="",
                    help="segment counts timed beside the span's powers of two, ','-separated (any 1-256, e.g. "
                         "'24,48': counts whose program total fits the card's resident programs)")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if a.segment_span < 1 or a.segment_span & (a.segment_span - 1):
        sys.exit(f"bench_decode_batched.py: --segment-span {a.segment_span}: a power of two (1, 2, 4, 8, ...)")
    if not torch.cuda.is_available():
        sys.exit("bench_decode_batched.py: no GPU visible to torch; run it on the GPU machine")
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    heads = [tuple(int(y) for y in x.split("/")) for x in a.heads.split(",")]
    kinds = [x for x in a.kv.split(",") if x]
    if any(k not in BLOCK for k in kinds) or any(q % k for q, k in heads):
        sys.exit("bench_decode_batched.py: --kv takes bf16,int8; --heads q/KV with q a multiple of KV")
    try:
        int8_launches = [tuple(int(y) for y in x.split(",")) for x in a.int8_launches.split(";") if x.strip()]
    except ValueError:
        int8_launches = [()]
    try:
        extra_segments = [int(x) for x in a.segments.split(",") if x.strip()]
    except ValueError:
        extra_segments = [0]
    if any(not 1 <= x <= 256 for x in extra_segments):
        sys.exit(f"bench_decode_batched.py: --segments {a.segments!r}: integers from 1 to 256, ','-separated")
    qk_map = {"int8": True, "bf16": False, "default": DEC.QK_INT8_DOT}
    qk_paths = [qk_map.get(x.strip()) for x in a.qk.split(",")]
    if any(len(x) != 3 or min(x) < 1 for x in int8_launches) or None in qk_paths:
        sys.exit("bench_decode_batched.py: --int8-launches takes TILE_N,warps,stages;... (positive integers); "
                 "--qk takes int8, bf16, default")
    os.makedirs(a.out, exist_ok=True)
    dev = torch.cuda.get_device_properties(0)
    ncu = dev.multi_processor_count
    prov = dict(commit=commit(), device=dev.name, compute_units=ncu, torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None), python=platform.python_version(),
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                command="python3 " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, REPO), *sys.argv[1:]]))
    pp = os.path.join(a.payload, "provenance.json")
    if os.path.isfile(pp):
        with open(pp) as f:
            prov["payload"] = json.load(f)
    res = dict(provenance=prov, points=[], errors=[], goals=[])
    try:
        up = Unified(a.payload)
        prov["vllm_unified_from"] = up.source
    except Exception as e:  # noqa: BLE001 - our kernel is still measured
        up = None
        res["errors"].append(f"vLLM's unified kernel not importable: {type(e).__name__}: {e}"[:600])
    bw = copy_bandwidth(DEV)
    res["copy_bw_tb_s"] = bw * 1e-12
    print(f"== {dev.name}, {ncu} CUs, copy bandwidth {bw * 1e-12:.2f} TB/s", flush=True)
    path = os.path.join(a.out, "decode-batched.json")
    n = 0
    for hq, hkv in heads:
        for kind in kinds:
            for B in batches:
                for ctx in contexts:
                    n += 1
                    try:
                        p = bench_point(hq, hkv, kind, B, ctx, ncu, up, bw, a.seed + n, int8_launches, qk_paths,
                                        a.segment_span, extra_segments)
                    except Exception:  # noqa: BLE001 - one point's failure (e.g. out of memory) is recorded
                        res["errors"].append(f"{hq}/{hkv} {kind} b{B} ctx {ctx}: " + traceback.format_exc()[-800:])
                        torch.cuda.empty_cache()
                        continue
                    res["points"].append(p)
                    b, v = p["builtin"], p["vllm"]
                    ours = "%8.1f us %4.0f %%" % (b["us"], 100 * b["frac_copy_bw"]) if b else "  failed"
                    bb = p["best"]
                    if bb and bb is not b:
                        ours += " best %8.1f us %4.0f %% (%s)" % (bb["us"], 100 * bb["frac_copy_bw"], best_label(bb))
                    theirs = "%8.1f us" % v["us"] if v else "       -"
                    print(f"{hq:>2}/{hkv} {kind:4} b{B:<2} ctx {ctx:>5}: forge {ours}  vllm {theirs}", flush=True)
                    res["goals"] = goals(res["points"])
                    with open(path, "w") as f:
                        json.dump(res, f, indent=1)
    res["goals"] = goals(res["points"])
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "decode-batched.md"), "w") as f:
        f.write(render(res))
    print()
    for g, ok, d in res["goals"]:
        print(f"{'PASS' if ok else 'FAIL'}: {g} ({d})")
    for e in res["errors"]:
        print("error:", e.splitlines()[0])
    print(f"wrote {path} and decode-batched.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
