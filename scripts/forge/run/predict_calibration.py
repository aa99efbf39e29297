"""`forge predict --calibration REPORT`: the speed-ups a calibration measured, turned into a prediction.

Component speed-ups (upstream path time / chosen path time, from the report's records), per tier at
that tier's work:
  prefill_attn  full-attention prefill of each request's prompt in the organizers' 4096-token chunks:
                each kernel's time per chunk is fitted as a * FLOPs(prefix, chunk) + b over the measured
                steps, summed over a prompt's chunks, over the tier's prompts;
  decode_attn   batch-1 decode attention at each request's mean context (prompt + half its output),
                interpolated between the measured contexts;
  gemv          every linear layer of a decode step at one token (calls per token as weights; the MLP's
                gate_up runs the fused gate_up + SiLU-and-mul decision);
  prefill_gemm  TunableOp: measured and reported, but 1 (the server does not apply its results).
Everything else is 1 and labelled assumed. A calibration made on gfx936 is labelled measured on the card,
any other device measured on a stand-in (what a GPU machine shows, not what the DCU will do).

`--check-e2e DIR` checks the method where both sides can be measured: an e2e run of the same device
with `contest` and `upstream` side by side. Each upstream request's measured TTFT and TPOT minus the
calibrated kernel savings (absolute times: 16 full-attention layers per token and per chunk, the GEMV
calls per token) predicts the contest request; the client's time between requests is held as measured.
The predicted tok/s ratio per tier is compared with the measured one.
"""

from __future__ import annotations

import bisect
import json
import math
import sys
from pathlib import Path

from .. import paths, ui
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..records import guard_tracked
from . import archive, results, runs
from . import calibration as sel
from . import calibration_docs as cd
from .timemodel import COMPONENTS, predict_from_components, print_table, score_prediction, speedup_problem

ATTN_LAYERS = 16
CHUNK = 4096


def _chunks(prompt: int) -> list[tuple[int, int]]:
    return [(p, min(CHUNK, prompt - p)) for p in range(0, prompt, CHUNK)]


def _pc(point: str) -> tuple[int, int]:
    p, c = (int(x.split("=")[1]) for x in point.split())
    return p, c


def _flops(point: str) -> float:
    p, c = _pc(point)
    return c * (p + (c + 1) / 2)


def load(report: Path) -> tuple[dict, list[dict]]:
    """(calibration.json, every measured family's records) of a calibration output folder, read and
    checked by the calibration's one reader (calibration_docs.read_report). A smoke calibration (tiny
    shapes under Triton's interpreter on a CPU: `calibrate --install` refuses its table) is refused: its
    factors are no measurement of a kernel, and the product was priced from them without a word."""
    doc, records = cd.read_report(Path(report))
    opts = doc["provenance"].get("options")
    if isinstance(opts, dict) and opts.get("smoke") is True:
        raise ForgeError(f"--calibration {report}: a smoke calibration (forge calibrate --smoke: tiny shapes under "
                         "Triton's interpreter on a CPU) measures nothing real, so its speed-ups would price the "
                         "product from nothing", hint="give a calibration measured on the card or a GPU machine "
                                                      "(forge calibrate without --smoke)")
    return doc, records


