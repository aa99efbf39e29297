"""The forge decode GEMV in the patched tree: built into _C (CMake list, bindings, wrappers) and routed by
VLLM_FORGE_GEMV (patches "build: compile the decode GEMV into vllm._C ..." and "gemv: VLLM_FORGE_GEMV ...").

No GPU here: the _C ops are registered on the CPU under their real names with the schemas taken from the
patched torch_bindings.cpp, computing in float64, and every call is recorded; the ROCm platform is
mocked through a stand-in amdsmi reporting gfx936, the CUDA platform by replacing current_platform."""

import json
import re
import textwrap

import pytest
from helpers import bench_module

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def schemas(tree) -> dict:
    binds = (tree / "csrc" / "torch_bindings.cpp").read_text()
    out = {}
    for name in ("forge_gemv", "forge_gemv_silu_mul"):
        m = re.search(r'ops\.def\(\s*((?:"[^"]*"\s*)+)\);\s*ops\.impl\("' + name + r'", torch::kCUDA, &' + name
                      + r'\);', binds)
        assert m, f"{name} is not defined and implemented in csrc/torch_bindings.cpp"
        out[name] = "".join(re.findall(r'"([^"]*)"', m.group(1)))
    return out


def test_build_carries_the_kernel(patched_tree):
    cmake = (patched_tree / "CMakeLists.txt").read_text()
    assert '"csrc/forge/forge_gemv.cu"' in cmake and "FORGE_IN_VLLM=1" in cmake
    assert (patched_tree / "csrc" / "forge" / "forge_gemv.cu").read_bytes() == \
        (ROOT / "kernels" / "csrc" / "forge_gemv.cu").read_bytes()
    s = schemas(patched_tree)
    assert s["forge_gemv"] == "forge_gemv(Tensor! out, Tensor x, Tensor w, int block=0, int rows=0) -> ()"
    ops_h = (patched_tree / "csrc" / "ops.h").read_text()
    for name in ("forge_gemv", "forge_gemv_silu_mul"):
        assert re.search(r"void " + name + r"\(torch::Tensor& out, const torch::Tensor& x,\s*const torch::Tensor& w, "
                         r"int64_t block, int64_t rows\);", ops_h), name
    src = (ROOT / "kernels" / "csrc" / "forge_gemv.cu").read_text()
    for name in ("forge_gemv", "forge_gemv_silu_mul"):
        assert re.search(r"void " + name + r"\(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w, "
                         r"int64_t block,\s*int64_t rows\)", src), name


PRELUDE = textwrap.dedent(
    """
    import json, os, sys, types, torch
    import torch.nn.functional as F
    SCHEMAS = json.loads(os.environ["FORGE_TEST_SCHEMAS"])
    calls = []
    lib = torch.library.Library("_C", "FRAGMENT")
    def gemv(out, x, w, block=0, rows=0):
        calls.append(("forge_gemv", tuple(x.shape), tuple(w.shape)))
        out.copy_((x.double() @ w.double().T).to(out.dtype))
    def gemv_silu(out, x, w, block=0, rows=0):
        calls.append(("forge_gemv_silu_mul", tuple(x.shape), tuple(w.shape)))
        y = x.double() @ w.double().T
        i = w.shape[0] // 2
        out.copy_((F.silu(y[:, :i]) * y[:, i:]).to(out.dtype))
    def silu_and_mul(out, x):
        calls.append(("silu_and_mul",))
        d = x.shape[-1] // 2
        out.copy_(F.silu(x[..., :d]) * x[..., d:])
    for name, fn in (("forge_gemv", gemv), ("forge_gemv_silu_mul", gemv_silu)):
        lib.define(SCHEMAS[name])
        lib.impl(name, fn, "CPU")
    lib.define("silu_and_mul(Tensor! result, Tensor input) -> ()")
    lib.impl("silu_and_mul", silu_and_mul, "CPU")
    """
)

