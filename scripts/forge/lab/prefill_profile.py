"""Where one long prefill's time goes, by component: a torch-profiler trace of one request on a
harness server, summed by kernel and forward step, then grouped as full attention, GDN, GEMM and the
rest, with the GEMM time as the floor under the TTFT (what is left if every other kernel cost nothing);
with `--profile-decode STEPS` the profiled request also generates STEPS tokens, and the decode steps
are summed the same way, per step.

On the GPU machine (`forge e2e-gpu --profile-prefill TOKENS`): each server is started with vLLM's
`--profiler-config` (torch profiler, idle until /start_profile); after the tiers one fresh prompt of
TOKENS tokens is sent without the profiler (its latency with one output token is the TTFT), then
another under it; the trace's GPU kernels are assigned to vLLM's forward steps (one per prefill
chunk) through their launch's correlation id and written to <run>/prefill-profile/<profile>.json
(kernel names kept, so the grouping below can be redone). With `--profile-batch B` (and
--profile-decode), B such requests are started at once instead and their decode steps at batch B
profiled (forge.lab.batch_profile: <run>/batch-profile/<profile>-b<B>.json). Here: `forge
prefill-profile RUN...` renders the tables (a section on the batch profiles where a run has any), the
chart and a JSON under reports/."""

from __future__ import annotations

import contextlib
import json
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import options, paths, records, ui
from ..errors import ForgeError
from ..run import archive, runs, synth
from . import batch_profile
from .client import complete, post_empty
from .profiler import new_trace, trace_dir, traces_now
from .trace_digest import ORDER, by_category, category, decode_summary, digest, totals

if TYPE_CHECKING:
    from .session import Run

SUBDIR = "prefill-profile"


# --- on the GPU machine -----------------------------------------------------------------------------

def refuse_by_args(argv: list[str], tokens: int, decode_steps: int, who: str) -> None:
    """A profiled request a server's --max-model-len cannot hold (its prompt is TOKENS give or take a few, then
    1 + STEPS output tokens): checked before any server starts (forge.lab.preflight); vLLM refused it after
    the tiers, recorded as the server's error in a run that exited 0."""
    limit = options.last_int(argv, "--max-model-len")
    most = (limit or 0) - batch_profile.PROMPT_SLACK - 1 - decode_steps
    if limit is not None and tokens > most:
        raise ForgeError(f"--profile-prefill {tokens}" + (f" --profile-decode {decode_steps}" if decode_steps else "")
                         + f": {who}'s --max-model-len {limit} holds a prompt of at most {max(most, 0)} tokens (give or "
                           f"take {batch_profile.PROMPT_SLACK}) with {1 + decode_steps} output token(s)",
                         hint=f"give --profile-prefill {max(most, 1)} or less" + (" or a lower --profile-decode"
                                                                                  if decode_steps else ""))


def capture(run: Run, name: str, model: Path, tokens: int, decode_steps: int = 0) -> dict:
    st = run.servers[name]
    base = f"http://{st['host']}:{st['port']}"
    tdir = trace_dir(run.out, name)
    tdir.mkdir(parents=True, exist_ok=True)
    plain = synth.synthetic_prompt(model, tokens, f"profile-a-{tokens}")
    profiled = synth.synthetic_prompt(model, tokens, f"profile-b-{tokens}")
    t = time.monotonic()
    complete(st, plain, 1, timeout=600)
    ttft_plain = time.monotonic() - t
    before = traces_now(tdir)
    post_empty(f"{base}/start_profile", timeout=120)
    t = time.monotonic()
    try:
        complete(st, profiled, 1 + decode_steps, timeout=600)
        ttft_prof = time.monotonic() - t
    finally:
        post_empty(f"{base}/stop_profile", timeout=900)
    trace = new_trace(tdir, before)
    dig = digest(trace)
    dig.update(profile=name, prompt_tokens=tokens, ttft_s_unprofiled=round(ttft_plain, 3),
               trace=trace.name, trace_mib=round(trace.stat().st_size / 2**20, 1), recorded=runs.now_iso())
    if decode_steps:                          # the profiled request's latency is then not its TTFT
        dig.update(decode_steps_asked=decode_steps, latency_s_profiled=round(ttft_prof, 3))
    else:
        dig.update(ttft_s_profiled=round(ttft_prof, 3))
    (run.out / SUBDIR).mkdir(exist_ok=True)
    runs.write_json(run.out / SUBDIR / f"{name}.json", dig)
    cats = totals(dig)
    dig["headline"] = {"ttft_s": round(ttft_plain, 2), "steps": len(dig["steps"]),
                       **{k.replace(" ", "_") + "_ms": round(v, 1) for k, v in cats.items()}}
    if dig.get("decode_steps"):
        ds = decode_summary(dig["decode_steps"])
        dig["headline"].update(decode_steps=ds["steps"], decode_step_gpu_span_ms=ds["gpu_span_ms_median"])
    return dig


