"""Bad records and interrupts on the verbs that read and write records of their own: calibration
family documents and reports (calibrate, predict --calibration and its --check-e2e), imported results
(import-throughput), the server record (stop), and Ctrl-C at any moment, also while the tool loads.
Each damaged input is refused before anything is selected, priced, written or signalled: exit code 2,
one error line naming the file and the key, nothing written, `git status` as it was. A recorded result
is replaced only when asked (--force), and an interrupt leaves the previous complete result or none,
with one line and exit code 130."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import FIXTURE_RUNS, ROOT, forge, forge_env
from test_bad_inputs import git_status, refused, writes_nothing

TIERS = ["4-8K", "8-16K", "16-32K"]
RECORDED_CALIBRATION = ROOT / "reports" / "calibration" / "2026-12-02-h200"     # tracked: never to be rewritten
OPTIONS = {"kernels": "checkout", "ops": "build", "quick": False, "smoke": False, "seed": 1234}
CAL_ARGS = ["--kernels", "checkout", "--ops", "build"]
DEVICE = {"device_name": "Stand-in Card", "arch": "gfx90a", "compute_units": 104, "toolkit": "hip 6.3",
          "torch": "2.10", "triton": "3.4", "driver": None}


# --- a calibration whose kernels follow simple laws (times small against the fixture runs' requests) --

def rec(dec: str, cand: str, kind: str, us: float | None, point: str, launch=None, weight=1.0, ok=True) -> dict:
    return {"decision": dec, "candidate": cand, "kind": kind, "launch": launch, "selectable": kind != "vendor",
            "point": point, "weight": weight, "ok": ok, "err": 0.001 if ok else None, "tol": 0.02, "error": None,
            "us": None if us is None else {"median": us, "p10": us * 0.99, "p90": us * 1.01, "n": 10}}


def family_records() -> dict[str, list[dict]]:
    prefill, decode = [], []
    for p in (0, 4096, 8192, 12288, 16384, 20480):
        f = 4096 * (p + 4097 / 2)
        prefill += [rec("prefill.16bit", "vLLM unified (16-row tiles)", "upstream", 1e-5 * f, f"P={p} C=4096"),
                    rec("prefill.16bit", "built-in", "builtin", 4e-6 * f, f"P={p} C=4096", [64, 64, 4, 1]),
                    rec("prefill.16bit", "BLOCK_M 128", "ours", 2.5e-6 * f, f"P={p} C=4096", [128, 64, 8, 2])]
    for ctx, up, ours in ((4096, 4.0, 2.0), (8192, 8.0, 3.0), (16384, 16.0, 5.0), (32768, 32.0, 8.0)):
        decode += [rec("decode.1.16bit", "vLLM unified 3D", "upstream", up, f"ctx={ctx}"),
                   rec("decode.1.16bit", "S64", "builtin", ours * 1.2, f"ctx={ctx}", [64, 32, 4, 2]),
                   rec("decode.1.16bit", "S128", "ours", ours, f"ctx={ctx}", [128, 32, 4, 2])]
    gemv = []
    for shape, calls in (("5120x6144", 64), ("96x5120", 48)):
        gemv += [rec(f"gemv.plain.{shape}.1", "F.linear", "upstream", 10.0, "M=1", weight=calls),
                 rec(f"gemv.plain.{shape}.1", "forge", "builtin", 6.0, "M=1", [0, 0], weight=calls),
                 rec(f"gemv.plain.{shape}.1", "forge b640 r2", "ours", 5.0, "M=1", [640, 2], weight=calls)]
    gemm = [rec("gemm.5120x6144", "default", "upstream", 100.0, "M=4096"),
            rec("gemm.5120x6144", "tunableop", "ours", 95.0, "M=4096")]
    write = [rec("write.b784.t1", "triton", "ours", 3.0, "block=784 tokens=1")]
    return {"gemv": gemv, "prefill": prefill, "decode": decode, "write": write, "gemm": gemm}


def family_doc(fam: str, records: list[dict], device: dict | None = None) -> dict:
    return {"family": fam, "device": dict(device or DEVICE), "options": dict(OPTIONS), "records": records,
            "notes": [], "seconds": 1.0}


def measured_folder(folder: Path, device: dict | None = None) -> Path:
    """The family documents of a calibration, as the families' processes leave them (no selection yet)."""
    folder.mkdir(parents=True, exist_ok=True)
    for fam, recs in family_records().items():
        (folder / f"{fam}.json").write_text(json.dumps(family_doc(fam, recs, device)))
    return folder


