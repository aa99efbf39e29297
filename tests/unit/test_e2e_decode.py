"""forge e2e-decode: measured TPOT savings beside the kernel benchmark's prediction, checked against
an independent float64 interpolation on random benchmark points and random run figures."""

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import ROOT, forge, h200_e2e  # noqa: E402

from forge.errors import ForgeError  # noqa: E402
from forge.lab import e2e_decode  # noqa: E402

CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]


def _bench(rng):
    rows = []
    curves = {}
    for kv, kernel in (("bf16", "vllm_unified_3d"), ("bf16", "forge"), ("int8", "forge")):
        us = sorted(rng.uniform(5, 300) for _ in CONTEXTS)
        curves[(kv, kernel)] = us
        rows += [{"kv": kv, "kernel": kernel, "batch": 1, "context": c, "us": u} for c, u in zip(CONTEXTS, us)]
        rows += [{"kv": kv, "kernel": kernel, "batch": 4, "context": c, "us": 1e6} for c in CONTEXTS]  # not batch 1
    return {"provenance": {"git_commit": "0" * 40, "device": "test"}, "decode": rows}, curves


def _server(d: Path, decode: str, kv_arg: list[str]):
    d.mkdir(parents=True)
    (d / "serve.json").write_text(json.dumps({"launch": ["python3", "-m", "vllm", "serve", "m", *kv_arg],
                                              "env": {"VLLM_FORGE_DECODE": decode}}))


def _round(d: Path, r: str, tier: str, prompt: int, out: int, tpot: float, completed: int = 1):
    f = d / "rounds" / r / f"{tier}.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({"completed": completed, "input_lens": [prompt], "output_lens": [out],
                             "mean_tpot_ms": tpot}))
    (f.parent / f"{tier}.identity.json").write_text("{}")


def test_prediction_and_measurement_against_an_independent_interpolation(tmp_path):
    rng = random.Random()
    bench, curves = _bench(rng)
    folder = tmp_path / "run"
    _server(folder / "runs" / "upstream", "0", [])
    _server(folder / "runs" / "fast-int8", "1", ["--kv-cache-dtype=int8"])
    _server(folder / "runs" / "contest", "1", ["--kv-cache-dtype", "auto"])
    layers = rng.randrange(4, 40)
    cases = [("r1", "4-8K", rng.randrange(1100, 7000), 1024), ("r1", "16-32K", rng.randrange(16000, 31000), 777),
             ("r2", "16-32K", rng.randrange(16000, 31000), 1024)]
    tp = {}
    for r, t, prompt, out in cases:
        for prof in ("upstream", "fast-int8", "contest"):
            tp[(prof, r, t)] = rng.uniform(10, 30)
            _round(folder / "runs" / prof, r, t, prompt, out, tp[(prof, r, t)])
    _round(folder / "runs" / "upstream", "r1", "8-16K", 9000, 1024, 20.0)           # served by one side only
    _round(folder / "runs" / "contest", "r1", "8-16K", 9000, 1024, 18.0, completed=0)
    for prof in ("upstream", "fast-int8", "contest"):                  # one token out: no TPOT to compare
        _round(folder / "runs" / prof, "r3", "4-8K", 5000, 1, None)
    (folder / "runs" / "contest" / "rounds" / "r1" / "4-8K.client.json").write_text(   # a client's partial file
        json.dumps({"completed": 1, "input_lens": [4000], "output_lens": [10], "mean_tpot_ms": 1.0}))
    res = e2e_decode.analyse(folder, bench, layers)
    assert set(res["profiles"]) == {"fast-int8", "contest"}
    assert (res["profiles"]["fast-int8"]["kv"], res["profiles"]["contest"]["kv"]) == ("int8", "bf16")
    for prof, kv in (("fast-int8", "int8"), ("contest", "bf16")):
        rows = {(x["round"], x["tier"]): x for x in res["profiles"][prof]["rows"]}
        assert set(rows) == {(r, t) for r, t, _, _ in cases}
        for r, t, prompt, out in cases:
            ctx = np.float64(prompt) + np.float64(out) / 2
            ref = np.interp(ctx, CONTEXTS, curves[("bf16", "vllm_unified_3d")])
            ours = np.interp(ctx, CONTEXTS, curves[(kv, "forge")])
            x = rows[(r, t)]
            assert x["predicted_saved_ms"] == pytest.approx(layers * (ref - ours) / 1000, rel=1e-12)
            assert x["saved_ms"] == pytest.approx(tp[("upstream", r, t)] - tp[(prof, r, t)], rel=1e-12)
    # outside the benchmark's contexts there is no prediction, and the report says so
    assert e2e_decode.decode_us(bench, "bf16", "forge", 40000) is None
    assert e2e_decode.decode_us(bench, "int8", "vllm_unified_3d", 4096) is None
    assert e2e_decode.decode_us(bench, "bf16", "forge", 32768) == curves[("bf16", "forge")][-1]


