"""gfx936 on vLLM's skinny-GEMM route (patch "rocm: gfx936 joins the skinny-GEMM route").

The platform is mocked: a stand-in `amdsmi` reports the device's gfx name, so vllm.platforms.rocm
resolves its arch flags as on that card; the skinny kernels are replaced by recorders. The C++ guard
is checked at the preprocessor with hipcc (a gfx90a compile with the target macro swapped for
__gfx936__: upstream LLVM cannot target gfx936 itself), else with cpp."""

import json
import re
import shutil
import subprocess
import textwrap

import pytest

ROUTE = textwrap.dedent(
    """
    import json, sys, types, torch
    fake = types.ModuleType("amdsmi")
    class AmdSmiException(Exception):
        pass
    fake.AmdSmiException = AmdSmiException
    fake.amdsmi_init = lambda: None
    fake.amdsmi_shut_down = lambda: None
    fake.amdsmi_get_processor_handles = lambda: [object()]
    fake.amdsmi_get_gpu_asic_info = lambda h: {"target_graphics_version": ARCH}
    fake.amdsmi_topo_get_link_type = lambda a, b: {}
    sys.modules["amdsmi"] = fake
    # the rehearsal's vLLM is a CPU build (its version says so): only the mocked ROCm device counts
    import vllm.platforms as _platforms
    _platforms.builtin_platform_plugins["cpu"] = lambda: None
    import vllm.platforms.rocm as rocm
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as U
    calls = []
    def rec(name):
        def f(w, x, *a, **k):
            calls.append(name)
            return torch.full((x.shape[0], w.shape[0]), 7.0, dtype=x.dtype)
        return f
    ops.wvSplitK = rec("wvSplitK")
    ops.LLMM1 = rec("LLMM1")
    U.num_compute_units = lambda: 80
    out = {"gcn": rocm._GCN_ARCH, "on_gfx9": rocm.on_gfx9(), "skinny_arch": rocm.on_skinny_gemm_arch(),
           "custom_paged_attn": rocm.use_rocm_custom_paged_attention(
               torch.bfloat16, 128, 16, 6, 4096, 0, "auto"),
           "route": {}}
    for (M, N, K) in [(1, 256, 512), (2, 256, 512), (4, 256, 512), (5, 256, 512), (1, 8, 512), (1, 256, 500)]:
        del calls[:]
        x = torch.randn(M, K).bfloat16()
        w = torch.randn(N, K).bfloat16()
        y = U.rocm_unquantized_gemm_impl(x, w)
        assert y.shape == (M, N)
        out["route"][f"{M}x{N}x{K}"] = calls[0] if calls else "F.linear"
    print("RESULT" + json.dumps(out))
    """
)


def route(run_in_vllm, arch):
    res = run_in_vllm(f"ARCH = {arch!r}\n" + ROUTE, env={"VLLM_FORGE_GEMV": "0"})
    line = next(l for l in res.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("arch", ["gfx936", "gfx90a"])
def test_gfx9_skinny_route_taken(run_in_vllm, arch):
    r = route(run_in_vllm, arch)
    assert r["gcn"] == arch and r["skinny_arch"] is True
    assert r["route"] == {"1x256x512": "wvSplitK", "2x256x512": "wvSplitK", "4x256x512": "wvSplitK",
                          "5x256x512": "F.linear", "1x8x512": "LLMM1", "1x256x500": "F.linear"}, r
    if arch == "gfx936":
        # only the skinny route: the other gfx9 switches (custom paged attention, AITER, ViT) stay off
        assert r["on_gfx9"] is False and r["custom_paged_attn"] is False


@pytest.mark.parametrize("arch", ["gfx1100", "gfx908"])
def test_other_archs_keep_the_library_gemm(run_in_vllm, arch):
    r = route(run_in_vllm, arch)
    assert r["skinny_arch"] is False
    assert set(r["route"].values()) == {"F.linear"}, r


GUARD_PROBE = """
#ifdef __HIP__GFX9__
FORGE_PROBE_GFX9
#endif
#ifdef __HIP__MI3XX__
FORGE_PROBE_MI3XX
#endif
"""


def guard_text(tree) -> str:
    src = (tree / "csrc" / "rocm" / "skinny_gemms.cu").read_text()
    m = re.search(r"(#if defined\(__HIPCC__\) &&[^#]*#define __HIP__GFX9__\s*#endif)\s*"
                  r"(#if defined\(__HIPCC__\)[^#]*#define __HIP__MI3XX__\s*#endif)", src)
    assert m, "the __HIP__GFX9__ / __HIP__MI3XX__ guards were not found in csrc/rocm/skinny_gemms.cu"
    assert "__gfx936__" in m.group(1)
    return m.group(1) + "\n" + m.group(2) + "\n" + GUARD_PROBE


def preprocess(path, arch_args):
    if shutil.which("hipcc"):
        cmd = ["hipcc", "-x", "hip", "-E", "--cuda-device-only", "-nogpulib", *arch_args, str(path)]
        res = subprocess.run(cmd, capture_output=True, text=True, env={"HIP_PLATFORM": "amd",
                                                                         "PATH": "/usr/bin:/bin"})
    else:
        defs = [a for a in arch_args if a.startswith(("-D", "-U"))]
        res = subprocess.run(["cpp", "-D__HIPCC__", *defs, str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.mark.skipif(not (shutil.which("hipcc") or shutil.which("cpp")), reason="no hipcc or cpp")
def test_arch_guard_admits_gfx936(patched_tree, tmp_path):
    f = tmp_path / "guard.hip"
    f.write_text(guard_text(patched_tree))
    gfx936 = preprocess(f, ["--offload-arch=gfx90a", "-U__gfx90a__", "-D__gfx936__"])
    assert "FORGE_PROBE_GFX9" in gfx936 and "FORGE_PROBE_MI3XX" not in gfx936
    gfx90a = preprocess(f, ["--offload-arch=gfx90a", "-D__gfx90a__"])
    assert "FORGE_PROBE_GFX9" in gfx90a and "FORGE_PROBE_MI3XX" not in gfx90a
    other = preprocess(f, ["--offload-arch=gfx1100", "-D__gfx1100__"])
    assert "FORGE_PROBE_GFX9" not in other


def test_build_arch_list_has_gfx936(patched_tree):
    cmake = (patched_tree / "CMakeLists.txt").read_text()
    m = re.search(r'set\(HIP_SUPPORTED_ARCHS "([^"]*)"\)', cmake)
    assert m and "gfx936" in m.group(1).split(";")