def calibrated_folder(tmp_path: Path) -> Path:
    """A complete calibration: the family documents and what `forge calibrate` made of them."""
    cal = measured_folder(tmp_path / "cal")
    r = forge(tmp_path, "calibrate", "--out", str(cal), *CAL_ARGS)
    assert r.returncode == 0, r.stderr
    return cal


class New:
    """What a damage function returns to replace a whole document (anything else it returns is ignored:
    it changed the document in place)."""

    def __init__(self, value):
        self.value = value


def edit(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    out = fn(data)
    path.write_text(json.dumps(out.value if isinstance(out, New) else data))


def snapshot(folder: Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def interrupted(r: subprocess.CompletedProcess) -> str:
    """Exit 130, no traceback, one line saying so (every other line is progress)."""
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    said = [x for x in lines if not x.startswith("[forge] ")]
    assert len(said) == 1 and "interrupted" in said[0], r.stderr
    return said[0]


# Runs `forge ARGS` and sends it SIGINT at a chosen moment, as Ctrl-C would: right after a file of the
# given name is renamed or copied into place (a result half written), or when a module is first imported.
SHIM = r'''
import os, runpy, shutil, signal, sys
when, what = sys.argv[1], sys.argv[2]
ctrl_c = lambda: os.kill(os.getpid(), signal.SIGINT)
if when == "import":
    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == what:
                sys.meta_path.remove(Finder)
                ctrl_c()
            return None
    sys.meta_path.insert(0, Finder)
elif when == "placed":
    def after(real):
        def placed(src, dst, *a, **k):
            out = real(src, dst, *a, **k)
            if os.path.basename(os.fspath(dst)) == what:
                ctrl_c()
            return out
        return placed
    os.replace, os.rename, shutil.copyfile = after(os.replace), after(os.rename), after(shutil.copyfile)
sys.argv = ["forge", *sys.argv[3:]]
runpy.run_module("forge", run_name="__main__", alter_sys=True)
'''


def forge_interrupted(tmp_path: Path, when: str, what: str, *args: str, **env) -> subprocess.CompletedProcess:
    shim = tmp_path / "ctrl_c.py"
    shim.write_text(SHIM)
    return subprocess.run([sys.executable, str(shim), when, what, *args], cwd=ROOT, env=forge_env(tmp_path, **env),
                          capture_output=True, text=True, timeout=120)


# --- import-throughput ------------------------------------------------------------------------------

def organizers_folder(tmp_path: Path, name: str = "testdata", run: str = "fast") -> Path:
    src = tmp_path / name
    for t in TIERS:
        d = src / "test" / f"{t}_throughput"
        d.mkdir(parents=True)
        shutil.copyfile(FIXTURE_RUNS / run / f"{t}.json", d / "result.json")
    return src


def test_an_import_into_a_scored_run_is_refused_unless_forced(tmp_path):
    a, b = organizers_folder(tmp_path, "a"), organizers_folder(tmp_path, "b", run="base")
    assert forge(tmp_path, "import-throughput", str(a), "--run-id", "R").returncode == 0
    assert forge(tmp_path, "score", "--run", "R").returncode == 0
    rdir = tmp_path / "runs" / "R"
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "import-throughput", str(b), "--run-id", "R"), "run R", "already holds", "a score")
    # asked: the folder is replaced whole (no score of other results is left beside the new ones)
    r = forge(tmp_path, "import-throughput", str(b), "--run-id", "R", FORCE="1")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in rdir.iterdir()) == sorted([*(f"{t}.json" for t in TIERS), "manifest.json"])
    assert all((rdir / f"{t}.json").read_bytes() == (FIXTURE_RUNS / "base" / f"{t}.json").read_bytes() for t in TIERS)
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name != "R"], "no staging folder left"