ROCM = PRELUDE + textwrap.dedent(
    """
    fake = types.ModuleType("amdsmi")
    fake.AmdSmiException = Exception
    fake.amdsmi_init = fake.amdsmi_shut_down = lambda: None
    fake.amdsmi_get_processor_handles = lambda: [object()]
    fake.amdsmi_get_gpu_asic_info = lambda h: {"target_graphics_version": "gfx936"}
    fake.amdsmi_topo_get_link_type = lambda a, b: {}
    sys.modules["amdsmi"] = fake
    # the rehearsal's vLLM is a CPU build (its version says so): only the mocked ROCm device counts
    import vllm.platforms as _platforms
    _platforms.builtin_platform_plugins["cpu"] = lambda: None
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as U
    class RocmStub:
        is_rocm = staticmethod(lambda: True)
        is_cuda = is_cpu = staticmethod(lambda: False)
    U.current_platform = RocmStub()
    def rec(name):
        def f(w, x, *a, **k):
            calls.append((name,))
            return (x.double() @ w.double().T).to(x.dtype)
        return f
    ops.wvSplitK = rec("wvSplitK")
    ops.LLMM1 = rec("LLMM1")
    U.num_compute_units = lambda: 80
    out = {"enabled": U.forge_gemv_enabled()}
    def first(x, w, bias=None):
        del calls[:]
        y = U.rocm_unquantized_gemm_impl(x, w, bias)
        ref = x.double() @ w.double().T
        assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max() + 1e-3, "wrong result"
        assert y.shape == (*x.shape[:-1], w.shape[0])
        return calls[0][0] if calls else "F.linear"
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    w = torch.randn(96, 5120, generator=g).bfloat16()          # in_proj_ba: in the table
    other = torch.randn(256, 512, generator=g).bfloat16()      # not in the table
    route = {}
    for M in (1, 2, 3, 4, 5):
        route[f"ba M={M}"] = first(torch.randn(M, 5120, generator=g).bfloat16(), w)
    route["ba 3d (1,2,K)"] = first(torch.randn(1, 2, 5120, generator=g).bfloat16(), w)
    route["ba fp16"] = first(torch.randn(1, 5120, generator=g).half(), w.half())
    route["ba bias"] = first(torch.randn(1, 5120, generator=g).bfloat16(), w, torch.zeros(96).bfloat16())
    route["other M=1"] = first(torch.randn(1, 512, generator=g).bfloat16(), other)
    out["route"] = route
    # fused gate_up + SiLU-and-mul: kernel at 1-4 rows of a table shape, else GEMM + silu_and_mul
    wgu = torch.randn(2 * 64, 256, generator=g).bfloat16()
    fused = {}
    for M in (1, 4, 5):
        del calls[:]
        x = torch.randn(M, 256, generator=g).bfloat16()
        y = U.forge_gate_up_silu_mul_impl(x, wgu)
        r = x.double() @ wgu.double().T
        ref = F.silu(r[:, :64]) * r[:, 64:]
        fused[M] = {"calls": [c[0] for c in calls],
                    "err": ((y.double() - ref).abs().max() / ref.abs().max()).item()}
    out["fused"] = fused
    # the Qwen3.5 / Qwen2-MoE MLP forward takes the fused op
    from torch import nn
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP
    # the mocked ROCm platform registered vLLM's custom ops for the GPU key; run them on the CPU here
    vlib = torch.library.Library("vllm", "FRAGMENT")
    vlib.impl("forge_gate_up_silu_mul", U.forge_gate_up_silu_mul_impl, "CPU")
    gu = MergedColumnParallelLinear.__new__(MergedColumnParallelLinear)
    nn.Module.__init__(gu)
    gu.weight = nn.Parameter(wgu, requires_grad=False)
    mlp = types.SimpleNamespace(forge_fused=True, gate_up_proj=gu, act_fn=None,
                                down_proj=lambda t: (t, None), expert_gate=None)
    del calls[:]
    x = torch.randn(2, 256, generator=g).bfloat16()
    y = Qwen2MoeMLP.forward(mlp, x)
    r = x.double() @ wgu.double().T
    ref = F.silu(r[:, :64]) * r[:, 64:]
    out["mlp"] = {"calls": [c[0] for c in calls], "err": ((y.double() - ref).abs().max() / ref.abs().max()).item()}
    print("RESULT" + json.dumps(out))
    """
)

