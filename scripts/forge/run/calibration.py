"""What a calibration's measurements decide: the selection rule, the per-device table, and the
speed-ups the time model takes. Pure functions over the records the families write
(kernels/calibrate/common.py describes a record); `forge calibrate` runs the families.

Selection, per decision:
  - a candidate is eligible only when it was correct (within its tolerance against float64) and timed
    at every point of the decision; a failing one is never selected, and the report says why; one the
    kernel in use could not take (a record's "not_timed") is listed as not timed with its reason, not failed;
  - a candidate's time is the weighted sum of its median times over the points, its spread the
    weighted sum of (p90 - p10) / 2;
  - the fastest eligible selectable candidate wins over the upstream path only by more than the noise
    (the larger relative spread of the two, at least NOISE_FLOOR); otherwise the upstream path stays:
    ties go to upstream. A decision without an upstream path (the int8 cache's Q.K paths, both ours)
    holds the built-in to the same rule.
"""

from __future__ import annotations

import math

NOISE_FLOOR = 0.01
MMA = "mma"               # a GEMV decision's launch that names the Triton skinny GEMM (kernels/forge_tuned)
CHECK_ONLY = ("write",)   # families whose records are correctness checks, not decisions


def _totals(recs: list[dict]) -> dict | None:
    """(time, spread, points) of one candidate's records, or None when it is not eligible."""
    if not recs or not all(r.get("ok") and r.get("us") for r in recs):
        return None
    t = sum(r["weight"] * r["us"]["median"] for r in recs)
    s = sum(r["weight"] * (r["us"]["p90"] - r["us"]["p10"]) / 2 for r in recs)
    return {"us": t, "spread_us": s, "points": len(recs)}


def not_timed(recs: list[dict]) -> str | None:
    """Why a candidate was not timed (the first of its records that says so), or None."""
    return next((r["not_timed"] for r in recs if r.get("not_timed")), None)


def why_failed(recs: list[dict]) -> str:
    for r in recs:
        if r.get("error"):
            return f"{r['point']}: {r['error']}"
        if not r.get("ok"):
            err = r.get("err")
            shown = "inf (output not written or NaN)" if err is not None and math.isinf(err) else f"{err:.3g}"
            return f"{r['point']}: error {shown} over the tolerance {r.get('tol')}"
    return "not timed at every point"


def _noise(floor: float, *totals: dict) -> float:
    """The noise two (or more) timings are compared within: the largest relative half-spread of them
    (each {"us", "spread_us"}), at least `floor`."""
    return max([t["spread_us"] / t["us"] if t["us"] else 0.0 for t in totals] + [floor])


def select(records: list[dict], noise_floor: float = NOISE_FLOOR) -> dict:
    """{decision: {"chosen", "kind", "launch", "us", "upstream", "builtin", "speedup", "noise",
    "candidates": {name: {...}}, "failed": {name: why}, "why"}} for every decision with records, plus
    "not_timed": {name: why} where a candidate was not timed (the kernel in use could not take it)."""
    by_dec: dict[str, dict[str, list[dict]]] = {}
    for r in records:
        if r["decision"].split(".")[0] in CHECK_ONLY:
            continue
        by_dec.setdefault(r["decision"], {}).setdefault(r["candidate"], []).append(r)
    out = {}
    for dec, cands in sorted(by_dec.items()):
        # the points some candidate was timed at (a candidate that failed everywhere adds none)
        points = {r["point"] for recs in cands.values() for r in recs if r.get("ok") and r.get("us")}
        info, failed, skipped = {}, {}, {}
        for name, recs in cands.items():
            why_not = not_timed(recs)
            if why_not:
                skipped[name] = why_not
                continue
            tot = _totals(recs)
            if tot is None or tot["points"] < len(points):
                failed[name] = why_failed(recs)
                continue
            first = recs[0]
            info[name] = {**tot, "kind": first["kind"], "launch": first.get("launch"),
                          "selectable": first.get("selectable", True)}
        ups = [n for n, recs in cands.items() if recs[0]["kind"] == "upstream"]
        up = ups[0] if ups else None
        ours = sorted((n for n, i in info.items() if i["selectable"] and i["kind"] in ("ours", "builtin")),
                      key=lambda n: info[n]["us"])
        best = ours[0] if ours else None
        builtin = next((n for n, i in info.items() if i["kind"] == "builtin"), None)
        d = {"candidates": info, "failed": failed, "upstream": up if up in info else None,
             "builtin": builtin, "best_ours": best, **({"not_timed": skipped} if skipped else {})}
        # what ours must beat: the upstream path, else (a choice between our own, e.g. the int8 cache's Q.K
        # paths) the built-in; ties go to it
        ref = up if up in info else builtin if up is None and builtin in info else None
        said = "upstream" if ref == up else "the built-in"
        if ref and best and best != ref:
            noise = _noise(noise_floor, info[ref], info[best])
            wins = info[best]["us"] < info[ref]["us"] * (1 - noise)
            chosen = best if wins else ref
            why = (f"{best} is {info[ref]['us'] / info[best]['us']:.3f}x {said}, beyond the noise {noise:.1%}"
                   if wins else f"{best} is within the noise ({noise:.1%}) of {said} or slower: {said} stays")
            d.update(noise=noise)
        elif ref and best:
            chosen, why = best, "the built-in is the fastest correct (no upstream path in this decision)"
        elif best:
            chosen, why = best, ("no upstream candidate in this decision" if up is None else
                                 f"the upstream path failed ({failed.get(up)}): the fastest correct of ours")
        elif up in info:
            chosen, why = up, ("none of our candidates is correct and timed"
                               + (f" ({', '.join(skipped)} not timed)" if skipped else "") + ": upstream stays")
        else:
            chosen, why = None, "no candidate is correct and timed"
        d.update(chosen=chosen, why=why)
        if chosen:
            c = info[chosen]
            d.update(kind=c["kind"], launch=c["launch"], us=c["us"])
            if d["upstream"]:
                d["speedup"] = info[d["upstream"]]["us"] / c["us"]
            if builtin:
                d["vs_builtin"] = info[builtin]["us"] / c["us"]
        out[dec] = d
    return out


