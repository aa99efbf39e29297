"""Inputs found to be taken wrongly in the eleventh round of input hardening.

`forge calibrate --install` on a device whose table git tracks (configs/kernels/tuned/<device>.json, as the
GPU machine's is) measured every family first (minutes of the card's time: about 100 s for the decode family
alone) and only then refused to replace the committed table; and since the refusal ended the command, its
`--install-vllm` (the copy beside the installed vLLM's loader, for a server started next) was not done
either. The destination is now checked before anything is measured: the same refusal, naming the table and
`--force`, with nothing measured and nothing written.

`forge calibrate` (without --smoke) where torch sees no GPU: every family ran on the CPU, every candidate
failed, and it exited 0 with a table that decides nothing ("calibration: 0 decisions"), as if the machine had
been calibrated. It is now refused before any family runs, naming the device and the two ways on (the card, or
--smoke for the interpreter's check).

`forge serve --shm-size 64x` (and `sweep`'s): any text was taken, handed to `docker run --shm-size=` with an
image (where a typo fails only when the container starts) and ignored without one. It is now refused as the
option's value, before anything else is read.
"""

from __future__ import annotations

import json
import os

import pytest
from checkout_copy import commit, forge_in, make_checkout, status
from helpers import ROOT, forge
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_records import CAL_ARGS, DEVICE

from forge.run.calibration_docs import device_slug


def fake_python(tmp_path, device: dict = DEVICE):
    """An executable that answers the device query with `device` (and anything else with the same line,
    which no family takes for its results)."""
    exe = tmp_path / "python-stand-in"
    exe.write_text(f"#!/bin/sh\necho '{json.dumps(device)}'\n")
    os.chmod(exe, 0o755)
    return exe


def calibrate_over_a_committed_table(tmp_path_factory, tmp_path, *extra: str):
    """`forge calibrate --families write --install EXTRA` in a checkout whose table for DEVICE git tracks, the
    device query answered by the stand-in: (the checkout, its table's path, its status before, the result)."""
    checkout = make_checkout(tmp_path_factory.mktemp("round11-cal") / "checkout")
    table = f"configs/kernels/tuned/{device_slug(DEVICE)}.json"
    commit(checkout, {table: '{"the": "committed table"}\n'})
    before = status(checkout)
    r = forge_in(checkout, tmp_path, "calibrate", "--out", str(tmp_path / "cal"), "--families", "write", "--install",
                 *extra, "--python", str(fake_python(tmp_path)), *CAL_ARGS)
    return checkout, table, before, r


def test_calibrate_install_over_a_committed_table_is_refused_before_measuring(tmp_path_factory, tmp_path):
    checkout, table, before, r = calibrate_over_a_committed_table(tmp_path_factory, tmp_path)
    cal = tmp_path / "cal"
    refused(r, table, "a committed table", "--install")
    assert "nothing was measured" in r.stderr and "--force" in r.stderr, r.stderr
    # no family ran: its document and log would be in the output folder
    assert not cal.exists() or not any(cal.iterdir()), sorted(p.name for p in cal.iterdir())
    assert status(checkout) == before


def test_calibrate_install_with_force_measures_as_before(tmp_path_factory, tmp_path):
    checkout, _, before, r = calibrate_over_a_committed_table(tmp_path_factory, tmp_path, "--force")
    cal = tmp_path / "cal"
    # the family ran (the stand-in gives it no results, so the calibration then stops: exit 2, the table kept)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "write: measuring" in r.stderr and (cal / "write.log").is_file(), r.stderr
    assert "a committed table" not in r.stderr
    assert status(checkout) == before


def test_calibrate_where_torch_sees_no_gpu_is_refused_before_measuring(tmp_path):
    # the identity torch gives on a machine without a GPU (forge_tuned.device_identity)
    cpu = {"torch": "2.10", "triton": "3.4", "device_name": "cpu", "arch": "cpu", "compute_units": 0,
           "toolkit": None, "driver": None}
    cal = tmp_path / "cal"
    r = forge_in(ROOT, tmp_path, "calibrate", "--out", str(cal), "--families", "write",
                 "--python", str(fake_python(tmp_path, cpu)), *CAL_ARGS)
    refused(r, "sees no GPU", "device 'cpu'", "write")
    assert "--smoke" in r.stderr, r.stderr
    assert not cal.exists() or not any(cal.iterdir()), sorted(p.name for p in cal.iterdir())



@pytest.mark.parametrize("verb", [["serve"], ["sweep", "upstream"]])
@pytest.mark.parametrize("size", ["64x", "0", "-1g", "1.5g", "", "64 g"])
def test_a_shared_memory_size_docker_cannot_read_is_refused(tmp_path, verb, size):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *verb, f"--shm-size={size}")
    refused(r, "--shm-size", "not a size of shared memory")
