"""Kernel tests: GPU when torch sees one, else Triton's CPU interpreter at small sizes."""
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_env import KDIR, ON_GPU, REPO  # noqa: E402,F401  (sets TRITON_INTERPRET before triton)

import pytest  # noqa: E402


def _load(name, rel):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(KDIR, rel))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def wr():
    return _load("forge_int8_kv_write", "triton/int8_kv_write.py")


@pytest.fixture(scope="session")
def dec():
    return _load("forge_split_kv_decode", "triton/split_kv_decode.py")


@pytest.fixture(scope="session")
def dev():
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="session")
def on_gpu():
    return ON_GPU


@pytest.fixture(scope="session")
def pre():
    return _load("forge_prefill_attention", "triton/prefill_attention.py")
