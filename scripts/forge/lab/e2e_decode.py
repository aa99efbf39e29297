"""`forge e2e-decode`: does an end-to-end run's decode speed-up match the kernel benchmark?

For every request a profile and the reference both served (the same prompt: the same place in a tier's
client invocation, or the same round of a folder of the earlier layout), the measured TPOT saving
(reference TPOT - profile TPOT) is set beside the saving the kernel benchmark predicts: the decode
attention time of the reference's kernel minus the profile's, at batch 1 and the request's mean
context (prompt + half the output), interpolated linearly between the benchmark's context lengths,
times the model's full-attention layers. Which kernel a server ran follows from its recorded launch
(serve.json): `VLLM_FORGE_DECODE=1` is our split-KV kernel, otherwise vLLM's unified 3D kernel; the KV
dtype from `--kv-cache-dtype`. Where a server ran our decode GEMV (`VLLM_FORGE_GEMV=1`), the GEMV
benchmark adds its term: at one token, for each linear layer the route sends to the kernel, the anchor's
time (what runs without the kernel) minus the kernel's built-in launch, times the layer's calls per token
(full-attention, linear-attention, every layer, the LM head once; the MLP's gate_up as the fused gate_up +
SiLU against GEMM + activation). The route is the server's VLLM_FORGE_GEMV_SHAPES where set, else the
benchmark's own at one token (where the kernel won; a shared (N, K) only where every layer of it won),
which is the patch's table on the run it was recorded from. Writes decode.json and decode.md into the run
folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import config, options, paths, records, switches, ui
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..run import archive, runs

# the kernel benchmark the prediction comes from: a copy of the H200 run recorded in
# reports/kernels/bench.json (tools read their inputs from configs/ or arguments, never from reports/)
DEFAULT_BENCH = paths.ROOT / "configs" / "kernels" / "bench-h200.json"
DEFAULT_CONFIG = paths.ROOT / "configs" / "models" / "qwen3.5-27b" / "config.json"
# the GEMV benchmark (kernels/bench/bench_gemv.py): a copy of the H200 run in reports/kernels/gemv/bench_gemv.json
DEFAULT_GEMV_BENCH = paths.ROOT / "configs" / "kernels" / "gemv-h200.json"
# which layers call each benchmarked GEMV shape once per decoded token
GEMV_CALLERS = {"qkv_gate": "full_attention", "o_proj": "full_attention", "in_proj_qkvz": "linear_attention",
                "in_proj_ba": "linear_attention", "out_proj": "linear_attention", "gate_up": "all",
                "down": "all", "lm_head": "once"}
GEMV_ROUTE_IMPL = "vLLM route without the kernel"   # bench_gemv.py's anchor on ROCm (--ops vllm)
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


def layer_counts(config: dict) -> dict[str, int]:
    """Calls per decoded token of each GEMV_CALLERS kind."""
    tc = config.get("text_config", config)
    types = tc.get("layer_types") or []
    n = tc.get("num_hidden_layers") or len(types)
    full = attention_layers(config)
    return {"full_attention": full, "linear_attention": n - full, "all": n, "once": 1}


def server_gemv(serve: dict) -> str | None:
    """The GEMV route a recorded server ran: None (the kernel off: VLLM_FORGE_GEMV unset, "0", or "auto",
    which is off on the CUDA machines the harness runs on), else its VLLM_FORGE_GEMV_SHAPES ("" = the
    platform's table)."""
    env = serve.get("env") or {}
    if str(env.get("VLLM_FORGE_GEMV", "")) != "1":
        return None
    return str(env.get("VLLM_FORGE_GEMV_SHAPES", "")).strip()


def _shapes_at_one_token(spec: str) -> set[tuple[int, int]] | None:
    """(N, K) a VLLM_FORGE_GEMV_SHAPES value sends to the GEMV at one token (not those it sends to the
    skinny GEMM, "=mma"); None for "all"."""
    table = switches.gemv_launches(spec, "a recorded server's VLLM_FORGE_GEMV_SHAPES")   # as the server parses it
    return None if table is None else {nk for nk, rows in table.items() if rows.get(1) == "gemv"}


def gemv_saving(gbench: dict, calls: dict[str, int], spec: str) -> dict:
    """Predicted ms per decoded token the GEMV route saves against the same server without the kernel,
    at one token: {"ms", "terms": {shape: ms}} (see the module's docstring)."""
    nk = {r["shape"]: (r["N"], r["K"]) for r in gbench.get("rows", [])}
    one = {r["shape"]: r for r in gbench.get("summary", []) if r.get("M") == 1}
    missing = [s for s in GEMV_CALLERS if s not in one or s not in nk]
    if missing:
        raise ForgeError(f"the GEMV benchmark has no one-row result for {', '.join(missing)}",
                         hint="give --gemv-bench the bench_gemv.json of a full run (not --quick)")
    saved = {s: (r.get("route_us") or r["linear_us"]) - r["default_us"] for s, r in one.items() if s in GEMV_CALLERS}
    fused = [r for r in gbench.get("fused_gate_up", []) if r.get("M") == 1]
    anchor = ([r["us"] for r in fused if r["impl"].startswith(GEMV_ROUTE_IMPL)]
              or [r["us"] for r in fused if r["impl"].startswith("F.linear")])
    ours = [r["us"] for r in fused if r["impl"] == "forge_gemv_silu_mul"]
    if anchor and ours:                    # with the switch on, the MLP's gate_up runs as the fused op
        saved["gate_up"] = anchor[0] - ours[0]
    routed = _shapes_at_one_token(spec) if spec else {
        k for k in set(nk.values()) if all(saved[s] > 0 for s in GEMV_CALLERS if nk[s] == k)}
    terms = {s: calls[GEMV_CALLERS[s]] * saved[s] / 1000.0 if routed is None or nk[s] in routed else 0.0
             for s in GEMV_CALLERS}
    return {"ms": sum(terms.values()), "terms": terms}


def read_serve_record(path: Path) -> dict:
    """A run's serve.json (the record of the server it measured) with the keys read here checked: a JSON
    object whose 'env' maps names to values and whose 'command' and 'launch' are lists of words."""
    rec = runs.read_json(path)
    hint = "serve.json is damaged; restore it from the packed record (forge unpack-run) or a copy of the results"
    if not isinstance(rec, dict):
        raise ForgeError(f"{paths.rel(path)}: a JSON {type(rec).__name__}, not the record of a server", hint=hint)
    env = rec.get("env")
    if env is not None and not (isinstance(env, dict) and all(isinstance(v, (str, int, float)) and not
                                                              isinstance(v, bool) for v in env.values())):
        raise ForgeError(f"{paths.rel(path)}: key 'env' is {repr(env)[:60]}, expected a mapping of variable to value",
                         hint=hint)
    for key in ("command", "launch"):
        v = rec.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(a, str) for a in v)):
            raise ForgeError(f"{paths.rel(path)}: key '{key}' is {repr(v)[:60]}, expected a list of words (the "
                             "server's command line)", hint=hint)
    return rec


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


def _requests(run_dir: Path, tiers: list[str]) -> dict[tuple[str, str], dict]:
    """{(request, tier): one served request} of one profile's run folder, each as a one-request
    result: the requests of each <tier>.json (one client invocation over the tier's prompts, in the
    dataset's order), or, in a folder of the earlier layout, its rounds (rounds/r<k>/<tier>.json, one
    request each)."""
    if (run_dir / "rounds").is_dir():
        return {(f.parent.name, t): runs.read_json(f) for t in tiers
                for f in sorted((run_dir / "rounds").glob(f"r*/{t}.json"))}
    out = {}
    for t in tiers:
        f = runs.result_path(run_dir, t)
        if not f.is_file():
            continue
        res = runs.read_json(f)
        ins, outs, itls = res.get("input_lens") or [], res.get("output_lens") or [], res.get("itls") or []
        errors = res.get("errors") or [""] * len(ins)
        for i, (n_in, n_out, itl, err) in enumerate(zip(ins, outs, itls, errors)):
            ok = not err and n_out and n_out > 1
            out[(f"#{i + 1}", t)] = {"completed": 1 if ok else 0, "input_lens": [n_in], "output_lens": [n_out],
                                     "mean_tpot_ms": 1000.0 * sum(itl) / (n_out - 1) if ok else None}
    return out


