"""`forge predict --calibration` on a hand-made calibration whose kernels follow simple laws, so every
factor and the e2e check can be computed by hand here."""

import json

import pytest

from forge.errors import ForgeError
from forge.run import calibration as sel
from forge.run import predict_calibration as pc

A_UP, A_OURS = 1e-3, 2.5e-4       # prefill: us per FLOP unit C * (P + (C + 1) / 2), no fixed cost
DEC_UP = {4096: 40.0, 32768: 320.0}
DEC_OURS = {4096: 20.0, 32768: 80.0}


def rec(dec, cand, kind, us, point, launch=None):
    return {"decision": dec, "candidate": cand, "kind": kind, "launch": launch, "selectable": True, "point": point,
            "weight": 1.0, "ok": True, "err": 0.0, "tol": 0.02, "error": None,
            "us": {"median": us, "p10": us, "p90": us, "n": 5}}


def calibration(tmp_path, arch="sm_90"):
    recs = []
    for p in (0, 4096, 8192):
        f = 4096 * (p + 4097 / 2)
        recs += [rec("prefill.16bit", "unified", "upstream", A_UP * f, f"P={p} C=4096"),
                 rec("prefill.16bit", "ours", "builtin", A_OURS * f, f"P={p} C=4096", [128, 64, 8, 2])]
    for ctx in DEC_UP:
        recs += [rec("decode.1.16bit", "unified 3D", "upstream", DEC_UP[ctx], f"ctx={ctx}"),
                 rec("decode.1.16bit", "S128", "ours", DEC_OURS[ctx], f"ctx={ctx}", [128, 32, 4, 2])]
    recs += [rec("gemv.plain.96x5120.1", "F.linear", "upstream", 100.0, "M=1"),
             rec("gemv.plain.96x5120.1", "forge", "builtin", 50.0, "M=1", [0, 0]),
             rec("gemv.plain.96x5120.2", "F.linear", "upstream", 999.0, "M=2"),        # two tokens: not decode
             rec("gemv.plain.96x5120.2", "forge", "builtin", 1.0, "M=2", [0, 0]),
             rec("gemv.plain.34816x5120.1", "F.linear", "upstream", 999.0, "M=1"),     # the MLP runs the fused op
             rec("gemv.plain.34816x5120.1", "forge", "builtin", 1.0, "M=1", [0, 0]),
             rec("gemv.fused.34816x5120.1", "F.linear + act", "upstream", 200.0, "M=1"),
             rec("gemv.fused.34816x5120.1", "forge fused", "builtin", 150.0, "M=1", [0, 0]),
             rec("gemm.96x5120", "default", "upstream", 100.0, "M=4096"),
             rec("gemm.96x5120", "tunableop", "ours", 90.0, "M=4096")]
    fams = {"prefill": [], "decode": [], "gemv": [], "gemm": []}
    for r in recs:
        fams[r["decision"].split(".")[0]].append(r)
    device = {"device_name": "Card", "arch": arch, "compute_units": 80, "toolkit": "hip 6.3", "torch": "2.10",
              "triton": "3.4", "driver": None}
    for fam, rs in fams.items():
        (tmp_path / f"{fam}.json").write_text(json.dumps({"family": fam, "device": device, "options": {},
                                                          "records": rs}))
    doc = {"selection": sel.select(recs), "device": device, "table": {},
           "families": {f: {} for f in fams}, "provenance": {"report": "x", "date": "d", "commit": "c"}}
    (tmp_path / "calibration.json").write_text(json.dumps(doc))
    return tmp_path


WORKLOAD = {"tiers": {"T": {"requests": [(8192, 100)]}}}


def test_the_factors_are_the_kernels_ratios_at_the_tiers_work(tmp_path):
    doc, recs = pc.load(calibration(tmp_path))
    f = pc.factors(doc, recs, WORKLOAD)["T"]
    assert f["prefill_attn"]["factor"] == pytest.approx(A_UP / A_OURS)               # 4x at any prompt
    # decode at the mean context 8192 + 100 / 2, interpolated between 4096 and 32768
    x = (8242 - 4096) / (32768 - 4096)
    assert f["decode_attn"]["factor"] == pytest.approx((40 + 280 * x) / (20 + 60 * x))
    assert f["gemv"]["factor"] == pytest.approx((100 + 200) / (50 + 150))          # one token; fused gate_up
    assert f["prefill_gemm"]["factor"] == 1.0 and "1.111x" in f["prefill_gemm"]["how"]
    assert f["prefill_attn"]["label"] == "measured on a stand-in (Card)"
    assert f["host"] == {"factor": 1.0, "label": "assumed", "how": "not calibrated: unchanged"}


def test_a_calibration_on_gfx936_is_labelled_measured_on_the_card(tmp_path):
    doc, recs = pc.load(calibration(tmp_path, arch="gfx936:sramecc+:xnack-"))
    assert pc.factors(doc, recs, WORKLOAD)["T"]["gemv"]["label"] == "measured on the card"


def test_the_e2e_check_subtracts_the_kernel_savings_from_the_reference_requests(tmp_path):
    (tmp_path / "cal").mkdir()
    cal = calibration(tmp_path / "cal")
    e2e = tmp_path / "e2e"
    for prof, tput in (("upstream", 3 / 2.04), ("contest", 2.0)):
        (e2e / "runs" / prof).mkdir(parents=True)
        (e2e / "runs" / prof / "T.json").write_text(json.dumps({
            "input_lens": [8192], "output_lens": [3], "ttfts": [1.0], "itls": [[0.02, 0.02]], "duration": 2.04,
            "output_throughput": tput, "completed": 1, "failed": 0, "errors": [""]}))
    doc, recs = pc.load(cal)
    got = pc.check_e2e(doc, recs, e2e, ["T"])["T"]
    flops = 4096 * (0 + 4097 / 2) + 4096 * (4096 + 4097 / 2)            # the prompt's two chunks
    ttft = 1.0 - 16 * A_UP * flops / 1e6 + 16 * A_OURS * flops / 1e6
    x = (8193.5 - 4096) / (32768 - 4096)                                   # mean context 8192 + 3 / 2
    save_ms = 16 * ((40 + 280 * x) - (20 + 60 * x)) / 1000 + (300 - 200) / 1000
    req = ttft + 2 * (0.02 - save_ms / 1000)
    assert got["client_gaps_s"] == pytest.approx(1.0)
    assert got["predicted_ratio"] == pytest.approx(2.04 / (1.0 + req))
    assert got["measured_ratio"] == pytest.approx(2.0 / (3 / 2.04))


def test_a_folder_that_is_not_a_calibration_is_named(tmp_path):
    with pytest.raises(ForgeError, match="no calibration.json"):
        pc.load(tmp_path)
    (tmp_path / "calibration.json").write_text("[1]")
    with pytest.raises(ForgeError, match="not a calibration report"):
        pc.load(tmp_path)
