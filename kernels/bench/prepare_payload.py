#!/usr/bin/env python3
"""Prepare the (git-ignored) payload the GPU benchmark needs next to the repository.

    python kernels/bench/prepare_payload.py --vllm-src /path/to/vllm-0.18.1 [--out build/gpu-payload]

Copies vLLM 0.18.1's two Triton attention files (unified attention, grouped split-KV decode)
from a pristine source tree, adds minimal stand-ins for the few ``vllm.*`` modules they import
(``vllm.triton_utils``, ``vllm.platforms``, ``vllm.logger``, the batch-invariance switch), and
records provenance (git commit, source path, sha256 of the copied files). No vLLM source is
committed to this repository; the payload folder must stay ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import time

FILES = ("vllm/v1/attention/ops/triton_unified_attention.py",
         "vllm/v1/attention/ops/triton_decode_attention.py")

SHIMS = {
    "vllm/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/ops/__init__.py": "",
    "vllm/triton_utils/__init__.py": "import triton\nimport triton.language as tl\n",
    "vllm/logger.py": "import logging\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/batch_invariant.py":
        "def vllm_is_batch_invariant():\n    return False\n",
    "vllm/platforms/__init__.py": (
        "import torch\n\n"
        "class _Platform:\n"
        "    def is_rocm(self):\n        return torch.version.hip is not None\n"
        "    def is_cuda(self):\n        return torch.version.cuda is not None\n"
        "    def fp8_dtype(self):\n"
        "        return torch.float8_e4m3fnuz if self.is_rocm() else torch.float8_e4m3fn\n"
        "    def num_compute_units(self, device_id=0):\n"
        "        return torch.cuda.get_device_properties(device_id).multi_processor_count\n\n"
        "current_platform = _Platform()\n"),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-src", required=True, help="root of an extracted vllm-0.18.1 sdist")
    ap.add_argument("--out", default="build/gpu-payload")
    a = ap.parse_args()
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    out = os.path.join(repo, a.out) if not os.path.isabs(a.out) else a.out
    if os.path.isdir(out):
        shutil.rmtree(out)
    hashes = {}
    for rel in FILES:
        src = os.path.join(a.vllm_src, rel)
        dst = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        hashes[rel] = hashlib.sha256(open(src, "rb").read()).hexdigest()
    for rel, text in SHIMS.items():
        dst = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "w") as f:
            f.write(text)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                                text=True).stdout.strip()
        st = subprocess.run(["git", "status", "--porcelain", "--", "kernels", "tests/kernels"],
                            cwd=repo, capture_output=True, text=True).stdout
        dirty_paths = [l[3:] for l in st.splitlines() if l.strip()]
    except OSError:
        commit, dirty_paths = "unknown", ["(git unavailable)"]
    prov = {"git_commit": commit, "kernels_dirty": bool(dirty_paths), "dirty_paths": dirty_paths,
            "vllm_source": os.path.abspath(a.vllm_src), "vllm_version": "0.18.1",
            "vllm_files_sha256": hashes, "prepared": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(os.path.join(out, "provenance.json"), "w") as f:
        json.dump(prov, f, indent=1)
    print(json.dumps(prov, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
