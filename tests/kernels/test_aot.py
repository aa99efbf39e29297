"""AOT compile for AMD targets without a GPU: LDS / register / spill report (slow-ish, < 2 min)."""
import pytest


def _aot():
    import aot  # kernels/aot.py (kernels/ is on pytest's pythonpath)
    return aot


@pytest.mark.slow
def test_aot_hip_targets(tmp_path):
    aot = _aot()
    recs = aot.aot_compile_all(["hip:gfx90a", "hip:gfx942"])
    assert {r["target"] for r in recs} == {"hip:gfx90a", "hip:gfx942"}
    names = {r["kernel"] for r in recs}
    assert any("int8" in n and "1552" in n for n in names) and any("bf16,bs=784" in n for n in names)
    assert any(n.startswith("int8_kv_write") for n in names)
    skinny = [r for r in recs if r["kernel"].startswith("skinny_gemm")]
    assert len(skinny) == 12 and all(r["matrix_ops"] > 0 for r in skinny), skinny  # MFMA, not vector FMAs
    assert sum(r["kernel"].endswith(",M=32]") for r in skinny) == 4, skinny          # the 32-row tile too
    for r in recs:
        assert r["ok"], r
        assert 0 < r["shared_bytes"] <= 65536
        assert r["registers"] and r["spills"] == 0 and "vgpr_spill_count" in r
    # CLI writes the JSON and returns 0
    out = tmp_path / "aot.json"
    assert aot.main(["--target", "hip:gfx90a", "--json", str(out)]) == 0
    assert out.exists()


@pytest.mark.slow
def test_aot_detects_lds_overflow(monkeypatch):
    aot = _aot()
    monkeypatch.setenv("FORGE_AOT_LDS_LIMIT", "1024")
    recs = aot.aot_compile_all(["hip:gfx90a"])
    bad = [r for r in recs if not r["ok"]]
    assert bad and all("shared memory" in p for r in bad for p in r["problems"])
    assert aot.main(["--target", "hip:gfx90a"]) == 1


def test_amd_spill_parser():
    aot = _aot()
    st = aot._amd_stats("  .vgpr_count: 120\n  .vgpr_spill_count: 3\n  .sgpr_spill_count: 0\n")
    assert st["registers"] == 120 and st["spills"] == 3
