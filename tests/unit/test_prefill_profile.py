"""The prefill profile (forge.lab.prefill_profile): kernels of a torch-profiler trace assigned to vLLM's
model steps through their launch's correlation id, grouped, and rendered. The traces here are built
by hand in the Chrome-trace layout the profiler writes (kernel, cuda_runtime/cuda_driver and
user_annotation events), so every expected figure is computed from the events below."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys

import pytest
from helpers import ROOT, forge_env  # noqa: E402

from forge.errors import ForgeError
from forge.lab import prefill_profile as pp


def _trace(path, steps, kernels, extra=()):
    """steps: [(ts, dur, prefill_tokens)]; kernels: [(name, launch_ts, gpu_ts, dur, launch_cat)]; times in
    ms here, in µs in the trace (as the profiler writes them)."""
    steps = [(ts * 1000, dur * 1000, n) for ts, dur, n in steps]
    kernels = [(name, lts * 1000, gts * 1000, dur * 1000, lcat) for name, lts, gts, dur, lcat in kernels]
    ev = [{"ph": "X", "cat": "user_annotation", "name": f"execute_context_1({n})_generation_0(0)", "ts": ts,
           "dur": dur} for ts, dur, n in steps]
    ev += [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_0(0)", "ts": 1, "dur": 5}]
    for i, (name, lts, gts, dur, lcat) in enumerate(kernels):
        ev.append({"ph": "X", "cat": lcat, "name": "cudaLaunchKernel", "ts": lts, "dur": 2, "args": {"correlation": i}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": gts, "dur": dur, "args": {"correlation": i}})
    ev += list(extra)
    random.Random(7).shuffle(ev)                      # the profiler's event order is not relied on
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return path


KERNELS = [
    # step 1 (CPU 100..300): an attention kernel, a GEMM, a GDN kernel, an elementwise one
    ("kernel_unified_attention_2d", 110, 400, 50.0, "cuda_driver"),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", 120, 450, 30.0, "cuda_runtime"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", 130, 480, 20.0, "cuda_driver"),
    ("void at::native::elementwise_kernel<128, 4>", 140, 500, 5.0, "cuda_runtime"),
    # step 2 (CPU 1000..1200), launched late in the step, run after it ends on the CPU side
    ("_prefill_attention_kernel", 1190, 1300, 40.0, "cuda_driver"),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", 1195, 1340, 30.0, "cuda_runtime"),
    # between steps: sampling
    ("sampling_kernel", 1500, 1510, 7.0, "cuda_runtime"),
]


def test_kernels_go_to_the_step_that_launched_them_and_are_grouped(tmp_path):
    d = pp.digest(_trace(tmp_path / "t.json.gz", [(1000, 200, 5616), (100, 200, 8192)], KERNELS))
    assert [s["prefill_tokens"] for s in d["steps"]] == [8192, 5616]         # in time order, the empty step dropped
    s1, s2 = d["steps"]
    assert s1["kernels"]["nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT"] == [1, 30000.0]      # µs
    assert s2["kernels"] == {"_prefill_attention_kernel": [1, 40000.0],
                             "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": [1, 30000.0]}
    assert s1["gpu_span_ms"] == pytest.approx(505 - 400) and s1["cpu_ms"] == pytest.approx(200)
    assert s2["gpu_span_ms"] == pytest.approx(1370 - 1300)
    assert d["outside"]["kernels"] == {"sampling_kernel": [1, 7000.0]}
    assert d["prefill_span_ms"] == pytest.approx(1370 - 400)
    tot = pp.totals(d)
    assert tot == pytest.approx({"full attention": 90, "GDN": 20, "GEMM": 60, "rest": 12})


def test_decode_steps_are_kept_apart_from_the_prefill_and_summed_per_step(tmp_path):
    """A request that also generates tokens (--profile-decode): its one-token steps are decode steps, kept out
    of the prefill's steps, span and totals (before, their kernels went to "outside"), and summed per step."""
    prefill = [("_prefill_attention_kernel", 110, 400, 40.0, "cuda_driver"),
               ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", 120, 450, 30.0, "cuda_runtime")]
    # two decode steps at CPU 2000..2010 and 3000..3010, each a graph launch of a GEMV, a GDN and an attention
    # kernel; the second step's GDN kernel is slower
    decode = []
    for base, gdn in ((2000, 0.004), (3000, 0.008)):
        decode += [("gemv_kernel<640, 4>", base + 1, base + 20, 0.010, "cuda_runtime"),
                   ("fused_recurrent_gated_delta_rule_fwd_kernel", base + 2, base + 20.010, gdn, "cuda_runtime"),
                   ("_split_kv_decode_kernel", base + 3, base + 20.020, 0.002, "cuda_runtime")]
    ev = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_1(1)", "ts": b * 1000,
           "dur": 10_000} for b in (2000, 3000)]
    d = pp.digest(_trace(tmp_path / "t.json.gz", [(100, 200, 6000)], prefill + decode, extra=ev))
    assert [s["prefill_tokens"] for s in d["steps"]] == [6000]
    assert d["prefill_span_ms"] == pytest.approx(480 - 400)
    assert d["outside"]["kernels"] == {}
    assert pp.totals(d) == pytest.approx({"full attention": 40, "GDN": 0, "GEMM": 30, "rest": 0})
    assert [s["decode_tokens"] for s in d["decode_steps"]] == [1, 1]
    ds = pp.decode_summary(d["decode_steps"])
    assert ds["steps"] == 2
    assert ds["categories_ms"] == pytest.approx({"full attention": 0.002, "GDN": 0.006, "GEMM": 0.010, "rest": 0})
    assert ds["gpu_span_ms_median"] == pytest.approx(0.022)             # first kernel 20.000 to last 20.022
    assert ds["top_kernels"][0]["name"] == "gemv_kernel<640, 4>" and ds["top_kernels"][0]["launches"] == 1
    assert ds["top_kernels"][1]["us"] == pytest.approx(6.0)
    # the document gets a decode section; a prefill-only trace has none
    res = pp.analyse({"contest": {**d, "profile": "contest", "prompt_tokens": 6000, "source": "x"}})
    md = pp.render_md(res, "t")
    assert "## Decode steps" in md and "| contest | 2 | 0.022 |" in md
    only = pp.digest(_trace(tmp_path / "p.json.gz", [(100, 200, 6000)], prefill))
    assert "decode_steps" not in only
    assert "## Decode steps" not in pp.render_md(pp.analyse({"c": {**only, "profile": "c", "prompt_tokens": 1,
                                                                 "source": "x"}}), "t")


