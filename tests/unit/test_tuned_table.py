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


def table(ident, tp=1, heads=(24, 4), **extra):
    return {"schema": T.SCHEMA, "validators": {**{k: ident[k] for k in T.MATCH}, "tp": tp, "heads": list(heads)},
            "provenance": {"commit": "x"},
            "gemv": {"plain": {"96x5120": {"1": [640, 2], "4": [0, 0]}}}, "prefill": {"16bit": [64, 32, 4, 1]},
            "decode": {"segments": {str(heads[1]): {"1": {"32768": 32}}}, "launch": {"16bit": [16, 4, 1]}},
            **extra}


def write(folder: Path, name: str, data) -> Path:
    p = folder / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_the_matching_table_of_the_folder_is_taken(tmp_path):
    write(tmp_path, "a-dcu.json", table(DCU))
    write(tmp_path, "b-h200.json", table(H200))
    got, line, _ = T.choose(H200, None, folder=str(tmp_path))
    assert got["validators"]["device_name"] == "NVIDIA H200" and "b-h200.json" in line
    got, line, _ = T.choose(DCU, None, folder=str(tmp_path))
    assert got["validators"]["arch"] == "gfx936" and "a-dcu.json" in line


def test_a_stale_table_is_refused_with_the_keys_that_differ(tmp_path):
    newer = dict(H200, torch="2.12")
    write(tmp_path, "h200.json", table(H200))
    got, line, _ = T.choose(newer, None, folder=str(tmp_path))
    assert got is None
    assert "torch '2.11' != '2.12'" in line and "built-in defaults" in line and "h200.json" in line
    assert "\n" not in line


def test_the_driver_and_provenance_are_recorded_not_matched(tmp_path):
    write(tmp_path, "h200.json", table(H200, provenance={"commit": "other", "series": "other"}))
    got, _, _ = T.choose(dict(H200, driver=99999), None, folder=str(tmp_path))
    assert got is not None


def test_an_explicit_table_for_another_device_is_refused(tmp_path):
    p = write(tmp_path, "dcu.json", table(DCU))
    got, line, _ = T.choose(H200, str(p), folder=str(tmp_path / "none"))
    assert got is None and f"{T.ENV}={p} refused" in line and "device_name 'BW' != 'NVIDIA H200'" in line


@pytest.mark.parametrize("env", ["0", "off", "none"])
def test_off_means_the_built_in_defaults(tmp_path, env):
    write(tmp_path, "h200.json", table(H200))
    got, line, _ = T.choose(H200, env, folder=str(tmp_path))
    assert got is None and "built-in defaults" in line


def _with(**kw):
    return json.dumps(dict(table(H200), **kw))


