"""Markdown table and PNG plot from the benchmark's bench.json (also usable without a GPU)."""

from __future__ import annotations

import json
import os

GOALS = {("bf16", 32768): 38.0, ("int8", 32768): 20.0, ("bf16", 4096): 8.0, ("int8", 4096): 8.0}


def _index(res):
    idx = {}
    for r in res.get("decode", []):
        if "us" in r:
            idx[(r["kernel"], r["kv"], r["batch"], r["context"])] = r
    return idx


def provenance_lines(res):
    p = res.get("provenance", {})
    return [f"- git commit: `{p.get('git_commit')}` (kernels dirty: {p.get('kernels_dirty')}"
            + (f"; uncommitted: {', '.join(p['dirty_paths'])}" if p.get("dirty_paths") else "") + ")",
            f"- device: {p.get('device')} ({p.get('compute_units')} SMs), CUDA {p.get('cuda')}",
            f"- torch {p.get('torch')}, triton {p.get('triton')}, python {p.get('python')}",
            f"- date: {p.get('date')}",
            f"- command: `{p.get('command')}`",
            f"- vLLM reference kernels: vLLM {p.get('vllm_version')} sdist, sha256 "
            + ", ".join(f"{os.path.basename(k)}={v[:12]}" for k, v in p.get("vllm_files_sha256", {}).items())]


def markdown(res) -> str:
    bw = res.get("copy_bw_Bps") or 0
    idx = _index(res)
    L = ["# Kernel benchmark", "", *provenance_lines(res), "",
         f"Device copy bandwidth (read+write): **{bw / 1e12:.2f} TB/s**. Chosen forge launch config "
         f"(tile, warps, stages): {res.get('chosen_config')}.", "",
         "## Decode attention (24 q / 4 kv heads, head_dim 256, one query token per sequence)", "",
         "µs per call (CUDA graph, rotated KV caches, median). frac = KV bytes / time / copy bandwidth. "
         "forge bf16 uses 784-token blocks, forge int8 1552-token blocks (page layout with fp32 scales); "
         "vLLM kernels run bf16 with 784-token blocks. Speed-up is vs vLLM's unified 3D kernel (TRITON_ATTN).", "",
         "| batch | context | forge bf16 | frac | forge int8 | frac | vLLM 3D (16 seg) | vLLM grouped (64 splits) | speed-up bf16 | speed-up int8 |",
         "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(k[2], k[3]) for k in idx})
    for B, C in keys:
        fb = idx.get(("forge", "bf16", B, C))
        fi = idx.get(("forge", "int8", B, C))
        u = idx.get(("vllm_unified_3d", "bf16", B, C))
        g = idx.get(("vllm_grouped", "bf16", B, C))

        def us(r):
            return f"{r['us']:.1f}" if r else "-"

        def fr(r):
            return f"{r['kv_bytes'] / (r['us'] * 1e-6) / bw:.2f}" if (r and bw) else "-"

        def sp(r):
            return f"{u['us'] / r['us']:.2f}×" if (r and u) else "-"
        L.append(f"| {B} | {C} | {us(fb)} | {fr(fb)} | {us(fi)} | {fr(fi)} | {us(u)} | {us(g)} | {sp(fb)} | {sp(fi)} |")
    L += ["", "## Goals (batch 1)", "", "| case | goal µs | reached µs | met |", "|---|---:|---:|---|"]
    for (kv, C), goal in GOALS.items():
        r = idx.get(("forge", kv, 1, C))
        if r:
            L.append(f"| {kv} {C} | {goal} | {r['us']:.1f} | {'yes' if r['us'] <= goal else 'no'} |")
    slower = [(k, r["us"], idx[("vllm_unified_3d", "bf16", k[2], k[3])]["us"]) for k, r in idx.items()
              if k[0] == "forge" and ("vllm_unified_3d", "bf16", k[2], k[3]) in idx
              and r["us"] > idx[("vllm_unified_3d", "bf16", k[2], k[3])]["us"]]
    L.append("")
    L.append("Points where forge is slower than vLLM's 3D kernel: " +
             (", ".join(f"{k[1]} B={k[2]} ctx={k[3]} ({a:.1f} vs {b:.1f} µs)" for k, a, b in slower) or "none") + ".")
    L += ["", "## Quantize-on-write (int8 KV, 4 kv heads × 256, block 1552)", "",
          "| kernel | case | µs | TB/s | frac copy BW |", "|---|---|---:|---:|---:|"]
    for w in res.get("write", []):
        us = w.get("us_per_layer", w.get("us"))
        L.append(f"| {w['kernel']} | {w['case']} | {us:.2f} | {w.get('tb_s', float('nan')):.2f} | "
                 f"{w.get('frac_copy_bw', float('nan')):.2f} |")
    L += ["", "## Correctness (GPU, float64 references)", "", "| check | details | error | ok |", "|---|---|---:|---|"]
    for c in res.get("correctness", []):
        det = {k: v for k, v in c.items() if k not in ("test", "rel_err", "ok", "tol")}
        err = c.get("rel_err", c.get("max_lsb_diff", c.get("bytes_differing")))
        L.append(f"| {c['test']} | {json.dumps(det)} | {err} | {c.get('ok')} |")
    if res.get("decode_extra"):
        L += ["", "## Other block sizes (batch 1)", "", "| kernel | kv | block | context | µs | frac copy BW |",
              "|---|---|---:|---:|---:|---:|"]
        for r in res["decode_extra"]:
            if "us" in r:
                L.append(f"| {r['kernel']} | {r['kv']} | {r['block']} | {r['context']} | {r['us']:.1f} | "
                         f"{r['kv_bytes'] / (r['us'] * 1e-6) / bw:.2f} |")
    if res.get("sweep"):
        L += ["", "## Launch-config sweep (forge decode)", "", "| kv | batch | ctx | tile | warps | stages | S | µs |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["sweep"]:
            L.append(f"| {r['kv']} | {r['batch']} | {r['context']} | {r.get('tile')} | {r.get('warps')} | "
                     f"{r.get('stages')} | {r.get('S')} | {r.get('us', float('nan')):.1f} |")
    if res.get("errors"):
        L += ["", "## Errors", ""] + [f"- `{e[-300:]}`" for e in res["errors"]]
    return "\n".join(L) + "\n"


def plot(res, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    idx = _index(res)
    batches = sorted({k[2] for k in idx})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 4), squeeze=False)
    series = [("forge", "bf16", "forge bf16 (bs 784)"), ("forge", "int8", "forge int8 (bs 1552)"),
              ("vllm_unified_3d", "bf16", "vLLM unified 3D bf16"), ("vllm_grouped", "bf16", "vLLM grouped bf16")]
    for ax, B in zip(axes[0], batches):
        for k, kv, label in series:
            pts = sorted((c, r["us"]) for (kk, kvv, b, c), r in idx.items() if kk == k and kvv == kv and b == B)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"batch {B}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("µs per decode call")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    p = res.get("provenance", {})
    fig.suptitle(f"decode attention 24q/4kv/256 — {p.get('device')} — commit {str(p.get('git_commit'))[:10]} — "
                 f"torch {p.get('torch')} triton {p.get('triton')} — {p.get('date')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_reports(res, out_dir):
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(markdown(res))
    plot(res, os.path.join(out_dir, "bench.png"))