@pytest.mark.parametrize("name, cat", [
    ("kernel_unified_attention_2d", "full attention"), ("_prefill_attention_kernel", "full attention"),
    ("_widen_prefix_kernel", "full attention"), ("reshape_and_cache_kernel_flash", "full attention"),
    ("merge_16x16_to_64x64_inverse_kernel", "GDN"), ("chunk_fwd_kernel_o", "GDN"),
    ("_causal_conv1d_fwd_kernel", "GDN"), ("fused_gdn_gating_kernel", "GDN"),
    ("nvjet_sm90_tst_192x208_64x4_2x1_v_bz_coopB_TNT", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM"), ("wvSplitK_hf_sml_", "GEMM"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MeanOps>>", "rest"),
    ("layer_norm_fwd_kernel", "rest"), ("[gpu_memcpy] Memcpy DtoD (Device -> Device)", "rest"),
    ("triton_poi_fused__to_copy__unsafe_view_add_clone_forge_unquantized_gemm_mean_mul_pow_rsqrt_silu_view", "rest"),
    ("triton_red_fused__to_copy_add_copy__forge_unquantized_gemm_mean_mul_pow_rsqrt_4", "rest"),
    ("fused_recurrent_gated_delta_rule_packed_decode_kernel", "GDN"), ("_split_kv_decode_kernel", "full attention"),
    ("void fgemv::gemv_kernel<128, 1, 1, true, true>(fgemv::Params)", "GEMM"),
    # the matrix-unit skinny GEMM (forge_skinny_gemm.py, a tuned table's "mma" pairs) and its split-K sum
    ("_skinny_gemm_kernel", "GEMM"), ("_split_k_reduce_kernel", "GEMM"),
])
def test_categories(name, cat):
    assert pp.category(name) == cat


def test_a_trace_without_a_prefill_step_is_refused(tmp_path):
    t = _trace(tmp_path / "t.json.gz", [], KERNELS[:2])
    with pytest.raises(ForgeError, match="no model step with prompt tokens"):
        pp.digest(t)
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(ForgeError, match="not a readable Chrome trace"):
        pp.digest(bad)