def build_table(selection: dict, validators: dict, provenance: dict, decode_context: int = 32768) -> dict:
    """The per-device table (kernels/forge_tuned) from a selection. A GEMV decision that upstream won
    leaves the shape at that token count out (the platform GEMM runs); one that ours won names its
    launch: [block, rows] of the GEMV, or "mma" (the skinny GEMM); prefill and decode take the
    fastest correct launch of ours (the route to our kernel is not the table's to switch); the int8
    decode launch only where it beats the built-in beyond the noise (`int8_decode_launch`), the int8
    cache's own segment counts at the launch it runs (`decode.segments_int8`), and its Q.K path where it
    was measured (`qk_int8_choice`)."""
    table = {"schema": "forge-tuned/2", "validators": validators, "provenance": provenance}
    kv_heads = str((validators.get("heads") or [24, 4])[1])
    gemv: dict = {}
    decode: dict[int, dict] = {}
    decode_int8: dict[int, dict] = {}
    decode_qk: dict[int, dict] = {}
    for dec, d in selection.items():
        parts = dec.split(".")
        if parts[0] == "gemv" and d.get("kind") in ("ours", "builtin"):
            _, kind, shape, m = parts
            launch = d["launch"]          # [block, rows] of our GEMV, or "mma": the skinny GEMM's built-in launch
            gemv.setdefault(kind, {}).setdefault(shape, {})[m] = launch if launch == MMA else list(launch)
        elif parts[0] == "prefill" and d.get("best_ours"):
            table.setdefault("prefill", {})[parts[1]] = list(d["candidates"][d["best_ours"]]["launch"])
        elif parts[0] == "decode" and d.get("best_ours") and parts[2] == "16bit":
            decode[int(parts[1])] = d
        elif parts[0] == "decode" and parts[2] == "int8":
            decode_int8[int(parts[1])] = d
        elif parts[0] == "decode" and parts[2] == "qk":
            decode_qk[int(parts[1])] = d
    if decode:
        # one launch for every batch (the server applies one): the one that won at the largest batch
        # measured; each batch's segments: its fastest correct count at that launch, measured over
        # contexts up to decode_context, for the rank's KV heads
        launch = decode[max(decode)]["candidates"][decode[max(decode)]["best_ours"]]["launch"][1:]
        table["decode"] = {"segments": {kv_heads: _segments_at(decode, launch, decode_context)},
                           "launch": {"16bit": [int(x) for x in launch]}}
    int8 = int8_decode_launch(decode_int8)
    if int8:
        table.setdefault("decode", {}).setdefault("launch", {})["int8"] = int8
    # the int8 cache's own counts, at the launch it runs at each batch (the table's, else the batch's
    # built-in): the fastest count of a batch differs between the two caches (an int8 tile holds twice
    # the tokens)
    segs8: dict[str, dict[str, int]] = {}
    for b, d in sorted(decode_int8.items()):
        at = int8 or (d["candidates"][d["builtin"]]["launch"][1:] if d.get("builtin") in d.get("candidates", {})
                      else None)
        if at:
            segs8.update(_segments_at({b: d}, at, decode_context))
    if segs8:
        table.setdefault("decode", {})["segments_int8"] = {kv_heads: segs8}
    qk = qk_int8_choice(decode_qk)
    if qk is not None:
        table.setdefault("decode", {})["qk_int8"] = qk
    if gemv:
        table["gemv"] = gemv
    return table


