"""The patched tree routes 5-16-token calls to the forge GEMV's skinny GEMM only where a table lists the
(shape, token count) (patch "gemv: the route takes 5-16-token pairs a table lists ..."): the shapes list
"NxK/M" with M up to 16 here (a tuned table goes through the same per-call lookup: test_tuned_route.py);
"NxK" without an M and "all" stay at 1-4 tokens; on ROCm the fused gate_up + SiLU leaves 9-16 tokens to
the platform GEMM + silu_and_mul whatever the table says (the kernel is not built there for them); 17
tokens never reach the kernel. Mocked platforms and float64 CPU stand-ins of the _C ops, as
test_gemv_dispatch.py. Before the patch every 5-16-token call here took the platform GEMM and "NxK/12"
was refused."""

import pytest
from test_gemv_dispatch import PRELUDE, ROCM, run

CUDA = PRELUDE + """
import vllm.model_executor.layers.utils as U
class CudaStub:
    is_cuda = staticmethod(lambda: True)
    is_rocm = is_cpu = staticmethod(lambda: False)
U.current_platform = CudaStub()
g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
w = torch.randn(96, 5120, generator=g).bfloat16()
wgu = torch.randn(2 * 64, 256, generator=g).bfloat16()
plain, fused = {}, {}
for M in (1, 4, 5, 8, 9, 12, 16, 17):
    del calls[:]
    x = torch.randn(M, 5120, generator=g).bfloat16()
    y = U.forge_unquantized_gemm_impl(x, w)
    ref = x.double() @ w.double().T
    plain[M] = {"calls": [c[0] for c in calls], "ok": bool((y.double() - ref).abs().max() <= 1e-2 * ref.abs().max())}
    del calls[:]
    xg = torch.randn(M, 256, generator=g).bfloat16()
    yg = U.forge_gate_up_silu_mul_impl(xg, wgu)
    r = xg.double() @ wgu.double().T
    refg = F.silu(r[:, :64]) * r[:, 64:]
    fused[M] = {"calls": [c[0] for c in calls],
                "ok": bool((yg.double() - refg).abs().max() <= 1e-2 * refg.abs().max())}
print("RESULT" + json.dumps({"plain": plain, "fused": fused}))
"""

ROCM_SKINNY = ROCM.replace('print("RESULT" + json.dumps(out))', """
skinny = {}
for M in (8, 9, 12, 16, 17):
    skinny[f"ba M={M}"] = first(torch.randn(M, 5120, generator=g).bfloat16(), w)
    del calls[:]
    x = torch.randn(M, 256, generator=g).bfloat16()
    y = U.forge_gate_up_silu_mul_impl(x, wgu)
    r = x.double() @ wgu.double().T
    ref = F.silu(r[:, :64]) * r[:, 64:]
    skinny[f"fused M={M}"] = [c[0] for c in calls]
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2, M
out["skinny"] = skinny
print("RESULT" + json.dumps(out))""")
assert ROCM_SKINNY != ROCM

LISTED = "96x5120/5,96x5120/12,96x5120/16,96x5120/17,128x256/12,128x256/8,128x256/1"


def test_shapes_list_above_four_tokens_parses_only_to_16(run_in_vllm):
    res = run_in_vllm("import vllm.model_executor.layers.utils as U; U.forge_gemv_shapes()",
                      env={"VLLM_FORGE_GEMV_SHAPES": "96x5120/17"}, check=False)
    assert res.returncode != 0 and "VLLM_FORGE_GEMV_SHAPES" in res.stderr and "96x5120/17" in res.stderr


def test_cuda_takes_the_listed_5_to_16_token_pairs(run_in_vllm, patched_tree):
    r = run(run_in_vllm, patched_tree, CUDA, VLLM_FORGE_GEMV="1",
            VLLM_FORGE_GEMV_SHAPES=LISTED.replace(",96x5120/17", ""))
    p, f = r["plain"], r["fused"]
    assert [M for M, v in p.items() if v["calls"] == ["forge_gemv"]] == ["5", "12", "16"], p
    assert all(v["calls"] == [] for M, v in p.items() if M not in ("5", "12", "16")), p    # F.linear
    assert [M for M, v in f.items() if v["calls"] == ["forge_gemv_silu_mul"]] == ["1", "8", "12"], f
    assert all(v["calls"] == ["silu_and_mul"] for M, v in f.items() if M not in ("1", "8", "12")), f
    assert all(v["ok"] for v in [*p.values(), *f.values()])


@pytest.mark.parametrize("spec", ["96x5120,128x256", "all"])
def test_nxk_and_all_stay_at_four_tokens(run_in_vllm, patched_tree, spec):
    r = run(run_in_vllm, patched_tree, CUDA, VLLM_FORGE_GEMV="1", VLLM_FORGE_GEMV_SHAPES=spec)
    assert [M for M, v in r["plain"].items() if v["calls"] == ["forge_gemv"]] == ["1", "4"], r["plain"]
    assert [M for M, v in r["fused"].items() if v["calls"] == ["forge_gemv_silu_mul"]] == ["1", "4"], r["fused"]


def test_rocm_fused_stops_at_eight_tokens(run_in_vllm, patched_tree):
    r = run(run_in_vllm, patched_tree, ROCM_SKINNY, VLLM_FORGE_GEMV_SHAPES=LISTED.replace(",96x5120/17", ""))
    s = r["skinny"]
    assert s["ba M=12"] == "forge_gemv" and s["ba M=16"] == "forge_gemv", s
    assert s["ba M=8"] == "F.linear" and s["ba M=9"] == "F.linear" and s["ba M=17"] == "F.linear", s
    assert s["fused M=8"] == ["forge_gemv_silu_mul"], s
    # listed, but the fused kernel is not built on AMD at 12 rows: the unfused path (whose GEMM takes the
    # plain kernel at this listed pair) and the separate activation
    assert s["fused M=12"] == ["forge_gemv", "silu_and_mul"], s
    assert s["fused M=16"] == ["silu_and_mul"] and s["fused M=17"] == ["silu_and_mul"], s