DUPLICATE = json.dumps(table(H200))[:-1] + ', "prefill": {"16bit": [64, 32, 4, 1]}}'
MALFORMED = [
    ("{nope", "not valid JSON"),
    (json.dumps([1, 2]), "not a JSON object"),
    (_with(schema="other/9"), "key 'schema'"),
    (_with(validators={"arch": "sm_90"}), "key 'validators'"),
    (_with(validators=dict(table(H200)["validators"], compute_units="132")), "validators.compute_units"),
    (_with(validators=dict(table(H200)["validators"], compute_units=True)), "validators.compute_units"),
    (_with(gemv={"plain": {"96x5120": {"17": [0, 0]}}}), "token count must be 1-16"),
    (_with(gemv={"plain": {"96x5120": {"0": [0, 0]}}}), "token count must be 1-16"),
    (_with(gemv={"plain": {"96by5120": {"1": [0, 0]}}}), "expected 'NxK'"),
    (_with(gemv={"plain": {"0x0": {"1": [0, 0]}}}), "N, K > 0"),
    (_with(gemv={"plain": {"96x5120": {"1": [0]}}}), "list of 2"),
    # wrong types where an object is expected: each raised AttributeError in the loader and stopped the server
    (_with(prefill="x"), "key 'prefill': expected an object"),
    (_with(gemv=[1]), "key 'gemv': expected an object"),
    (_with(gemv={"plain": [1]}), "key 'gemv.plain': expected an object"),
    (_with(gemv={"plain": {"96x5120": [1]}}), "key 'gemv.plain.96x5120': expected an object"),
    (_with(decode="x"), "key 'decode': expected an object"),
    (_with(decode={"segments": [1]}), "key 'decode.segments': expected an object"),
    (_with(decode={"launch": "x"}), "key 'decode.launch': expected an object"),
    (_with(provenance="x"), "key 'provenance': expected an object"),
    (_with(gemv=None), "key 'gemv': expected an object"),
    # values outside what the kernels launch
    (_with(prefill={"16bit": [64, 32, 4]}), "key 'prefill.16bit'"),
    (_with(prefill={"16bit": [0, 0, 0, 0]}), "BLOCK_M 0 is not one the kernel launches"),
    (_with(prefill={"16bit": [True, 32, 4, 1]}), "must be a list of 4 integers"),
    (_with(prefill={"16bit": [64, 32, 3, 1]}), "num_warps 3"),
    (_with(decode={"launch": {"16bit": [0, 0, 0]}}), "TILE_N 0"),
    (_with(decode={"launch": {"16bit": [16, 4, False]}}), "must be a list of 3 integers"),
    (_with(decode={"segments": {"4": {"1": {"32768": 0}}}}), "whole number from 1 to 256"),
    (_with(decode={"segments": {"4": {"1": {"32768": 2 ** 40}}}}), "whole number from 1 to 256"),
    (_with(decode={"segments": {"4": {"1": {"32768": True}}}}), "whole number"),
    (_with(decode={"segments": {"4": {"1": {"32768": 24.0}}}}), "whole number"),
    (_with(decode={"segments": {"4": {"0": {"32768": 32}}}}), "batch size"),
    (_with(decode={"segmnets": {"1": 32}}), "unknown key"),
    (_with(gemv={"plain": {"96x5120": {"1": [True, False]}}}), "must be integers"),
    (_with(gemv={"plain": {"96x5120": {"1": [100, 2]}}}), "launch menu"),
    (_with(gemv={"fused": {"34816x5120": {"1": [640, 8]}}}), "launch menu"),
    (_with(gemv={"fused": {"101x5120": {"1": [0, 0]}}}), "N must be even"),
    # a number key written otherwise than it reads back: "01" beside "1" would be one batch, the last replacing
    # the other without a word
    (_with(decode={"segments": {"4": {"01": {"32768": 32}}}}), "batch size 1-1024 (without leading zeros)"),
    (_with(decode={"segments": {"04": {"1": {"32768": 32}}}}), "KV heads of one rank, a count >= 1 (without leading"),
    (_with(decode={"segments": {"4": {"1": {"032768": 32}}}}), "context length in tokens 1-16777216 (without leading"),
    (_with(gemv={"plain": {"96X5120": {"1": [0, 0]}}}), "a lower-case x between"),
    (_with(gemv={"plain": {"096x5120": {"1": [0, 0]}}}), "each a number without leading zeros"),
    # thousands of digits: int() itself raises ValueError there, which the loader's callers do not catch
    (_with(decode={"segments": {"4": {"1" * 5000: {"32768": 32}}}}), "batch size 1-1024"),
    (_with(gemv={"plain": {"9" * 5000 + "x5120": {"1": [0, 0]}}}), "each a number without leading zeros"),
    (_with(extra={}), "unknown key(s) 'extra'"),
    (DUPLICATE, "appears twice"),
]


@pytest.mark.parametrize("bad, why", MALFORMED, ids=[w for _, w in MALFORMED])
def test_a_malformed_table_is_refused_naming_the_key(tmp_path, bad, why):
    p = write(tmp_path, "t.json", bad)
    got, line, refused = T.choose(H200, str(p), folder=str(tmp_path / "none"))
    assert got is None and why in line and "refused" in line and "\n" not in line
    assert refused and why in refused[0]
    got, line, refused = T.choose(H200, None, folder=str(tmp_path))   # in the folder: skipped with its reason
    assert got is None and "t.json" in line and why in line and why in refused[0]