def _segments_at(decisions: dict[int, dict], launch: list, context: int) -> dict[str, dict[str, int]]:
    """{batch: {context: segments}}: each batch's fastest correct segment count at `launch`
    ([TILE_N, warps, stages]), where that launch was measured."""
    segs = {}
    for b, d in sorted(decisions.items()):
        at = [c for c in d["candidates"].values() if c["kind"] in ("ours", "builtin") and c.get("selectable", True)
              and list(c["launch"][1:]) == list(launch)]
        if at:
            segs[str(b)] = {str(context): int(min(at, key=lambda c: c["us"])["launch"][0])}
    return segs


def _launch_totals(decisions: dict[int, dict]) -> dict[tuple, tuple[float, float]]:
    """{(TILE_N, warps, stages): (us, spread_us)} summed over the batches of each launch's fastest
    correct segment count; a launch not correct and timed at every batch is left out."""
    best: dict[tuple, dict[int, dict]] = {}
    for b, d in decisions.items():
        for c in d["candidates"].values():
            if c["kind"] not in ("ours", "builtin") or not c.get("selectable", True) or not c.get("launch"):
                continue
            at = best.setdefault(tuple(int(x) for x in c["launch"][1:]), {})
            if b not in at or c["us"] < at[b]["us"]:
                at[b] = c
    return {launch: (sum(c["us"] for c in at.values()), sum(c["spread_us"] for c in at.values()))
            for launch, at in best.items() if len(at) == len(decisions)}


def int8_decode_launch(decisions: dict[int, dict], noise_floor: float = NOISE_FLOOR) -> list[int] | None:
    """`decode.launch.int8` from the `decode.<batch>.int8` decisions, or None (the kernel's built-in
    launch stays). The server applies one launch at every batch: each launch's time is the sum over the
    batches of its fastest segment count; the fastest launch is written only when it beats the built-in
    launch by more than the noise (the larger relative spread of the two, at least the floor). Without
    a built-in measured at every batch nothing is written."""
    builtins = {tuple(int(x) for x in d["candidates"][d["builtin"]]["launch"][1:])
                for d in decisions.values() if d.get("builtin") in d.get("candidates", {})}
    if len(builtins) != 1 or not decisions or not all(d.get("builtin") in d.get("candidates", {})
                                                      for d in decisions.values()):
        return None
    totals = _launch_totals(decisions)
    builtin = builtins.pop()
    if builtin not in totals:
        return None
    best = min(totals, key=lambda launch: totals[launch][0])
    (t_best, s_best), (t_bi, s_bi) = totals[best], totals[builtin]
    noise = _noise(noise_floor, {"us": t_best, "spread_us": s_best}, {"us": t_bi, "spread_us": s_bi})
    return [*best] if best != builtin and t_best < t_bi * (1 - noise) else None


def qk_int8_choice(decisions: dict[int, dict], noise_floor: float = NOISE_FLOOR) -> bool | None:
    """`decode.qk_int8` from the `decode.<batch>.qk` decisions (the int8 cache's Q.K paths at each batch's
    built-in launch: "builtin" the int8 dot, "ours" converted K tiles), or None (nothing written: the
    kernel's built-in). The server runs one path at every batch: False where the converted path, summed
    over the batches, beats the int8 dot by more than the noise, or where the int8 dot failed at every
    batch and the converted path was correct and timed at each; True where both were measured at every
    batch and the int8 dot held; None otherwise (a batch with neither, or the two measured at different batches)."""
    if not decisions:
        return None
    def at(d, kind):
        return next((c for c in d.get("candidates", {}).values() if c["kind"] == kind), None)
    dots, conv = [at(d, "builtin") for d in decisions.values()], [at(d, "ours") for d in decisions.values()]
    if any(c is None for c in conv):
        return None
    if all(c is None for c in dots):
        return False
    if any(c is None for c in dots):
        return None
    dot, cv = ({k: sum(c[k] for c in cs) for k in ("us", "spread_us")} for cs in (dots, conv))
    return not cv["us"] < dot["us"] * (1 - _noise(noise_floor, dot, cv))


# --- what the time model takes -------------------------------------------------------------------

def point_times(records: list[dict], decision: str, candidate: str) -> dict[str, float]:
    return {r["point"]: r["us"]["median"] for r in records
            if r["decision"] == decision and r["candidate"] == candidate and r.get("us")}


def fit_rate(times: dict[str, float], flops) -> tuple[float, float]:
    """(us per FLOP, fixed us) of a kernel from its (point -> us) times, least squares on
    us = a * flops(point) + b; used to price prompts between the measured points."""
    xs = [flops(p) for p in times]
    ys = list(times.values())
    n = len(xs)
    if n == 1:
        return ys[0] / xs[0], 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else my / mx
    return a, my - a * mx
