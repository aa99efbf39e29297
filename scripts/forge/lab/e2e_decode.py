"""`forge e2e-decode`: does an end-to-end run's decode speed-up match the kernel benchmark?

For every request a profile and the reference served in the same round, the measured TPOT saving
(reference TPOT - profile TPOT) is set beside the saving the kernel benchmark predicts: the decode
attention time of the reference's kernel minus the profile's, at batch 1 and the request's mean
context (prompt + half the output), interpolated linearly between the benchmark's context lengths,
times the model's full-attention layers. Which kernel a server ran follows from its recorded launch
(serve.json): `VLLM_FORGE_DECODE=1` is our split-KV kernel, otherwise vLLM's unified 3D kernel; the KV
dtype from `--kv-cache-dtype`. Writes decode.json and decode.md into the run folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..run import contest as contest_mod
from .. import paths, ui
from ..run import archive, runs
from ..errors import ForgeError

# the kernel benchmark the prediction comes from: a copy of the H200 run recorded in
# reports/kernels/bench.json (tools read their inputs from configs/ or arguments, never from reports/)
DEFAULT_BENCH = paths.ROOT / "configs" / "kernels" / "bench-h200.json"
DEFAULT_CONFIG = paths.ROOT / "configs" / "models" / "qwen3.5-27b" / "config.json"
UPSTREAM_KERNEL = "vllm_unified_3d"     # TRITON_ATTN's decode launch in vLLM 0.18.1 (bench.json name)


def attention_layers(config: dict) -> int:
    """Full-attention layers of a hybrid model (the others keep no KV cache to attend over)."""
    tc = config.get("text_config", config)
    types = tc.get("layer_types")
    if types:
        return sum(1 for t in types if t == "full_attention")
    interval = tc.get("full_attention_interval")
    n = tc.get("num_hidden_layers")
    if interval and n:
        return n // interval
    if n:
        return n
    raise ForgeError("model config has neither layer_types nor num_hidden_layers",
                     hint="give --config the model's config.json")


def server_kernel(serve: dict) -> tuple[str, str]:
    """(KV dtype, decode kernel) a recorded server ran, in the kernel benchmark's names."""
    cmd = serve.get("launch") or serve.get("command") or []
    kv = "bf16"
    for i, a in enumerate(cmd):
        v = cmd[i + 1] if a == "--kv-cache-dtype" and i + 1 < len(cmd) else (
            a.split("=", 1)[1] if a.startswith("--kv-cache-dtype=") else None)
        if v is not None:
            kv = "int8" if v == "int8" else "bf16" if v in ("auto", "bfloat16", "bf16") else v
    kernel = "forge" if str((serve.get("env") or {}).get("VLLM_FORGE_DECODE", "")) == "1" else UPSTREAM_KERNEL
    return kv, kernel


def decode_us(bench: dict, kv: str, kernel: str, context: float) -> float | None:
    """µs per decode-attention call at batch 1, linear between the measured contexts; None outside
    them or when the benchmark has no such kernel."""
    pts = sorted((r["context"], r["us"]) for r in bench.get("decode", [])
                 if r.get("batch") == 1 and r.get("kv") == kv and r.get("kernel") == kernel)
    for (c0, u0), (c1, u1) in zip(pts, pts[1:]):
        if c0 <= context <= c1:
            return u0 + (u1 - u0) * (context - c0) / (c1 - c0)
    if pts and context == pts[-1][0]:
        return pts[-1][1]
    return None


def _rounds(run_dir: Path, tiers: list[str]) -> dict[tuple[str, str], dict]:
    """{(round, tier): the round's `vllm bench serve` result} of one profile's run folder."""
    return {(f.parent.name, t): runs.read_json(f) for t in tiers
            for f in sorted((run_dir / "rounds").glob(f"r*/{t}.json"))}


def analyse(folder: Path, bench: dict, layers: int, reference: str = "upstream") -> dict:
    rdir = folder / "runs"
    if not (rdir / reference / "serve.json").is_file():
        raise ForgeError(f"{folder}: no runs/{reference}/serve.json (the reference server's record)",
                         hint=archive.read_hint(folder, "give an e2e-gpu results folder and its reference "
                                                                "profile (--reference)"))
    ref_kernel = server_kernel(runs.read_json(rdir / reference / "serve.json"))
    tiers = contest_mod.tier_names(contest_mod.load_contest())
    ref_rounds = _rounds(rdir / reference, tiers)
    profiles = {}
    for pdir in sorted(p for p in rdir.iterdir() if p.is_dir() and p.name != reference
                       and not p.name.startswith("fault-") and (p / "serve.json").is_file()):
        kern = server_kernel(runs.read_json(pdir / "serve.json"))
        rows = []
        measured = sorted(_rounds(pdir, tiers).items(), key=lambda kv: ((kv[1].get("input_lens") or [0])[0], kv[0][0]))
        for key, res in measured:
            ref = ref_rounds.get(key)
            if ref is None or res.get("completed") != 1 or ref.get("completed") != 1 \
                    or res.get("mean_tpot_ms") is None or ref.get("mean_tpot_ms") is None:
                continue                 # one served request per round and profile: its TPOT is the request's
            prompt = (res.get("input_lens") or [None])[0]
            out_tokens = (res.get("output_lens") or [None])[0]
            if prompt is None or out_tokens is None:
                continue
            ctx = prompt + out_tokens / 2.0
            u_ref = decode_us(bench, *ref_kernel, ctx)
            u_prof = decode_us(bench, *kern, ctx)
            pred = None if u_ref is None or u_prof is None else layers * (u_ref - u_prof) / 1000.0
            rows.append({"round": key[0], "tier": key[1], "prompt_tokens": prompt, "output_tokens": out_tokens,
                         "reference_tpot_ms": ref["mean_tpot_ms"], "tpot_ms": res["mean_tpot_ms"],
                         "saved_ms": ref["mean_tpot_ms"] - res["mean_tpot_ms"], "predicted_saved_ms": pred,
                         "reference_attention_ms": None if u_ref is None else layers * u_ref / 1000.0})
        profiles[pdir.name] = {"kv": kern[0], "kernel": kern[1], "rows": rows}
    return {"folder": paths.rel(folder), "reference": reference, "reference_kv": ref_kernel[0],
            "reference_kernel": ref_kernel[1], "attention_layers": layers,
            "bench_provenance": {k: bench.get("provenance", {}).get(k) for k in ("git_commit", "device", "torch",
                                                                               "triton", "date", "command")},
            "profiles": profiles}