@pytest.mark.parametrize("bad, why", MALFORMED[2:], ids=[w for _, w in MALFORMED[2:]])
def test_a_malformed_table_for_another_device_does_not_affect_selection(tmp_path, bad, why):
    write(tmp_path, "a-broken.json", bad.replace('"NVIDIA H200"', '"another card"'))
    write(tmp_path, "b-h200.json", table(H200))
    got, line, refused = T.choose(H200, None, folder=str(tmp_path))
    assert got is not None and "b-h200.json" in line
    assert len(refused) == 1 and "a-broken.json" in refused[0]


def test_an_amd_table_names_only_launches_built_for_amd():
    ok = table(DCU, gemv={"plain": {"14336x5120": {"1": [640, 8], "4": [640, 4]}}})
    T.validate(ok)                          # 8 and 16 partial sums per thread
    with pytest.raises(T.TableError, match="not built for AMD"):
        T.validate(table(DCU, gemv={"plain": {"14336x5120": {"4": [640, 8]}}}))
    with pytest.raises(T.TableError, match="not built for AMD"):
        T.validate(table(DCU, gemv={"fused": {"34816x5120": {"3": [640, 4]}}}))
    T.validate(table(H200, gemv={"plain": {"14336x5120": {"4": [256, 8]}}}))   # built on NVIDIA below 640


def test_skinny_token_counts_name_only_launches_built_there():
    """5-16 tokens (MT 8 and 16): at most 16 partial sums per thread, 32 on NVIDIA in blocks <= 256; the
    fused kernel stops at 8 tokens on AMD, its built-in launch included. Fails on the 1-4-token validator
    (every 5-16 key refused) and on one that checks the partial sums at MT 4 (would pass 8 rows x 16)."""
    T.validate(table(H200, gemv={"plain": {"16384x5120": {"5": [128, 4], "16": [256, 2], "9": [0, 0]},
                                           "5120x8704": {"12": [640, 1]}},
                                 "fused": {"17408x5120": {"16": [64, 1], "8": [128, 2]}}}))
    T.validate(table(DCU, gemv={"plain": {"16384x5120": {"8": [640, 2], "16": [640, 1]}},
                                "fused": {"17408x5120": {"8": [640, 1], "6": [0, 0]}}}))
    for tab, why in (
            (table(H200, gemv={"plain": {"16384x5120": {"16": [64, 4]}}}), "not built for NVIDIA"),
            (table(H200, gemv={"plain": {"16384x5120": {"8": [512, 4]}}}), "not built for NVIDIA"),
            (table(H200, gemv={"fused": {"17408x5120": {"16": [64, 2]}}}), "not built for NVIDIA"),
            (table(DCU, gemv={"plain": {"16384x5120": {"16": [640, 2]}}}), "not built for AMD"),
            (table(DCU, gemv={"fused": {"17408x5120": {"9": [640, 1]}}}), "not built for AMD"),
            (table(DCU, gemv={"fused": {"17408x5120": {"12": [0, 0]}}}), "stops at 8")):
        with pytest.raises(T.TableError, match=why):
            T.validate(tab)


def test_the_server_keeps_its_defaults_whatever_the_loader_meets(monkeypatch, tmp_path, caplog):
    write(tmp_path, "t.json", '{"schema": "forge-tuned/1", "gemv": [1]}')
    monkeypatch.setattr(T, "HERE", str(tmp_path))
    monkeypatch.setattr(T, "device_identity", lambda device_index=0: dict(H200))
    monkeypatch.delenv(T.ENV, raising=False)
    monkeypatch.setattr(T.choose, "__defaults__", (str(tmp_path), None))
    T.active.cache_clear()
    caplog.set_level("INFO", logger=T.logger.name)
    try:
        assert T.active() is None
        assert any("refused" in r.getMessage() and "t.json" in r.getMessage() for r in caplog.records)
        T.active.cache_clear()

        def broken(*a, **k):
            raise KeyError("a bug")
        monkeypatch.setattr(T, "choose", broken)
        assert T.active() is None
        assert any("could not choose a table" in r.getMessage() for r in caplog.records)
    finally:
        T.active.cache_clear()


