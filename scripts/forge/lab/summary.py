"""summary.md of an end-to-end run: servers, tiers side by side, TTFT/TPOT ratios to the reference
and the DCU prediction from them, proxy scores, plumbing and fault checks, what was left out."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

from .. import options
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..run import predict, runs, synth, timemodel
from ..run.score_doc import fmt
from . import stacks
from .serverlog import log_facts


class Run(Protocol):
    """What the summary reads of an end-to-end run (lab/session.py's Run, which writes the summary
    after every step; named here so that the summary does not import the session that calls it)."""

    contest: dict
    out: Path
    servers: dict
    summary: dict

    def run_dir(self, name: str, create: bool = True) -> Path: ...


def _server_facts(run: Run, s: dict, name: str) -> tuple:
    """(ready s, first request s, log facts) of a profile's server: this invocation's, or, for a profile
    whose tiers were all kept, the latest earlier invocation's that started it."""
    st = run.servers.get(name)
    if st:
        return st.get("ready_s", "—"), st.get("warm_s", "—"), log_facts(Path(st["log"])) if st.get("log") else {}
    for e in reversed(s.get("earlier_invocations", [])):
        facts = (e.get("server_facts") or {}).get(name)
        if facts is not None:
            steps = e.get("steps") or []
            ready = next((x.get("seconds") for x in steps if x.get("step") == f"server {name} ready"), "—")
            warm_s = next((x.get("seconds") for x in steps if x.get("step", "").startswith(f"server {name} warmed")), "—")
            return ready, warm_s, facts
    return "—", "—", {}


def tier_ratio_lines(run: Run, names: list[str], ref: str) -> list[str]:
    """Per tier and profile: mean TTFT and TPOT, the TTFT share of the tier's wall time, the ratios to
    the reference, and what `forge predict` makes of those ratios on the DCU."""
    tiers = contest_mod.tier_names(run.contest)
    rows, ratios = [], {}
    for t in tiers:
        ref_m = None
        if runs.result_path(run.run_dir(ref, create=False), t).is_file():
            try:
                ref_m = predict.run_means(run.run_dir(ref, create=False), t)
            except ForgeError:
                pass
        for n in names:
            p = runs.result_path(run.run_dir(n, create=False), t)
            if not p.is_file():
                continue
            try:
                mt, mp = predict.run_means(run.run_dir(n, create=False), t)
            except ForgeError:
                continue
            r = runs.read_json(p)
            ok = [i for i, e in enumerate(r.get("errors") or []) if not e]
            dur = r.get("duration") or 0
            share = sum(r["ttfts"][i] for i in ok) / dur if dur and r.get("ttfts") else None
            rt = mt / ref_m[0] if ref_m else None
            rp = mp / ref_m[1] if ref_m else None
            if rt and rp:
                ratios.setdefault(n, {})[t] = (rt, rp)
            rows.append(f"| {t} | {n} | {mt / 1000:.2f} | {fmt(share and 100 * share, '.0f')} % | {mp:.1f} "
                        f"| {fmt(rt, '.3f')} | {fmt(rp, '.3f')} |")
    if not rows:
        return []
    L = ["", f"## Per tier: TTFT share of wall time and ratios to {ref}", "",
         "| tier | profile | mean TTFT s | TTFT share | mean TPOT ms | TTFT ratio | TPOT ratio |",
         "|---|---|---|---|---|---|---|", *rows]
    preds = []
    try:
        w = synth.load_workload(run.contest)
        for n, per in ratios.items():
            if n == ref or set(per) != set(tiers):
                continue
            pred = timemodel.predict_from_ratios(w, {t: per[t][0] for t in tiers}, {t: per[t][1] for t in tiers})
            res = timemodel.score_prediction(run.contest, w, pred, "official")
            preds.append(f"- {n}: **{res['display']}** against the official baseline ("
                         + " / ".join(f"{pred[t]['tok_s']:.2f}" for t in tiers) + " tok/s)")
    except ForgeError as e:
        preds.append(f"- not computed: {e.message}")
    if preds:
        basis = ("assumes the ratios carry over to the DCU, applied to the official upstream run's mean TTFT and "
                 "TPOT" if ref == "upstream" else
                 f"the ratios are to {ref}, not upstream: each figure prices only the difference from {ref}, "
                 "applied to the official upstream run's mean TTFT and TPOT as if it were the whole change")
        L += ["", f"DCU prediction from these ratios (`forge predict --e2e`; {basis}):", "", *preds]
    return L


