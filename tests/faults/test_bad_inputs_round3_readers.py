"""Every record is read by one bounded JSON reader (forge.records.read_json): a file nested past a record's
depth, an integer longer than Python parses, a FIFO or a device in place of the file, or an object giving a
key twice is refused with one line naming the file, from whichever verb reads it (stop, clean, score,
compare, predict, import-throughput, calibrate): no traceback, no wait, nothing written or signalled."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import FIXTURE_RUNS, forge
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_records import CAL_ARGS, measured_folder, organizers_folder

DAMAGE = {"nested": ("[" * 100000 + "]" * 100000, "nested deeper"),
          "long integer": ('{"completed": ' + "7" * 5000 + "}", "4300 digits"),
          "fifo": (None, "not a regular file"),
          "device": (None, "not a regular file")}


def damage(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.symlink("/dev/zero", path)
    else:
        path.write_text(DAMAGE[kind][0])


def _runs(tmp_path: Path) -> tuple[Path, Path]:
    run, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    shutil.copytree(FIXTURE_RUNS / "base", base)
    return run, base


def _stop(tmp_path, kind):
    damage(tmp_path / "build" / "serve" / "server.json", kind)
    return ["stop"], {}, "server.json"


def _clean(tmp_path, kind):
    damage(tmp_path / "build" / "serve" / "server.json", kind)
    return ["clean"], {"FORGE_DIST_DIR": str(tmp_path / "dist")}, "server.json"


def _score(tmp_path, kind):
    run, _ = _runs(tmp_path)
    damage(run / "8-16K.json", kind)
    return ["score", "--run", str(run)], {}, "8-16K.json"


def _compare(tmp_path, kind):
    run, base = _runs(tmp_path)
    damage(base / "16-32K.json", kind)
    return ["compare", "--a", str(base), "--b", str(run)], {}, "16-32K.json"


def _predict(tmp_path, kind):
    run, base = _runs(tmp_path)
    damage(run / "4-8K.json", kind)
    return ["predict", "--run", str(run), "--reference", str(base), "--out", str(tmp_path / "o")], {}, "4-8K.json"


def _import(tmp_path, kind):
    src = organizers_folder(tmp_path)
    damage(src / "test" / "8-16K_throughput" / "result.json", kind)
    return ["import-throughput", str(src), "--run-id", "R"], {}, "8-16K_throughput/result.json"


def _calibrate(tmp_path, kind):
    cal = measured_folder(tmp_path / "cal")
    damage(cal / "decode.json", kind)
    return ["calibrate", "--out", str(cal), *CAL_ARGS], {}, "decode.json"


VERBS = {"stop": _stop, "clean": _clean, "score": _score, "compare": _compare, "predict": _predict,
         "import-throughput": _import, "calibrate": _calibrate}
CASES = [(v, k) for v in VERBS for k in DAMAGE if k in ("nested", "long integer") or v == "stop"]


@pytest.mark.parametrize("verb,kind", CASES)
def test_a_record_past_the_readers_bounds_is_refused_naming_it(tmp_path, verb, kind):
    args, env, name = VERBS[verb](tmp_path, kind)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, timeout=60, **env)
    refused(r, name, DAMAGE[kind][1])


def test_a_result_giving_a_key_twice_is_not_imported(tmp_path):
    src = organizers_folder(tmp_path)
    p = src / "test" / "4-8K_throughput" / "result.json"
    text = p.read_text().rstrip()
    assert text.endswith("}")
    p.write_text(text[:-1] + ', "output_throughput": 99999}')
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "import-throughput", str(src), "--run-id", "R"), "4-8K_throughput/result.json",
                "'output_throughput'", "twice")


def test_a_calibration_giving_its_records_twice_is_refused(tmp_path):
    cal = measured_folder(tmp_path / "cal")
    p = cal / "gemv.json"
    text = json.dumps(json.loads(p.read_text()))
    p.write_text(text[:-1] + ', "records": []}')
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "calibrate", "--out", str(cal), *CAL_ARGS), "gemv.json", "'records'", "twice")
