"""Inputs found to be taken wrongly in the twentieth round of input hardening.

`forge e2e-gpu --round final --capacity contest:max-num-seqs=+4` (or `=04`, or max-num-batched-tokens written so):
taken, the server given --max-num-seqs 4, where the same value in the final round's variables (MAX_NUM_SEQS=+4,
MAX_NUM_SEQS_4_8K=04) is refused as not written plainly. It is now refused as they are, naming the item, with the
plain number as the fix.

`forge e2e-gpu --out DIR --triton-cache DIR/triton` (or the results folder itself): taken; the servers' compiled
kernels were written into the results folder, which --pack and pack-run pack whole, so the run's archive held the
Triton cache. A --triton-cache inside --out is now refused before anything is written, with a folder beside it.
"""

from __future__ import annotations

import pytest
from test_bad_inputs import refused
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round17 import e2e_gpu_writes_nothing

# --- e2e-gpu --capacity: a value with a sign or a leading zero --------------------------------------------------------

@pytest.mark.parametrize("item,words,fix", [
    ("max-num-seqs=+4", "a sign before the number", "contest:max-num-seqs=4"),
    ("max-num-seqs=04", "a leading zero before the number", "contest:max-num-seqs=4"),
    ("max-num-batched-tokens=02048", "a leading zero before the number", "contest:max-num-batched-tokens=2048"),
])
def test_e2e_gpu_capacity_refuses_a_value_not_written_plainly(tmp_path, item, words, fix):
    """Taken before as the number (the final round's variables refuse "+64" and "064")."""
    spec = f"contest:{item}"
    r = e2e_gpu_writes_nothing(tmp_path, "--round", "final", "--profiles", "contest,upstream", "--capacity", spec)
    refused(r, f"--capacity {spec!r}: {item}: {words}")
    assert f"write the plain number, e.g. --capacity {fix}" in fix_line(r), r.stderr


def test_e2e_gpu_capacity_takes_a_plain_value(tmp_path):
    """The plain number passes --capacity; the deadline is what refuses this run."""
    r = e2e_gpu_writes_nothing(tmp_path, "--round", "final", "--profiles", "contest,upstream", "--capacity",
                               "contest:max-num-seqs=4", "--deadline-s", "30", "--reserve-s", "0")
    refused(r, "--deadline-s 30", "no tier would be measured")


# --- e2e-gpu --triton-cache: inside the results folder ---------------------------------------------------------------

@pytest.mark.parametrize("where", ["out/triton", "out"])
def test_e2e_gpu_refuses_a_triton_cache_inside_the_results_folder(tmp_path, where):
    """Taken before: the compiled kernels went into the results folder, and with it into the run's archive."""
    r = e2e_gpu_writes_nothing(tmp_path, "--triton-cache", str(tmp_path / where))
    refused(r, f"--triton-cache {tmp_path / where}: inside the results folder {tmp_path / 'out'}",
            "the run's archive would hold the Triton cache")
    assert f"--triton-cache {tmp_path.resolve() / 'out-triton'}" in fix_line(r), r.stderr