# --- here: the document -----------------------------------------------------------------------------

def load_profiles(folders: list[Path], labels: list[Path] | None = None, batch_only: bool = False) -> dict[str, dict]:
    """The prefill profiles of results folders ({profile: digest}); labels: the folders as the user named
    them, for the recorded source paths (see provenance); batch_only: a folder with batch profiles
    (forge.lab.batch_profile) and no prefill profile is no error."""
    found: dict[str, dict] = {}
    for f, label in zip(folders, labels or folders):
        files = sorted((Path(f) / SUBDIR).glob("*.json"))
        packed = Path(f) != Path(label)
        if not files and batch_only and batch_profile.has_profiles(f):
            continue
        if not files:
            raise ForgeError(f"{paths.rel(Path(label))}: no {SUBDIR}/*.json here"
                             + (f" (nor in its {archive.ARCHIVE})" if packed else ""),
                             hint="give a results folder of `forge e2e-gpu --profile-prefill TOKENS`")
        for p in files:
            source = paths.rel(Path(label) / SUBDIR / p.name)
            named = source + (f" (in its {archive.ARCHIVE})" if packed else "")
            try:
                d = runs.read_json(p)
            except ForgeError as e:
                raise ForgeError(e.message.replace(paths.rel(p), named), hint=e.hint) from None
            if not isinstance(d, dict) or "steps" not in d or "profile" not in d:
                raise ForgeError(f"{named}: not a prefill profile (no steps/profile)")
            found[d["profile"]] = {**d, "source": source}
    return found


def analyse(profs: dict[str, dict]) -> dict:
    out = {}
    for name, d in profs.items():
        cats = totals(d)
        busy = sum(cats.values())
        span = d["prefill_span_ms"] / 1000
        if not span > 0:
            raise ForgeError(f"{d['source']}: the prefill span is {span} s; no kernel in its steps")
        top: dict[str, float] = {}
        for slot in (*d["steps"], d["outside"]):
            for k, (_, us) in slot["kernels"].items():
                top[k] = top.get(k, 0.0) + us / 1000
        out[name] = {
            "prompt_tokens": d["prompt_tokens"], "ttft_s": d.get("ttft_s_unprofiled"),
            "ttft_s_profiled": d.get("ttft_s_profiled"), "prefill_span_s": round(span, 3),
            "gpu_busy_ms": round(busy, 1), "categories_ms": {c: round(v, 1) for c, v in cats.items()},
            "shares_of_prefill": {c: round(v / 1000 / span, 4) for c, v in cats.items()},
            "gemm_floor_s": round(cats["GEMM"] / 1000, 3),
            "steps": [{"tokens": s["prefill_tokens"], "cpu_ms": s["cpu_ms"], "gpu_span_ms": s["gpu_span_ms"],
                       **{c: round(v, 1) for c, v in by_category(s["kernels"]).items()}} for s in d["steps"]],
            "top_kernels": [{"name": k, "category": category(k), "ms": round(v, 2)}
                            for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]],
            "source": d["source"]}
        if d.get("decode_steps"):
            out[name]["decode"] = decode_summary(d["decode_steps"])
    return out


def provenance(folders: list[Path], labels: list[Path] | None = None) -> list[dict]:
    """Per results folder: what its summary.json says of the run (commit, bundle, versions, device);
    labels: the folders as the user named them (a packed record is read from a temporary extraction)."""
    out = []
    for f, label in zip(folders, labels or folders):
        sp = Path(f) / "summary.json"
        s = runs.read_json(sp) if sp.is_file() else {}
        first = (s.get("earlier_invocations") or [s])[0]
        out.append({"folder": paths.rel(Path(label)), "git": s.get("git"), "bundle": (s.get("bundle") or {}).get("version"),
                    "versions": s.get("versions"), "device": (s.get("identity") or {}).get("device"),
                    "started": first.get("started")})
    return out