def analyse(folder: Path, bench: dict, layers: int, reference: str = "upstream", gbench: dict | None = None,
            calls: dict[str, int] | None = None) -> dict:
    rdir = folder / "runs"
    if not (rdir / reference / "serve.json").is_file():
        raise ForgeError(f"{folder}: no runs/{reference}/serve.json (the reference server's record)",
                         hint=archive.read_hint(folder, "give an e2e-gpu results folder and its reference "
                                                                "profile (--reference)"))
    ref_serve = read_serve_record(rdir / reference / "serve.json")
    ref_kernel = server_kernel(ref_serve)

    def gemv(serve: dict) -> dict | None:
        spec = server_gemv(serve)
        if spec is None:
            return None
        if gbench is None or calls is None:
            return {"route": spec or "the platform's table", "ms": None, "terms": {}}
        return {"route": spec or "the platform's table", **gemv_saving(gbench, calls, spec)}

    ref_gemv = gemv(ref_serve)
    tiers = contest_mod.tier_names(contest_mod.load_contest())
    ref_rounds = _requests(rdir / reference, tiers)
    profiles = {}
    for pdir in sorted(p for p in rdir.iterdir() if p.is_dir() and p.name != reference
                       and not p.name.startswith("fault-") and (p / "serve.json").is_file()):
        serve = read_serve_record(pdir / "serve.json")
        kern = server_kernel(serve)
        own_gemv = gemv(serve)
        g_ms = [0.0 if g is None else g["ms"] for g in (own_gemv, ref_gemv)]
        gemv_pred = None if None in g_ms else g_ms[0] - g_ms[1]
        rows = []
        measured = sorted(_requests(pdir, tiers).items(), key=lambda kv: ((kv[1].get("input_lens") or [0])[0], kv[0][0]))
        for key, res in measured:
            ref = ref_rounds.get(key)
            if ref is None or res.get("completed") != 1 or ref.get("completed") != 1 \
                    or res.get("mean_tpot_ms") is None or ref.get("mean_tpot_ms") is None:
                continue                 # one served request on each side: its TPOT is the request's
            prompt = (res.get("input_lens") or [None])[0]
            out_tokens = (res.get("output_lens") or [None])[0]
            if prompt is None or out_tokens is None:
                continue
            ctx = prompt + out_tokens / 2.0
            u_ref = decode_us(bench, *ref_kernel, ctx)
            u_prof = decode_us(bench, *kern, ctx)
            pred = None if u_ref is None or u_prof is None else layers * (u_ref - u_prof) / 1000.0
            if pred is not None and (own_gemv or ref_gemv):
                pred = None if gemv_pred is None else pred + gemv_pred
            rows.append({"round": key[0], "tier": key[1], "prompt_tokens": prompt, "output_tokens": out_tokens,
                         "reference_tpot_ms": ref["mean_tpot_ms"], "tpot_ms": res["mean_tpot_ms"],
                         "saved_ms": ref["mean_tpot_ms"] - res["mean_tpot_ms"], "predicted_saved_ms": pred,
                         "reference_attention_ms": None if u_ref is None else layers * u_ref / 1000.0})
        profiles[pdir.name] = {"kv": kern[0], "kernel": kern[1], "rows": rows}
        if own_gemv or ref_gemv:
            profiles[pdir.name].update(gemv=own_gemv, predicted_gemv_saved_ms=gemv_pred)
    return {"folder": paths.rel(folder), "reference": reference, "reference_kv": ref_kernel[0],
            "reference_kernel": ref_kernel[1], "reference_gemv": ref_gemv, "attention_layers": layers,
            "bench_provenance": {k: bench.get("provenance", {}).get(k) for k in ("git_commit", "device", "torch",
                                                                               "triton", "date", "command")},
            "gemv_bench_provenance": None if gbench is None else {
                k: gbench.get("provenance", {}).get(k) for k in ("git_commit", "device", "torch", "date", "command")},
            "profiles": profiles}