CUDA = PRELUDE + textwrap.dedent(
    """
    import vllm.model_executor.layers.utils as U
    class CudaStub:
        is_cuda = staticmethod(lambda: True)
        is_rocm = is_cpu = staticmethod(lambda: False)
    U.current_platform = CudaStub()
    fn = U.dispatch_unquantized_gemm()
    out = {"dispatch": fn.__name__}
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    w = torch.randn(96, 5120, generator=g).bfloat16()
    res = {}
    for M in (1, 4, 8):
        del calls[:]
        x = torch.randn(M, 5120, generator=g).bfloat16()
        y = fn(None, x, w, None)
        ref = x.double() @ w.double().T
        res[M] = {"calls": [c[0] for c in calls],
                  "ok": bool((y.double() - ref).abs().max() <= 1e-2 * ref.abs().max())}
    out["calls"] = res
    print("RESULT" + json.dumps(out))
    """
)


def run(run_in_vllm, patched_tree, code, **env):
    full = {"FORGE_TEST_SCHEMAS": json.dumps(schemas(patched_tree)), **env}
    res = run_in_vllm(code, env=full)
    line = next(l for l in res.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_rocm_routes_table_shapes_to_the_gemv(run_in_vllm, patched_tree):
    r = run(run_in_vllm, patched_tree, ROCM, VLLM_FORGE_GEMV_SHAPES="96x5120, 128x256")
    assert r["enabled"] is True
    assert r["route"] == {
        "ba M=1": "forge_gemv", "ba M=2": "forge_gemv", "ba M=3": "forge_gemv", "ba M=4": "forge_gemv",
        "ba M=5": "F.linear",             # 5 rows: not the GEMV
        "ba 3d (1,2,K)": "forge_gemv",    # leading dims flattened: 2 rows
        # not the GEMV's (dtype, bias, shape): rocBLAS, never the skinny kernels on gfx936 (the vendor
        # tree builds no vllm._rocm_C, and gfx936 is not in vLLM's gfx9 list)
        "ba fp16": "F.linear", "ba bias": "F.linear",
        "other M=1": "F.linear",
    }, r["route"]
    f = r["fused"]
    assert f["1"]["calls"] == ["forge_gemv_silu_mul"] and f["4"]["calls"] == ["forge_gemv_silu_mul"]
    assert f["5"]["calls"] == ["silu_and_mul"]    # 5 rows: F.linear, then the separate activation
    assert all(v["err"] < 1e-2 for v in f.values()), f
    assert r["mlp"]["calls"] == ["forge_gemv_silu_mul"] and r["mlp"]["err"] < 1e-2


def test_rocm_switch_off(run_in_vllm, patched_tree):
    r = run(run_in_vllm, patched_tree, ROCM, VLLM_FORGE_GEMV="0", VLLM_FORGE_GEMV_SHAPES="96x5120,128x256")
    assert r["enabled"] is False
    # off: rocBLAS, as vLLM 0.18.1 runs gfx936 (the skinny route is not opened to it: no _rocm_C there)
    assert r["route"]["ba M=1"] == "F.linear" and r["route"]["ba M=4"] == "F.linear"


# the H200 run the CUDA table comes from: configs/kernels/gemv-h200.json, a copy of reports/kernels/gemv/bench_gemv.json
BENCH = ROOT / "configs" / "kernels" / "gemv-h200.json"
SHAPE_NK = {"qkv_gate": (14336, 5120), "o_proj": (5120, 6144), "in_proj_qkvz": (16384, 5120),
            "in_proj_ba": (96, 5120), "out_proj": (5120, 6144), "gate_up": (34816, 5120),
            "down": (5120, 17408), "lm_head": (248320, 5120)}
TABLES = textwrap.dedent(
    """
    import json, vllm.model_executor.layers.utils as U
    t = lambda d: sorted([n, k, sorted(ms)] for (n, k), ms in d.items())
    print('RESULT' + json.dumps({"cuda": t(U.FORGE_GEMV_CUDA), "rocm": t(U.FORGE_GEMV_ROCM),
                                 "fused_cuda": t(U.FORGE_GEMV_FUSED_CUDA), "fused_rocm": t(U.FORGE_GEMV_FUSED_ROCM),
                                 "shapes": sorted(U.forge_gemv_shapes())}))
    """
)


def wins_from_bench() -> tuple[list, list]:
    """(N, K) -> token counts where the recorded run's built-in launch beat F.linear (3 rows follow 4: the
    same kernel), for the plain GEMV and the fused gate_up + SiLU: bench_gemv.route() of that run."""
    r = bench_module("bench_gemv").route(json.loads(BENCH.read_text()))
    return r["plain"], r["fused"]


def test_route_from_a_run():
    """route() on a made-up run: a shared (N, K) takes the kernel only where both rows won, 3 tokens follow
    4, gate_up's env entry follows the fused kernel, all four token counts collapse to NxK."""
    summary = []

    def cell(shape, M, ours, linear):
        summary.append({"shape": shape, "M": M, "default_us": ours, "linear_us": linear})

    for M in (1, 2, 4):
        cell("o_proj", M, 9.0, 10.0)
        cell("out_proj", M, 9.0 if M != 2 else 11.0, 10.0)   # out_proj lost at 2 rows
        cell("down", M, 9.0, 10.0)
        cell("gate_up", M, 11.0, 10.0)                          # plain gate_up lost everywhere
        cell("qkv_gate", M, 12.0, 10.0)                         # never won: left out
    fused = [{"M": M, "impl": impl, "us": us} for M, impl, us in (
        (1, "F.linear + silu_and_mul (1 Triton kernel)", 20.0), (1, "forge_gemv_silu_mul", 18.0),
        (1, "forge_gemv_silu_mul b64 r1", 5.0),                 # a variant: not what the route calls
        (2, "F.linear + silu_and_mul (1 Triton kernel)", 20.0), (2, "forge_gemv_silu_mul", 21.0),
        (4, "F.linear + silu_and_mul (1 Triton kernel)", 20.0), (4, "forge_gemv_silu_mul", 19.0))]
    r = bench_module("bench_gemv").route({"summary": summary, "fused_gate_up": fused})
    assert r["plain"] == [[5120, 6144, [1, 3, 4]], [5120, 17408, [1, 2, 3, 4]]]
    assert r["fused"] == [[34816, 5120, [1, 3, 4]]]
    assert r["env"] == "5120x6144/1,5120x6144/3,5120x6144/4,5120x17408,34816x5120/1,34816x5120/3,34816x5120/4"
    # no fused rows (a run that did not time gate_up): gate_up's entry is the plain GEMV's, here none
    r = bench_module("bench_gemv").route({"summary": summary})
    assert r["fused"] == [] and "34816x5120" not in r["env"]
    # a run that timed vLLM's own route (--ops vllm on ROCm): that is the anchor, not F.linear
    for c in summary:
        if c["shape"] == "down":
            c["route_us"] = 8.0 if c["M"] == 1 else 10.0       # the skinny kernel beats ours at one row
    fused.append({"M": 1, "impl": "vLLM route without the kernel + silu_and_mul (1 Triton kernel)", "us": 17.0})
    r = bench_module("bench_gemv").route({"summary": summary, "fused_gate_up": fused})
    assert [5120, 17408, [2, 3, 4]] in r["plain"] and r["fused"] == [[34816, 5120, [3, 4]]]


def test_tables_follow_the_measurements(run_in_vllm):
    r = run_in_vllm(TABLES)
    line = next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))
    got = json.loads(line[len("RESULT"):])
    plain, fused = wins_from_bench()
    assert got["cuda"] == plain, (got["cuda"], plain)
    assert got["fused_cuda"] == fused, (got["fused_cuda"], fused)
    # ROCm: the one-row pairs with a public gfx936 strided-K figure (design/contest-facts.md)
    assert got["rocm"] == [[14336, 5120, [1]], [16384, 5120, [1]], [34816, 5120, [1]]]
    assert got["fused_rocm"] == [[34816, 5120, [1]]]
    # this machine is not ROCm: the shapes in use are the CUDA table's, every issue shape
    assert got["shapes"] == sorted(list(nk) for nk in set(SHAPE_NK.values()))