def test_the_document_from_traces_brought_back(tmp_path):
    run = tmp_path / "run"
    a = _trace(tmp_path / "a.json.gz", [(100, 200, 8192), (1000, 200, 5616)], KERNELS)
    b = _trace(tmp_path / "b.json.gz", [(100, 200, 8192), (1000, 200, 5616)], KERNELS[:4])
    out = tmp_path / "doc"
    r = subprocess.run([sys.executable, "-m", "forge", "prefill-profile", str(run), "--trace", f"upstream={a}",
                        "--trace", f"contest={b}", "--tokens", "13808", "--out", str(out)],
                       cwd=ROOT, env=forge_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "prefill-profile.json").read_text())["profiles"]
    up = res["upstream"]
    assert up["prefill_span_s"] == pytest.approx(0.970) and up["gemm_floor_s"] == pytest.approx(0.060)
    assert up["shares_of_prefill"]["full attention"] == pytest.approx(0.090 / 0.970, abs=1e-4)
    assert up["steps"][1] == {"tokens": 5616, "cpu_ms": 200.0, "gpu_span_ms": 70.0, "full attention": 40.0,
                              "GDN": 0.0, "GEMM": 30.0, "rest": 0.0}
    assert res["contest"]["steps"][0]["tokens"] == 8192 and res["contest"]["categories_ms"]["GDN"] == 20.0
    assert res["contest"]["prefill_span_s"] == pytest.approx(0.105)     # its second step launched nothing
    md = (out / "prefill-profile.md").read_text()
    assert "| upstream | 13808 | — | 0.970 |" in md
    assert (run / "prefill-profile" / "upstream.json").is_file()


def test_a_packed_record_is_read_without_unpacking_it(tmp_path):
    """A recorded results folder keeps its raw files in raw.tgz (forge pack-run): the document is made from
    it directly, names the folder as given, and leaves the folder as it was."""
    from forge.run import archive
    run = tmp_path / "run"
    a = _trace(tmp_path / "a.json.gz", [(100, 200, 8192), (1000, 200, 5616)], KERNELS)
    cmd = [sys.executable, "-m", "forge", "prefill-profile", str(run)]
    kw = dict(cwd=ROOT, env=forge_env(tmp_path), capture_output=True, text=True, timeout=120)
    r = subprocess.run(cmd + ["--trace", f"upstream={a}", "--tokens", "13808", "--out", str(tmp_path / "doc1")], **kw)
    assert r.returncode == 0, r.stderr
    archive.pack_run(run)
    before = sorted(p.name for p in run.iterdir())
    assert before == ["raw.tgz"]
    r = subprocess.run(cmd + ["--out", str(tmp_path / "doc2"), "--title", "It's packed"], **kw)
    assert r.returncode == 0, r.stderr
    first = json.loads((tmp_path / "doc1" / "prefill-profile.json").read_text())
    second = json.loads((tmp_path / "doc2" / "prefill-profile.json").read_text())
    assert second["profiles"] == first["profiles"]
    assert second["profiles"]["upstream"]["source"].endswith("run/prefill-profile/upstream.json")
    assert second["provenance"][0]["folder"] == first["provenance"][0]["folder"]
    assert second["command"].endswith("--title 'It'\"'\"'s packed'")
    assert sorted(p.name for p in run.iterdir()) == before
    # a trace is not added beside the archive (it would hide the profiles inside it)
    r = subprocess.run(cmd + ["--trace", f"contest={a}", "--tokens", "5", "--out", str(tmp_path / "doc3")], **kw)
    assert r.returncode == 2 and "packed record" in r.stderr and "unpack-run" in r.stderr, r.stderr
    assert sorted(p.name for p in run.iterdir()) == before
    # a damaged member is named as the user knows it, not by the temporary extraction
    bad = tmp_path / "bad"
    (bad / "prefill-profile").mkdir(parents=True)
    (bad / "prefill-profile" / "x.json").write_text('{"profile": "x"}')
    archive.pack_run(bad)
    r = subprocess.run([sys.executable, "-m", "forge", "prefill-profile", str(bad), "--out", str(tmp_path / "d4")],
                       **kw)
    assert r.returncode == 2 and f"{bad}/prefill-profile/x.json (in its raw.tgz): not a prefill profile" in r.stderr


@pytest.mark.parametrize("args, words", [
    (["--trace", "upstream"], "expected PROFILE=FILE"),
    (["--trace", "upstream=/nonexistent.json.gz", "--tokens", "5"], "no such file"),
    (["--trace", "upstream=x.json.gz"], "needs --tokens"),
    ([], "no prefill-profile/*.json here"),
])
def test_bad_inputs_are_refused_with_the_reason(tmp_path, args, words):
    r = subprocess.run([sys.executable, "-m", "forge", "prefill-profile", str(tmp_path / "run"), *args,
                        "--out", str(tmp_path / "doc")],
                       cwd=ROOT, env=forge_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and words in r.stderr, r.stderr
