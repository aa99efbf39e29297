"""Every int8 launch the calibration's decode family offers (kernels/calibrate/attention.py DECODE_LAUNCHES)
runs the split-KV kernel correctly: against float64 on an int8 cache of 1552-token blocks (the int8 block
at TP1-TP4), ragged lengths that cross a block inside a tile, NaN-poisoned output and partials. Under the
CPU interpreter warps do not matter and stages only choose the loop: each TILE_N at 1 stage (the one-tile loop)
and at 3 (block ids loaded one tile ahead, `BT_AHEAD`; TILE_N 16 divides the block: its one-id-per-tile form)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from calibrate.attention import DECODE_LAUNCHES
from kernel_env import KDIR, ON_GPU
from reference import decode_ref, make_block_table, rel_err

D = 256
BACKEND = "hip" if getattr(torch.version, "hip", None) else "cuda"
if ON_GPU:
    LAUNCHES = DECODE_LAUNCHES[(BACKEND, "int8")]
else:
    LAUNCHES = sorted({(t, 4, st) for b in ("cuda", "hip") for t, _, _ in DECODE_LAUNCHES[(b, "int8")] for st in (1, 3)})


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda x: "TILE_N{}-w{}-s{}".format(*x))
def test_every_offered_int8_launch_matches_float64(dec, dev, launch):
    bs, hq, hkv = 1552, 6, 1
    lens = [1560, 200] if not ON_GPU else [3200, 1560, 32768]
    gen = torch.Generator(device=dev).manual_seed(launch[0])
    nb = sum(-(-n // bs) for n in lens) + 2
    q = torch.randn(len(lens), hq, D, generator=gen, device=dev)
    kc = torch.randint(-127, 128, (nb, bs, hkv, D), generator=gen, device=dev, dtype=torch.int8)
    vc = torch.randint(-127, 128, (nb, bs, hkv, D), generator=gen, device=dev, dtype=torch.int8)
    ks = torch.rand(nb, hkv, bs, generator=gen, device=dev) * 0.03 + 0.002
    vs = torch.rand(nb, hkv, bs, generator=gen, device=dev) * 0.03 + 0.002
    bt = make_block_table(len(lens), lens, bs, nb, generator=torch.Generator().manual_seed(7), device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    ref = decode_ref(q, kc, vc, bt, sl, D ** -0.5, ks, vs)
    for S in (1, 3):
        out = torch.full_like(q, float("nan"))
        ws = dec.decode_workspace(len(lens), hq, D, S, dev)
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
        dec.split_kv_decode(q, kc, vc, bt, sl, D ** -0.5, out, k_scale_cache=ks, v_scale_cache=vs, num_segments=S,
                            workspace=ws, tile_n=launch[0], num_warps=launch[1], num_stages=launch[2])
        assert torch.isfinite(out).all(), (launch, S)
        assert rel_err(out, ref) <= 1e-3, (launch, S)


AOT_CHECK = """
import json, sys
import aot
from triton.backends.compiler import GPUTarget
from calibrate.attention import DECODE_LAUNCHES
kind, block = sys.argv[1], int(sys.argv[2])
dec = aot.load_kernels()[1]
kv = "int8" if kind == "int8" else "bf16"
bad = []
for arch in ("gfx90a", "gfx942"):
    for launch in DECODE_LAUNCHES[("hip", kind)]:
        r = aot.compile_one(f"{kv}{launch}", aot._decode_spec(dec, kv, block, 8, True, launch=launch),
                            GPUTarget("hip", arch, 64))
        if not r["ok"]:
            bad.append([arch, list(launch), r["problems"]])
print("RESULT" + json.dumps(bad))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind,block", [("int8", 1552), ("16bit", 784)])
def test_every_offered_hip_launch_fits_lds_without_spills(kind, block):
    """On AMD (the DCU is gfx9) a decode launch the calibration offers compiles within 64 KiB of LDS and
    spills no registers (kernels/aot.py's portability gate), for gfx90a and gfx942. In a child process without
    TRITON_INTERPRET, as `make kernels-check` compiles: inside this suite's interpreter process a compile that
    misses Triton's cache fails in the frontend (tl.load), whatever the launch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = KDIR
    res = subprocess.run([sys.executable, "-c", AOT_CHECK, kind, str(block)], cwd=KDIR, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT"))
    assert json.loads(line[len("RESULT"):]) == []