def _tier_result(run: Run, name: str, tier: str) -> dict | None:
    """The profile's result of the tier (vllm bench serve's JSON, merged), or None where there is none."""
    p = runs.result_path(run.run_dir(name, create=False), tier)
    r = runs.read_json(p) if p.is_file() else None
    return r if isinstance(r, dict) else None


def sla_lines(run: Run, names: list[str], ref: str) -> list[str]:
    """Per tier and profile, its TTFT P99 and TPOT P99 over the reference's, against the contest's latency
    limits (configs/contest.yaml `scoring`), the reference standing in for the baseline: the gate a faster
    configuration can fail (more requests admitted together wait through each other's prefills)."""
    sc = run.contest["scoring"]
    lim_ttft, lim_tpot = sc["ttft_p99_max_ratio"], sc["tpot_p99_max_ratio"]
    rows = []
    for t in contest_mod.tier_names(run.contest):
        found = {}
        for n in dict.fromkeys([ref, *names]):
            r = _tier_result(run, n, t) or {}
            if all(isinstance(r.get(k), (int, float)) and r[k] > 0 for k in ("p99_ttft_ms", "p99_tpot_ms")):
                found[n] = (r["p99_ttft_ms"], r["p99_tpot_ms"])
        if ref not in found:
            continue
        for n in names:
            if n == ref or n not in found:
                continue
            rt, rp = (found[n][i] / found[ref][i] for i in (0, 1))
            over = [w for w, x, lim in (("TTFT", rt, lim_ttft), ("TPOT", rp, lim_tpot)) if x > lim]
            rows.append(f"| {t} | {n} | {rt:.2f} | {rp:.2f} | {'outside: ' + ', '.join(over) if over else 'within'} |")
    if not rows:
        return []
    return ["", f"## Latency against {ref} per tier (the SLA's limits, {ref} as the baseline)", "",
            f"The contest's limits: TTFT P99 at most {lim_ttft:g}x the baseline's per tier, TPOT P99 at most "
            f"{lim_tpot:g}x pooled over the three tiers (here per tier; the pooled P99 is in the proxy score where "
            "every tier ran).", "", f"| tier | profile | TTFT P99 / {ref}'s | TPOT P99 / {ref}'s | limits |",
            "|---|---|---|---|---|", *rows]


STALL_S = 1.0      # a gap between two streamed chunks of one request this long is a stall the client saw


def stall_lines(run: Run, names: list[str]) -> list[str]:
    """Per tier and profile where the client waited STALL_S or more between two chunks of a request: how
    often, the longest gap and how many chunks a request's tokens came in (the organizers' client measures
    TTFT and TPOT at delivery, so a server that delivers in bursts is seen so). Nothing when none did."""
    rows = []
    for t in contest_mod.tier_names(run.contest):
        for n in names:
            itls = (_tier_result(run, n, t) or {}).get("itls")
            if not isinstance(itls, list) or not all(isinstance(x, list) for x in itls):
                continue
            gaps = [g for x in itls for g in x if isinstance(g, (int, float)) and g >= STALL_S]
            if gaps:
                chunks = sorted(len(x) for x in itls)
                rows.append(f"| {t} | {n} | {len(gaps)} | {max(gaps):.2f} | {chunks[0]}-{chunks[-1]} |")
    if not rows:
        return []
    return ["", f"## Delivery stalls (the client waited {STALL_S:g} s or more for a request's next chunk)", "",
            "| tier | profile | gaps | longest s | chunks per request |", "|---|---|---|---|---|", *rows]


