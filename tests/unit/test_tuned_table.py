"""The per-device table's loader (kernels/forge_tuned, placed in vLLM as vllm/forge_tuned): which table a
device takes, why a table is refused, and the committed tables' shape. Pure: the device identity is given."""

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


def table(ident, **extra):
    return {"schema": T.SCHEMA, "validators": {k: ident[k] for k in T.MATCH}, "provenance": {"commit": "x"},
            "gemv": {"plain": {"96x5120": {"1": [640, 2], "4": [0, 0]}}}, "prefill": {"16bit": [64, 32, 4, 1]},
            "decode": {"segments": {"1": 32}, "launch": {"16bit": [16, 4, 1]}}, **extra}


def write(folder: Path, name: str, data) -> Path:
    p = folder / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_the_matching_table_of_the_folder_is_taken(tmp_path):
    write(tmp_path, "a-dcu.json", table(DCU))
    write(tmp_path, "b-h200.json", table(H200))
    got, line = T.choose(H200, None, folder=str(tmp_path))
    assert got["validators"]["device_name"] == "NVIDIA H200" and "b-h200.json" in line
    got, line = T.choose(DCU, None, folder=str(tmp_path))
    assert got["validators"]["arch"] == "gfx936" and "a-dcu.json" in line


def test_a_stale_table_is_refused_with_the_keys_that_differ(tmp_path):
    newer = dict(H200, torch="2.12")
    write(tmp_path, "h200.json", table(H200))
    got, line = T.choose(newer, None, folder=str(tmp_path))
    assert got is None
    assert "torch '2.11' != '2.12'" in line and "built-in defaults" in line and "h200.json" in line
    assert "\n" not in line


def test_the_driver_and_provenance_are_recorded_not_matched(tmp_path):
    write(tmp_path, "h200.json", table(H200, provenance={"commit": "other", "series": "other"}))
    got, _ = T.choose(dict(H200, driver=99999), None, folder=str(tmp_path))
    assert got is not None


def test_an_explicit_table_for_another_device_is_refused(tmp_path):
    p = write(tmp_path, "dcu.json", table(DCU))
    got, line = T.choose(H200, str(p), folder=str(tmp_path / "none"))
    assert got is None and f"{T.ENV}={p} refused" in line and "device_name 'BW' != 'NVIDIA H200'" in line


@pytest.mark.parametrize("env", ["0", "off", "none"])
def test_off_means_the_built_in_defaults(tmp_path, env):
    write(tmp_path, "h200.json", table(H200))
    got, line = T.choose(H200, env, folder=str(tmp_path))
    assert got is None and "built-in defaults" in line


@pytest.mark.parametrize("bad, why", [
    ("{nope", "not valid JSON"),
    (json.dumps([1, 2]), "not a JSON object"),
    (json.dumps(dict(table(H200), schema="other/9")), "key 'schema'"),
    (json.dumps(dict(table(H200), validators={"arch": "sm_90"})), "key 'validators'"),
    (json.dumps(dict(table(H200), gemv={"plain": {"96x5120": {"5": [0, 0]}}})), "token count must be 1-4"),
    (json.dumps(dict(table(H200), gemv={"plain": {"96by5120": {"1": [0, 0]}}})), "expected 'NxK'"),
    (json.dumps(dict(table(H200), gemv={"plain": {"96x5120": {"1": [0]}}})), "list of 2"),
    (json.dumps(dict(table(H200), prefill={"16bit": [64, 32, 4]})), "key 'prefill.16bit'"),
    (json.dumps(dict(table(H200), decode={"segments": {"1": 24}})), "power of two"),
])
def test_a_malformed_table_is_refused_naming_the_key(tmp_path, bad, why):
    p = write(tmp_path, "t.json", bad)
    got, line = T.choose(H200, str(p), folder=str(tmp_path / "none"))
    assert got is None and why in line and "refused" in line
    got, line = T.choose(H200, None, folder=str(tmp_path))   # in the folder: skipped with its reason
    assert got is None and "t.json" in line and why in line


def test_an_unreadable_table_is_refused(tmp_path):
    got, line = T.choose(H200, str(tmp_path / "missing.json"), folder=str(tmp_path))
    assert got is None and "cannot read it" in line


def test_the_getters_read_the_active_table(monkeypatch):
    monkeypatch.setattr(T, "active", lambda: table(H200, gemv={"plain": {"96x5120": {"1": [640, 2]}},
                                                              "fused": {"34816x5120": {"2": [64, 1]}}}))
    assert T.gemv_route() == {(96, 5120): {1: (640, 2)}}
    assert T.gemv_route(fused=True) == {(34816, 5120): {2: (64, 1)}}
    assert T.prefill_launch(False) == (64, 32, 4, 1) and T.prefill_launch(True) is None
    assert T.decode_segments(1) == 32 and T.decode_segments(2) is None
    assert T.decode_launch(False) == (16, 4, 1)
    monkeypatch.setattr(T, "active", lambda: None)
    assert T.gemv_route() is None and T.prefill_launch(False) is None and T.decode_segments(1) is None


def test_every_committed_table_is_valid_and_describes_its_routes():
    tables = sorted((ROOT / "configs" / "kernels" / "tuned").glob("*.json"))
    assert tables, "configs/kernels/tuned/ holds at least the GPU machine's table"
    for p in tables:
        t = T.read(str(p))
        assert all(t["validators"].get(k) is not None for k in T.MATCH), p
        assert t["provenance"].get("report"), f"{p.name}: provenance names the calibration report"
        lines = T.describe(t)
        assert len(lines) == sum(len(s) for s in t.get("gemv", {}).values()) + len(t.get("prefill", {})) + \
            len(t.get("decode", {}).get("segments", {})) + len(t.get("decode", {}).get("launch", {}))