def test_attention_layers_of_the_model_config():
    cfg = json.loads((ROOT / "configs" / "models" / "qwen3.5-27b" / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    assert e2e_decode.attention_layers(cfg) == tc["layer_types"].count("full_attention") == 16
    assert e2e_decode.attention_layers({"num_hidden_layers": 48, "full_attention_interval": 4}) == 12
    with pytest.raises(ForgeError):
        e2e_decode.attention_layers({})


def test_cli_on_the_recorded_h200_run(tmp_path):
    """The real run's files: one row per (round, tier) both servers served, savings from their TPOTs."""
    import shutil
    src = h200_e2e() / "2026-11-30-h200-contest"
    dst = tmp_path / "run"
    shutil.copytree(src / "runs", dst / "runs")
    r = forge(tmp_path, "e2e-decode", str(dst))
    assert r.returncode == 0, r.stderr
    res = json.loads((dst / "decode.json").read_text())
    rows = res["profiles"]["contest"]["rows"]
    assert [x["prompt_tokens"] for x in rows] == [5120, 10240, 20224, 27904]
    for x in rows:
        ref = json.loads((dst / "runs" / "upstream" / "rounds" / x["round"] / f"{x['tier']}.json").read_text())
        own = json.loads((dst / "runs" / "contest" / "rounds" / x["round"] / f"{x['tier']}.json").read_text())
        assert x["saved_ms"] == pytest.approx(ref["mean_tpot_ms"] - own["mean_tpot_ms"], rel=1e-12)
        assert x["predicted_saved_ms"] is not None
    assert "| r2 | 16-32K | 27,904 |" in (dst / "decode.md").read_text()
    bad = forge(tmp_path, "e2e-decode", str(tmp_path))
    assert bad.returncode == 2 and "serve.json" in bad.stderr and "Traceback" not in bad.stderr


def test_no_prediction_where_the_benchmark_did_not_measure_the_profiles_kernel(tmp_path):
    """int8kv runs vLLM's decode kernel on an int8 cache, which the kernel benchmark did not measure:
    its rows carry the measured TPOT difference and no predicted saving (no guess)."""
    import shutil
    src = h200_e2e() / "2026-11-30-h200-int8kv"
    dst = tmp_path / "run"
    shutil.copytree(src / "runs", dst / "runs")
    r = forge(tmp_path, "e2e-decode", str(dst))
    assert r.returncode == 0, r.stderr
    rows = json.loads((dst / "decode.json").read_text())["profiles"]["int8kv"]["rows"]
    assert [x["prompt_tokens"] for x in rows] == [5120, 7168, 10240, 14336, 20224, 27904]
    assert all(x["predicted_saved_ms"] is None and x["saved_ms"] is not None for x in rows)
    body = lambda text: text.split("\n", 1)[1]       # the first line names the generating module
    # decode.md as recorded in reports/e2e/2026-11-30-h200-int8kv, which read the kernel benchmark from
    # reports/kernels/bench.json; the same numbers now come from its copy in configs/, and the first
    # column names the request (a round of that layout, a place in a tier's client invocation now)
    assert body((dst / "decode.md").read_text()) == body((src / "decode.md").read_text()).replace(
        "reports/e2e/2026-11-30-h200-int8kv", str(dst)).replace("reports/kernels/bench.json",
                                                                "configs/kernels/bench-h200.json").replace(
        "| round | tier |", "| request | tier |")


# --- the GEMV term ----------------------------------------------------------------------------------
GEMV_BENCH = ROOT / "configs" / "kernels" / "gemv-h200.json"


def _gemv_one_row_saving_us(bench: dict) -> dict:
    """µs saved per call at one row by the kernel's built-in launch against F.linear (the fused gate_up +
    SiLU against F.linear + the activation), written out from the benchmark's rows, not its summary."""
    out = {}
    for r in bench["rows"]:
        if r["M"] == 1 and r["impl"] == "F.linear":
            ours = next(x["us"] for x in bench["rows"]
                        if x["M"] == 1 and x["shape"] == r["shape"] and x["impl"] == "forge_gemv")
            out[r["shape"]] = r["us"] - ours
    fused = {x["impl"]: x["us"] for x in bench["fused_gate_up"] if x["M"] == 1}
    out["gate_up"] = next(u for i, u in fused.items() if i.startswith("F.linear")) - fused["forge_gemv_silu_mul"]
    return out


def _gemv_run(tmp_path) -> Path:
    import shutil
    dst = tmp_path / "run"
    shutil.copytree(h200_e2e() / "2026-12-01-h200-gemv-upstream" / "runs", dst / "runs")
    return dst


def _set_env(run: Path, profile: str, **env):
    f = run / "runs" / profile / "serve.json"
    serve = json.loads(f.read_text())
    for k, v in env.items():
        if v is None:
            serve["env"].pop(k, None)
        else:
            serve["env"][k] = v
    f.write_text(json.dumps(serve))


def _rows(tmp_path, run: Path, *args) -> list[dict]:
    r = forge(tmp_path, "e2e-decode", str(run), *args)
    assert r.returncode == 0, r.stderr
    return json.loads((run / "decode.json").read_text())["profiles"]


def test_gemv_term_of_a_recorded_run(tmp_path):
    """contest-gemv (VLLM_FORGE_GEMV=1, the CUDA table: every Qwen3.5-27B shape at one token) against
    upstream on an H200: each request's prediction is the attention term (the same run with the switch
    off) plus the GEMV benchmark's one-row savings times the calls per token (16 full-attention layers,
    48 linear-attention layers, 64 MLPs, one LM head)."""
    bench = json.loads(GEMV_BENCH.read_text())
    us = _gemv_one_row_saving_us(bench)
    calls = {"qkv_gate": 16, "o_proj": 16, "in_proj_qkvz": 48, "in_proj_ba": 48, "out_proj": 48,
             "gate_up": 64, "down": 64, "lm_head": 1}
    expected_ms = sum(calls[s] * us[s] for s in calls) / 1000.0
    run = _gemv_run(tmp_path)
    on = _rows(tmp_path, run)["contest-gemv"]
    md = (run / "decode.md").read_text()
    assert "of which GEMV ms" in md and "`contest-gemv` ran our decode GEMV (route: the platform's table)" in md
    _set_env(run, "contest-gemv", VLLM_FORGE_GEMV=None)
    off = _rows(tmp_path, run)["contest-gemv"]
    assert "gemv" not in off and "of which GEMV" not in (run / "decode.md").read_text()
    assert on["predicted_gemv_saved_ms"] == pytest.approx(expected_ms, rel=1e-9)
    assert len(on["rows"]) == len(off["rows"]) == 18
    for a, b in zip(on["rows"], off["rows"]):
        assert a["saved_ms"] == b["saved_ms"]
        assert a["predicted_saved_ms"] - b["predicted_saved_ms"] == pytest.approx(expected_ms, rel=1e-9)


def test_gemv_term_follows_the_servers_route_and_sign(tmp_path):
    bench = json.loads(GEMV_BENCH.read_text())
    us = _gemv_one_row_saving_us(bench)
    run = _gemv_run(tmp_path)
    # only down (5120x17408) at one token; 14336x5120 at two tokens does not count at one
    _set_env(run, "contest-gemv", VLLM_FORGE_GEMV_SHAPES="5120x17408/1, 14336x5120/2")
    p = _rows(tmp_path, run)["contest-gemv"]
    assert p["predicted_gemv_saved_ms"] == pytest.approx(64 * us["down"] / 1000.0, rel=1e-9)
    assert p["gemv"]["route"] == "5120x17408/1, 14336x5120/2"
    # a pair on the skinny GEMM ("=mma") is not the GEMV's saving
    _set_env(run, "contest-gemv", VLLM_FORGE_GEMV_SHAPES="5120x17408/1, 14336x5120/1=mma")
    p = _rows(tmp_path, run)["contest-gemv"]
    assert p["predicted_gemv_saved_ms"] == pytest.approx(64 * us["down"] / 1000.0, rel=1e-9)
    _set_env(run, "contest-gemv", VLLM_FORGE_GEMV_SHAPES="5120x17408/1")
    # the GEMV in the reference instead: the profile is predicted slower by the same amount
    _set_env(run, "contest-gemv", VLLM_FORGE_GEMV=None, VLLM_FORGE_GEMV_SHAPES=None)
    _set_env(run, "upstream", VLLM_FORGE_GEMV="1", VLLM_FORGE_GEMV_SHAPES="5120x17408")
    p = _rows(tmp_path, run)["contest-gemv"]
    assert p["predicted_gemv_saved_ms"] == pytest.approx(-64 * us["down"] / 1000.0, rel=1e-9)
    # "auto" is off on the CUDA machines the harness runs on
    _set_env(run, "upstream", VLLM_FORGE_GEMV="auto")
    assert "gemv" not in _rows(tmp_path, run)["contest-gemv"]
    # a value the patch would refuse is refused here too, naming it
    _set_env(run, "upstream", VLLM_FORGE_GEMV="1", VLLM_FORGE_GEMV_SHAPES="5120by17408")
    bad = forge(tmp_path, "e2e-decode", str(run))
    assert bad.returncode == 2 and "'5120by17408'" in bad.stderr and "Traceback" not in bad.stderr


def test_gemv_route_of_the_benchmark_needs_every_layer_of_a_shared_shape(tmp_path):
    """Without VLLM_FORGE_GEMV_SHAPES the route is the benchmark's at one token: o_proj and out_proj share
    5120x6144, so a loss at one of them keeps both off."""
    bench = json.loads(GEMV_BENCH.read_text())
    for r in bench["summary"]:
        if r["shape"] == "o_proj" and r["M"] == 1:
            r["default_us"] = r["linear_us"] + 1.0
    f = tmp_path / "gemv.json"
    f.write_text(json.dumps(bench))
    us = _gemv_one_row_saving_us(json.loads(GEMV_BENCH.read_text()))
    run = _gemv_run(tmp_path)
    full = _rows(tmp_path, run)["contest-gemv"]["predicted_gemv_saved_ms"]
    p = _rows(tmp_path, run, "--gemv-bench", str(f))["contest-gemv"]
    assert p["gemv"]["terms"]["o_proj"] == 0.0 and p["gemv"]["terms"]["out_proj"] == 0.0
    assert p["predicted_gemv_saved_ms"] == pytest.approx(
        full - (16 * us["o_proj"] + 48 * us["out_proj"]) / 1000.0, rel=1e-9)
    missing = forge(tmp_path, "e2e-decode", str(run), "--gemv-bench", str(tmp_path / "none.json"))
    assert missing.returncode == 2 and "GEMV benchmark not found" in missing.stderr
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "cut.json").write_text('{"summary": [')
    g = json.loads(GEMV_BENCH.read_text())
    del g["summary"][3]["default_us"]
    (tmp_path / "nodefault.json").write_text(json.dumps(g))
    (tmp_path / "ints.json").write_text(json.dumps({"decode": [1, 2]}))
    for flag, f, words in (("--bench", "list.json", "not a kernel benchmark"),
                           ("--gemv-bench", "cut.json", "not valid JSON"),
                           ("--gemv-bench", "nodefault.json", "key 'summary[3].default_us': expected number"),
                           ("--bench", "ints.json", "key 'decode[0]': expected mapping")):
        bad = forge(tmp_path, "e2e-decode", str(run), flag, str(tmp_path / f))
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
