"""The timing the decode benchmarks share (bench_kernels.py, bench_decode_batched.py and
sweep_decode_launch.py import it from beside them): the per-launch device time of a CUDA graph
(`time_graph`; its capture and timed replays are the calibration's, kernels/calibrate/common.py),
and the device's copy bandwidth (`copy_bandwidth`), the roof a kernel's KV read rate is quoted
against. Needs torch, and kernels/calibrate beside this folder."""

from __future__ import annotations

import os
import sys

KDIR = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if KDIR not in sys.path:
    sys.path.insert(0, KDIR)      # kernels/, the import root of calibrate

import torch  # noqa: E402
from calibrate.common import graph_replay_us  # noqa: E402


def time_graph(fns, iters=30, warm=2):
    """Per-launch device time (us) of a CUDA graph that runs every fn of ``fns`` once: (median, min, max)
    of ``iters`` replays, after ``warm`` eager passes on a side stream and one replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    ts = sorted(graph_replay_us(torch, fns, iters))
    return ts[len(ts) // 2], ts[0], ts[-1]


def copy_bandwidth(device="cuda"):
    """Bytes read + written per second by a 2 GiB device-to-device copy on ``device`` (median of 10,
    after 3 untimed copies)."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    ts.sort()
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / ts[len(ts) // 2]
