"""`forge calibrate`'s GEMV family at the graphs' 24 and 32 tokens (a server run above concurrency 16 decodes
batches of 17-32, which vLLM pads to its captured graph sizes 24 and 32): the family's own loop
(kernels/calibrate/gemv.py `run`) on a CPU, the device calls replaced by stand-ins that compute right (the
GEMV extension, the skinny GEMM, the platform route and vLLM's skinny kernels, the graph timer), measures
1-16 and 24 and 32 tokens; at 24 and 32 only the platform GEMM (and the separate activation for the fused
decision) and the skinny GEMM ("mma"), never a launch of our GEMV (its kernel stops at 16) nor vLLM's skinny
kernels; and what it records passes the calibration's document reader."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "kernels"))
import forge_tuned  # noqa: E402
from calibrate import common as C  # noqa: E402
from calibrate import gemv as G  # noqa: E402

from forge.run import calibration_docs as cd  # noqa: E402

SHAPES = [("qkv_gate", 64, 128), ("gate_up", 96, 128)]      # small stand-ins of one rank's layers
ROUTE = "vLLM ROCm route (kernel off)"


class CudaOnCpu:
    """torch with its "cuda" device on the CPU and a device that reports itself (NVIDIA, or ROCm: `hip`)."""

    def __init__(self, hip: bool):
        self.version = SimpleNamespace(hip="6.3" if hip else None, cuda=None if hip else "12.8")
        props = SimpleNamespace(L2_cache_size=4096, multi_processor_count=8)
        self.cuda = SimpleNamespace(is_available=lambda: True, synchronize=lambda: None, empty_cache=lambda: None,
                                    get_device_properties=lambda i: props)

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def Generator(device=None):
        return torch.Generator()

    @staticmethod
    def randn(*shape, device=None, generator=None):
        return torch.randn(*shape, generator=generator)

    @staticmethod
    def empty(*shape, device=None, dtype=None):
        return torch.empty(*shape, dtype=dtype)


def _silu_mul(gu, out):
    half = out.shape[1]
    return out.copy_(F.silu(gu[:, :half]) * gu[:, half:])


class Gemv:
    """forge_gemv / forge_gemv_silu_mul's calls, right to float32 rounding; refuses past its 16 rows as the
    kernel does."""
    rows: list[int] = []

    @classmethod
    def forge_gemv(cls, y, x, w, block, rows):
        cls.rows.append(x.shape[0])
        assert x.shape[0] <= forge_tuned.GEMV_MAX_TOKENS
        return y.copy_(F.linear(x.float(), w.float()))

    @classmethod
    def forge_gemv_silu_mul(cls, y, x, w, block, rows):
        cls.rows.append(x.shape[0])
        assert x.shape[0] <= forge_tuned.GEMV_MAX_TOKENS
        return _silu_mul(F.linear(x.float(), w.float()), y)


def _mma(x, w, out, workspace=None):
    assert x.shape[0] <= 32
    return out.copy_(F.linear(x.float(), w.float()))


MMA = SimpleNamespace(MAX_M=32, num_compute_units=lambda: 8, workspace_numel=lambda M, N, s, f=False: 0,
                      launch_config=lambda M, N, K, cus, fused=False: SimpleNamespace(split_k=1),
                      skinny_gemm=_mma,
                      skinny_gemm_silu_mul=lambda x, w, out, workspace=None: _silu_mul(F.linear(x.float(), w.float()),
                                                                                       out))


def measure(tmp_path, monkeypatch, hip: bool) -> list[dict]:
    return run_family(tmp_path, monkeypatch, hip)["records"]


def run_family(tmp_path, monkeypatch, hip: bool, mma=MMA, kernels: str = "checkout") -> dict:
    """The family's document from its loop on the CPU, the skinny GEMM module `mma` loaded as --kernels says."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(C, "linear", lambda tp=1: SHAPES)
    monkeypatch.setattr(C, "time_graph", lambda torch, fns, reps=15: {"median": 10.0, "p10": 9.9, "p90": 10.1,
                                                                       "n": reps})
    monkeypatch.setattr(G, "load_ops", lambda torch, ops: (Gemv, "the GEMV (a stand-in)"))
    monkeypatch.setattr(G, "load_mma", lambda kernels: (mma, "the skinny GEMM (a stand-in)"))
    monkeypatch.setattr(G, "activation", lambda torch, F: (_silu_mul, "silu_and_mul"))
    linear = lambda x, w: F.linear(x, w)  # noqa: E731
    monkeypatch.setattr(G, "upstream_gemm", lambda torch, F: (linear, ROUTE if hip else "F.linear"))
    monkeypatch.setattr(G, "skinny", lambda torch: {"wvSplitK": linear, "LLMM1": linear} if hip else {})
    Gemv.rows = []
    args = SimpleNamespace(ops="build", kernels=kernels, quick=False, seed=7, tp=1,
                           ledger=C.Ledger(str(tmp_path / "gemv.json"), False))
    doc = G.run(CudaOnCpu(hip), args, lambda done, total, what: None)
    for i, r in enumerate(doc["records"]):
        cd.check_record(r, cd.Doc("gemv.json", "hint"), "gemv", f"records[{i}]")
    return doc