def _gemv_line(who: str, g: dict | None) -> str:
    if g is None:
        return f"- GEMV: `{who}` ran without our decode GEMV"
    if g["ms"] is None:
        return f"- GEMV: `{who}` ran our decode GEMV (route: {g['route']}); no GEMV benchmark, no prediction"
    terms = ", ".join(f"{s} {v:.2f}" for s, v in sorted(g["terms"].items(), key=lambda kv: -kv[1]) if v)
    return (f"- GEMV: `{who}` ran our decode GEMV (route: {g['route']}): the GEMV benchmark predicts "
            f"{g['ms']:.2f} ms per token saved against the same server without it ({terms or 'no routed shape'})")


def render_md(res: dict) -> str:
    bp = res["bench_provenance"]
    with_gemv = bool(res.get("reference_gemv")) or any("gemv" in p for p in res["profiles"].values())
    L = ["<!-- generated by `forge e2e-decode` (scripts/forge/lab/e2e_decode.py); do not edit -->",
         f"# Decode: measured TPOT saving against the kernel benchmark ({res['folder']})", "",
         f"- reference `{res['reference']}`: {res['reference_kv']} KV, decode kernel `{res['reference_kernel']}`",
         f"- prediction: `{res.get('bench', 'reports/kernels/bench.json')}` "
         f"(commit `{(bp.get('git_commit') or '?')[:12]}`, "
         f"{bp.get('device')}, torch {bp.get('torch')}, triton {bp.get('triton')}), batch 1, linear between "
         f"measured contexts at prompt + output/2, × {res['attention_layers']} full-attention layers"]
    gp = res.get("gemv_bench_provenance")
    if with_gemv and gp:
        L.append(f"- GEMV prediction: `{res.get('gemv_bench')}` (commit `{(gp.get('git_commit') or '?')[:12]}`, "
                 f"{gp.get('device')}, torch {gp.get('torch')}), one row, the built-in launch against the route "
                 f"without the kernel, × calls per token; added to the attention term")
    if with_gemv:
        L.append(_gemv_line(res["reference"], res.get("reference_gemv")))
    L.append("")
    for name, p in res["profiles"].items():
        L += [f"## {name} ({p['kv']} KV, decode kernel `{p['kernel']}`)", ""]
        cols = ["request", "tier", "prompt tokens", "reference TPOT ms", "TPOT ms", "saved ms", "predicted ms"]
        if with_gemv:
            g = p.get("predicted_gemv_saved_ms")
            L += [_gemv_line(name, p.get("gemv")),
                  "- predicted = decode attention + GEMV ("
                  + ("—" if g is None else f"{g:.2f} ms") + " per token)", ""]
            cols.append("of which GEMV ms")
        cols.append("reference decode attention ms (predicted)")
        L += ["| " + " | ".join(cols) + " |", "|---|---|" + "---:|" * (len(cols) - 2)]
        for r in p["rows"]:
            pred = "—" if r["predicted_saved_ms"] is None else f"{r['predicted_saved_ms']:.2f}"
            att = "—" if r["reference_attention_ms"] is None else f"{r['reference_attention_ms']:.2f}"
            cells = [r["round"], r["tier"], f"{r['prompt_tokens']:,}", f"{r['reference_tpot_ms']:.2f}",
                     f"{r['tpot_ms']:.2f}", f"{r['saved_ms']:.2f}", pred]
            if with_gemv:
                g = p.get("predicted_gemv_saved_ms")
                cells.append("—" if g is None else f"{g:.2f}")
            L.append("| " + " | ".join(cells + [att]) + " |")
        if not p["rows"]:
            L.append("| — | no request served by both servers |" + " |" * (len(cols) - 2))
        L.append("")
    return "\n".join(L).rstrip() + "\n"


# the fields this module reads from each entry of the benchmarks' lists
ENTRY_FIELDS = {
    "kernel benchmark": {"decode": {"batch": int, "kv": str, "kernel": str, "context": float, "us": float}},
    "GEMV benchmark": {"summary": {"shape": str, "M": int, "linear_us": float, "default_us": float},
                       "rows": {"shape": str, "N": int, "K": int, "M": int},
                       "fused_gate_up": {"M": int, "impl": str, "us": float}},
}


