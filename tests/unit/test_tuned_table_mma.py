"""The per-device table's "mma" entries (kernels/forge_tuned): `gemv.plain|fused.NxK.M` = "mma" routes that
pair to the Triton skinny GEMM on the matrix units at its built-in launch, at 1-32 tokens (the GEMV's own
[block, rows] launches stop at 16), plain and fused, on every platform (fused at 9-16 tokens on AMD too, where the CUDA-core GEMV stops at 8). Any other string, or
"mma" at a token count the kernel does not take, is refused naming the key and what is legal."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
import forge_tuned as T  # noqa: E402

H200 = {"device_name": "NVIDIA H200", "arch": "sm_90", "compute_units": 132, "toolkit": "cuda 13.0",
        "torch": "2.11", "triton": "3.6", "driver": 13000}
DCU = {"device_name": "BW", "arch": "gfx936", "compute_units": 80, "toolkit": "hip 6.3", "torch": "2.10",
       "triton": "3.4", "driver": None}


def table(ident, gemv):
    return {"schema": T.SCHEMA, "validators": {**{k: ident[k] for k in T.MATCH}, "tp": 1, "heads": [24, 4]},
            "provenance": {"commit": "x"}, "gemv": gemv}


@pytest.mark.parametrize("ident", [H200, DCU], ids=["nvidia", "amd"])
def test_mma_is_legal_at_every_token_count_plain_and_fused(ident):
    every = {str(m): "mma" for m in range(1, 33)}
    t = table(ident, {"plain": {"14336x5120": dict(every)}, "fused": {"34816x5120": dict(every)}})
    assert T.validate(t) is t
    # beside [block, rows] entries of the GEMV in the same shape, and through the JSON reader
    mixed = table(ident, {"plain": {"5120x17408": {"1": [0, 0], "2": [640, 2], "5": "mma", "16": "mma",
                                                   "24": "mma", "32": "mma"}}})
    assert T.parse(json.dumps(mixed))["gemv"]["plain"]["5120x17408"]["24"] == "mma"
    # above 16 tokens only the skinny GEMM: the GEMV's launches stop at 16
    with pytest.raises(T.TableError, match="token count must be 1-16"):
        T.validate(table(ident, {"plain": {"5120x17408": {"24": [0, 0]}}}))


def test_mma_runs_the_fused_kernel_on_amd_where_the_gemv_stops_at_8_tokens():
    assert T.validate(table(DCU, {"fused": {"34816x5120": {"12": "mma", "9": "mma", "16": "mma"}}}))
    with pytest.raises(T.TableError, match="stops at 8"):         # the GEMV's built-in launch is still refused
        T.validate(table(DCU, {"fused": {"34816x5120": {"12": [0, 0]}}}))


@pytest.mark.parametrize("ident", [H200, DCU], ids=["nvidia", "amd"])
@pytest.mark.parametrize("kind,shape", [("plain", "14336x5120"), ("fused", "34816x5120")])
@pytest.mark.parametrize("m,value", [("3", "MMA"), ("3", "mma2"), ("3", ""), ("12", " mma"), ("33", "mma"),
                                     ("0", "mma")])
def test_any_other_string_or_token_count_is_refused_naming_the_key_and_what_is_legal(tmp_path, ident, kind, shape, m,
                                                                                     value):
    with pytest.raises(T.TableError) as e:
        T.validate(table(ident, {kind: {shape: {m: value}}}))
    msg = str(e.value)
    assert f"key 'gemv.{kind}.{shape}.{m}'" in msg and "'mma'" in msg and "[block, rows]" in msg, msg
    assert "\n" not in msg
    # the loader refuses the file whole, with the same reason, and the server keeps its defaults
    (tmp_path / "t.json").write_text(json.dumps(table(ident, {kind: {shape: {m: value}}})))
    got, _, bad = T.choose(ident, None, folder=str(tmp_path))
    assert got is None and f"gemv.{kind}.{shape}.{m}" in bad[0]


def test_the_route_gives_mma_beside_the_gemv_launches(monkeypatch):
    monkeypatch.setattr(T, "active", lambda: table(H200, {
        "plain": {"14336x5120": {"1": [640, 2], "2": [0, 0], "5": "mma", "16": "mma"}, "96x5120": {"9": "mma"}},
        "fused": {"34816x5120": {"1": [64, 1], "8": "mma"}}}))
    assert T.gemv_route() == {(14336, 5120): {1: (640, 2), 2: (0, 0), 5: "mma", 16: "mma"}, (96, 5120): {9: "mma"}}
    assert T.gemv_route(fused=True) == {(34816, 5120): {1: (64, 1), 8: "mma"}}
    assert T.gemv_route()[(96, 5120)][9] == T.GEMV_MMA


def test_the_server_log_names_the_skinny_gemm_at_its_token_counts():
    lines = T.describe(table(H200, {"plain": {"14336x5120": {"1": [640, 2], "10": "mma", "5": "mma", "2": [0, 0]}},
                                    "fused": {"34816x5120": {"12": "mma"}}}))
    assert lines == [
        "gemv fused 34816x5120: forge skinny GEMM (matrix units, built-in launch) at M=12; other token counts: "
        "platform GEMM",
        "gemv plain 14336x5120: forge GEMV at M=1 block 640 rows 2, M=2 built-in; forge skinny GEMM (matrix "
        "units, built-in launch) at M=5, M=10; other token counts: platform GEMM"]


def test_the_mirrored_token_range_is_the_kernels():
    src = (ROOT / "kernels" / "forge_triton" / "skinny_gemm.py").read_text()
    assert f"\nMAX_M = {T.MMA_MAX_TOKENS}\n" in src