class Kernels:
    """The measured kernels as functions of the work: prefill attention per prompt, decode attention
    per context, GEMV per token (us), upstream and chosen."""

    def __init__(self, doc: dict, records: list[dict]):
        S = doc["selection"]
        self.have = set()
        d = S.get("prefill.16bit")
        if d and d.get("upstream") and d.get("best_ours"):
            up = sel.point_times(records, "prefill.16bit", d["upstream"])
            ours = sel.point_times(records, "prefill.16bit", d["best_ours"])
            if up and ours:
                self.fit_up, self.fit_ours = sel.fit_rate(up, _flops), sel.fit_rate(ours, _flops)
                self.have.add("prefill_attn")
        d = S.get("decode.1.16bit")
        if d and d.get("upstream") and d.get("chosen"):
            self.dec_up = {int(k.split("=")[1]): v for k, v in sel.point_times(records, "decode.1.16bit",
                                                                                d["upstream"]).items()}
            self.dec_ch = {int(k.split("=")[1]): v for k, v in sel.point_times(records, "decode.1.16bit",
                                                                                d["chosen"]).items()}
            if self.dec_up and self.dec_ch:
                self.have.add("decode_attn")
        up = ch = 0.0
        n = 0
        for dec, s in S.items():
            parts = dec.split(".")
            if parts[0] != "gemv" or parts[-1] != "1" or not s.get("upstream") or not s.get("chosen"):
                continue
            if parts[1] == "plain" and f"gemv.fused.{parts[2]}.1" in S:
                continue                      # the MLP runs the fused decision instead
            c = s["candidates"]
            up += c[s["upstream"]]["us"]
            ch += c[s["chosen"]]["us"]
            n += 1
        if n:
            self.gemv_up, self.gemv_ch = up, ch
            self.have.add("gemv")
        gu = gc = 0.0
        for dec, s in S.items():
            if dec.startswith("gemm.") and s.get("upstream") and s.get("chosen"):
                gu += s["candidates"][s["upstream"]]["us"]
                gc += s["candidates"][s["chosen"]]["us"]
        self.gemm = gu / gc if gc else None

    def prefill_s(self, prompt: int, ours: bool) -> float:
        a, b = self.fit_ours if ours else self.fit_up
        return ATTN_LAYERS * sum(a * c * (p + (c + 1) / 2) + b for p, c in _chunks(prompt)) / 1e6

    @staticmethod
    def _interp(tab: dict[int, float], x: float) -> float:
        xs = sorted(tab)
        if x <= xs[0]:
            return tab[xs[0]] * x / xs[0]
        if x >= xs[-1]:
            return tab[xs[-1]] * x / xs[-1]
        i = bisect.bisect(xs, x)
        x0, x1 = xs[i - 1], xs[i]
        return tab[x0] + (tab[x1] - tab[x0]) * (x - x0) / (x1 - x0)

    def decode_ms(self, ctx: float, ours: bool) -> float:
        return ATTN_LAYERS * self._interp(self.dec_ch if ours else self.dec_up, ctx) / 1000


def _ratio(up: float, ours: float, decision: str, comp: str, tier: str, source: str) -> float:
    """upstream time / ours, both positive, within the plausible range of a speed-up
    (timemodel.SPEEDUP_RANGE): a fit that prices the tier's work at no time or less, or a factor past
    the range (a damaged record: the model's times would leave the float range), names its decision."""
    redo = "(forge calibrate --out FOLDER --force --redo FAMILY)"
    if not (up > 0 and ours > 0 and math.isfinite(up / ours)):
        raise ForgeError(f"{source}: {decision}: the times fitted to the calibration's points price the tier's work at "
                         f"{up:.3g} s upstream and {ours:.3g} s ours; both must be positive",
                         hint=f"the measured times do not grow with the work: measure the family again {redo}")
    why = speedup_problem(up / ours, f"{up / ours:.3g}")
    if why:
        raise ForgeError(f"{source}: {decision}: the speed-up of {comp} at tier {tier} ({up:.3g} upstream / {ours:.3g} "
                         f"ours): {why}", hint=f"no kernel change comes near that: the records are damaged or were "
                                               f"measured wrong; measure the family again {redo}")
    return up / ours


