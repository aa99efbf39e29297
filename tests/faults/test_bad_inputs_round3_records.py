"""Nothing recorded is replaced without --force, whichever verb writes: a prediction into a folder git
tracks (predict --out), the profile document at prefill-profile's default --out, a run's decode.md
(e2e-decode), a local edit of a run's summary.md (unpack-run in place), and the committed tuned table
(calibrate --install) — and a calibration made again from families measured earlier keeps the provenance
of that measurement instead of taking this checkout's. Each refusal: exit 2, one line naming the folder
and what it holds, `--force` in the fix, nothing written, `git status` as it was."""

from __future__ import annotations

import json
import shutil

import pytest
from checkout_copy import commit, forge_in, make_checkout, status
from helpers import FIXTURE_RUNS, ROOT, forge, h200_e2e
from test_bad_inputs import refused, writes_nothing

RECORDED_CALIBRATION = ROOT / "reports" / "calibration" / "2026-12-02-h200"
PROFILED_RUN = ROOT / "reports" / "e2e" / "2026-12-03-h200-profile-6000-decode-64"     # packed, read only
TABLE = "configs/kernels/tuned/nvidia-h200-sm_90-132cu.json"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    root = make_checkout(tmp_path_factory.mktemp("round3-records") / "checkout")
    src = ROOT / "reports" / "predict" / "prefill-attn-x12"
    contest = h200_e2e() / "2026-11-30-h200-contest"
    commit(root, {**{f"reports/predict/x12/{p.name}": p.read_bytes() for p in src.iterdir()},
                  "reports/prefill-profile/prefill-profile.md": "# the recorded document\n",
                  "reports/prefill-profile/prefill-profile.json": "{}\n",
                  **{f"reports/e2e/r/{p.relative_to(contest)}": p.read_bytes()
                     for p in (contest / "runs").rglob("*") if p.is_file()},
                  "reports/e2e/r/decode.md": "# the recorded decode document\n"})
    return root


def _refused_to_replace(r, *words) -> None:
    refused(r, "already holds", *words)
    assert "--force" in r.stderr, r.stderr


def test_predict_into_a_tracked_prediction_needs_force(tmp_path, checkout):
    before = status(checkout)
    with writes_nothing(tmp_path):
        r = forge_in(checkout, tmp_path, "predict", "--speedup", "gemv=1.3", "--out", "reports/predict/x12")
    _refused_to_replace(r, "reports/predict/x12", "git tracks", "predict.json")
    assert r.stdout == "" and status(checkout) == before
    r = forge_in(checkout, tmp_path, "predict", "--speedup", "gemv=1.3", "--out", "reports/predict/x12", "--force")
    assert r.returncode == 0, r.stderr
    assert "reports/predict/x12/predict.json" in status(checkout)
    commit(checkout, {})                    # the next case starts from a clean checkout


def test_prefill_profile_at_its_default_out_needs_force(tmp_path, checkout):
    before = status(checkout)
    with writes_nothing(tmp_path):
        r = forge_in(checkout, tmp_path, "prefill-profile", str(PROFILED_RUN), "--title", "again")
    _refused_to_replace(r, "reports/prefill-profile", "prefill-profile.json")
    assert status(checkout) == before


def test_e2e_decode_of_a_tracked_run_needs_force(tmp_path, checkout):
    before = status(checkout)
    with writes_nothing(tmp_path):
        r = forge_in(checkout, tmp_path, "e2e-decode", "reports/e2e/r")
    _refused_to_replace(r, "reports/e2e/r", "decode.md")
    assert status(checkout) == before and not (checkout / "reports" / "e2e" / "r" / "decode.json").exists()


def test_unpack_in_place_keeps_a_local_edit_unless_forced(tmp_path):
    run = tmp_path / "run"
    (run / "runs" / "fast").mkdir(parents=True)
    (run / "summary.md").write_text("# the run as recorded\n")
    shutil.copyfile(FIXTURE_RUNS / "fast" / "4-8K.json", run / "runs" / "fast" / "4-8K.json")
    assert forge(tmp_path, "pack-run", str(run)).returncode == 0
    (run / "summary.md").write_text("# the run, with my notes\n")
    with writes_nothing(tmp_path):
        _refused_to_replace(forge(tmp_path, "unpack-run", str(run)), "summary.md")
    r = forge(tmp_path, "unpack-run", str(run), "--force")
    assert r.returncode == 0, r.stderr
    assert (run / "summary.md").read_text() == "# the run as recorded\n" and (run / "runs" / "fast" / "4-8K.json").is_file()
    # a folder unpacked as it was recorded unpacks again without asking (nothing of it changes)
    assert forge(tmp_path, "unpack-run", str(run)).returncode == 0


def test_a_calibration_made_again_keeps_what_was_measured(tmp_path, checkout):
    cal = tmp_path / "cal"
    shutil.copytree(RECORDED_CALIBRATION, cal)
    measured = json.loads((cal / "calibration.json").read_text())["provenance"]
    table = (checkout / TABLE).read_bytes()
    before = status(checkout)
    r = forge_in(checkout, tmp_path, "calibrate", "--out", str(cal), "--force", "--install",
                 "--kernels", "installed", "--ops", "build")
    assert "Traceback" not in r.stderr, r.stderr
    # nothing was measured again: the selection made again names the measurement's provenance, which
    # (a GPU machine's path, a dirty commit without its diff's hash) is not shipped over the committed table
    assert json.loads((cal / "calibration.json").read_text())["provenance"] == measured
    assert json.loads((cal / "table.json").read_text())["provenance"] == measured
    refused(r, "table.json", "provenance")
    assert (checkout / TABLE).read_bytes() == table and status(checkout) == before