def render_md(res: dict, title: str, prov: list[dict] | None = None, batch: dict | None = None) -> str:
    L = [f"# {title}", ""]
    if res:
        L += ["One fresh prompt per profile, sent alone to a warm server under the torch profiler. "
              "Prefill span: from the first kernel of the request's first model step to the last kernel of its "
              "last (the GPU side of the TTFT); TTFT: a one-token request of the same length without the profiler, "
              "where it was measured. Kernel times are summed by kernel name and grouped "
              "(`forge.lab.trace_digest.CATEGORIES`); shares are of the prefill span. The GEMM floor is the "
              "prefill if every kernel but the GEMMs cost nothing. On the GPU harness \"rest\" includes the plain-torch "
              "stand-ins of vLLM's compiled norms and activations (fp32 elementwise and copy kernels), which a real "
              "build runs as fused kernels.", "",
              "| profile | tokens | TTFT s | prefill span s | GPU busy s | "
              + " | ".join(f"{c} s (share)" for c in ORDER) + " | GEMM floor / span |",
              "|---|---|---|---|---|" + "---|" * len(ORDER) + "---|"]
    for n, r in res.items():
        cells = [f"{r['categories_ms'][c] / 1000:.3f} ({100 * r['shares_of_prefill'][c]:.0f} %)" for c in ORDER]
        ttft = f"{r['ttft_s']:.3f}" if r.get("ttft_s") else "—"
        L.append(f"| {n} | {r['prompt_tokens']} | {ttft} | {r['prefill_span_s']:.3f} | {r['gpu_busy_ms'] / 1000:.3f} | "
                 + " | ".join(cells) + f" | {r['gemm_floor_s'] / r['prefill_span_s']:.2f} |")
    for n, r in res.items():
        L += ["", f"## {n}: per forward step (prefill chunk), ms", "",
              "| step | prompt tokens | CPU span | GPU span | " + " | ".join(ORDER) + " |",
              "|---|---|---|---|" + "---|" * len(ORDER)]
        for i, s in enumerate(r["steps"], 1):
            L.append(f"| {i} | {s['tokens']} | {s['cpu_ms']:.1f} | {s['gpu_span_ms']:.1f} | "
                     + " | ".join(f"{s[c]:.1f}" for c in ORDER) + " |")
        L += ["", "Largest kernels:", "", "| kernel | group | ms |", "|---|---|---|"]
        L += [f"| `{k['name'][:90]}` | {k['category']} | {k['ms']:.1f} |" for k in r["top_kernels"]]
    dec = {n: r["decode"] for n, r in res.items() if r.get("decode")}
    if dec:
        L += ["", "## Decode steps (one token each, after the profiled prefill)", "",
              "GPU span: from a step's first kernel to its last (median over the steps); kernel times are means "
              "per step.", "",
              "| profile | steps | GPU span ms | CPU ms | GPU busy ms | " + " | ".join(f"{c} ms" for c in ORDER) + " |",
              "|---|---|---|---|---|" + "---|" * len(ORDER)]
        for n, r in dec.items():
            L.append(f"| {n} | {r['steps']} | {r['gpu_span_ms_median']:.3f} | {r['cpu_ms_median']:.3f} | "
                     f"{r['gpu_busy_ms']:.3f} | " + " | ".join(f"{r['categories_ms'][c]:.3f}" for c in ORDER) + " |")
        for n, r in dec.items():
            L += ["", f"### {n}: largest kernels per decode step", "", "| kernel | group | launches | µs |",
                  "|---|---|---|---|"]
            L += [f"| `{k['name'][:90]}` | {k['category']} | {k['launches']:g} | {k['us']:.1f} |"
                  for k in r["top_kernels"]]
    more = batch_profile.render_lines(batch or {})
    L += more[1:] if more and L[-1] == "" else more     # one blank line after the heading
    if prov:
        L += ["", "## Provenance", ""]
        for p in prov:
            g = p.get("git") or {}
            v = p.get("versions") or {}
            L.append(f"- `{p['folder']}`: started {p.get('started')}, forge commit `{str(g.get('commit'))[:12]}`"
                     f"{' (dirty)' if g.get('dirty') else ''}, bundle vLLM `{p.get('bundle')}`, Python "
                     f"{v.get('python')}, torch {v.get('torch')}, triton {v.get('triton')}")
    return "\n".join(L) + "\n"