def test_a_shipped_table_names_no_machine_path_and_a_clean_or_hashed_commit():
    good = table(H200, provenance={"commit": "0123456789ab", "command": "forge calibrate --install",
                                  "report": "reports/calibration/x"})
    assert T.shipping_problems(good) == []
    dirty = dict(good, provenance=dict(good["provenance"], commit="0123456789ab (dirty)"))
    assert "diff_sha256" in T.shipping_problems(dirty)[0]
    dirty["provenance"]["diff_sha256"] = "a" * 64
    assert T.shipping_problems(dirty) == []
    tmp = dict(good, provenance=dict(good["provenance"], report="/tmp/pipe/cal",
                                     command="forge calibrate --out /tmp/pipe/cal"))
    assert [p.split()[0] for p in T.shipping_problems(tmp)] == ["provenance.command", "provenance.report"]


def test_an_unreadable_table_is_refused(tmp_path):
    got, line, _ = T.choose(H200, str(tmp_path / "missing.json"), folder=str(tmp_path))
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
        assert T.shipping_problems(t) == [], p
        assert t["provenance"].get("report"), f"{p.name}: provenance names the calibration report"
        lines = T.describe(t)
        # one line per GEMV shape, prefill cache kind, (KV heads, batch) of the decode segments (and of the
        # int8 cache's own), decode launch, and the int8 cache's Q.K path where the table chose it
        segs = T.decode_segment_table(t)
        segs8 = T.decode_segment_table(t, kv_int8=True, alone=True) if t.get("decode", {}).get("segments_int8") else {}
        assert len(lines) == sum(len(s) for s in t.get("gemv", {}).values()) + len(t.get("prefill", {})) + \
            sum(len(b) for b in segs.values()) + sum(len(b) for b in segs8.values()) + \
            len(t.get("decode", {}).get("launch", {})) + ("qk_int8" in t.get("decode", {})), p.name


def test_the_submission_preflight_reads_its_tables_with_the_loader_it_ships(tmp_path):
    from forge.ship import submission
    folder = tmp_path / "vllm" / "forge_tuned"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text((ROOT / "kernels" / "forge_tuned" / "__init__.py").read_text())
    ok = submission._tuned_tables_check(tmp_path)
    assert ok["ok"] and "no per-device table" in ok["detail"]
    good = table(DCU, provenance={"commit": "0123456789ab", "command": "forge calibrate --install",
                                  "report": "reports/calibration/x"})
    write(folder, "bw-gfx936-80cu.json", good)
    assert submission._tuned_tables_check(tmp_path)["ok"]
    write(folder, "other.json", dict(good, gemv=[1]))
    got = submission._tuned_tables_check(tmp_path)
    assert not got["ok"] and "vllm/forge_tuned/other.json: key 'gemv'" in got["detail"]


# --- tensor-parallel degree and per-rank geometry ----------------------------------------------------

def test_a_table_is_taken_only_at_its_own_tensor_parallel_degree(tmp_path):
    write(tmp_path, "h200-tp1.json", table(H200))
    got, line, _ = T.choose(H200, None, folder=str(tmp_path), tp=2)
    assert got is None and "h200-tp1.json" in line and "degree 1 (24 q / 4 KV heads per rank)" in line
    assert "runs 2" in line and "built-in defaults" in line
    assert T.choose(H200, None, folder=str(tmp_path), tp=1)[0] is not None
    # the reverse: a TP2 table (12 / 2 heads per rank) is refused at TP1, taken at TP2
    p = write(tmp_path / "..", "h200-tp2.json", table(H200, tp=2, heads=(12, 2)))
    got, line, _ = T.choose(H200, str(p), folder=str(tmp_path), tp=1)
    assert got is None and "degree 2 (12 q / 2 KV heads per rank)" in line and "runs 1" in line
    got, _, _ = T.choose(H200, str(p), folder=str(tmp_path), tp=2)
    assert got["validators"]["tp"] == 2
    # one folder holding both: each degree takes its own
    write(tmp_path, "h200-tp2.json", table(H200, tp=2, heads=(12, 2)))
    assert T.choose(H200, None, folder=str(tmp_path), tp=2)[0]["validators"]["tp"] == 2
    assert T.choose(H200, None, folder=str(tmp_path), tp=1)[0]["validators"]["tp"] == 1


