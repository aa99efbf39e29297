"""Shared constants of the kernel tests (a module with a name of its own: test files import it
instead of `conftest`, which is ambiguous when several test folders run in one session)."""
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # must be set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
KDIR = os.path.join(REPO, "kernels")
