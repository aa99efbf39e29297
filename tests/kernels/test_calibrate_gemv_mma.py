"""The GEMV calibration's skinny-GEMM candidate as the family runs it (kernels/calibrate/gemv.py: `load_mma`,
`mma_workspace`, then `skinny_gemm(x, w, out, workspace=...)` / `skinny_gemm_silu_mul`) at 1-16 rows and at the
graphs' 24 and 32: the module this checkout's calibration imports is the kernel, the preallocated fp32
workspace covers the built-in launch's split-K partials at every row count, and the call writes every output
cell right (NaN-poisoned output, float64 reference, fresh random inputs; the seed is in each failure message).
On a CPU: Triton's interpreter at a shape whose built-in launch splits K (8 compute units there)."""

import os

import pytest
import torch
import torch.nn.functional as F
from calibrate import gemv as G
from forge_triton import skinny_gemm as SK
from kernel_env import ON_GPU

DEV = "cuda" if ON_GPU else "cpu"
# real per-rank shapes whose built-in launch splits K, plain and fused, at 64-228 compute units (the fused
# gate_up 34816 x 5120 does not split at 132 SMs: BLOCK_K 64, SPLIT_K 1, 272 programs)
SHAPES = [(5120, 17408), (7168, 5120)] if ON_GPU else [(64, 1024), (96, 768)]


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("N,K", SHAPES)
def test_the_candidate_runs_the_built_in_launch_in_its_workspace(N, K, fused):
    sk, note = G.load_mma("checkout")
    assert sk.skinny_gemm is SK.skinny_gemm and "kernels/forge_triton/skinny_gemm.py" in note
    ws = G.mma_workspace(torch, sk, N, K, fused, device=DEV)
    cfg = SK.launch_config(16, N, K, SK.num_compute_units(), fused=fused)
    assert cfg.split_k > 1, "the shape must split K, or the workspace is not exercised"
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).bfloat16()
    n_out = N // 2 if fused else N
    for M in (1, 7, 16, 24, 32):     # the 16-row tile and the 32-row one (the graphs' 24 and 32)
        assert ws.numel() >= SK.workspace_numel(M, N, SK.launch_config(M, N, K, SK.num_compute_units(),
                                                                       fused=fused).split_k, fused)
        x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
        y = torch.full((M, n_out), float("nan"), device=DEV, dtype=torch.bfloat16)
        ws.fill_(float("nan"))
        call = sk.skinny_gemm_silu_mul if fused else sk.skinny_gemm
        got = call(x, w, y, workspace=ws)
        assert got.data_ptr() == y.data_ptr()
        ref = x.double() @ w.double().T
        if fused:
            ref = F.silu(ref[:, :n_out]) * ref[:, n_out:]
        err = (y.double() - ref).abs() / ref.abs().clamp_min(1e-2 * ref.pow(2).mean().sqrt())
        assert not torch.isnan(y).any() and err.max().item() <= G.TOL, (seed, M, err.max().item())