def test_kernel_defaults_are_the_benchmarks_best():
    """The CUDA (block, rows) table in forge_gemv.cu against the recorded run: each entry is the best
    variant the run timed; where the run's built-in choice ("forge_gemv", block = rows = 0) was best,
    the entry must be a variant the run also timed, within 1 % of it (the built-in choice was that entry
    when the run was made, and the same launch timed twice differs by less than that)."""
    src = (ROOT / "kernels" / "csrc" / "forge_gemv.cu").read_text()
    table = {}
    for n, k, silu, b1, b2, b4, r1, r2, r4 in re.findall(
            r"\{(\d+), (\d+), (true|false), \{(\d+), (\d+), (\d+)\}, \{(\d+), (\d+), (\d+)\}\}", src):
        table[(int(n), int(k), silu == "true")] = {1: (int(b1), int(r1)), 2: (int(b2), int(r2)),
                                                  4: (int(b4), int(r4))}
    data = json.loads(BENCH.read_text())

    def parse(impl):
        m = re.search(r"b(\d+) r(\d+)$", impl)
        return (int(m.group(1)), int(m.group(2))) if m else None

    def check(got, timed: dict, what):
        """timed: impl -> us of our kernel's launches in one (shape, M) cell."""
        best_impl = min(timed, key=timed.get)
        us = {parse(i): u for i, u in timed.items() if parse(i)}
        if parse(best_impl) is None:
            assert got in us and us[got] <= 1.01 * timed[best_impl], (what, got, best_impl)
        else:
            assert got == parse(best_impl), (what, got, best_impl)

    checked = 0
    for r in data["summary"]:
        N, K = SHAPE_NK[r["shape"]]
        got = table[(N, K, False)][r["M"]]
        timed = {x["impl"]: x["us"] for x in data["rows"]
                 if x["shape"] == r["shape"] and x["M"] == r["M"] and x["impl"].startswith("forge_gemv")}
        if r["shape"] == "out_proj" and parse(min(timed, key=timed.get)) not in (None, got):
            # shares o_proj's shape: the entry must be within 1 % of the best for both
            us = {parse(i): u for i, u in timed.items()}
            assert got in us and us[got] <= 1.01 * r["best_us"], (r, got)
        else:
            check(got, timed, (r["shape"], r["M"]))
        checked += 1
    for M in (1, 2, 4):
        timed = {x["impl"]: x["us"] for x in data["fused_gate_up"]
                 if x["M"] == M and x["impl"].startswith("forge_gemv_silu_mul")}
        check(table[(17408, 5120, True)][M], timed, ("fused", M))
        checked += 1
    assert checked == 27