def factors(doc: dict, records: list[dict], workload: dict, source: str = "the calibration") -> dict:
    """{tier: {component: {"factor", "label", "how"}}} for every component of the DCU time model; a
    factor that is no plausible speed-up is refused naming `source` (the folder as the user gave it)."""
    k = Kernels(doc, records)
    if not k.have:                  # every factor 1: the upstream build's prediction, shown as the calibration's
        failed = [f"{f} failed: {str(i['failed'])[:120]}" for f, i in doc["families"].items() if i.get("failed")]
        raise ForgeError(f"{source}: no component of the time model was measured (no prefill, decode or gemv "
                         f"decision" + (f"; {'; '.join(failed)}" if failed else "") + "): a prediction from it would "
                         "be the upstream build's, unchanged", hint="measure the families again (forge calibrate --out "
                         "FOLDER --force --redo FAMILY), or price the product with --speedup NAME=FACTOR")
    dev = doc.get("device", {})
    on_card = str(dev.get("arch", "")).startswith("gfx936")
    where = "measured on the card" if on_card else f"measured on a stand-in ({dev.get('device_name')})"
    out = {}
    for tier, w in workload["tiers"].items():
        reqs = w["requests"]
        f = {}
        for comp in COMPONENTS:
            f[comp] = {"factor": 1.0, "label": "assumed", "how": "not calibrated: unchanged"}
        if "prefill_attn" in k.have:
            up = sum(k.prefill_s(s, False) for s, _ in reqs)
            ours = sum(k.prefill_s(s, True) for s, _ in reqs)
            f["prefill_attn"] = {"factor": _ratio(up, ours, "prefill.16bit", "prefill_attn", tier, source), "label": where,
                                 "how": "vLLM unified kernel (16-row tiles) / our chunked-prefill launch, 4096-token "
                                        "chunks of the tier's prompts"}
        if "decode_attn" in k.have:
            up = sum(k.decode_ms(s + n / 2, False) * n for s, n in reqs)
            ours = sum(k.decode_ms(s + n / 2, True) * n for s, n in reqs)
            f["decode_attn"] = {"factor": _ratio(up, ours, "decode.1.16bit", "decode_attn", tier, source), "label": where,
                                "how": "vLLM unified 3D decode (16 segments) / split-KV decode, batch 1, the tier's "
                                       "contexts"}
        if "gemv" in k.have:
            f["gemv"] = {"factor": _ratio(k.gemv_up, k.gemv_ch, "the gemv decisions", "gemv", tier, source),
                         "label": where,
                         "how": "platform GEMM / the chosen route of every linear layer at one token, calls per "
                                "token as weights"}
        if k.gemm:
            f["prefill_gemm"] = {"factor": 1.0, "label": "assumed",
                                 "how": f"TunableOp measured {k.gemm:.3f}x at 4096-token GEMMs; not applied by the "
                                        "server, so 1"}
        out[tier] = f
    return out


def predict(workload: dict, fac: dict) -> dict:
    """The DCU time model with each tier's own speed-ups."""
    pred = {}
    for tier, f in fac.items():
        sp = {c: v["factor"] for c, v in f.items() if v["factor"] != 1.0}
        pred[tier] = predict_from_components(workload, sp)[tier]
    return pred


E2E_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "duration", "output_throughput")


def e2e_result(folder: Path, root: Path, name: str, tier: str) -> dict:
    """runs/<name>/<tier>.json of an e2e results folder (`folder`: the folder `root` itself, or a packed
    record's extraction), read by the reader score and compare use (results.check_result) plus what the
    check needs: every request's prompt, output, TTFT and token times, all completed with a token at
    least, and a positive duration and throughput. Errors name the file as the user knows it."""
    p = folder / "runs" / name / f"{tier}.json"
    label = (paths.rel(root / "runs" / name / f"{tier}.json") if folder == root
             else f"{paths.rel(root)}/{archive.ARCHIVE}: runs/{name}/{tier}.json")
    try:
        res = runs.read_json(p)
    except ForgeError as e:
        raise ForgeError(e.message.replace(paths.rel(p), label), hint=e.hint) from None
    results.check_result(res, label)
    for key in E2E_KEYS:
        if res.get(key) is None:
            raise ForgeError(f"{label}: key '{key}' missing; the check needs every request's times",
                             hint="measure with `vllm bench serve --save-detailed` (forge e2e-gpu does)")
    for key in ("duration", "output_throughput"):
        if not results.finite_positive(res[key]):
            raise ForgeError(f"{label}: key '{key}' is {repr(res[key])[:40]}, expected a finite number > 0",
                             hint=results.DAMAGED)
    for i, n in enumerate(res["output_lens"]):
        err = (res.get("errors") or [None] * len(res["output_lens"]))[i]
        if err or n < 1:
            raise ForgeError(f"{label}: request {i} " + (f"failed ({str(err)[:60]})" if err else
                                                         "has no output token (key 'output_lens[%d]' is 0)" % i)
                             + "; the check compares runs whose requests all completed", hint=results.DAMAGED)
    return res