@pytest.mark.parametrize("key,value,words", [
    ("output_throughput", "fast", ["output_throughput", "'fast'"]),
    ("output_throughput", -5, ["output_throughput", "-5"]),
    ("output_throughput", math.nan, ["output_throughput", "nan"]),
    ("ttfts", "0.1,0.2", ["ttfts", "a list"]),
    ("completed", None, ["completed"]),
    ("input_lens", [1, 2], ["input_lens", "entries"]),
])
def test_an_import_reads_every_result_as_score_does_before_writing(tmp_path, key, value, words):
    src = organizers_folder(tmp_path)
    # the last tier is the damaged one: the first two must not be written either
    edit(src / "test" / "16-32K_throughput" / "result.json", lambda d: d.pop(key) if value is None else d.update({key: value}))
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "import-throughput", str(src), "--run-id", "R"), "16-32K_throughput", *words)


@pytest.mark.parametrize("args,words", [
    (["--profile", "bogus-profile"], ["--profile", "bogus-profile", "no such profile"]),
    (["--profile", "../../x"], ["--profile", "not a plain name"]),
])
def test_an_import_checks_its_profile(tmp_path, args, words):
    src = organizers_folder(tmp_path)
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "import-throughput", str(src), *args), *words)


def test_a_required_argument_given_empty_is_not_told_to_be_left_out(tmp_path):
    with writes_nothing(tmp_path):
        err = refused(forge(tmp_path, "import-throughput", ""), "FOLDER", "empty")
    assert "leave" not in err


def test_an_unbalanced_quote_hint_names_the_option_given(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "bench-all-tiers", "--model", "/m", "--client", '"x')
    refused(r, "--client", "unbalanced")
    assert "e.g. --client " in r.stderr and "--vllm" not in r.stderr


@pytest.mark.parametrize("force", [False, True])
def test_an_interrupted_import_leaves_the_previous_run_or_none(tmp_path, force):
    a, b = organizers_folder(tmp_path, "a"), organizers_folder(tmp_path, "b", run="base")
    runs = tmp_path / "runs"
    if force:
        assert forge(tmp_path, "import-throughput", str(a), "--run-id", "R").returncode == 0
    before = snapshot(runs) if runs.exists() else {}
    # Ctrl-C right after the first tier's result is copied
    r = forge_interrupted(tmp_path, "placed", "4-8K.json", "import-throughput", str(b), "--run-id", "R",
                          **({"FORCE": "1"} if force else {}))
    interrupted(r)
    assert (snapshot(runs) if runs.exists() else {}) == before
    assert not runs.exists() or [p.name for p in runs.iterdir()] == (["R"] if force else [])


# --- calibrate --------------------------------------------------------------------------------------

def test_calibrate_refuses_to_rewrite_a_recorded_calibration(tmp_path):
    before = snapshot(RECORDED_CALIBRATION)
    try:
        with writes_nothing(tmp_path):
            r = forge(tmp_path, "calibrate", "--out", str(RECORDED_CALIBRATION.relative_to(ROOT)),
                      "--kernels", "installed", "--ops", "build")
        refused(r, "tracked by git", "would replace it")
        assert "--force" in r.stderr
    finally:                            # the checkout as it was, should the refusal ever fail
        for f, data in before.items():
            if Path(f).read_bytes() != data:
                Path(f).write_bytes(data)


def test_calibrate_into_a_complete_calibration_needs_force(tmp_path):
    cal = calibrated_folder(tmp_path)
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "calibrate", "--out", str(cal), *CAL_ARGS), "a complete calibration", "replace it")
    r = forge(tmp_path, "calibrate", "--out", str(cal), *CAL_ARGS, "--force")
    assert r.returncode == 0, r.stderr


def _damage(fam: str, fn):
    return fam, fn


