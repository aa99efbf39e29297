"""Kernel tests: GPU when torch sees one, else Triton's CPU interpreter at small sizes."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
from kernel_env import KDIR, ON_GPU, REPO  # noqa: E402,F401  (sets TRITON_INTERPRET before triton)


@pytest.fixture(scope="session")
def wr():
    from forge_triton import int8_kv_write
    return int8_kv_write


@pytest.fixture(scope="session")
def dec():
    from forge_triton import split_kv_decode
    return split_kv_decode


@pytest.fixture(scope="session")
def dev():
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="session")
def on_gpu():
    return ON_GPU


@pytest.fixture(scope="session")
def pre():
    from forge_triton import prefill_attention
    return prefill_attention
