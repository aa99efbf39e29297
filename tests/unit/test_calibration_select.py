"""The calibration's selection rule and the table it writes (scripts/forge/run/calibration.py), on
hand-made records: the fastest correct candidate; a failing one never, however fast; ties (within the
measured noise) go to the upstream path."""

import pytest

from forge.run import calibration as sel


def rec(dec, cand, kind, us, *, point="M=1", ok=True, spread=0.0, launch=None, weight=1.0, error=None,
        selectable=True):
    return {"decision": dec, "candidate": cand, "kind": kind, "launch": launch, "selectable": selectable,
            "point": point, "weight": weight, "ok": ok, "err": 0.0 if ok else 0.5, "tol": 0.02, "error": error,
            "us": {"median": us, "p10": us - spread / 2, "p90": us + spread / 2, "n": 10} if (ok and us) else None}


D = "gemv.plain.96x5120.1"


def test_the_fastest_correct_candidate_wins_and_a_wrong_one_never():
    recs = [rec(D, "F.linear", "upstream", 100.0),
            rec(D, "forge built-in", "builtin", 80.0, launch=[0, 0]),
            rec(D, "forge b640 r2", "ours", 60.0, launch=[640, 2]),
            rec(D, "forge b64 r2", "ours", 10.0, ok=False, launch=[64, 2])]   # fastest, but wrong
    s = sel.select(recs)[D]
    assert s["chosen"] == "forge b640 r2" and s["launch"] == [640, 2]
    assert s["speedup"] == pytest.approx(100 / 60) and s["vs_builtin"] == pytest.approx(80 / 60)
    assert "forge b64 r2" in s["failed"] and "over the tolerance" in s["failed"]["forge b64 r2"]


def test_a_tie_within_the_noise_goes_to_upstream():
    # 2 % faster, but each spread is 6 % of its time: within the noise
    recs = [rec(D, "F.linear", "upstream", 100.0, spread=6.0), rec(D, "forge built-in", "builtin", 98.0, spread=6.0)]
    s = sel.select(recs)[D]
    assert s["chosen"] == "F.linear" and s["kind"] == "upstream" and s["noise"] == pytest.approx(0.03, rel=0.05)
    # the same 2 % with tight spreads: the 1 % floor, and ours wins
    recs = [rec(D, "F.linear", "upstream", 100.0, spread=0.2), rec(D, "forge built-in", "builtin", 98.0, spread=0.2)]
    assert sel.select(recs)[D]["chosen"] == "forge built-in"
    # 0.5 % faster is under the floor: upstream
    recs = [rec(D, "F.linear", "upstream", 100.0), rec(D, "forge built-in", "builtin", 99.5)]
    assert sel.select(recs)[D]["chosen"] == "F.linear"


def test_every_point_counts_and_a_missing_point_disqualifies():
    P = "prefill.16bit"
    recs = [rec(P, "unified", "upstream", 50.0, point="a"), rec(P, "unified", "upstream", 50.0, point="b", weight=2),
            rec(P, "L1", "builtin", 10.0, point="a", launch=[1, 2, 3, 4]),
            rec(P, "L1", "builtin", 30.0, point="b", weight=2, launch=[1, 2, 3, 4]),
            rec(P, "L2", "ours", 5.0, point="a", launch=[5, 6, 7, 8]),                       # fails at b
            rec(P, "L2", "ours", None, point="b", weight=2, ok=False, error="OutOfResources: shared memory",
                launch=[5, 6, 7, 8])]
    s = sel.select(recs)[P]
    assert s["chosen"] == "L1" and s["us"] == pytest.approx(10 + 2 * 30)
    assert s["candidates"]["unified"]["us"] == pytest.approx(150.0)
    assert s["failed"]["L2"] == "b: OutOfResources: shared memory"


def test_a_vendor_path_is_timed_but_never_chosen():
    recs = [rec(D, "F.linear", "upstream", 100.0), rec(D, "wvSplitK", "vendor", 20.0, selectable=False),
            rec(D, "forge built-in", "builtin", 90.0)]
    s = sel.select(recs)[D]
    assert s["chosen"] == "forge built-in" and "wvSplitK" in s["candidates"]