FAMILY_DAMAGE = {
    "document a list": _damage("gemv", lambda d: New([])),
    "document null": _damage("gemv", lambda d: New(None)),
    "records a string": _damage("gemv", lambda d: d.update(records="x")),
    "records of numbers": _damage("prefill", lambda d: d.update(records=[1, 2])),
    "no decision": _damage("decode", lambda d: d["records"][0].pop("decision")),
    "weight a string": _damage("gemv", lambda d: d["records"][1].update(weight="x")),
    "unknown decision": _damage("gemv", lambda d: d["records"][0].update(decision="gemv.x")),
    "decision of another family": _damage("gemv", lambda d: d["records"][0].update(decision="prefill.16bit")),
    "launch a string": _damage("prefill", lambda d: d["records"][1].update(launch="64,64")),
    "device a string": _damage("decode", lambda d: d.update(device="x")),
    "negative time": _damage("decode", lambda d: d["records"][2]["us"].update(median=-4.0, p10=-4.0, p90=-4.0)),
    "NaN time": _damage("gemv", lambda d: d["records"][2]["us"].update(median=math.nan)),
    "zero time": _damage("gemm", lambda d: d["records"][1]["us"].update(median=0, p10=0)),
    "a bad point": _damage("prefill", lambda d: d["records"][0].update(point="P=x")),
    "another device": _damage("gemm", lambda d: d["device"].update(device_name="Other Card", compute_units=60)),
}
DAMAGE_WORDS = {"document a list": ["a JSON list"], "document null": ["a JSON NoneType"],
                "records a string": ["'records'"], "records of numbers": ["'records[0]'"],
                "no decision": ["'records[0].decision'"], "weight a string": ["'records[1].weight'"],
                "unknown decision": ["'records[0].decision'", "gemv.x"],
                "decision of another family": ["'records[0].decision'"], "launch a string": ["'records[1].launch'"],
                "device a string": ["'device'"], "negative time": ["'records[2].us.median'", "-4.0"],
                "NaN time": ["'records[2].us.median'"], "zero time": ["'records[1].us.median'"],
                "a bad point": ["'records[0].point'"], "another device": ["'device'", "Other Card", "one device"]}


@pytest.mark.parametrize("damage", sorted(FAMILY_DAMAGE))
def test_calibrate_refuses_a_damaged_family_document_before_selecting(tmp_path, damage):
    fam, fn = FAMILY_DAMAGE[damage]
    cal = measured_folder(tmp_path / "cal")
    edit(cal / f"{fam}.json", fn)
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "calibrate", "--out", str(cal), *CAL_ARGS), f"{fam}.json", *DAMAGE_WORDS[damage])


def test_a_device_record_cannot_name_a_file_outside_the_tables(tmp_path):
    cal = measured_folder(tmp_path / "cal")
    escape = "/.." * 12 + f"{tmp_path}/ESCAPED"
    for f in cal.glob("*.json"):
        edit(f, lambda d: d["device"].update(compute_units=escape))
    tables = ROOT / "configs" / "kernels" / "tuned"
    with writes_nothing(tmp_path, tables):
        refused(forge(tmp_path, "calibrate", "--out", str(cal), *CAL_ARGS, "--install"), "device.compute_units")
    assert not list(tmp_path.glob("ESCAPED*"))


@pytest.mark.parametrize("args,words", [
    (["--families", ""], ["--families", "names no family"]),
    (["--families", ","], ["--families", "names no family"]),
    (["--seed", "99999999999999999999999"], ["--seed", "not a seed"]),
    (["--seed", "-1"], ["--seed", "not a seed"]),
])
def test_calibrate_counts_have_bounds(tmp_path, args, words):
    out = tmp_path / "cal"
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "calibrate", "--out", str(out), *CAL_ARGS, *args), *words)
    assert not out.exists()