@pytest.mark.parametrize("table_tp,heads,running", [(1, (24, 4), 2), (2, (12, 2), 1)])
def test_the_server_refuses_another_degree_in_its_log_and_runs_defaults(monkeypatch, tmp_path, caplog,
                                                                      table_tp, heads, running):
    write(tmp_path, "h200.json", table(H200, tp=table_tp, heads=heads))
    monkeypatch.setattr(T, "device_identity", lambda device_index=0: dict(H200))
    monkeypatch.setattr(T, "running_tp", lambda: running)
    monkeypatch.delenv(T.ENV, raising=False)
    monkeypatch.setattr(T.choose, "__defaults__", (str(tmp_path), None))
    T.active.cache_clear()
    caplog.set_level("INFO", logger=T.logger.name)
    try:
        assert T.active() is None
        assert T.decode_segments(1, heads[1], 32768) is None and T.gemv_route() is None   # the defaults run
        msg = " ".join(r.getMessage() for r in caplog.records)
        assert f"measured at tensor-parallel degree {table_tp}" in msg and f"runs {running}" in msg
        assert f"tensor-parallel degree {running}" in msg and "built-in defaults" in msg
        # at its own degree the same table is taken
        monkeypatch.setattr(T, "running_tp", lambda: table_tp)
        assert T.active()["validators"]["tp"] == table_tp
        assert T.decode_segments(1, heads[1], 32768) == 32
    finally:
        T.active.cache_clear()


def test_outside_vllm_the_degree_is_not_known_and_counts_as_one():
    assert T.running_tp() is None      # no vLLM parallel state in the tool's process


def test_an_old_table_is_read_as_tp1_at_24_4_heads(tmp_path):
    old = table(H200)
    old["schema"] = T.OLD_SCHEMA
    del old["validators"]["tp"], old["validators"]["heads"]
    old["decode"]["segments"] = {"1": 64, "8": 16}
    T.validate(old)
    assert T.geometry(old) == {"tp": 1, "heads": [24, 4]}
    assert T.decode_segment_table(old) == {4: {1: {32768: 64}, 8: {32768: 16}}}
    p = write(tmp_path, "old.json", old)
    assert T.choose(H200, str(p), tp=1)[0] is not None
    got, line, _ = T.choose(H200, str(p), tp=2)
    assert got is None and "degree 1" in line
    # the new schema must say its geometry
    new = table(H200)
    del new["validators"]["tp"]
    with pytest.raises(T.TableError, match="validators.*tp, heads"):
        T.validate(new)


def test_decode_segments_keyed_by_kv_heads_batch_and_context(monkeypatch):
    t = table(H200, tp=2, heads=(12, 2))
    # 24: a count between two powers of two (whole waves of programs), taken as measured
    t["decode"]["segments"] = {"2": {"1": {"8192": 32, "32768": 64}, "10": {"32768": 24}}}
    T.validate(t)
    monkeypatch.setattr(T, "active", lambda: t)
    assert T.decode_segments(1, 2, 32768) == 64 and T.decode_segments(1, 2, 6000) == 32
    assert T.decode_segments(1, 2, 65536) == 64          # beyond the measured: the longest measured
    assert T.decode_segments(1) == 64 and T.decode_segments(10, 2, 32768) == 24
    assert T.decode_segments(4, 2, 32768) is None        # not measured: the built-in heuristic
    assert T.decode_segments(1, 4, 32768) is None        # another rank geometry
    assert any("2 KV head(s), batch 10: 24 up to 32768 tokens" in x for x in T.describe(t))


