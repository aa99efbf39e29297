"""kernels/bench/bench_decode_batched.py's plumbing on a CPU (Triton's interpreter, tiny sizes, timing
stubbed): every point's candidates are checked against float64 before they are timed, a wrong
candidate is recorded as failed and never timed, and the goals and the report are made from the points.
The numbers mean nothing here; the GPU run is the measurement."""
import importlib.util
import json
import os

import pytest
import torch
from kernel_env import ON_GPU, REPO

pytestmark = pytest.mark.skipif(ON_GPU, reason="the GPU runs the benchmark itself")


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_decode_batched",
                                                  os.path.join(REPO, "kernels", "bench", "bench_decode_batched.py"))
    B = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(B)
    monkeypatch.setattr(B, "DEV", "cpu")
    monkeypatch.setattr(B, "DT", torch.float32)
    monkeypatch.setattr(B, "BLOCK", {"bf16": 16, "int8": 32})
    monkeypatch.setattr(B, "D", 64)
    monkeypatch.setattr(B, "SCALE", 64 ** -0.5)
    monkeypatch.setattr(B, "MIN_TOUCH", 1)
    monkeypatch.setattr(B, "time_graph", lambda fns, **k: ([f() for f in fns], (10.0, 9.0, 11.0))[1])
    return B


class Reference:
    """Stands in for vLLM's unified kernel: float64 attention, or a wrong one."""
    int8 = True

    def __init__(self, B, wrong=False):
        self.B, self.wrong = B, wrong

    def prepare(self, batch, hq, hkv):
        return None

    def call(self, prep, q, c, out, max_len):
        ref = self.B.REF.decode_ref(q, c["k"], c["v"], c["bt"], c["sl"], self.B.SCALE, c["ks"], c["vs"])
        out.copy_(ref * (2.0 if self.wrong else 1.0))


def test_points_are_checked_then_timed(bench):
    kind = "int8"
    p = bench.bench_point(6, 2, kind, 3, 40, 8, Reference(bench), 1e12, 5)
    names = [r["kernel"] for r in p["results"]]
    assert "forge builtin" in names and "vllm unified 3D" in names
    assert all(r["ok"] and r["rel_err"] <= 1e-2 and r["us"] == 10.0 for r in p["results"]), p["results"]
    assert p["builtin"]["launch"][0] == bench.DEC.choose_num_segments(8, 3, 2, 32768)
    assert p["kv_bytes"] == sum(p["lens"]) * 2 * 2 * (64 + 4)       # K and V codes, their fp32 scales
    assert p["lens"][-1] == 40 and all(30 <= n <= 40 for n in p["lens"])


def test_a_wrong_candidate_is_recorded_and_not_timed_and_the_goals_say_so(bench):
    p = bench.bench_point(6, 2, "bf16", 3, 40, 8, Reference(bench, wrong=True), 1e12, 6)
    up = next(r for r in p["results"] if r["kernel"] == "vllm unified 3D")
    assert not up["ok"] and "us" not in up and p["vllm"] is None
    bench.HEADS = ((6, 2),)
    bench.GOAL_BATCH, bench.GOAL_MIN_CTX = 3, 10
    goals = bench.goals([p])
    assert [ok for _, ok, _ in goals] == [False, False]      # a tiny read rate; nothing to compare with
    res = dict(provenance=dict(device="cpu", command="c", commit="x"), points=[p], errors=[], goals=goals,
               copy_bw_tb_s=1.0)
    md = bench.render(res)
    assert "| 6/2 | bf16 | 3 | 40 |" in md and "vllm unified 3D: error" in md and "FAIL" in md
    json.dumps(res)