def test_an_interrupted_calibration_leaves_one_set_of_results(tmp_path):
    cal = calibrated_folder(tmp_path)
    old_table = json.loads((cal / "table.json").read_text())
    # the decode family measured again with other times: 64 segments win now, where 128 did
    edit(cal / "decode.json", lambda d: [r["us"].update({k: v / 2 for k, v in r["us"].items() if k != "n"})
                                         for r in d["records"] if r["candidate"] == "S64"])
    r = forge_interrupted(tmp_path, "placed", "table.json", "calibrate", "--out", str(cal), *CAL_ARGS, FORCE="1")
    interrupted(r)
    table = json.loads((cal / "table.json").read_text())
    assert json.loads((cal / "calibration.json").read_text())["table"] == table, "the folder disagrees with itself"
    # segments per KV heads, batch and context (forge-tuned/2): 4 KV heads, batch 1, at 32K
    assert table["decode"]["segments"]["4"]["1"]["32768"] == 64
    assert old_table["decode"]["segments"]["4"]["1"]["32768"] == 128
    assert not [p.name for p in cal.iterdir() if p.name.startswith(".")], "no staging files left"


# --- predict --calibration --------------------------------------------------------------------------

def _choose(d: dict, name: str) -> None:
    d["selection"]["prefill.16bit"]["chosen"] = name


REPORT_DAMAGE = {
    "chosen names a missing candidate": ("calibration.json", lambda d: _choose(d, "no such launch"),
                                         ["selection.prefill.16bit.chosen", "no such launch"]),
    "a candidate's time a string": ("calibration.json", lambda d: d["selection"]["decode.1.16bit"]["candidates"]
                                    ["S128"].update(us="fast"), ["selection.decode.1.16bit.candidates.S128.us"]),
    "a candidate's time 0": ("calibration.json", lambda d: d["selection"]["decode.1.16bit"]["candidates"]
                             ["S128"].update(us=0), ["selection.decode.1.16bit.candidates.S128.us"]),
    "device a string": ("calibration.json", lambda d: d.update(device="x"), ["'device'"]),
    "no provenance": ("calibration.json", lambda d: d.pop("provenance"), ["'provenance'"]),
    "family document a list": ("gemv.json", lambda d: New([]), ["gemv.json", "a JSON list"]),
    "a bad point": ("decode.json", lambda d: d["records"][0].update(point="ctx=many"), ["decode.json",
                                                                                         "'records[0].point'"]),
    "records a string": ("prefill.json", lambda d: d.update(records="x"), ["prefill.json", "'records'"]),
    "a record's time negative": ("prefill.json", lambda d: d["records"][0]["us"].update(median=-1.0, p10=-1.0),
                                 ["prefill.json", "'records[0].us.median'"]),
}


@pytest.mark.parametrize("damage", sorted(REPORT_DAMAGE))
def test_predict_refuses_a_damaged_calibration_before_printing(tmp_path, damage):
    cal = calibrated_folder(tmp_path)
    name, fn, words = REPORT_DAMAGE[damage]
    edit(cal / name, fn)
    out = tmp_path / "out"
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--calibration", str(cal), "--out", str(out))
    refused(r, *words)
    assert r.stdout == "", "nothing is printed before every input is read"


def test_predict_refuses_a_calibration_whose_families_are_gone(tmp_path):
    cal = calibrated_folder(tmp_path)
    (cal / "prefill.json").unlink()
    (cal / "decode.json").unlink()
    with writes_nothing(tmp_path):
        err = refused(forge(tmp_path, "predict", "--calibration", str(cal), "--out", str(tmp_path / "out")),
                      "not found", "family as measured")
    assert "prefill.json" in err or "decode.json" in err


# --- predict --calibration --check-e2e --------------------------------------------------------------

def e2e_folder(tmp_path: Path) -> Path:
    """An e2e results folder: upstream and contest side by side (the fixture runs, every request's times)."""
    e2e = tmp_path / "e2e"
    for prof, run in (("upstream", "base"), ("contest", "fast")):
        shutil.copytree(FIXTURE_RUNS / run, e2e / "runs" / prof)
    return e2e


def test_check_e2e_reads_a_packed_record_as_it_is(tmp_path):
    cal, e2e = calibrated_folder(tmp_path), e2e_folder(tmp_path)
    assert forge(tmp_path, "pack-run", str(e2e)).returncode == 0
    assert not (e2e / "runs").exists()
    r = forge(tmp_path, "predict", "--calibration", str(cal), "--check-e2e", str(e2e), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert all(f"{t}: predicted tok/s ratio" in r.stdout for t in TIERS), r.stdout


def test_check_e2e_names_the_profiles_an_unpacked_folder_holds(tmp_path):
    cal, e2e = calibrated_folder(tmp_path), e2e_folder(tmp_path)
    (e2e / "runs" / "contest").rename(e2e / "runs" / "contest-gemv")
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "predict", "--calibration", str(cal), "--check-e2e", str(e2e)),
                "no runs/contest/", "contest-gemv, upstream")