def by_token_count(records: list[dict]) -> dict[int, dict[str, set[str]]]:
    out: dict[int, dict[str, set[str]]] = {}
    for r in records:
        out.setdefault(int(r["point"][2:]), {}).setdefault(r["decision"].rsplit(".", 2)[0], set()).add(r["candidate"])
    return out


@pytest.mark.parametrize("hip", [False, True], ids=["nvidia", "amd"])
def test_24_and_32_tokens_are_measured_for_the_platform_gemm_and_the_skinny_gemm_only(tmp_path, monkeypatch, hip):
    records = measure(tmp_path, monkeypatch, hip)
    assert all(r["ok"] and r["us"] for r in records), [r for r in records if not r["ok"]][:3]
    got = by_token_count(records)
    assert sorted(got) == [*range(1, 17), 24, 32]
    up = ROUTE if hip else "F.linear"
    for m in (24, 32):
        assert got[m] == {"gemv.plain": {up, "forge mma"} | ({"F.linear"} if hip else set()),
                          "gemv.fused": {f"{up} + silu_and_mul", "forge fused mma"}}, (m, got[m])
        assert {r["decision"] for r in records if r["point"] == f"M={m}"} == {
            f"gemv.plain.64x128.{m}", f"gemv.plain.96x128.{m}", f"gemv.fused.96x128.{m}"}
    assert max(Gemv.rows) == 16                     # the GEMV ran, at 1-16 tokens only
    for m in range(1, 17):                          # below, as before: the GEMV's launches, vLLM's kernels
        assert "forge built-in" in got[m]["gemv.plain"] and "forge mma" in got[m]["gemv.plain"], (m, got[m])
        assert ({"wvSplitK", "LLMM1"} <= got[m]["gemv.plain"]) is hip
    above = [r for r in records if int(r["point"][2:]) > 16]
    assert {r["kind"] for r in above} == {"upstream", "ours"} | ({"vendor"} if hip else set())
    assert all(r["launch"] in (None, G.MMA) for r in above)


def test_the_token_counts_and_the_gemv_launches_per_count():
    assert G.token_counts() == (*range(1, 17), 24, 32) and G.token_counts(quick=True) == (1, 2, 8)
    assert set(G.GRAPH_TOKENS) <= set(range(forge_tuned.GEMV_MAX_TOKENS + 1, forge_tuned.MMA_MAX_TOKENS + 1))
    for m in (17, 24, 32):
        for fused in (False, True):
            for on_amd in (False, True):
                assert G.launches(m, fused, on_amd) == [] and G.launches(m, fused, on_amd, quick=True) == []
