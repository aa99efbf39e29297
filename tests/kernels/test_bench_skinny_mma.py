"""kernels/bench/bench_skinny_mma.py --smoke on a CPU (Triton's interpreter, tiny shapes): the benchmark runs
end to end, checks every launch against float64 before timing it, writes its JSON and table, and a wrong
kernel is recorded, never timed, and fails the run. The numbers mean nothing here; the GPU run is the
measurement (`python3 kernels/bench/bench_skinny_mma.py --out DIR`)."""
import json

import pytest
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
                     for m in (1, 5, 16)}
    impls = {r["impl"] for r in doc["rows"]}
    assert {"mma", "F.linear"} <= impls and len([i for i in impls if i.startswith("mma ")]) >= 3  # the sweep
    md = (tmp_path / "bench_skinny_mma.md").read_text()
    assert "| 0 | gate_up | fused | 192x256 | 16 |" in md and "Where the new kernel beat F.linear" in md
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