def test_a_failing_upstream_leaves_the_fastest_correct_of_ours_and_nothing_correct_leaves_none():
    recs = [rec(D, "F.linear", "upstream", None, ok=False, error="RuntimeError: boom"),
            rec(D, "forge built-in", "builtin", 90.0)]
    s = sel.select(recs)[D]
    assert s["chosen"] == "forge built-in" and "upstream path failed" in s["why"] and "boom" in s["why"]
    s = sel.select([rec(D, "forge built-in", "builtin", None, ok=False)])[D]
    assert s["chosen"] is None and s["why"] == "no candidate is correct and timed"


def test_correctness_only_families_make_no_decision():
    assert sel.select([rec("write", "triton", "ours", 5.0)]) == {}


def test_the_table_routes_what_won_and_keeps_our_kernels_launches():
    recs = [rec("gemv.plain.96x5120.1", "F.linear", "upstream", 100.0),
            rec("gemv.plain.96x5120.1", "forge b640 r2", "ours", 50.0, launch=[640, 2]),
            rec("gemv.plain.5120x6144.4", "F.linear", "upstream", 100.0),
            rec("gemv.plain.5120x6144.4", "forge built-in", "builtin", 120.0, launch=[0, 0]),
            rec("gemv.fused.34816x5120.2", "F.linear + act", "upstream", 100.0),
            rec("gemv.fused.34816x5120.2", "forge fused built-in", "builtin", 70.0, launch=[0, 0]),
            # upstream is faster here, but the route to our prefill kernel is not the table's: its best launch
            rec("prefill.16bit", "unified", "upstream", 10.0, point="P=0 C=4096"),
            rec("prefill.16bit", "L", "ours", 20.0, point="P=0 C=4096", launch=[128, 64, 8, 2]),
            rec("decode.1.16bit", "unified 3D", "upstream", 100.0, point="ctx=4096"),
            rec("decode.1.16bit", "S128", "ours", 30.0, point="ctx=4096", launch=[128, 32, 4, 2]),
            rec("decode.1.int8", "S64", "builtin", 30.0, point="ctx=4096", launch=[64, 64, 8, 2])]
    t = sel.build_table(sel.select(recs), {"device_name": "d"}, {"commit": "c"})
    assert t["gemv"] == {"plain": {"96x5120": {"1": [640, 2]}}, "fused": {"34816x5120": {"2": [0, 0]}}}
    assert t["prefill"] == {"16bit": [128, 64, 8, 2]}
    # int8 decode: its built-in launch kept, with its count there; a table without heads was measured at the
    # whole model's 4 KV heads
    assert t["decode"] == {"segments": {"4": {"1": {"32768": 128}}}, "launch": {"16bit": [32, 4, 2]},
                           "segments_int8": {"4": {"1": {"32768": 64}}}}
    assert t["schema"] == "forge-tuned/2" and t["validators"] == {"device_name": "d"}


def test_decode_segments_per_batch_at_the_one_launch_of_the_largest_batch():
    """The server applies one decode launch: the one that won at the largest batch; every batch's
    segment count is its fastest at that launch (not at a launch the server will not run)."""
    recs = []
    for b, times in ((1, {(64, 32, 4, 3): 10.0, (32, 32, 4, 2): 11.0, (64, 32, 4, 2): 12.0}),
                     (10, {(16, 32, 4, 2): 50.0, (8, 32, 4, 2): 55.0, (16, 32, 4, 3): 60.0})):
        recs.append(rec(f"decode.{b}.16bit", "unified 3D", "upstream", 100.0, point="ctx=32768"))
        for launch, us in times.items():
            recs.append(rec(f"decode.{b}.16bit", f"S{launch}", "ours", us, point="ctx=32768", launch=list(launch)))
    t = sel.build_table(sel.select(recs), {"device_name": "d", "tp": 2, "heads": [12, 2]}, {"commit": "c"})
    assert t["decode"] == {"segments": {"2": {"1": {"32768": 32}, "10": {"32768": 16}}},
                           "launch": {"16bit": [32, 4, 2]}}