def chart(res: dict, png: Path) -> bool:
    plt = ui.pyplot()
    if plt is None:
        return False
    names = list(res)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.8 * len(names)))
    left = [0.0] * len(names)
    for c in ORDER:
        vals = [res[n]["categories_ms"][c] / 1000 for n in names]
        ax.barh(names, vals, left=left, label=c)
        left = [a + b for a, b in zip(left, vals)]
    for i, n in enumerate(names):
        ax.plot([res[n]["prefill_span_s"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
        ax.plot([res[n]["gemm_floor_s"]] * 2, [i - 0.4, i + 0.4], color="red", ls="--", lw=1.5)
    ax.set_xlabel("seconds (bars: GPU kernel time by group; black: prefill span; red dashed: GEMM floor)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def add_trace(run_dir: Path, name: str, trace: Path, tokens: int) -> Path:
    """A trace brought back from the GPU machine, digested into <run>/prefill-profile/<name>.json
    (what `e2e-gpu --profile-prefill` writes there, without the unprofiled TTFT)."""
    if not trace.is_file():
        raise ForgeError(f"--trace {name}={trace}: no such file")
    dig = digest(trace)
    dig.update(profile=name, prompt_tokens=tokens, trace=trace.name,
               trace_mib=round(trace.stat().st_size / 2**20, 1), recorded=runs.now_iso())
    dest = run_dir / SUBDIR / f"{name}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    runs.write_json(dest, dig)
    return dest


def cmd_prefill_profile(args) -> int:
    if args.trace and archive.is_packed(Path(args.folders[0])):
        first = paths.rel(Path(args.folders[0]))
        raise ForgeError(f"{first} is a packed record: a trace added beside its {archive.ARCHIVE} would hide the "
                         "profiles inside it", hint=f"forge unpack-run {first}, add the trace, then forge pack-run "
                                                    f"{first}")
    force = options.forced(args.force)
    traces = []
    for spec in args.trace or []:          # every --trace checked before the first is digested
        name, sep, file = spec.partition("=")
        if not sep or not name or not file:
            raise ForgeError(f"--trace {spec}: expected PROFILE=FILE")
        paths.plain_name(name, f"--trace {spec}: the profile")
        if not args.tokens:
            raise ForgeError("--trace needs --tokens (the profiled prompt's length)")
        dest = Path(args.folders[0]) / SUBDIR / f"{name}.json"
        records.guard_tracked(dest.parent, {dest: None}, doing=f"--trace {name}=...", force=force,
                              hint="add the trace to a copy of the run")
        traces.append((name, file))
    for name, file in traces:
        ui.info(f"digested {paths.rel(add_trace(Path(args.folders[0]), name, Path(file), args.tokens))}")
    folders = [Path(f) for f in args.folders]
    with contextlib.ExitStack() as stack:          # a packed record (raw.tgz) is read without unpacking it here
        readable = [stack.enter_context(archive.readable(f)) for f in folders]
        batch = batch_profile.load(readable, folders)
        res = analyse(load_profiles(readable, folders, batch_only=True))
        prov = provenance(readable, folders)
    out = Path(args.out)
    title = args.title or ("Where a long prefill's time goes" if res else "Where a decode step's time goes at a batch")
    command = "forge prefill-profile " + " ".join(args.folders) + (f" --title {shlex.quote(args.title)}"
                                                                   if args.title else "")
    doc = {"title": title, "profiles": res, **({"batch_profiles": batch} if batch else {}), "provenance": prov,
           "command": command}
    texts = {"prefill-profile.json": json.dumps(doc, indent=2) + "\n",
             "prefill-profile.md": render_md(res, title, prov, batch)}
    records.guard_tracked(out, {**{out / n: t for n, t in texts.items()}, out / "prefill-profile.png": None},
                          doing="this profile document", force=force, hint="give another --out")
    paths.write_files(out, texts)
    drawn = chart(res, out / "prefill-profile.png") if res else False
    ui.info(f"wrote {paths.rel(out / 'prefill-profile.md')}" + (" and the chart" if drawn else ""))
    return 0


def register(sub) -> None:
    p = sub.add_parser("prefill-profile", help="one long prefill by component (attention, GDN, GEMM, rest), and "
                                                "decode steps at a batch, from e2e-gpu --profile-prefill results",
                       description=__doc__,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", metavar="RUN", help="results folders of forge e2e-gpu --profile-prefill "
                                                             "(with or without --profile-batch)")
    p.add_argument("--out", default=str(paths.REPORTS / "prefill-profile"),
                   help="where the table, chart and JSON go (default reports/prefill-profile)")
    p.add_argument("--title", help="the document's heading")
    p.add_argument("--trace", action="append", metavar="PROFILE=FILE",
                   help="first digest a torch-profiler trace brought back from the GPU machine into the first "
                        "RUN's prefill-profile/PROFILE.json (repeatable; needs --tokens)")
    p.add_argument("--tokens", type=int, help="the traced prompt's length in tokens (with --trace)")
    p.add_argument("--force", action="store_true",
                   help="replace a document recorded in --out, or a profile of the run (files git tracks; also FORCE=1)")
    p.set_defaults(func=cmd_prefill_profile)