def _check_entries(entries, fields: dict, file: str, lst: str) -> None:
    """Each entry a mapping with these fields of these types, else a ForgeError naming file and key."""
    for i, e in enumerate(config.check_type(entries, list, file, lst)):
        config.check_type(e, dict, file, f"{lst}[{i}]")
        for f, t in fields.items():
            config.check_type(e.get(f), t, file, f"{lst}[{i}].{f}")


def write(folder: Path, bench_path: Path = DEFAULT_BENCH, config_path: Path = DEFAULT_CONFIG,
          reference: str = "upstream", gemv_bench_path: Path = DEFAULT_GEMV_BENCH, force: bool = False) -> dict:
    for what, p in (("kernel benchmark", bench_path), ("model config", config_path),
                    ("GEMV benchmark", gemv_bench_path)):
        if not Path(p).is_file():
            raise ForgeError(f"{what} not found: {p}", hint={
                "kernel benchmark": "run the kernel benchmark (kernels/bench/bench_kernels.py) or give its JSON "
                                    "with --bench",
                "GEMV benchmark": "run kernels/bench/bench_gemv.py or give its bench_gemv.json with --gemv-bench",
            }.get(what, "give --config"))
    loaded = {}
    for what, p, key in (("model config", config_path, None), ("kernel benchmark", bench_path, "decode"),
                         ("GEMV benchmark", gemv_bench_path, "summary")):
        d = runs.read_json(Path(p))
        if not isinstance(d, dict) or (key and not isinstance(d.get(key), list)):
            raise ForgeError(f"{paths.rel(Path(p))}: not a {what}" + (f" (no '{key}' list)" if key else ""),
                             hint=f"give the {what}'s JSON as written by its tool")
        for lst, fields in ENTRY_FIELDS.get(what, {}).items():
            _check_entries(d.get(lst, []), fields, paths.rel(Path(p)), lst)
        loaded[what] = d
    config = loaded["model config"]
    res = analyse(folder, loaded["kernel benchmark"], attention_layers(config), reference,
                  loaded["GEMV benchmark"], layer_counts(config))
    res["bench"] = paths.rel(Path(bench_path))
    res["gemv_bench"] = paths.rel(Path(gemv_bench_path))
    texts = {"decode.json": json.dumps(res, indent=2) + "\n", "decode.md": render_md(res)}
    records.guard_tracked(folder, {folder / n: t for n, t in texts.items()}, doing="e2e-decode",
                          force=force, hint="write it into a copy of the run")
    paths.write_files(folder, texts)
    return res


def cmd_e2e_decode(args) -> int:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise ForgeError(f"{folder}: not a folder", hint="give a results folder of forge e2e-gpu")
    paths.plain_name(args.reference, "--reference")      # a profile's folder under runs/, never a path
    res = write(folder, Path(args.bench), Path(args.config), args.reference, Path(args.gemv_bench),
                force=options.forced(args.force))
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
    p.add_argument("--bench", type=options.nonempty("--bench"), default=str(DEFAULT_BENCH),
                   help=f"kernel benchmark JSON (default {paths.rel(DEFAULT_BENCH)}, "
                        "a copy of reports/kernels/bench.json)")
    p.add_argument("--gemv-bench", type=options.nonempty("--gemv-bench"), default=str(DEFAULT_GEMV_BENCH),
                   help=f"GEMV benchmark JSON, for servers with VLLM_FORGE_GEMV=1 (default "
                        f"{paths.rel(DEFAULT_GEMV_BENCH)}, a copy of reports/kernels/gemv/bench_gemv.json)")
    p.add_argument("--config", type=options.nonempty("--config"), default=str(DEFAULT_CONFIG), help="model config.json (default: Qwen3.5-27B's)")
    p.add_argument("--reference", default="upstream", help="the reference profile (default upstream)")
    p.add_argument("--force", action="store_true",
                   help="replace the run's recorded decode.md (a file git tracks; also FORCE=1)")
    p.set_defaults(func=cmd_e2e_decode)
