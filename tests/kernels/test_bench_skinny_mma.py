"""kernels/bench/bench_skinny_mma.py --smoke on a CPU (Triton's interpreter, tiny shapes): the benchmark runs
end to end at 1-16 rows and at the graphs' 24 and 32, checks every launch against float64 before timing it,
writes its JSON and table, and a wrong kernel is recorded, never timed, and fails the run; the CUDA-core GEMV
is timed at 1-16 rows only. The numbers mean nothing here; the GPU run is the measurement
(`python3 kernels/bench/bench_skinny_mma.py --out DIR`)."""
import json

import pytest
import torch.nn.functional as F
from forge_triton import skinny_gemm as SK
from helpers import bench_module
from kernel_env import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the GPU runs the benchmark itself")


def test_smoke_runs_checks_and_writes(tmp_path):
    B = bench_module("bench_skinny_mma")
    assert B.main(["--out", str(tmp_path), "--smoke"]) == 0
    doc = json.loads((tmp_path / "bench_skinny_mma.json").read_text())
    assert doc["provenance"]["smoke"] and doc["provenance"]["command"] and "git_commit" in doc["provenance"]
    assert doc["failed"] == 0 and all(c["ok"] for c in doc["correctness"])
    cells = {(s["shape"], s["kind"], s["M"]) for s in doc["summary"]}
    assert cells == {(n, k, m) for n, k in (("smoke", "plain"), ("gate_up", "plain"), ("gate_up", "fused"))
                     for m in (1, 5, 16, 24, 32)}
    # the graphs' 24 and 32 rows: F.linear and the kernel's 32-row tile, its built-in launch and the sweep
    for m in (24, 32):
        at = {r["impl"] for r in doc["rows"] if r["M"] == m and r["kind"] == "plain" and r["shape"] == "smoke"}
        assert {"F.linear", "mma"} <= at and any(i.startswith("mma ") for i in at), (m, at)
    impls = {r["impl"] for r in doc["rows"]}
    assert {"mma", "F.linear"} <= impls and len([i for i in impls if i.startswith("mma ")]) >= 3  # the sweep
    md = (tmp_path / "bench_skinny_mma.md").read_text()
    assert "| 0 | gate_up | fused | 192x256 | 16 |" in md and "Where the new kernel beat F.linear" in md
    assert "| 0 | gate_up | fused | 192x256 | 32 |" in md and "## Per layer at M = 17-32 (measured: 24, 32)" in md
    # recorded results are kept
    with pytest.raises(SystemExit) as e:
        B.main(["--out", str(tmp_path), "--smoke"])
    assert e.value.code == 2


def test_a_wrong_kernel_is_recorded_not_timed_and_fails_the_run(tmp_path, monkeypatch):
    B = bench_module("bench_skinny_mma")
    right = SK.skinny_gemm

    def wrong(x, w, out=None, **kw):
        return right(x, w, out, **kw).mul_(1.05)

    monkeypatch.setattr(SK, "skinny_gemm", wrong)
    assert B.main(["--out", str(tmp_path), "--smoke", "--no-sweep"]) == 1
    doc = json.loads((tmp_path / "bench_skinny_mma.json").read_text())
    bad = [c for c in doc["correctness"] if not c["ok"]]
    assert bad and all(c["impl"] == "mma" and c["kind"] == "plain" for c in bad)
    assert not [r for r in doc["rows"] if r["impl"] == "mma" and r["kind"] == "plain"]
    assert [r for r in doc["rows"] if r["impl"] == "mma" and r["kind"] == "fused"]


class FakeGemv:
    """The CUDA-core GEMV extension's calls (out, x, w), right to float32 rounding: the benchmark's GEMV rows
    on a CPU, where the extension is not built."""
    calls: list[int] = []

    @classmethod
    def forge_gemv(cls, y, x, w):
        cls.calls.append(x.shape[0])
        return y.copy_(F.linear(x.float(), w.float()))

    @classmethod
    def forge_gemv_silu_mul(cls, y, x, w):
        cls.calls.append(x.shape[0])
        gu = F.linear(x.float(), w.float())
        return y.copy_(F.silu(gu[:, :y.shape[1]]) * gu[:, y.shape[1]:])


def test_the_gemv_is_timed_at_1_16_rows_and_never_at_the_graphs_24_and_32(tmp_path, monkeypatch):
    B = bench_module("bench_skinny_mma")
    FakeGemv.calls = []
    monkeypatch.setattr(B, "load_gemv", lambda gpu, no_gemv: (FakeGemv, 0.0, "a stand-in"))
    assert B.main(["--out", str(tmp_path), "--smoke", "--no-sweep"]) == 0
    doc = json.loads((tmp_path / "bench_skinny_mma.json").read_text())
    gemv = {(r["shape"], r["kind"], r["M"]) for r in doc["rows"] if r["impl"] == "gemv"}
    assert gemv == {(n, k, m) for n, k in (("smoke", "plain"), ("gate_up", "plain"), ("gate_up", "fused"))
                    for m in (1, 5, 16)}
    assert FakeGemv.calls and max(FakeGemv.calls) == 16
    big = [s for s in doc["summary"] if s["M"] in (24, 32)]
    assert len(big) == 6 and all(s["gemv_us"] is None and s["linear_us"] and s["builtin_us"] for s in big), big
    md = (tmp_path / "bench_skinny_mma.md").read_text()
    assert "| 0 | smoke | plain | 200x360 | 32 |" in md


def test_ms_takes_the_graphs_token_counts_up_to_the_kernels_32_rows(tmp_path):
    B = bench_module("bench_skinny_mma")
    assert B.parse_args(["--out", str(tmp_path)]).ms == [*range(1, 17), 24, 32]
    assert B.parse_args(["--out", str(tmp_path), "--ms", "17-32"]).ms == list(range(17, 33))
    assert B.parse_args(["--out", str(tmp_path), "--quick"]).ms[-2:] == [24, 32]
    with pytest.raises(SystemExit) as e:
        B.parse_args(["--out", str(tmp_path), "--ms", "1-33"])
    assert e.value.code == 2
