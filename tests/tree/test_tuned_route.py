"""The patched vLLM reads the per-device table at start-up (patch "tuned: the per-device launch and route
table ..."): a table whose validators match the running device routes the GEMV at its (shape, token count)
pairs with the launch it names and sets the attention launches; a table for another device is refused with
its reason in the log and the built-in defaults stand; VLLM_FORGE_TUNED=0 and VLLM_FORGE_GEMV_SHAPES
override it. No GPU: the table is written for this process's own device identity (the CPU), the ROCm
platform is mocked (a stand-in amdsmi reporting gfx936) and the _C ops are recorders computing in float64."""

import json
import textwrap

import pytest
from test_gemv_dispatch import schemas

SNIPPET = textwrap.dedent(
    """
    import json, logging, os, sys, types, torch
    import torch.nn.functional as F
    SCHEMAS = json.loads(os.environ["FORGE_TEST_SCHEMAS"])
    calls = []
    lib = torch.library.Library("_C", "FRAGMENT")
    def gemv(out, x, w, block=0, rows=0):
        calls.append(("forge_gemv", block, rows))
        out.copy_((x.double() @ w.double().T).to(out.dtype))
    def gemv_silu(out, x, w, block=0, rows=0):
        calls.append(("forge_gemv_silu_mul", block, rows))
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
    fake = types.ModuleType("amdsmi")
    fake.AmdSmiException = Exception
    fake.amdsmi_init = fake.amdsmi_shut_down = lambda: None
    fake.amdsmi_get_processor_handles = lambda: [object()]
    fake.amdsmi_get_gpu_asic_info = lambda h: {"target_graphics_version": "gfx936"}
    fake.amdsmi_topo_get_link_type = lambda a, b: {}
    sys.modules["amdsmi"] = fake
    import vllm.platforms as _platforms
    _platforms.builtin_platform_plugins["cpu"] = lambda: None
    import vllm.forge_tuned as T
    logs = []
    class Keep(logging.Handler):
        def emit(self, r):
            logs.append(r.getMessage())
    T.logger.disabled = False          # vLLM's logging configuration may have run before
    T.logger.addHandler(Keep())
    T.logger.setLevel(logging.INFO)
    ident = T.device_identity()
    table = {"schema": T.SCHEMA, "validators": {**{k: ident[k] for k in T.MATCH}, "tp": 1, "heads": [24, 4]},
             "provenance": {},
             "gemv": {"plain": {"96x5120": {"1": [640, 2], "3": [0, 0]}},
                      "fused": {"128x256": {"1": [64, 1]}}},
             "prefill": {"16bit": [64, 16, 4, 1]}, "decode": {"segments": {"4": {"1": {"32768": 32}}}, "launch": {"16bit": [16, 4, 1]}}}
    if os.environ["CASE"] == "stale":
        table["validators"]["device_name"] = "another card"
    path = os.path.join(os.environ["TMP"], "table.json")
    with open(path, "w") as f:
        json.dump(table, f)
    os.environ.setdefault("VLLM_FORGE_TUNED", path)
    import vllm.model_executor.layers.utils as U
    class RocmStub:
        is_rocm = staticmethod(lambda: True)
        is_cuda = is_cpu = staticmethod(lambda: False)
    U.current_platform = RocmStub()
    U.num_compute_units = lambda: 80
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    def first(x, w):
        del calls[:]
        y = U.rocm_unquantized_gemm_impl(x, w, None)
        ref = x.double() @ w.double().T
        assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max() + 1e-3, "wrong result"
        return list(calls[0]) if calls else ["F.linear"]
    w = torch.randn(96, 5120, generator=g).bfloat16()
    out = {"route": {M: first(torch.randn(M, 5120, generator=g).bfloat16(), w) for M in (1, 2, 3, 4)}}
    wgu = torch.randn(128, 256, generator=g).bfloat16()
    fused = {}
    for M in (1, 2):
        del calls[:]
        U.forge_gate_up_silu_mul_impl(torch.randn(M, 256, generator=g).bfloat16(), wgu)
        fused[M] = [list(c) for c in calls]
    out["fused"] = fused
    out["prefill"] = T.prefill_launch(False)
    out["decode"] = [T.decode_segments(1), T.decode_launch(False)]
    out["logs"] = logs
    print("RESULT" + json.dumps(out))
    """
)


def run(run_in_vllm, patched_tree, tmp_path, case, **env):
    full = {"FORGE_TEST_SCHEMAS": json.dumps(schemas(patched_tree)), "CASE": case, "TMP": str(tmp_path), **env}
    res = run_in_vllm(SNIPPET, env=full)
    line = next(l for l in res.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_a_matching_table_routes_its_shapes_with_its_launches(run_in_vllm, patched_tree, tmp_path):
    r = run(run_in_vllm, patched_tree, tmp_path, "match")
    assert r["route"] == {"1": ["forge_gemv", 640, 2], "2": ["F.linear"], "3": ["forge_gemv", 0, 0],
                          "4": ["F.linear"]}, r["route"]
    assert r["fused"]["1"] == [["forge_gemv_silu_mul", 64, 1]]
    assert r["fused"]["2"] == [["silu_and_mul"]]                 # not in the table: GEMM + separate activation
    assert r["prefill"] == [64, 16, 4, 1] and r["decode"] == [32, [16, 4, 1]]
    assert any("validators match" in l for l in r["logs"]), r["logs"]
    assert any("gemv plain 96x5120: forge GEMV at M=1 block 640 rows 2, M=3 built-in" in l for l in r["logs"])


def test_a_stale_table_is_refused_and_the_defaults_stand(run_in_vllm, patched_tree, tmp_path):
    r = run(run_in_vllm, patched_tree, tmp_path, "stale")
    # the built-in ROCm table: 96x5120 is not in it, so rocBLAS (F.linear) at every token count
    assert set(map(tuple, r["route"].values())) == {("F.linear",)}, r["route"]
    assert r["prefill"] is None and r["decode"] == [None, None]
    refusal = [l for l in r["logs"] if "refused" in l]
    assert refusal and "device_name 'another card'" in refusal[0] and "built-in defaults" in refusal[0]


@pytest.mark.parametrize("env, expect", [
    ({"VLLM_FORGE_TUNED": "0"}, {"1": ["F.linear"], "2": ["F.linear"]}),
    ({"VLLM_FORGE_GEMV_SHAPES": "96x5120/2"}, {"1": ["F.linear"], "2": ["forge_gemv", 0, 0]}),
])
def test_the_switches_override_the_table(run_in_vllm, patched_tree, tmp_path, env, expect):
    r = run(run_in_vllm, patched_tree, tmp_path, "match", **env)
    assert {m: r["route"][m] for m in expect} == expect, r["route"]
