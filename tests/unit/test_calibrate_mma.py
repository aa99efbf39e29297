"""The GEMV calibration's skinny-GEMM candidate (launch "mma": kernels/forge_triton/skinny_gemm.py at its
built-in launch) on hand-made records, no GPU: the table names "mma" where that candidate is the fastest
correct one and beats upstream beyond the noise, [block, rows] where a GEMV launch wins, nothing where
upstream stays; the table the loader takes; the documents' reader takes "mma" as a GEMV launch only; and
`forge calibrate` makes the table and the report from a GEMV family document holding such records. At the
graphs' 24 and 32 tokens (decode batches of 17-32 padded to vLLM's captured sizes) the family measures the
platform GEMM and "mma" only: "mma" goes into the table where it won, and a GEMV launch there is refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "kernels"))
import forge_tuned as T  # noqa: E402
from calibrate import gemv as G  # noqa: E402

from forge.errors import ForgeError  # noqa: E402
from forge.run import calibration as sel  # noqa: E402
from forge.run import calibration_docs as cd  # noqa: E402

H200 = {"device_name": "NVIDIA H200", "arch": "sm_90", "compute_units": 132, "toolkit": "cuda 13.0",
        "torch": "2.11", "triton": "3.6", "driver": 13000}
DCU = {"device_name": "BW", "arch": "gfx936", "compute_units": 80, "toolkit": "hip 6.3", "torch": "2.10",
       "triton": "3.4", "driver": None}


def rec(dec, cand, kind, us, *, launch=None, ok=True):
    point = "M=" + dec.rsplit(".", 1)[1]
    return {"decision": dec, "candidate": cand, "kind": kind, "launch": launch, "selectable": True, "point": point,
            "weight": 64.0, "ok": ok, "err": 0.001 if ok else 0.5, "tol": 0.02, "error": None,
            "us": {"median": us, "p10": us * 0.995, "p90": us * 1.005, "n": 12} if ok else None}


def decision(dec, upstream, builtin, gemv, mma, *, fused=False):
    f = "fused " if fused else ""
    return [rec(dec, "F.linear" + (" + act" if fused else ""), "upstream", upstream),
            rec(dec, f"forge {f}built-in", "builtin", builtin, launch=[0, 0]),
            rec(dec, f"forge {f}b64 r1" if fused else "forge b128 r2", "ours", gemv, launch=[64, 1] if fused else [128, 2]),
            rec(dec, f"forge {f}mma", "ours", mma, launch=G.MMA)]


RECORDS = (decision("gemv.plain.5120x17408.8", 100.0, 180.0, 170.0, 80.0)             # mma wins
           + decision("gemv.plain.5120x17408.1", 100.0, 90.0, 70.0, 85.0)             # the GEMV at [128, 2] wins
           + decision("gemv.plain.14336x5120.12", 100.0, 300.0, 250.0, 99.5)          # mma within the noise: upstream
           + decision("gemv.fused.34816x5120.12", 200.0, 400.0, 380.0, 150.0, fused=True)  # fused mma wins
           + decision("gemv.fused.34816x5120.2", 200.0, 170.0, 160.0, 300.0, fused=True)   # fused GEMV wins
           + decision("gemv.plain.96x5120.16", 100.0, 90.0, 95.0, 60.0)[:3]           # mma ...
           + [rec("gemv.plain.96x5120.16", "forge mma", "ours", 40.0, launch=G.MMA, ok=False)])  # ... wrong: never


# 24 and 32 tokens: the platform GEMM (plus the activation when fused) and the skinny GEMM, nothing else
GRAPH = (decision("gemv.plain.5120x17408.24", 100.0, 0, 0, 70.0)[::3]                # mma wins
         + decision("gemv.plain.5120x17408.32", 100.0, 0, 0, 99.6)[::3]              # within the noise: upstream
         + decision("gemv.fused.34816x5120.32", 200.0, 0, 0, 150.0, fused=True)[::3]  # fused mma wins
         + decision("gemv.fused.34816x5120.24", 200.0, 0, 0, 230.0, fused=True)[::3]  # slower: upstream
         + decision("gemv.plain.96x5120.24", 100.0, 0, 0, 60.0)[:1]                  # mma ...
         + [rec("gemv.plain.96x5120.24", "forge mma", "ours", 40.0, launch=G.MMA, ok=False)])  # ... wrong: never


def table(ident, records=RECORDS):
    return sel.build_table(sel.select(records), {**{k: ident[k] for k in T.MATCH}, "tp": 1, "heads": [24, 4]},
                           {"commit": "0123456789ab"})


@pytest.mark.parametrize("ident", [H200, DCU], ids=["nvidia", "amd"])
def test_the_table_names_mma_where_it_won_a_launch_where_the_gemv_won_and_nothing_where_upstream_stays(ident):
    t = table(ident)
    assert t["gemv"] == {"plain": {"5120x17408": {"8": "mma", "1": [128, 2]}, "96x5120": {"16": [0, 0]}},
                         "fused": {"34816x5120": {"12": "mma", "2": [64, 1]}}}
    assert T.validate(t) is t                    # the loader takes it (fused mma at 12 tokens on AMD too)
    s = sel.select(RECORDS)
    assert s["gemv.plain.14336x5120.12"]["chosen"] == "F.linear"
    assert "forge mma" in s["gemv.plain.96x5120.16"]["failed"]
    assert s["gemv.plain.5120x17408.8"]["launch"] == "mma" and s["gemv.plain.5120x17408.8"]["speedup"] == 1.25


@pytest.mark.parametrize("ident", [H200, DCU], ids=["nvidia", "amd"])
def test_at_24_and_32_tokens_the_table_names_mma_only_where_it_won(ident):
    assert {r["candidate"] for r in GRAPH} == {"F.linear", "forge mma", "F.linear + act", "forge fused mma"}
    for i, r in enumerate(GRAPH):               # what the family writes there, as `forge calibrate` reads it
        cd.check_record(r, cd.Doc("gemv.json", "hint"), "gemv", f"records[{i}]")
    t = table(ident, RECORDS + GRAPH)
    assert t["gemv"] == {"plain": {"5120x17408": {"8": "mma", "1": [128, 2], "24": "mma"}, "96x5120": {"16": [0, 0]}},
                         "fused": {"34816x5120": {"12": "mma", "2": [64, 1], "32": "mma"}}}
    assert T.validate(t) is t
    s = sel.select(GRAPH)
    assert s["gemv.plain.5120x17408.32"]["chosen"] == "F.linear"
    assert s["gemv.fused.34816x5120.24"]["chosen"] == "F.linear + act"
    assert s["gemv.plain.96x5120.24"]["chosen"] == "F.linear" and "forge mma" in s["gemv.plain.96x5120.24"]["failed"]
    assert s["gemv.plain.5120x17408.24"]["speedup"] == pytest.approx(100 / 70) and s["gemv.plain.5120x17408.24"]["builtin"] is None


def test_the_documents_take_24_and_32_tokens_and_no_gemv_launch_there():
    d = cd.Doc("gemv.json", "hint")
    for i, r in enumerate(GRAPH):
        cd.check_record(r, d, "gemv", f"records[{i}]")
    for m in ("17", "31", "33", "64"):
        with pytest.raises(ForgeError, match=r"key 'records\[0\].decision'"):
            cd.check_record(dict(GRAPH[0], decision=f"gemv.plain.5120x17408.{m}", point=f"M={m}"), d, "gemv", "records[0]")
    for m in (24, 32):
        gemv = rec(f"gemv.plain.5120x17408.{m}", "forge b128 r2", "ours", 50.0, launch=[128, 2])
        with pytest.raises(ForgeError, match=rf"key 'records\[0\].launch' .*'mma' or null at {m} tokens"):
            cd.check_record(gemv, d, "gemv", "records[0]")
    cd.check_record(rec("gemv.plain.5120x17408.16", "forge b128 r2", "ours", 50.0, launch=[128, 2]), d, "gemv", "r")


def test_the_documents_take_mma_as_a_gemv_launch_only():
    d = cd.Doc("gemv.json", "hint")
    cd.check_record(RECORDS[3], d, "gemv", "records[3]")
    bad = dict(RECORDS[3], decision="prefill.16bit", point="P=0 C=4096")
    with pytest.raises(ForgeError, match=r"prefill.json: key 'records\[0\].launch'"):
        cd.check_record(bad, cd.Doc("prefill.json", "hint"), "prefill", "records[0]")
    for other in ("MMA", "mma2", ""):
        with pytest.raises(ForgeError, match=r"key 'records\[3\].launch' .*'mma'"):
            cd.check_record(dict(RECORDS[3], launch=other), d, "gemv", "records[3]")


def test_calibrate_writes_mma_into_the_table_and_the_report(tmp_path):
    out = tmp_path / "cal"
    out.mkdir()
    doc = {"family": "gemv", "device": H200, "records": RECORDS + GRAPH, "notes": [], "seconds": 1.0,
           "options": {"kernels": "checkout", "ops": "build", "quick": False, "smoke": False, "seed": 1234}}
    (out / "gemv.json").write_text(json.dumps(doc))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FORGE_CALIBRATE_FAULT")}
    r = subprocess.run([sys.executable, "-m", "forge", "calibrate", "--families", "gemv", "--kernels", "checkout",
                        "--ops", "build", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(env, PYTHONPATH=str(ROOT / "scripts")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gemv: kept from" in r.stderr
    t = json.loads((out / "table.json").read_text())
    assert t["gemv"]["plain"]["5120x17408"] == {"8": "mma", "1": [128, 2], "24": "mma"}
    assert t["gemv"]["fused"]["34816x5120"] == {"12": "mma", "2": [64, 1], "32": "mma"}
    cal = cd.check_report(json.loads((out / "calibration.json").read_text()), "calibration.json")
    assert cal["selection"]["gemv.fused.34816x5120.12"]["launch"] == "mma"
    md = (out / "calibration.md").read_text()
    assert "gemv plain 5120x17408: forge GEMV at M=1 block 128 rows 2; forge skinny GEMM (matrix units, " \
           "built-in launch) at M=8, M=24" in md
    assert "| gemv.fused.34816x5120.32 | forge fused mma |" in md and "| gemv.plain.5120x17408.32 | F.linear |" in md
    rows = [md.index(f"| gemv.plain.5120x17408.{m} |") for m in (1, 8, 24, 32)]
    assert rows == sorted(rows), "the report lists a shape's token counts in their order"