def test_int8_launches_and_qk_paths_are_each_checked_timed_and_named(bench, monkeypatch):
    # the int8 cache's extra candidates: each (launch, Q.K path) at every segment count, each checked against
    # float64 first; the fastest is the point's best and the int8 goal line reads it
    monkeypatch.setattr(bench, "DT", torch.bfloat16)           # the int8 Q.K path needs 16-bit queries
    times = iter(range(1000, 0, -1))                             # later candidates time faster
    monkeypatch.setattr(bench, "time_graph", lambda fns, **k: ([f() for f in fns], (float(next(times)),) * 3)[1])
    p = bench.bench_point(6, 2, "int8", 3, 40, 8, None, 1e12, 7, int8_launches=[(16, 4, 1)], qk_paths=(True, False))
    forge = [r for r in p["results"] if r["kernel"].startswith("forge")]
    segs = {r["launch"][0] for r in forge}
    assert len(forge) == 2 * 2 * len(segs)                       # 2 launches x 2 Q.K paths x the segment counts
    assert {r["qk"] for r in forge} == {"int8", "bf16"} and all(r["ok"] and r["rel_err"] <= 1e-2 for r in forge)
    assert {tuple(r["launch"][1:]) for r in forge} == {(16, 4, 1), tuple(bench.DEC.default_launch_config(
        torch.int8, bench.D, num_seqs=3))}
    assert p["best"] is forge[-1] and p["best"]["us"] == min(r["us"] for r in forge)
    assert sum(r["kernel"] == "forge builtin" for r in forge) == 1
    bench.HEADS = ((6, 2),)
    bench.GOAL_BATCH, bench.GOAL_MIN_CTX = 3, 10
    goals = bench.goals([p])
    int8_goal = [g for g in goals if "int8" in g[0]]
    assert len(int8_goal) == 1 and bench.best_label(p["best"]) in int8_goal[0][2]
    # a run of the int8 cache alone states no bf16 goal as failed ("not measured" is not a measurement)
    assert not [g for g in goals if "bf16" in g[0]], goals


def test_a_copy_names_the_commit_of_its_source_manifest(bench, tmp_path, monkeypatch):
    # a copy whose git folder is another commit's: the record names the manifest's commit, and says so where the
    # copy's kernels differ from the files the manifest lists
    import hashlib
    rel = "kernels/forge_triton/split_kv_decode.py"
    data = open(os.path.join(REPO, rel), "rb").read()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    man = tmp_path / "source-manifest.json"
    monkeypatch.setenv("FORGE_SOURCE_MANIFEST", str(man))
    man.write_text(json.dumps({"commit": "abc123", "files": {rel: blob}}))
    assert bench.commit() == "abc123"
    man.write_text(json.dumps({"commit": "abc123", "files": {rel: "0" * 40}}))
    assert bench.commit() == "abc123 (kernels/ differ from it)"


def test_the_segment_span_widens_the_counts_timed_and_each_is_checked(bench):
    # the rank of 2 KV heads had its fastest count at the default sweep's edge (4 x the built-in): a wider
    # span times the counts beyond it, each checked against float64 before it is timed
    narrow = bench.bench_point(6, 2, "bf16", 3, 40, 8, None, 1e12, 8)
    wide = bench.bench_point(6, 2, "bf16", 3, 40, 8, None, 1e12, 8, span=8)
    counts = lambda p: sorted({r["launch"][0] for r in p["results"] if r["kernel"].startswith("forge")})  # noqa: E731
    s0 = bench.DEC.choose_num_segments(8, 3, 2, 32768)
    assert max(counts(narrow)) <= 4 * s0 < max(counts(wide)) == min(8 * s0, 256)
    assert set(counts(narrow)) < set(counts(wide))
    assert all(r["ok"] for r in wide["results"] if r["kernel"].startswith("forge"))


def test_counts_between_the_powers_are_timed_too_and_each_is_checked(bench):
    # --segments: counts that are no power of two (whole waves of programs: 24 at batch 10, 2 KV heads, 132 SMs
    # of two programs) beside the span's powers, each checked against float64 (ragged lengths) before it is timed
    p = bench.bench_point(6, 2, "int8", 3, 40, 8, None, 1e12, 8, extra_segments=(3, 6))
    counts = sorted({r["launch"][0] for r in p["results"] if r["kernel"].startswith("forge")})
    assert {3, 6} <= set(counts) and set(bench.segment_counts(bench.DEC.choose_num_segments(8, 3, 2, 32768))) < set(counts)
    assert all(r["ok"] and r["rel_err"] <= 1e-2 for r in p["results"] if r["kernel"].startswith("forge"))