@pytest.mark.parametrize("mode,expect", [("1", "forge_unquantized_gemm"), ("auto", "default_unquantized_gemm")])
def test_cuda_only_when_asked(run_in_vllm, patched_tree, mode, expect):
    r = run(run_in_vllm, patched_tree, CUDA, VLLM_FORGE_GEMV=mode)
    assert r["dispatch"] == expect
    if mode == "1":
        assert r["calls"]["1"]["calls"] == ["forge_gemv"] and r["calls"]["4"]["calls"] == ["forge_gemv"]
        assert r["calls"]["8"]["calls"] == []     # 8 rows: F.linear
    assert all(v["ok"] for v in r["calls"].values())


def test_bad_values_are_refused(run_in_vllm):
    res = run_in_vllm("import vllm.envs as e; e.VLLM_FORGE_GEMV", env={"VLLM_FORGE_GEMV": "yes"}, check=False)
    assert res.returncode != 0 and "VLLM_FORGE_GEMV" in res.stderr and "auto" in res.stderr
    res = run_in_vllm("import vllm.model_executor.layers.utils as U; U.forge_gemv_shapes()",
                      env={"VLLM_FORGE_GEMV_SHAPES": "14336by5120"}, check=False)
    assert res.returncode != 0 and "VLLM_FORGE_GEMV_SHAPES" in res.stderr and "14336by5120" in res.stderr