def test_fit_rate_recovers_a_linear_kernel():
    times = {f"P={p} C=4096": 3e-6 * 4096 * (p + 4097 / 2) + 7.0 for p in (0, 4096, 8192, 16384)}
    flops = lambda pt: (lambda p, c: c * (p + (c + 1) / 2))(*(int(x.split("=")[1]) for x in pt.split()))  # noqa: E731
    a, b = sel.fit_rate(times, flops)
    assert a == pytest.approx(3e-6) and b == pytest.approx(7.0)


def test_a_candidate_that_killed_its_process_fails_alone():
    """A killer is recorded once for every point (it never ran): the others' points still decide."""
    P = "prefill.16bit"
    recs = [rec(P, "unified", "upstream", 50.0, point="a"), rec(P, "unified", "upstream", 50.0, point="b"),
            rec(P, "L1", "builtin", 10.0, point="a"), rec(P, "L1", "builtin", 10.0, point="b"),
            rec(P, "L2", "ours", None, point="(every point)", ok=False, error="killed the calibration process")]
    s = sel.select(recs)[P]
    assert s["chosen"] == "L1" and set(s["candidates"]) == {"unified", "L1"}
    assert "killed" in s["failed"]["L2"]


def qk_recs(times: dict[int, tuple], spread: float = 0.0) -> list[dict]:
    """decode.<batch>.qk records: (int8 dot us or None for a failure, converted us or None) per batch."""
    out = []
    for b, (dot, conv) in times.items():
        for name, kind, us in (("int8 Q.K dot (built-in)", "builtin", dot),
                               ("Q.K on converted K tiles", "ours", conv)):
            out.append(rec(f"decode.{b}.qk", name, kind, us, point="ctx=32768", ok=us is not None, spread=spread,
                           launch=[8, 128, 4, 2], error=None if us is not None else "CompilationError: no int8 dot"))
    return out


VAL = {"device_name": "d", "tp": 1, "heads": [24, 4]}


@pytest.mark.parametrize("times, spread, expect", [
    ({1: (10.0, 8.0), 16: (40.0, 30.0)}, 0.0, False),       # converted faster beyond the noise at the sum
    ({1: (10.0, 9.95), 16: (40.0, 39.9)}, 0.0, True),       # 0.3 % faster: under the 1 % floor, the int8 dot stays
    ({1: (10.0, 9.0), 16: (40.0, 38.0)}, 8.0, True),        # 6 % faster, but spreads of 10-40 %: the int8 dot stays
    ({1: (8.0, 10.0), 16: (30.0, 40.0)}, 0.0, True),        # the int8 dot faster
    ({1: (None, 10.0), 16: (None, 40.0)}, 0.0, False),      # the int8 dot failed everywhere: converted
    ({1: (None, 10.0), 16: (30.0, 40.0)}, 0.0, None),       # failed at one batch only: nothing written
    ({1: (10.0, None), 16: (30.0, 40.0)}, 0.0, None),       # converted not measured everywhere: nothing written
])
def test_the_int8_qk_path_from_the_measured_batches(times, spread, expect):
    t = sel.build_table(sel.select(qk_recs(times, spread)), VAL, {"commit": "c"})
    assert t.get("decode", {}).get("qk_int8") == expect if expect is not None else "qk_int8" not in t.get("decode", {})


def test_a_choice_without_upstream_ties_to_the_built_in():
    """A decision with no upstream path (the int8 cache's Q.K): the other candidate replaces the built-in
    only beyond the noise, and the report says against what."""
    s = sel.select(qk_recs({4: (10.0, 9.95)}))["decode.4.qk"]
    assert s["kind"] == "builtin" and "built-in stays" in s["why"]
    s = sel.select(qk_recs({4: (9.0, 10.0)}))["decode.4.qk"]
    assert s["kind"] == "builtin" and "the built-in is the fastest" in s["why"]
    s = sel.select(qk_recs({4: (10.0, 8.0)}))["decode.4.qk"]
    assert s["kind"] == "ours" and "1.250x the built-in" in s["why"]