def render_md(res: dict) -> str:
    bp = res["bench_provenance"]
    L = ["<!-- generated by `forge e2e-decode` (scripts/forge/lab/e2e_decode.py); do not edit -->",
         f"# Decode: measured TPOT saving against the kernel benchmark ({res['folder']})", "",
         f"- reference `{res['reference']}`: {res['reference_kv']} KV, decode kernel `{res['reference_kernel']}`",
         f"- prediction: `{res.get('bench', 'reports/kernels/bench.json')}` "
         f"(commit `{(bp.get('git_commit') or '?')[:12]}`, "
         f"{bp.get('device')}, torch {bp.get('torch')}, triton {bp.get('triton')}), batch 1, linear between "
         f"measured contexts at prompt + output/2, × {res['attention_layers']} full-attention layers", ""]
    for name, p in res["profiles"].items():
        L += [f"## {name} ({p['kv']} KV, decode kernel `{p['kernel']}`)", "",
              "| round | tier | prompt tokens | reference TPOT ms | TPOT ms | saved ms | predicted ms | "
              "reference decode attention ms (predicted) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in p["rows"]:
            pred = "—" if r["predicted_saved_ms"] is None else f"{r['predicted_saved_ms']:.2f}"
            att = "—" if r["reference_attention_ms"] is None else f"{r['reference_attention_ms']:.2f}"
            L.append(f"| {r['round']} | {r['tier']} | {r['prompt_tokens']:,} | {r['reference_tpot_ms']:.2f} | "
                     f"{r['tpot_ms']:.2f} | {r['saved_ms']:.2f} | {pred} | {att} |")
        if not p["rows"]:
            L.append("| — | no round with one served request from both servers | | | | | | |")
        L.append("")
    return "\n".join(L).rstrip() + "\n"


def write(folder: Path, bench_path: Path = DEFAULT_BENCH, config_path: Path = DEFAULT_CONFIG,
          reference: str = "upstream") -> dict:
    for what, p in (("kernel benchmark", bench_path), ("model config", config_path)):
        if not Path(p).is_file():
            raise ForgeError(f"{what} not found: {p}",
                             hint="run the kernel benchmark (kernels/bench/bench_kernels.py) or give its JSON "
                                  "with --bench" if what == "kernel benchmark" else "give --config")
    res = analyse(folder, json.loads(Path(bench_path).read_text()),
                  attention_layers(json.loads(Path(config_path).read_text())), reference)
    res["bench"] = paths.rel(Path(bench_path))
    runs.write_json(folder / "decode.json", res)
    (folder / "decode.md").write_text(render_md(res))
    return res


def cmd_e2e_decode(args) -> int:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise ForgeError(f"{folder}: not a folder", hint="give a results folder of forge e2e-gpu")
    res = write(folder, Path(args.bench), Path(args.config), args.reference)
    for name, p in res["profiles"].items():
        print(f"{name} vs {res['reference']} ({p['kv']}, {p['kernel']}):")
        for r in p["rows"]:
            pred = "—" if r["predicted_saved_ms"] is None else f"{r['predicted_saved_ms']:.2f}"
            print(f"  {r['round']} {r['tier']:>6} {r['prompt_tokens']:>6} tokens: saved {r['saved_ms']:.2f} ms, "
                  f"predicted {pred} ms")
    ui.info(f"wrote {folder / 'decode.json'}, decode.md")
    return 0


def register(sub) -> None:
    p = sub.add_parser("e2e-decode", help="measured TPOT saving of an e2e-gpu run against the kernel benchmark",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("folder", help="results folder of forge e2e-gpu (reports/e2e/<date>-<device>)")
    p.add_argument("--bench", default=str(DEFAULT_BENCH),
                   help=f"kernel benchmark JSON (default {paths.rel(DEFAULT_BENCH)}, "
                        "a copy of reports/kernels/bench.json)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="model config.json (default: Qwen3.5-27B's)")
    p.add_argument("--reference", default="upstream", help="the reference profile (default upstream)")
    p.set_defaults(func=cmd_e2e_decode)
