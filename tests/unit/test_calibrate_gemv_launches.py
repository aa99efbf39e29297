"""`forge calibrate`'s GEMV family offers only launches forge_gemv.cu builds: a full `calibrate --tp 2` on an
H200 (2026-12-05) recorded 128 of its 1,116 GEMV records as failures that were no kernel's fault, the
launches (64 or 128 threads, 4 rows) the kernel refuses at 9-16 tokens (64 partial sums per thread)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
import forge_tuned  # noqa: E402
from calibrate import gemv  # noqa: E402


@pytest.mark.parametrize("on_amd", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_every_offered_launch_is_built_and_the_built_in_choice_stays(on_amd, fused):
    for m in range(1, 17):
        for quick in (False, True):
            offered = gemv.launches(m, fused, on_amd, quick)
            refused = [(b, r, forge_tuned.gemv_launch_problem(b, r, m, fused, on_amd)) for b, r in offered
                       if forge_tuned.gemv_launch_problem(b, r, m, fused, on_amd) is not None]
            assert not refused, (m, refused)
            if not (fused and on_amd and m > 8):      # the only range the kernel does not build at all
                assert offered[0] == (0, 0) and len(offered) >= (2 if quick else 3), (m, offered)
            else:
                assert offered == [], offered


def test_the_launches_the_tp2_calibration_recorded_as_failures_are_no_longer_offered():
    for m in range(9, 17):
        offered = gemv.launches(m, False, False)
        assert (64, 4) not in offered and (128, 4) not in offered and (64, 2) in offered, (m, offered)
    assert (64, 4) in gemv.launches(8, False, False)          # 32 partial sums at 5-8 tokens: built on NVIDIA