def textless_lines(run: Run, names: list[str]) -> list[str]:
    """Per tier and profile, the completed requests that generated tokens and returned no text. A token that
    decodes to nothing keeps vLLM's streaming detokenizer decoding the whole prompt again at every step
    (reports/e2e/2026-12-07-h100-final-16-32k-int8-stacks: it held the API process, and the client got every
    request in bursts); the harness's client keeps special tokens for that, so a row here says the run's figures
    may carry that cost again. Nothing when every request has text."""
    rows = []
    for t in contest_mod.tier_names(run.contest):
        for n in names:
            r = _tier_result(run, n, t) or {}
            texts, outs = r.get("generated_texts"), r.get("output_lens")
            errs = r.get("errors") or [""] * len(texts or [])
            if not (isinstance(texts, list) and isinstance(outs, list) and len(texts) == len(outs) == len(errs)):
                continue
            empty = sum(1 for x, o, e in zip(texts, outs, errs) if not e and isinstance(o, int) and o > 0 and not x)
            if empty:
                rows.append(f"| {t} | {n} | {empty} of {len(texts)} |")
    if not rows:
        return []
    return ["", "## Requests that returned no text", "",
            "Their tokens decoded to nothing: vLLM's API then decodes the whole prompt again at every token of such a "
            "request, which can hold its process and the whole server's delivery (the harness's client keeps special "
            "tokens, `harness/gpu/harness.yaml`, so that this does not happen).", "",
            "| tier | profile | requests |", "|---|---|---|", *rows]


def _max_num_seqs(run: Run, name: str) -> int | None:
    """The --max-num-seqs the profile's server ran with (its recorded launch, the last occurrence as vLLM's parser
    keeps it), or None where no record says."""
    rec = run.run_dir(name, create=False) / "serve.json"
    try:
        launch = runs.read_json(rec).get("launch") if rec.is_file() else None
    except ForgeError:
        return None
    return options.last_int([str(a) for a in launch], "--max-num-seqs") if isinstance(launch, list) else None


def residency_lines(run: Run, names: list[str]) -> list[str]:
    """Per tier and profile with several requests in flight: how many were decoding at once, from every request's
    timeline (its decode time, first token to last, summed over the requests and divided by the tier's wall time;
    the peak where the intervals overlap most), against the server's --max-num-seqs. Output tok/s is that mean over
    the mean TPOT, so a lift under load is the product of the two; a server below its max-num-seqs spent the rest
    ramping (requests enter and leave one prefill apart) or in a last, partial wave. Nothing at one at a time."""
    rows = []
    for t in contest_mod.tier_names(run.contest):
        for n in names:
            r = _tier_result(run, n, t) or {}
            itls, ttfts, starts, dur = r.get("itls"), r.get("ttfts"), r.get("start_times"), r.get("duration")
            errs = r.get("errors") or [""] * len(itls or [])
            if not (isinstance(itls, list) and isinstance(ttfts, list) and isinstance(starts, list) and dur
                    and len(itls) == len(ttfts) == len(starts) == len(errs)):
                continue
            spans = [(starts[i] + ttfts[i], starts[i] + ttfts[i] + sum(itls[i])) for i in range(len(itls))
                     if not errs[i] and isinstance(itls[i], list)]
            edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
            now = peak = 0
            for _, step in edges:
                now += step
                peak = max(peak, now)
            if peak <= 1:
                continue
            mean = sum(b - a for a, b in spans) / dur
            cap = _max_num_seqs(run, n)
            share = f"{100 * mean / cap:.0f} %" if cap else "—"
            rows.append(f"| {t} | {n} | {mean:.2f} | {peak} | {cap or '—'} | {share} | {fmt(r.get('mean_tpot_ms'))} |")
    if not rows:
        return []
    return ["", "## Requests decoding at once (every request's first to last token, summed, over the tier's wall time)",
            "", "Output tok/s is the mean over the mean TPOT. Below the server's --max-num-seqs: requests ramping in "
            "and out one prefill apart, or a last wave short of it.", "",
            "| tier | profile | mean | peak | max-num-seqs | mean of it | mean TPOT ms |", "|---|---|---|---|---|---|---|",
            *rows]


def difference_lines(diffs: list[dict]) -> list[str]:
    """The run's differences from the organizers' command (summary.json `differences`, made from
    harness/gpu/harness.yaml and the invocation's options), each with its reason."""
    if not diffs:
        return []
    L = ["", "## Differences from the organizers' command", "",
         "Everything else is the organizers' start script (configs/contest.yaml `server.start_script`, vLLM's "
         "default compilation config) and their client (`client.command`).", "",
         "| side | option | why |", "|---|---|---|"]
    for d in diffs:
        opt = " ".join(d["args"]).replace("|", "\\|")
        L.append(f"| {d['side']} | `{opt}` | {d['why']} |")
    return L