def check_e2e(doc: dict, records: list[dict], e2e: Path, tiers: list[str], profile: str = "contest",
              reference: str = "upstream") -> dict:
    """Per tier: the tok/s ratio profile/reference predicted from the reference's requests and the
    calibrated kernel savings, against the measured one (both as vLLM's client reports it). `e2e` is an
    e2e results folder, unpacked or a packed record (its raw.tgz is read as it is)."""
    k = Kernels(doc, records)
    missing = {"prefill_attn", "decode_attn", "gemv"} - k.have
    if missing:
        raise ForgeError(f"the calibration lacks {', '.join(sorted(missing))}: the check needs all three",
                         hint="calibrate the prefill, decode and gemv families")
    root = Path(e2e)
    if not root.is_dir():
        raise ForgeError(f"--check-e2e {e2e}: not a folder", hint="give an e2e results folder (reports/e2e/<run>)")
    with archive.readable(root) as folder:
        have = sorted(p.name for p in (folder / "runs").iterdir() if p.is_dir()) if (folder / "runs").is_dir() else []
        for name in (reference, profile):
            if name not in have:
                raise ForgeError(f"--check-e2e {e2e}: no runs/{name}/ (the {name} profile's results)"
                                 + (f"; its profiles: {', '.join(have)}" if have else "; it holds no runs/"),
                                 hint="give an e2e results folder measured with the contest and upstream profiles "
                                      "side by side")
        found = {t: (e2e_result(folder, root, reference, t), e2e_result(folder, root, profile, t)) for t in tiers}
    out = {}
    for t, (u, c) in found.items():
        req_u = req_p = 0.0
        for s, n, ttft, itl in zip(u["input_lens"], u["output_lens"], u["ttfts"], u["itls"]):
            tpot = sum(itl) / (n - 1) if n > 1 else 0.0
            ttft_p = ttft - k.prefill_s(s, False) + k.prefill_s(s, True)
            save_ms = k.decode_ms(s + n / 2, False) - k.decode_ms(s + n / 2, True) + (k.gemv_up - k.gemv_ch) / 1000
            req_u += ttft + sum(itl)
            req_p += ttft_p + (n - 1) * (tpot - save_ms / 1000)
        gaps = u["duration"] - req_u
        predicted = u["duration"] / (gaps + req_p) if gaps + req_p > 0 else math.inf
        if not math.isfinite(predicted):
            raise ForgeError(f"--check-e2e {e2e}: tier {t}: the calibrated savings exceed the {reference} run's own "
                             "request times; the calibration and the run are not of one device",
                             hint="check the calibration against an e2e run of the device it was measured on")
        measured = c["output_throughput"] / u["output_throughput"]
        out[t] = {"predicted_ratio": predicted, "measured_ratio": measured, "error": predicted / measured - 1,
                  "requests": len(u["output_lens"]), "client_gaps_s": gaps}
    return out


