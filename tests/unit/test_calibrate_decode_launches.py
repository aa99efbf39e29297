"""`forge calibrate`'s decode family times launches for the int8 cache too, not only its segment count (an
H200 reads the int8 KV at 38-55 % of copy bandwidth against 72-79 % for bf16), and the table takes
`decode.launch.int8` only from a launch that beats the int8 built-in beyond the noise; the int8 cache's own
segment counts (`decode.segments_int8`) are each batch's fastest at the launch it runs."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "scripts"))
import forge_tuned  # noqa: E402
from calibrate import attention  # noqa: E402
from forge_triton import split_kv_decode as dec  # noqa: E402

from forge.run import calibration as sel  # noqa: E402


def builtin(kv, is_hip, batch=10):
    s = dec.choose_num_segments(132, batch, 4, 32768)
    return (s, *dec.default_launch_config(torch.int8 if kv == "int8" else torch.bfloat16, 256, is_hip, batch))


@pytest.mark.parametrize("is_hip", [False, True])
@pytest.mark.parametrize("quick", [False, True])
def test_int8_decisions_time_other_launches_the_table_accepts(is_hip, quick):
    b = builtin("int8", is_hip)
    cands = attention.decode_candidates(is_hip, quick, False, b, "int8")
    assert cands[:2] == [("upstream", None), ("builtin", b)]
    launches = {tuple(launch[1:]) for kind, launch in cands if kind == "ours"}
    others = launches - {b[1:]}
    # other launches than the built-in, another tile size among them (an int8 token row is half the bytes)
    assert others and {t for t, _, _ in others} - {b[1]}, launches
    for launch in launches:
        assert forge_tuned._launch("decode.launch.int8", list(launch), forge_tuned.DECODE_LAUNCH) == launch
    # each launch at several segment counts, the built-in's among them
    segs = {launch[0] for kind, launch in cands if kind == "ours" and tuple(launch[1:]) != b[1:]}
    assert b[0] in segs and len(segs) >= 3
    if quick:   # the quick run stays small: the built-in launch and one other
        assert len(launches) <= 2


def test_the_smoke_run_offers_an_int8_launch_other_than_the_built_in():
    b = builtin("int8", False, batch=1)
    cands = attention.decode_candidates(False, False, True, b, "int8")
    assert len(cands) == 4 and any(launch[1:] != b[1:] for kind, launch in cands if kind == "ours")


@pytest.mark.parametrize("kv", ["16bit", "int8"])
@pytest.mark.parametrize("is_hip", [False, True])
def test_the_grid_times_counts_between_the_powers_and_the_table_takes_them(kv, is_hip):
    """Beside each power of two, 1.5x it (whole waves of programs: 24 at batch 10, 2 KV heads, beat 16 and 32 on an
    H100); every count the grid offers is one a table may hold; the quick run keeps the powers."""
    full = {g[0] for g in attention.decode_grid(is_hip, False, 16, kv)}
    assert full == {4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192}
    assert {g[0] for g in attention.decode_grid(is_hip, True, 16, kv)} == {8, 16, 32}
    for s in full:
        forge_tuned._batch_segments("decode.segments.2", {"10": s}, None)


def test_the_16bit_grid_is_unchanged():
    b = builtin("16bit", False)
    launches = {tuple(launch[1:]) for kind, launch in attention.decode_candidates(False, False, False, b, "16bit")
                if kind != "upstream"}
    assert launches == {(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 2)}


def rec(dec_, cand, kind, us, *, launch, point="ctx=32768", spread=0.0):
    return {"decision": dec_, "candidate": cand, "kind": kind, "launch": launch, "selectable": True, "point": point,
            "weight": 1.0, "ok": True, "err": 0.0, "tol": 0.03, "error": None,
            "us": {"median": us, "p10": us - spread / 2, "p90": us + spread / 2, "n": 15}}


def int8_records(times: dict[int, dict[tuple, float]], spread=0.0):
    recs = []
    for b, at in times.items():
        recs.append(rec(f"decode.{b}.int8", "vLLM unified 3D", "upstream", 500.0, launch=None))
        for launch, us in at.items():
            kind = "builtin" if launch == (8, 64, 8, 2) else "ours"
            recs.append(rec(f"decode.{b}.int8", "segments {} TILE_N {} warps {} stages {}".format(*launch), kind, us,
                            launch=list(launch), spread=spread * us))
    return recs


VALIDATORS = {"device_name": "NVIDIA H200", "arch": "sm_90", "compute_units": 132, "toolkit": "cuda 13.0",
              "torch": "2.11", "triton": "3.6", "tp": 1, "heads": [24, 4]}


def test_a_launch_that_beats_the_int8_built_in_is_written_and_validates():
    # TILE_N 128 wins at both batches, each at its own best segment count
    recs = int8_records({10: {(8, 64, 8, 2): 100.0, (16, 64, 8, 2): 95.0, (8, 128, 8, 2): 90.0, (16, 128, 8, 2): 80.0},
                         16: {(8, 64, 8, 2): 150.0, (8, 128, 8, 2): 120.0, (4, 32, 4, 2): 119.0}})
    t = sel.build_table(sel.select(recs), VALIDATORS, {"commit": "c"})
    # with each batch's fastest segment count at that launch, for the int8 cache alone
    assert t["decode"] == {"launch": {"int8": [128, 8, 2]},
                           "segments_int8": {"4": {"10": {"32768": 16}, "16": {"32768": 8}}}}
    assert forge_tuned.validate(t)["decode"]["launch"]["int8"] == [128, 8, 2]


def test_the_int8_launch_sits_beside_the_16bit_decisions():
    recs = int8_records({10: {(8, 64, 8, 2): 100.0, (8, 128, 4, 2): 70.0}})
    recs += [rec("decode.10.16bit", "vLLM unified 3D", "upstream", 500.0, launch=None),
             rec("decode.10.16bit", "S16", "ours", 150.0, launch=[16, 32, 4, 2])]
    t = sel.build_table(sel.select(recs), VALIDATORS, {"commit": "c"})
    assert t["decode"] == {"segments": {"4": {"10": {"32768": 16}}}, "segments_int8": {"4": {"10": {"32768": 8}}},
                           "launch": {"16bit": [32, 4, 2], "int8": [128, 4, 2]}}
    forge_tuned.validate(t)


@pytest.mark.parametrize("times,spread", [
    ({10: {(8, 64, 8, 2): 100.0, (8, 128, 8, 2): 99.5}}, 0.0),              # 0.5 %: under the 1 % floor
    ({10: {(8, 64, 8, 2): 100.0, (8, 128, 8, 2): 97.0}}, 0.08),             # 3 %, spreads of 8 %
    ({10: {(8, 64, 8, 2): 100.0, (16, 64, 8, 2): 60.0}}, 0.0),              # a segment count, not a launch
    # faster at batch 10 only: not measured at batch 16, so not a launch for every batch
    ({10: {(8, 64, 8, 2): 100.0, (8, 128, 8, 2): 50.0}, 16: {(8, 64, 8, 2): 100.0}}, 0.0),
    # faster at batch 10, slower over both batches
    ({10: {(8, 64, 8, 2): 100.0, (8, 128, 8, 2): 80.0}, 16: {(8, 64, 8, 2): 100.0, (8, 128, 8, 2): 130.0}}, 0.0),
])
def test_the_built_in_int8_launch_stays_within_the_noise_or_when_nothing_beats_it(times, spread):
    t = sel.build_table(sel.select(int8_records(times, spread)), VALIDATORS, {"commit": "c"})
    assert "launch" not in t["decode"]
    # the int8 cache's segment counts are those measured fastest at the launch it keeps, the built-in
    best = {str(b): {"32768": min((launch for launch in at if launch[1:] == (64, 8, 2)), key=at.get)[0]}
            for b, at in times.items()}
    assert t["decode"] == {"segments_int8": {"4": best}}
    forge_tuned.validate(t)


def test_without_a_table_launch_each_batch_counts_at_its_own_built_in_launch():
    # the kernel's built-in launch depends on the batch: each batch's int8 count is its fastest there
    recs = []
    for b, builtin_launch, times in ((10, (64, 8, 2), {(8, 64, 8, 2): 100.0, (16, 64, 8, 2): 90.0, (32, 32, 4, 2): 50.0}),
                                     (16, (32, 4, 2), {(4, 32, 4, 2): 100.0, (8, 32, 4, 2): 95.0, (16, 64, 8, 2): 40.0})):
        recs.append(rec(f"decode.{b}.int8", "vLLM unified 3D", "upstream", 500.0, launch=None))
        for launch, us in times.items():
            kind = "builtin" if launch[1:] == builtin_launch and launch[0] in (8, 4) else "ours"
            recs.append(rec(f"decode.{b}.int8", "segments {} TILE_N {} warps {} stages {}".format(*launch), kind, us,
                            launch=list(launch)))
    t = sel.build_table(sel.select(recs), VALIDATORS, {"commit": "c"})
    assert t["decode"] == {"segments_int8": {"4": {"10": {"32768": 16}, "16": {"32768": 8}}}}
    forge_tuned.validate(t)