def concurrency_words(client: str) -> str:
    """How many requests the client kept in flight, from its recorded command line."""
    m = re.search(r"--max-concurrency\s+(\d+)", client)
    rate = re.search(r"--request-rate\s+(\S+)", client)
    n = m.group(1) if m else "1"
    return f"concurrency {n}" + (f", request rate {rate.group(1)}" if rate and rate.group(1) != "1" else "")


def render_summary(run: Run, names: list[str], scored: dict, ref: str) -> str:
    s = run.summary
    v = s.get("versions", {})
    # a copy of the repository without .git (as sent to a GPU machine) knows its commit from the bundle
    commit, dirty, where = s["git"].get("commit"), s["git"].get("dirty"), "this checkout"
    if not commit:
        fb = (s.get("bundle") or {}).get("forge") or {}
        commit, dirty, where = fb.get("commit"), fb.get("dirty"), "as recorded in the bundle"
    L = ["<!-- generated by `forge e2e-gpu` (scripts/forge/lab/e2e.py); do not edit -->",
         f"# End-to-end run: {', '.join(names)} on {v.get('device', '?')}", "",
         f"- started {s['started']}, {s.get('seconds', '?')} s; command: `{s['command']}`",
         f"- forge commit `{(commit or '?')[:12]}`{' (dirty)' if dirty else ''} ({where}); "
         f"bundle vLLM `{s.get('bundle', {}).get('version', '?')}`",
         f"- Python {v.get('python')}, torch {v.get('torch')}, triton {v.get('triton')}, "
         f"transformers {v.get('transformers')}",
         "- harness, not a contest run: the organizers' server and client commands with the differences listed "
         "below (random weights among them), plain-torch stand-ins for vLLM's compiled ops, each server warmed "
         "once before the tiers; compare profiles only within this run.",
         f"- client, one invocation per (tier, profile) over the tier's prompts: `{s.get('client', '?')}`", ""]
    for e in s.get("earlier_invocations", []):
        L.append(f"- earlier invocation in this folder: started {e.get('started')}, {e.get('seconds')} s "
                 f"(its steps are in summary.json)")
    L += difference_lines(s.get("differences") or [])
    L += ["", "## Servers", "", "| profile | ready s | first request s | torch.compile s | graph capture s "
          "| attention block | KV cache tokens | max-length requests it holds | errors in log |",
          "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        ready, warm_s, f = _server_facts(run, s, n)
        L.append(f"| {n} | {ready} | {warm_s} | {f.get('compile_s', '—')} | {f.get('graph_capture_s', '—')} "
                 f"| {f.get('attention_block_size', '—')} | {f.get('kv_cache_tokens', '—')} "
                 f"| {f.get('max_concurrency', '—')} | {len(f.get('error_lines', []))} |")
    fit = s.get("gpu_fit") or {}
    if fit.get("checked"):
        rooms = ", ".join(f"{n} {v['kv_room_bytes']:,} (weights {v['weights_bytes']:,}, TP{v['tp']})"
                          for n, v in (fit.get("per_server") or {}).items())
        L += ["", f"GPU memory checked before the start ({fit['source']}): {fit['card_bytes']:,} bytes, "
                  f"{fit['servers']} server(s) at --gpu-memory-utilization {fit['utilization']:g}"
              + (f"; KV cache {fit['kv_cache_memory_bytes']:,} bytes each, room beside the weights: {rooms}"
                 if rooms else "") + "."]
    elif fit:
        seen = fit.get("cards")
        L += ["", f"GPU memory not checked before the start: {fit.get('why')}"
              + (f" ({seen['cards']} card(s) visible: {seen['source']})" if seen else "") + "."]
    mon = s.get("gpu_monitor") or {}
    if mon.get("tool"):
        L += ["", f"The GPU beside the run ({mon['tool']} every {mon['interval_s']:g} s: {mon.get('what', 'its state')}): "
                  f"`{mon['log']}`, {mon.get('samples', 0)} samples in this invocation."]
    elif mon:
        L += ["", f"The GPU beside the run: not sampled ({mon.get('why')})."]
    if s.get("servers_left_up"):
        L += ["", "Left up at the end (--keep-servers): " + ", ".join(
            f"{n} (pid {v['pid']}, port {v['port']})" for n, v in s["servers_left_up"].items())]
    shape = next((d.get("shape") for d in (s.get("datasets") or {}).values() if d.get("shape")), None)
    L += ["", f"## Tiers (output tok/s, {concurrency_words(s.get('client') or '')}, {shape or 'prompts as in summary.json datasets'})", "",
          "| tier | " + " | ".join(names) + " | best vs " + ref + " | TTFT P99 ms | TPOT P99 ms | prompts |",
          "|---|" + "---|" * len(names) + "---|---|---|---|"]
    for t in contest_mod.tier_names(run.contest):
        cells, tok = [], {}
        ttft, tpot, nprompt = [], [], []
        for n in names:
            p = runs.result_path(run.run_dir(n, create=False), t)
            if p.is_file():
                r = runs.read_json(p)
                tok[n] = r.get("output_throughput") or 0.0
                cells.append(f"{tok[n]:.2f}" + (f" ({r['failed']} failed)" if r.get("failed") else ""))
                ttft.append(f"{n}: {fmt(r.get('p99_ttft_ms'), '.0f')}")
                tpot.append(f"{n}: {fmt(r.get('p99_tpot_ms'))}")
                nprompt.append(str(r.get("completed", 0) + r.get("failed", 0)))
            else:
                cells.append("—")
        best = max((x for x in tok.items() if x[0] != ref), key=lambda x: x[1], default=None)
        lift = f"{best[0]} {100 * (best[1] / tok[ref] - 1):+.1f} %" if best and tok.get(ref) else "—"
        L.append(f"| {t} | " + " | ".join(cells) + f" | {lift} | {'; '.join(ttft)} | {'; '.join(tpot)} | "
                 f"{'/'.join(nprompt) or '—'} |")
    L += tier_ratio_lines(run, names, ref)
    L += sla_lines(run, names, ref)
    L += stall_lines(run, names)
    L += residency_lines(run, names)
    L += textless_lines(run, names)
    L += stacks.summary_lines(stacks.read(run.out))        # --stack-every's digest, once the run has made it
    L += ["", "## Proxy score (same-run reference = 60.0)", ""]
    if scored:
        for n, r in scored.items():
            L.append(f"- {n}: **{r['display']}** (pooled TPOT P99 {fmt(r['tpot_p99_pooled_ms'])} ms)")
    else:
        L.append(f"- not computed: {s.get('score_note', 'tiers missing')}")
    if s.get("plumbing"):
        p = s["plumbing"]
        L += ["", f"## Plumbing check: {p['test']} vs {p['reference']} (greedy, {p['max_tokens']} tokens)"
              + (f" — from the invocation of {p['from_earlier_invocation']}" if p.get("from_earlier_invocation") else ""), "",
              f"Verdict: **{p['verdict']}**", "",
              "| prompt words | identical | same prefix | first token same | top-5 common | max Δ logprob | ref top-5 spread |",
              "|---|---|---|---|---|---|---|"]
        for r in p["prompts"]:
            L.append(f"| {r['prompt_words']} | {r['identical']} | {r['same_prefix']}/{r['tokens']} | "
                     f"{r['first_token_same']} | {r['top_common']}/{r['top_k']} | "
                     f"{fmt(r['max_abs_logprob_diff'], '.4f')} | {fmt(r['ref_top_spread'], '.4f')} |")
    if s.get("fault"):
        f = s["fault"]
        L += ["", f"## Fault check ({f['server']} killed mid-tier)"
              + (f" — from the invocation of {f['from_earlier_invocation']}" if f.get("from_earlier_invocation") else ""), "",
              f"Result: **{'as intended' if f['ok'] else 'NOT as intended'}** — statuses {f['statuses']}; "
              f"failed {f['failed']}; score contributions "
              f"{ {n: v['contribution'] for n, v in f['score'].items()} if f['score'] else 'not scored'}"]
    if s.get("server_errors"):
        L += ["", "## Server errors", ""]
        for n, errs in s["server_errors"].items():
            L += [f"### {n}", "", "```", errs[-1][-2500:], "```", ""]
    if s["skipped"]:
        L += ["", "## Left out", ""] + [f"- {x}" for x in s["skipped"]]
    if s.get("error"):
        L += ["", "## Error", "", "```", s["error"], "```"]
    return "\n".join(L) + "\n"
