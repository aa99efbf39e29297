"""Every route decision of the series is made outside traced code (patch "routes: decided once, where
vLLM builds its layers ..."): vLLM's default compilation config traces each decoder layer's forward with
torch.compile, and a device query or a table read in there stops the server at start-up.

A small model piece - a vLLM linear layer into the Qwen3.5 MLP (Qwen2MoeMLP: fused gate_up + SiLU, down) -
is compiled with `torch.compile(fullgraph=True, dynamic=True)` (Dynamo's eager backend: what is checked is
the trace, not generated code) under mocked CUDA and ROCm platforms, with a tuned table active, for every
VLLM_FORGE_GEMV value, and with a vllm._C built without our kernels. Each case checks: no graph break (full
graph), the kernels each token count reached, and the result against float64 F.linear arithmetic. The _C ops
are CPU recorders computing in float64. Under the code before the patch the CUDA cases fail in the trace
(Dynamo reaches the table's `open`)."""

import json
import textwrap

import pytest

SNIPPET = textwrap.dedent(
    """
    import json, os, socket, sys, types, torch
    import torch.nn.functional as F
    from torch import nn
    calls = []
    lib = torch.library.Library("_C", "FRAGMENT")
    def gemv(out, x, w, block=0, rows=0):
        calls.append("forge_gemv")
        out.copy_((x.double() @ w.double().T).to(out.dtype))
    def gemv_silu(out, x, w, block=0, rows=0):
        calls.append("forge_gemv_silu_mul")
        y = x.double() @ w.double().T
        i = w.shape[0] // 2
        out.copy_((F.silu(y[:, :i]) * y[:, i:]).to(out.dtype))
    def silu_and_mul(out, x):
        calls.append("silu_and_mul")
        d = x.shape[-1] // 2
        out.copy_(F.silu(x[..., :d].double()) * x[..., d:].double())
    if os.environ["OPS"] == "built":
        lib.define("forge_gemv(Tensor! out, Tensor x, Tensor w, int block=0, int rows=0) -> ()")
        lib.impl("forge_gemv", gemv, "CPU")
        lib.define("forge_gemv_silu_mul(Tensor! out, Tensor x, Tensor w, int block=0, int rows=0) -> ()")
        lib.impl("forge_gemv_silu_mul", gemv_silu, "CPU")
    lib.define("silu_and_mul(Tensor! result, Tensor input) -> ()")
    lib.impl("silu_and_mul", silu_and_mul, "CPU")
    # the platform is resolved (this box's CPU, which keeps vLLM's custom ops on the CPU key) before a
    # stand-in amdsmi lets the ROCm route's module import
    from vllm.platforms import current_platform as _cp
    _cp.is_cpu()
    fake = types.ModuleType("amdsmi")
    fake.AmdSmiException = Exception
    fake.amdsmi_init = fake.amdsmi_shut_down = lambda: None
    fake.amdsmi_get_processor_handles = lambda: [object()]
    fake.amdsmi_get_gpu_asic_info = lambda h: {"target_graphics_version": "gfx936"}
    fake.amdsmi_topo_get_link_type = lambda a, b: {}
    sys.modules["amdsmi"] = fake
    import vllm.forge_tuned as T
    ident = T.device_identity()
    # a table for this process's own device: the GEMV at 1-2 tokens of the piece's projection, the fused
    # gate_up + SiLU at one token
    table = {"schema": T.SCHEMA, "validators": {**{k: ident[k] for k in T.MATCH}, "tp": 1, "heads": [24, 4]},
             "provenance": {},
             "gemv": {"plain": {"96x256": {"1": [640, 2], "2": [0, 0]}}, "fused": {"128x96": {"1": [64, 1]}}}}
    path = os.path.join(os.environ["TMP"], "table.json")
    with open(path, "w") as f:
        json.dump(table, f)
    os.environ["VLLM_FORGE_TUNED"] = path
    import torch._dynamo
    from torch._dynamo.utils import counters
    import vllm.model_executor.layers.utils as U
    class Stub:
        is_rocm = staticmethod(lambda: os.environ["PLATFORM"] == "rocm")
        is_cuda = staticmethod(lambda: os.environ["PLATFORM"] == "cuda")
        is_cpu = staticmethod(lambda: False)
    U.current_platform = Stub()
    U.num_compute_units = lambda: 80
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)

    class Piece(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = ReplicatedLinear(256, 96, bias=False, params_dtype=torch.bfloat16)
            self.mlp = Qwen2MoeMLP(hidden_size=96, intermediate_size=64, hidden_act="silu")

        def forward(self, x):
            h, _ = self.proj(x)
            return self.mlp(h)

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    results = {}
    for case in json.loads(os.environ["CASES"]):
        platform, switch = case.split(":")
        os.environ["PLATFORM"], os.environ["VLLM_FORGE_GEMV"] = platform, switch
        U._FORGE_GEMV_ON = None            # a new process, as far as the route is concerned
        U.forge_gemv_table.cache_clear()
        torch._dynamo.reset()
        counters.clear()
        with set_current_vllm_config(cfg):
            torch.set_default_dtype(torch.bfloat16)
            piece = Piece()                # the route is decided here
            torch.set_default_dtype(torch.float32)
        with torch.no_grad():
            for p in piece.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        compiled = torch.compile(piece, fullgraph=True, dynamic=True, backend="eager")
        out = {"enabled": U.forge_gemv_enabled(), "cases": {}, "error": None}
        try:
            with torch.no_grad():
                for M in (1, 2, 3, 5, 17):
                    x = torch.randn(M, 256, generator=g).bfloat16()
                    del calls[:]
                    y = compiled(x)
                    xd = x.double()
                    h = (xd @ piece.proj.weight.double().T).bfloat16().double()
                    gu = h @ piece.mlp.gate_up_proj.weight.double().T
                    ref = (F.silu(gu[:, :64]) * gu[:, 64:]) @ piece.mlp.down_proj.weight.double().T
                    out["cases"][M] = {"calls": list(calls), "shape": list(y.shape),
                                       "err": ((y.double() - ref).abs().max() / ref.abs().max()).item()}
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        out["graph_breaks"] = sum(counters["graph_break"].values())
        out["frames"] = dict(counters["frames"])
        results[case] = out
    print("RESULT" + json.dumps(results))
    """
)

