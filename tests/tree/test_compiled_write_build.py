"""The compiled int8 quantize-on-write (kernels/csrc/int8_kv_write.cu) is part of vLLM's own _C build
and can be selected at run time (VLLM_FORGE_INT8_WRITE=compiled).

On a CPU box there is no _C, so: the patched build files are checked (the source among CMake's checked
sources with its definition, the op's registration under that definition, torch_bindings.cpp passes a
C++ syntax check against torch's headers with every forge op registered), and the switch is driven end
to end with a stand-in op registered under the real op name. What the checked sources do with a source
that does not compile: tests/compile/test_cmake_checked_sources.py."""

import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge.builder import hipcompile  # noqa: E402


def checked_sources(tree: Path) -> dict[str, str]:
    """source -> definition, from the forge_checked_sources(...) call of the patched CMakeLists.txt."""
    call = re.search(r"\nforge_checked_sources\(FORGE_EXT_SRC FORGE_EXT_DEFS(.*?)\)", (tree / "CMakeLists.txt").read_text(),
                     re.S)
    assert call, "CMakeLists.txt does not check our sources before adding them to _C"
    return dict(re.findall(r'"(csrc/forge/[^"]+)"\s+(FORGE_HAS_\w+)', call.group(1)))


def test_cmake_and_bindings_carry_the_kernel(patched_tree):
    cmake = (patched_tree / "CMakeLists.txt").read_text()
    assert checked_sources(patched_tree)["csrc/forge/int8_kv_write.cu"] == "FORGE_HAS_INT8_KV_WRITE"
    assert "list(APPEND VLLM_EXT_SRC ${FORGE_EXT_SRC})" in cmake
    assert "target_compile_definitions(_C PRIVATE FORGE_IN_VLLM=1 ${FORGE_EXT_DEFS})" in cmake
    assert (patched_tree / "csrc" / "forge" / "int8_kv_write.cu").read_bytes() == \
        (ROOT / "kernels" / "csrc" / "int8_kv_write.cu").read_bytes()
    binds = (patched_tree / "csrc" / "torch_bindings.cpp").read_text()
    guarded = re.search(r"#ifdef FORGE_HAS_INT8_KV_WRITE\n(.*?)#endif", binds, re.S)
    assert guarded and 'cache_ops.impl("forge_int8_kv_write", torch::kCUDA, &forge_int8_kv_write)' in guarded.group(1)
    assert binds.count("forge_int8_kv_write") == guarded.group(1).count("forge_int8_kv_write")
    assert "forge_int8_kv_write(" in (patched_tree / "csrc" / "cache.h").read_text()


@pytest.mark.skipif(not shutil.which("g++"), reason="g++ is not installed")
def test_torch_bindings_compile(patched_tree, tmp_path):
    # torch's headers as kernels-check gives them to the in-_C compile (the CPU wheel lacks a generated header)
    inc = [*hipcompile.cuda_torch_include_args(tmp_path), f"-I{patched_tree / 'csrc'}",
           f"-I{sysconfig.get_paths()['include']}"]
    every_op = [f"-D{d}=1" for d in checked_sources(patched_tree).values()]
    res = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=_C", *every_op, *inc,
                          str(patched_tree / "csrc" / "torch_bindings.cpp")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


SWITCH = textwrap.dedent(
    """
    import json, os, types, torch
    calls = []
    lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
    lib.define("forge_int8_kv_write(Tensor key, Tensor value, Tensor! k_data, Tensor! v_data, "
               "Tensor! k_scale, Tensor! v_scale, Tensor slot_mapping) -> ()")
    from vllm.v1.attention.ops.forge_int8_kv_write import int8_kv_write
    def cpu_impl(key, value, kd, vd, ks, vs, slots):
        calls.append((kd.data_ptr(), ks.data_ptr(), int(slots.numel())))
        int8_kv_write(key, value, kd, vd, ks, vs, slots)
    lib.impl("forge_int8_kv_write", cpu_impl, "CPU")
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.utils.torch_utils import kv_cache_scale_bytes
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    nb, bs, H, D, T = 2, 16, 4, 256, 11
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=D, dtype=torch.int8,
                             kv_scale_bytes=kv_cache_scale_bytes("int8"))
    key = torch.randn(T, H, D, generator=g).bfloat16()
    val = torch.randn(T, H, D, generator=g).bfloat16()
    slots = torch.randperm(nb * bs, generator=g)[:T]
    layer = types.SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
    out = {}
    for mode in ("triton", "compiled"):
        os.environ["VLLM_FORGE_INT8_WRITE"] = mode
        kv = torch.full((nb * spec.page_size_bytes,), -1, dtype=torch.int8).view(
            TritonAttentionBackend.get_kv_cache_shape(nb, bs, H, D, cache_dtype_str="int8"))
        impl = TritonAttentionImpl(num_heads=24, head_size=D, scale=D ** -0.5, num_kv_heads=H,
                                   alibi_slopes=None, sliding_window=None, kv_cache_dtype="int8")
        before = len(calls)
        impl.do_kv_cache_update(layer, key, val, kv, slots)
        kd, vd, ks, vs = impl._int8_kv_cache_views(kv)
        out[mode] = dict(op_calls=len(calls) - before, flag=impl.int8_write_compiled,
                         same_views=bool(calls and calls[-1][:2] == (kd.data_ptr(), ks.data_ptr())),
                         cache=kv.clone())
    same = bool(torch.equal(out["triton"].pop("cache"), out["compiled"].pop("cache")))
    os.environ["VLLM_FORGE_INT8_WRITE"] = "cuda"
    try:
        TritonAttentionImpl(num_heads=24, head_size=D, scale=D ** -0.5, num_kv_heads=H, alibi_slopes=None,
                            sliding_window=None, kv_cache_dtype="int8")
        bad = "accepted"
    except ValueError as e:
        bad = str(e)
    print("JSON" + json.dumps(dict(out=out, same=same, bad=bad)))
    """
)


def test_compiled_write_switch(run_in_vllm):
    import json
    res = run_in_vllm(SWITCH, env={"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    r = json.loads([l for l in res.stdout.splitlines() if l.startswith("JSON")][-1][4:])
    assert r["out"]["triton"]["op_calls"] == 0 and r["out"]["triton"]["flag"] is False
    assert r["out"]["compiled"]["op_calls"] == 1 and r["out"]["compiled"]["flag"] is True
    assert r["out"]["compiled"]["same_views"]
    assert r["same"], "both paths must write identical caches"
    assert "triton" in r["bad"] and "compiled" in r["bad"], r["bad"]
