"""Our Triton kernels, importable as `forge_triton.<module>` with kernels/ on the import path (the
tests, kernels/selftest.py and kernels/aot.py; in vLLM the overlay places each file under
vllm/v1/attention/ops/ instead, and this file is not copied). The kernel modules import only torch
and triton.

`fresh(module)` loads a kernel module once more under a name of its own, with the JIT on even in a
process that runs Triton's interpreter (TRITON_INTERPRET=1 decides at decoration time): the AOT
compiler needs real JIT functions where the kernel tests run interpreted ones."""

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = ("int8_kv_write", "split_kv_decode", "prefill_attention", "skinny_gemm")


def fresh(module: str):
    if module not in MODULES:
        raise ValueError(f"no kernel module {module!r} in {HERE} (have: {', '.join(MODULES)})")
    name = f"forge_triton_jit_{module}"
    if name in sys.modules:
        return sys.modules[name]
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{module}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod
