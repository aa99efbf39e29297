"""The patched tree runs the matrix-unit skinny GEMM (vllm/model_executor/layers/forge_skinny_gemm.py, the
overlay copy of kernels/forge_triton/skinny_gemm.py) at the (shape, token count) pairs a tuned table marks
"mma" (patch "gemv: the route runs the matrix-unit skinny GEMM at the pairs a table marks "mma""): those
calls reach the Triton kernel (here in Triton's interpreter) and match float64, the table's other pairs
keep their GEMV launch, unlisted pairs the platform GEMM; the fused gate_up + SiLU runs "mma" at 12 rows on
ROCm (the CUDA/HIP kernel's 8-row limit is not the Triton kernel's); where the module cannot be imported
the "mma" pairs are dropped with a warning and the platform GEMM runs them. Same mocks as
test_tuned_route.py (a table for this process's own device, ROCm through a stand-in amdsmi, float64
recorders for the _C ops). Before the patch a table naming "mma" reached the CUDA/HIP op with a string
launch."""

import json

import pytest
from test_gemv_dispatch import schemas
from test_tuned_route import SNIPPET


def _swap(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


PLAIN_OLD = '"gemv": {"plain": {"96x5120": {"1": [640, 2], "3": [0, 0]}},'
PLAIN_NEW = '"gemv": {"plain": {"96x5120": {"1": [640, 2], "8": "mma", "12": "mma"}},'
FUSED_OLD = '"fused": {"128x256": {"1": [64, 1]}}},'
FUSED_NEW = '"fused": {"128x256": {"2": "mma", "12": "mma"}}},'

SETUP_OLD = "U.num_compute_units = lambda: 80\n"
SETUP_NEW = SETUP_OLD + """if os.environ["CASE"] == "nomma":
    sys.modules["vllm.model_executor.layers.forge_skinny_gemm"] = None     # the import fails
U.logger.disabled = False
U.logger.addHandler(Keep())
U.logger.setLevel(logging.INFO)
def recorder(name):
    def wrap(x, w, *a, **k):
        calls.append((name, tuple(x.shape), k.get("num_cus")))
        return getattr(S, "real_" + name)(x, w, *a, **k)
    return wrap
S = U._forge_mma() if os.environ["CASE"] != "nomma" else None
if S is not None:
    S.real_skinny_gemm, S.real_skinny_gemm_silu_mul = S.skinny_gemm, S.skinny_gemm_silu_mul
    S.skinny_gemm, S.skinny_gemm_silu_mul = recorder("skinny_gemm"), recorder("skinny_gemm_silu_mul")
"""

ROUTE_OLD = """out = {"route": {M: first(torch.randn(M, 5120, generator=g).bfloat16(), w) for M in (1, 2, 3, 4)}}
wgu = torch.randn(128, 256, generator=g).bfloat16()
fused = {}
for M in (1, 2):
    del calls[:]
    U.forge_gate_up_silu_mul_impl(torch.randn(M, 256, generator=g).bfloat16(), wgu)
    fused[M] = [list(c) for c in calls]
"""
ROUTE_NEW = """out = {"route": {M: first(torch.randn(M, 5120, generator=g).bfloat16(), w) for M in (1, 8, 12, 16)}}
wgu = torch.randn(128, 256, generator=g).bfloat16()
fused = {}
for M in (1, 2, 12, 16):
    del calls[:]
    x = torch.randn(M, 256, generator=g).bfloat16()
    y = U.forge_gate_up_silu_mul_impl(x, wgu)
    r = x.double() @ wgu.double().T
    ref = F.silu(r[:, :64]) * r[:, 64:]
    assert y.shape == (M, 64), y.shape
    assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max() + 1e-3, ("fused", M)
    fused[M] = [list(c) for c in calls]
"""

MMA_SNIPPET = SNIPPET
for _old, _new in ((PLAIN_OLD, PLAIN_NEW), (FUSED_OLD, FUSED_NEW), (SETUP_OLD, SETUP_NEW), (ROUTE_OLD, ROUTE_NEW)):
    MMA_SNIPPET = _swap(MMA_SNIPPET, _old, _new)


def run(run_in_vllm, patched_tree, tmp_path, case):
    env = {"FORGE_TEST_SCHEMAS": json.dumps(schemas(patched_tree)), "CASE": case, "TMP": str(tmp_path),
           "TRITON_INTERPRET": "1"}
    res = run_in_vllm(MMA_SNIPPET, env=env)
    line = next(l for l in res.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_the_table_s_mma_pairs_run_the_triton_kernel(run_in_vllm, patched_tree, tmp_path):
    r = run(run_in_vllm, patched_tree, tmp_path, "match")
    # `first` checks every result against float64 before it reports the route
    assert r["route"]["1"] == ["forge_gemv", 640, 2], r["route"]
    assert r["route"]["8"] == ["skinny_gemm", [8, 5120], 8] and r["route"]["12"] == ["skinny_gemm", [12, 5120], 8]
    assert r["route"]["16"] == ["F.linear"], r["route"]                 # not in the table
    f = r["fused"]
    assert f["2"] == [["skinny_gemm_silu_mul", [2, 256], 8]], f
    # 12 rows on ROCm: the Triton kernel has no 8-row limit, the table's pair runs it
    assert f["12"] == [["skinny_gemm_silu_mul", [12, 256], 8]], f
    assert f["1"] == [["silu_and_mul"]] and f["16"] == [["silu_and_mul"]], f    # not listed
    route_log = [l for l in r["logs"] if l.startswith("dcu-forge GEMV route: on")]
    assert route_log and "4 (shape, token count) pair(s) on the matrix-unit skinny GEMM" in route_log[0], route_log


def test_without_the_module_the_mma_pairs_take_the_platform_gemm(run_in_vllm, patched_tree, tmp_path):
    r = run(run_in_vllm, patched_tree, tmp_path, "nomma")
    assert r["route"] == {"1": ["forge_gemv", 640, 2], "8": ["F.linear"], "12": ["F.linear"],
                          "16": ["F.linear"]}, r["route"]
    assert all(c == [["silu_and_mul"]] for c in r["fused"].values()), r["fused"]
    warn = [l for l in r["logs"] if "skinny GEMM (Triton) not importable" in l]
    assert warn and '"mma" pairs run the platform GEMM' in warn[0], r["logs"]
    assert not any("matrix-unit skinny GEMM" in l for l in r["logs"] if l.startswith("dcu-forge GEMV route")), r["logs"]


@pytest.mark.parametrize("bad", ['"MMA"', '"mma2"', '[0, "mma"]'])
def test_a_table_with_a_bad_launch_is_refused_whole(run_in_vllm, patched_tree, tmp_path, bad):
    snippet = MMA_SNIPPET.replace('"8": "mma"', f'"8": {bad}')
    env = {"FORGE_TEST_SCHEMAS": json.dumps(schemas(patched_tree)), "CASE": "match", "TMP": str(tmp_path),
           "TRITON_INTERPRET": "1"}
    line = next(l for l in run_in_vllm(snippet, env=env).stdout.splitlines() if l.startswith("RESULT"))
    r = json.loads(line[len("RESULT"):])
    # refused whole: the built-in ROCm table has no 96x5120, so every call takes rocBLAS
    assert set(map(tuple, r["route"].values())) == {("F.linear",)}, r["route"]
    assert any("refused" in l and "gemv.plain.96x5120.8" in l for l in r["logs"]), r["logs"]


ONLY_MMA_SNIPPET = _swap(_swap(SNIPPET, PLAIN_OLD, '"gemv": {"plain": {"96x5120": {"8": "mma"}},'),
                         FUSED_OLD, '"fused": {"128x256": {"12": "mma"}}},')
ONLY_MMA_SNIPPET = _swap(ONLY_MMA_SNIPPET, SETUP_OLD, SETUP_OLD + """if os.environ["CASE"] == "nomma":
    sys.modules["vllm.model_executor.layers.forge_skinny_gemm"] = None     # the import fails
class CudaStub:
    is_cuda = staticmethod(lambda: True)
    is_rocm = is_cpu = staticmethod(lambda: False)
U.current_platform = CudaStub()
U.logger.disabled = False
U.logger.addHandler(Keep())
U.logger.setLevel(logging.INFO)
print("RESULT" + json.dumps({"on": U.forge_gemv_resolve(), "tables": [len(U.forge_gemv_table(False) or {}),
                                                                      len(U.forge_gemv_table(True) or {})],
                             "logs": logs}))
sys.exit(0)
""")


@pytest.mark.parametrize("case", ["match", "nomma"])
def test_on_cuda_a_table_of_only_mma_pairs_turns_the_route_on_only_with_the_module(run_in_vllm, patched_tree,
                                                                                    tmp_path, case):
    """CUDA under VLLM_FORGE_GEMV=auto turns the route on only where the device's tuned table routes a pair.
    A table whose pairs are all "mma" routes none when the skinny GEMM cannot be imported: the route is off
    and the log says why (before, it said "on" over shapes with no pair left)."""
    env = {"FORGE_TEST_SCHEMAS": json.dumps(schemas(patched_tree)), "CASE": case, "TMP": str(tmp_path),
           "TRITON_INTERPRET": "1", "VLLM_FORGE_GEMV": "auto"}
    line = next(l for l in run_in_vllm(ONLY_MMA_SNIPPET, env=env).stdout.splitlines() if l.startswith("RESULT"))
    r = json.loads(line[len("RESULT"):])
    route = [l for l in r["logs"] if l.startswith("dcu-forge GEMV route")]
    if case == "match":
        assert r["on"] is True and r["tables"] == [1, 1], r
        assert route and route[0].startswith("dcu-forge GEMV route: on") and "2 (shape, token count) pair(s)" in \
            route[0], route
    else:
        assert r["on"] is False and r["tables"] == [0, 0], r
        assert route and route[0].startswith("dcu-forge GEMV route: off") and 'lists only "mma" pairs' in route[0], \
            r["logs"]


def test_the_switch_names_mma_pairs_without_a_table(run_in_vllm, patched_tree, tmp_path):
    """VLLM_FORGE_GEMV_SHAPES replaces the tuned table: its "NxK/M=mma" items run the Triton kernel, its
    "NxK/M" items the GEMV at its built-in launch, everything else the platform GEMM (before, the switch
    could not name the skinny GEMM: "=mma" was refused as not a shape)."""
    env = {"FORGE_TEST_SCHEMAS": json.dumps(schemas(patched_tree)), "CASE": "match", "TMP": str(tmp_path),
           "TRITON_INTERPRET": "1", "VLLM_FORGE_GEMV_SHAPES": "96x5120/1, 96x5120/12=mma, 128x256/2=mma"}
    line = next(l for l in run_in_vllm(MMA_SNIPPET, env=env).stdout.splitlines() if l.startswith("RESULT"))
    r = json.loads(line[len("RESULT"):])
    assert r["route"] == {"1": ["forge_gemv", 0, 0], "8": ["F.linear"], "12": ["skinny_gemm", [12, 5120], 8],
                          "16": ["F.linear"]}, r["route"]
    assert r["fused"]["2"] == [["skinny_gemm_silu_mul", [2, 256], 8]], r["fused"]
    assert all(r["fused"][m] == [["silu_and_mul"]] for m in ("1", "12", "16")), r["fused"]
    route = [l for l in r["logs"] if l.startswith("dcu-forge GEMV route: on")]
    assert route and "VLLM_FORGE_GEMV_SHAPES" in route[0] and "matrix-unit skinny GEMM" in route[0], route


WIDE_SNIPPET = _swap(_swap(MMA_SNIPPET, "for M in (1, 8, 12, 16)}}", "for M in (1, 8, 12, 16, 17, 24, 32)}}"),
                     "for M in (1, 2, 12, 16):", "for M in (1, 2, 12, 16, 24, 32):")


@pytest.mark.parametrize("how", ["table", "switch"])
def test_mma_pairs_at_24_and_32_rows_run_the_32_row_tile(run_in_vllm, patched_tree, tmp_path, how):
    """A server run above concurrency 16 decodes 17-32 rows, padded to the graphs' 24 and 32: a table's (or
    the switch's) "mma" pair there runs the Triton kernel (its 32-row tile) and matches float64, an unlisted
    row count (17) the platform GEMM. Before, the route stopped at 16 rows whatever the table said."""
    snippet = WIDE_SNIPPET
    env = {"FORGE_TEST_SCHEMAS": json.dumps(schemas(patched_tree)), "CASE": "match", "TMP": str(tmp_path),
           "TRITON_INTERPRET": "1"}
    if how == "table":
        snippet = _swap(_swap(snippet, PLAIN_NEW, '"gemv": {"plain": {"96x5120": {"1": [640, 2], "8": "mma", '
                                                  '"12": "mma", "24": "mma", "32": "mma"}},'),
                        FUSED_NEW, '"fused": {"128x256": {"2": "mma", "12": "mma", "24": "mma"}}},')
    else:
        env["VLLM_FORGE_GEMV_SHAPES"] = "96x5120/1,96x5120/8=mma,96x5120/12=mma,96x5120/24=mma,96x5120/32=mma," \
                                        "128x256/2=mma,128x256/12=mma,128x256/24=mma"
    line = next(l for l in run_in_vllm(snippet, env=env).stdout.splitlines() if l.startswith("RESULT"))
    r = json.loads(line[len("RESULT"):])
    assert r["route"]["24"] == ["skinny_gemm", [24, 5120], 8] and r["route"]["32"] == ["skinny_gemm", [32, 5120], 8], \
        r["route"]
    assert r["route"]["17"] == ["F.linear"] and r["route"]["16"] == ["F.linear"], r["route"]
    assert r["fused"]["24"] == [["skinny_gemm_silu_mul", [24, 256], 8]], r["fused"]
    assert r["fused"]["32"] == [["silu_and_mul"]], r["fused"]