def test_an_int8_cache_takes_its_own_segments_where_measured_else_the_16_bit_ones(monkeypatch):
    t = table(H200)
    t["decode"]["segments"] = {"4": {"1": {"32768": 128}, "4": {"32768": 64}, "7": {"32768": 32}}}
    t["decode"]["segments_int8"] = {"4": {"1": {"32768": 64}, "7": {"32768": 8}}}
    T.validate(t)
    monkeypatch.setattr(T, "active", lambda: t)
    assert [T.decode_segments(b, 4, 32768) for b in (1, 4, 7)] == [128, 64, 32]
    assert [T.decode_segments(b, 4, 32768, kv_int8=True) for b in (1, 4, 7)] == [64, 64, 8]   # 4: not measured in int8
    assert T.decode_segments(5, 4, 32768, kv_int8=True) is None and T.decode_segments(7, 2, 32768, kv_int8=True) is None
    lines = T.describe(t)
    assert "decode int8 4 KV head(s), batch 7: 8 up to 32768 tokens segments" in lines
    assert "decode 4 KV head(s), batch 7: 32 up to 32768 tokens segments" in lines
    assert len([x for x in lines if "KV head(s), batch" in x]) == 5
    old = {**t, "schema": T.OLD_SCHEMA, "decode": {"segments": {"1": 64}, "segments_int8": {"1": 32}}}
    with pytest.raises(T.TableError, match="unknown key.*'segments_int8'"):
        T.validate(old)                                  # forge-tuned/1 has no int8 counts


@pytest.mark.parametrize("bad,match", [
    ({"validators.tp": 0}, "validators.tp"),
    ({"validators.tp": True}, "validators.tp"),
    ({"validators.heads": [12, 5]}, "validators.heads"),
    ({"validators.heads": [12]}, "validators.heads"),
    ({"decode.segments": {"4": {"1": {"32768": 32}}}}, "measured at 4 KV heads"),
    ({"decode.segments": {"2": {"0": {"32768": 32}}}}, "batch size"),
    ({"decode.segments": {"2": {"1": {"x": 32}}}}, "context length"),
    ({"decode.segments": {"2": {"1": {"32768": 257}}}}, "whole number from 1 to 256"),
    ({"decode.segments": {"2": {"1": 32}}}, "expected an object"),
    ({"decode.segments_int8": {"4": {"1": {"32768": 32}}}}, "decode.segments_int8.4': measured at 4 KV heads"),
    ({"decode.segments_int8": {"2": {"1": {"32768": -24}}}}, "whole number"),
    ({"decode.segments_16bit": {}}, "unknown key"),
    ({"decode.qk_int8": "false"}, "decode.qk_int8': true .* or false"),
    ({"decode.qk_int8": 0}, "decode.qk_int8"),
])
def test_the_geometry_and_decode_keys_are_validated(bad, match):
    t = table(H200, tp=2, heads=(12, 2))
    (key, value), = bad.items()
    top, sub = key.split(".")
    t[top][sub] = value
    with pytest.raises(T.TableError, match=match):
        T.validate(t)


@pytest.mark.parametrize("qk, expect, shown", [
    (False, False, "decode int8 Q.K: K tiles converted to the query dtype (the int8 dot measured slower)"),
    (True, None, "decode int8 Q.K: the int8 dot (built-in)"),
    (None, None, None),
])
def test_the_int8_qk_path_is_read_as_the_converted_path_or_the_built_in(monkeypatch, qk, expect, shown):
    """The table's decode.qk_int8: false runs converted K tiles; true and no key are the kernel's built-in
    (None: the int8 dot with its build-failure fallback, never the int8 dot asked for by name)."""
    t = table(H200)
    if qk is not None:
        t["decode"]["qk_int8"] = qk
    T.validate(t)
    monkeypatch.setattr(T, "active", lambda: t)
    assert T.decode_qk_int8() is expect
    qk_lines = [x for x in T.describe(t) if "Q.K" in x]
    assert qk_lines == ([shown] if shown else [])
    old = {**t, "schema": T.OLD_SCHEMA, "decode": {"segments": {"1": 64}, "qk_int8": False}}
    with pytest.raises(T.TableError, match="unknown key.*'qk_int8'"):
        T.validate(old)                                  # forge-tuned/1 has no Q.K choice
    monkeypatch.setattr(T, "active", lambda: None)
    assert T.decode_qk_int8() is None                    # no table: the built-in