# (platform, VLLM_FORGE_GEMV) -> the kernels each token count reaches: the projection (96x256 in the table at
# 1-2 tokens) then the MLP (fused gate_up + SiLU in the table at one token; else GEMM + silu_and_mul)
ON = {1: ["forge_gemv", "forge_gemv_silu_mul"], 2: ["forge_gemv", "silu_and_mul"], 3: ["silu_and_mul"],
      5: ["silu_and_mul"], 17: ["silu_and_mul"]}
OFF = {1: [], 2: [], 3: [], 5: [], 17: []}      # F.linear everywhere, vLLM's own SiluAndMul (native) in the MLP
EXPECT = {"cuda:auto": ON, "cuda:1": ON, "cuda:0": OFF, "rocm:auto": ON, "rocm:1": ON, "rocm:0": OFF}


def run(run_in_vllm, tmp_path, ops: str, cases: list[str]) -> dict:
    res = run_in_vllm(SNIPPET, env={"TMP": str(tmp_path), "OPS": ops, "CASES": json.dumps(cases),
                                    "VLLM_LOGGING_LEVEL": "INFO"})
    line = next(l for l in res.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):]), res.stdout + res.stderr


def check(r: dict, expect: dict) -> None:
    assert r["error"] is None, r["error"]
    assert r["graph_breaks"] == 0, r
    assert {int(m): c["calls"] for m, c in r["cases"].items()} == expect
    for m, c in r["cases"].items():
        assert c["shape"] == [int(m), 96] and c["err"] < 2e-2, (m, c)


def test_every_route_compiles_in_one_graph_with_a_table_active(run_in_vllm, tmp_path):
    results, log = run(run_in_vllm, tmp_path, "built", list(EXPECT))
    for case, expect in EXPECT.items():
        r = results[case]
        assert r["enabled"] is (expect is ON), (case, r["enabled"])
        check(r, expect)
    # what was decided is in the server log, once per decision
    assert "dcu-forge GEMV route: on (CUDA, VLLM_FORGE_GEMV=auto: the device's tuned table routes a GEMV); " \
           "the tuned table: 1 shape(s), fused gate_up: 1; ops forge_gemv, forge_gemv_silu_mul compiled in" in log
    assert "dcu-forge GEMV route: off (VLLM_FORGE_GEMV=0); the platform GEMM runs" in log


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_a_build_without_our_kernels_runs_the_platform_gemm(run_in_vllm, tmp_path, platform):
    """A vllm._C whose build left our .cu files out (the CMake safety net) has no forge ops: the route sees
    that once, says so, and every layer runs the platform's GEMM; nothing fails at the first decode."""
    results, log = run(run_in_vllm, tmp_path, "missing", [f"{platform}:1"])
    r = results[f"{platform}:1"]
    assert r["enabled"] is False
    check(r, OFF)
    assert "vllm._C has no forge_gemv, forge_gemv_silu_mul" in log and "the platform GEMM runs" in log