def render(doc: dict, fac: dict, pred: dict, res: dict, check: dict | None, source: str, command: str) -> str:
    dev = doc.get("device", {})
    lines = ["<!-- generated by `forge predict --calibration` (scripts/forge/run/predict_calibration.py); do not edit -->",
             f"# DCU prediction from the calibration on {dev.get('device_name')} ({dev.get('arch')})", "",
             f"- command: `{command}`",
             f"- calibration: {source} (measured {doc['provenance'].get('date')}, commit "
             f"{doc['provenance'].get('commit')}, `{doc['provenance'].get('command')}`)",
             "- method: the public DCU time model of vLLM 0.18.1 on gfx936 (`forge predict --help`), each component "
             "divided by its speed-up, applied to the official upstream run's mean TTFT and TPOT per tier", "",
             "| tier | component | speed-up | label | how |", "|---|---|---|---|---|"]
    for tier, f in fac.items():
        for comp, v in f.items():
            lines.append(f"| {tier} | {comp} | {v['factor']:.3f} | {v['label']} | {v['how']} |")
    lines += ["", "| tier | predicted TTFT ms | predicted TPOT ms | predicted tok/s | baseline tok/s |", "|---|---|---|---|---|"]
    for tier, p in pred.items():
        lines.append(f"| {tier} | {p['ttft_ms']:.0f} | {p['tpot_ms']:.1f} | {p['tok_s']:.2f} | "
                     f"{p['baseline_tok_s_measured']:.2f} |")
    lines += ["", f"Predicted score: **{res.get('display', res.get('total'))}** against the "
                  f"{res.get('baseline_name', 'official')} baseline (accuracy factor not applied).", ""]
    if check:
        lines += ["## The method checked on the calibration's own device", "",
                  "| tier | predicted tok/s ratio | measured | error | requests |", "|---|---|---|---|---|"]
        for t, v in check.items():
            lines.append(f"| {t} | {v['predicted_ratio']:.3f} | {v['measured_ratio']:.3f} | {v['error']:+.1%} | "
                         f"{v['requests']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def run(args, contest: dict, workload: dict) -> int:
    """Read and check everything (the calibration, the e2e results of --check-e2e), then print and
    write: a damaged input prints no prediction and writes nothing."""
    doc, records = load(Path(args.calibration))
    tp = ((doc.get("table") or {}).get("validators") or {}).get("tp") or 1
    if tp != 1:                      # the preliminary's server is one card at TP1: another rank's shapes priced it
        raise ForgeError(f"--calibration {args.calibration}: measured at one rank's shapes at tensor-parallel degree "
                         f"{tp} (forge calibrate --tp {tp}); the preliminary round serves one card at TP1",
                         hint="give a calibration measured at TP1 (forge calibrate without --tp), or price the final "
                              "round's topologies with it (--round final)")
    fac = factors(doc, records, workload, f"--calibration {args.calibration}")
    pred = predict(workload, fac)
    res = score_prediction(contest, workload, pred, args.baseline_name)
    label = args.label or f"calibration-{Path(args.calibration).name}"
    check = None
    if args.check_e2e:
        check = check_e2e(doc, records, Path(args.check_e2e), contest_mod.tier_names(contest))
    assumed = sorted({c for f in fac.values() for c, v in f.items() if v["how"] == "not calibrated: unchanged"}
                     & {"prefill_attn", "decode_attn", "gemv"})
    if assumed:
        ui.warn(f"the calibration measured no {', '.join(assumed)}: assumed unchanged (speed-up 1) in this prediction")
    out = Path(args.out) if args.out else paths.BUILD / "predict" / label
    command = "forge " + " ".join(sys.argv[1:])
    files = {"predict.md": render(doc, fac, pred, res, check, str(args.calibration), command),
             "predict.json": json.dumps({"factors": fac, "prediction": pred, "score": res, "check_e2e": check,
                                         "calibration": str(args.calibration)}, indent=1, default=str) + "\n"}
    guard_tracked(out, {out / n: t for n, t in files.items()}, doing="this prediction",
                  force=bool(getattr(args, "force", False)), hint="give another --out")
    print_table(label, pred, res)
    for t, v in (check or {}).items():
        print(f"{t}: predicted tok/s ratio {v['predicted_ratio']:.3f}, measured {v['measured_ratio']:.3f} "
              f"({v['error']:+.1%})", file=sys.stdout)
    paths.write_files(out, files)
    ui.info(f"wrote {paths.rel(out / 'predict.md')}, {paths.rel(out / 'predict.json')}")
    return 0