E2E_DAMAGE = {
    "itls strings": ("upstream", lambda d: d.update(itls=["0.1"] * len(d["itls"])), ["itls[0]"]),
    "duration a string": ("upstream", lambda d: d.update(duration="4.2"), ["'duration'"]),
    "output_throughput 0": ("upstream", lambda d: d.update(output_throughput=0), ["'output_throughput'"]),
    "fewer ttfts than requests": ("upstream", lambda d: d.update(ttfts=d["ttfts"][:-1]), ["'ttfts'", "entries"]),
    "fewer prompts than requests": ("contest", lambda d: d.update(input_lens=d["input_lens"][:-1]),
                                    ["'input_lens'", "entries"]),
    "a request without output": ("upstream", lambda d: d["output_lens"].__setitem__(1, 0), ["output_lens[1]"]),
}


@pytest.mark.parametrize("damage", sorted(E2E_DAMAGE))
def test_check_e2e_reads_results_as_score_does(tmp_path, damage):
    cal, e2e = calibrated_folder(tmp_path), e2e_folder(tmp_path)
    prof, fn, words = E2E_DAMAGE[damage]
    edit(e2e / "runs" / prof / "8-16K.json", fn)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--calibration", str(cal), "--check-e2e", str(e2e), "--out", str(tmp_path / "o"))
    refused(r, f"runs/{prof}/8-16K.json", *words)
    assert r.stdout == ""


# --- stop -------------------------------------------------------------------------------------------

@pytest.fixture
def bystanders():
    """Two live processes, each in a group of its own, that forge did not start."""
    ps = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
          for _ in range(2)]
    time.sleep(0.2)
    yield ps
    for p in ps:
        p.kill()
        p.wait()


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


@pytest.mark.parametrize("record", ["no start time", "another command line", "another group"])
def test_stop_signals_nothing_on_a_record_that_does_not_hold(tmp_path, bystanders, record):
    one, other = bystanders
    st = {"pid": one.pid, "pgid": one.pid, "start_time": _start_time(one.pid), "run_id": "x", "boot_id": None,
          "cmdline": ["vllm", "serve", "/m", "--port", "8001"], "server_args": ["serve", "/m", "--port", "8001"]}
    if record == "no start time":       # the record of the issue: a pid that is gone, a live group
        st.update(pid=4000000, start_time=None, pgid=other.pid)
    elif record == "another group":     # the process is the one recorded, the group is not its own
        st.update(cmdline=list(one.args), server_args=list(one.args[1:]), pgid=other.pid)
    state = tmp_path / "build" / "serve" / "server.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps(st))
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "stop"), "server.json")
    assert one.poll() is None and other.poll() is None, "a process was signalled"


# --- interrupts while the tool loads ------------------------------------------------------------------

@pytest.mark.parametrize("module,args", [
    ("forge.cli", ["stop"]),
    ("forge.run.calibrate", ["calibrate", "--out", "{tmp}/cal"]),
    ("forge.builder.image", ["import-throughput", "{tmp}/nowhere"]),
    ("forge.run.score", ["predict", "--speedup", "gemv=2", "--out", "{tmp}/out"]),
    ("forge.run.predict_calibration", ["predict", "--calibration", "{tmp}/cal", "--out", "{tmp}/out"]),
])
def test_ctrl_c_while_the_tool_loads_prints_one_line(tmp_path, module, args):
    status = git_status()
    r = forge_interrupted(tmp_path, "import", module, *(a.format(tmp=tmp_path) for a in args))
    interrupted(r)
    assert not [p for p in tmp_path.iterdir() if p.name != "ctrl_c.py"], "nothing written"
    assert git_status() == status
