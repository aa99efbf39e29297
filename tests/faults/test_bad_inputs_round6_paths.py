"""Paths that are not what a verb expects, and what Ctrl-C says: `forge pack-run` given a folder that is not
a run folder (reports/predict/, a plan's logs) or one whose raw files git tracks; a symlink loop given as
--out, --pack, --speedups or a pack-run folder (or found inside one); a named pipe or a device given as a
YAML file; and the line printed when a verb with nothing to resume (plan, predict) is interrupted. Each
mistake is refused before anything is written: exit code 2, one error line naming the path and what is
wrong, a `fix:` line, no traceback, the checkout's status as it was."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest
from checkout_copy import commit, forge_in, make_checkout, status
from helpers import FIXTURE_RUNS, forge, tiny_model
from test_bad_inputs import refused, writes_nothing


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round6-model"))


def fix_line(text: str) -> str:
    return next((x for x in text.splitlines() if x.startswith("  fix: ")), "")


# --- pack-run: a run folder only, and never a file git tracks --------------------------------------------

@pytest.mark.parametrize("folder,files", [
    # packed into reports/predict/raw.tgz, its 27 tracked files from 11 predictions deleted
    ("reports/predict", 27),
    # the plan check's four kv-*.log files, which tests/unit/test_plan_check.py reads, deleted
    ("reports/plan/2026-12-04-h200-kv-check", 4),
])
def test_pack_run_of_a_folder_that_is_not_a_run_folder_is_refused(tmp_path_factory, tmp_path, folder, files):
    checkout = make_checkout(tmp_path_factory.mktemp("round6-pack") / "checkout", extra=("reports/predict",
                                                                                            "reports/plan"))
    before = status(checkout)
    with writes_nothing(tmp_path):
        r = forge_in(checkout, tmp_path, "pack-run", folder)
    refused(r, folder, "not a run folder", f"its {files} raw files")
    assert "reports/e2e/<run>/" in fix_line(r.stderr) and "reports/runs/<run>/" in fix_line(r.stderr)
    assert status(checkout) == before and not (checkout / folder / "raw.tgz").exists()


def test_pack_run_of_a_loose_folder_outside_the_checkout_is_refused(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("my notes\n")
    (notes / "bench.log").write_text("a log I keep\n")
    with writes_nothing(tmp_path):             # packed and both files removed
        refused(forge(tmp_path, "pack-run", str(notes)), "not a run folder")


def test_pack_run_of_tracked_raw_files_is_refused_and_an_untracked_run_still_packs(tmp_path_factory, tmp_path):
    checkout = make_checkout(tmp_path_factory.mktemp("round6-tracked") / "checkout")
    recorded = {f"reports/runs/r/{n}": (FIXTURE_RUNS / "fast" / n).read_text()
                for n in ("manifest.json", "4-8K.json", "8-16K.json", "16-32K.json")}
    commit(checkout, {**recorded, "reports/runs/r/serve.json": "{}\n", "reports/runs/r/summary.md": "# r\n"})
    before = status(checkout)
    with writes_nothing(tmp_path):             # the five raw files deleted from the checkout
        r = forge_in(checkout, tmp_path, "pack-run", "reports/runs/r")
    err = refused(r, "reports/runs/r", "5 of its raw files are tracked by git", "16-32K.json, 4-8K.json, 8-16K.json, ...",
                  "nothing was packed")
    assert "serve.json" not in err and "git rm --cached" in fix_line(r.stderr) and "cp -r" in fix_line(r.stderr)
    assert status(checkout) == before and not (checkout / "reports/runs/r/raw.tgz").exists()
    # a fresh run of the same shape that git does not track packs as before
    fresh = checkout / "reports" / "runs" / "new"
    shutil.copytree(FIXTURE_RUNS / "fast", fresh)
    r = forge_in(checkout, tmp_path, "pack-run", "reports/runs/new")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in fresh.iterdir()) == ["raw.tgz"]
    assert status(checkout) == before + "?? reports/runs/new/raw.tgz\n"


# --- a symlink loop: refused, naming it ------------------------------------------------------------------

def loop(tmp_path: Path, name: str = "loop1") -> Path:
    a, b = tmp_path / name, tmp_path / f"{name}-back"
    os.symlink(b, a)
    os.symlink(a, b)
    return a


E2E = ["e2e-gpu", "--round", "final", "--bundle", "", "--vllm", "false", "--client", "false", "--no-plumbing",
       "--no-fault", "--start-guess-s", "0", "--deadline-s", "100000"]


@pytest.mark.parametrize("args", [
    # RuntimeError: Symlink loop from '.../loop1' (paths.outside_sources), rc 1
    ["plan", "--round", "final", "--out", "{loop}"],
    ["plan", "--round", "final", "--out", "{loop}/sub"],
    ["predict", "--round", "final", "--speedup", "gemv=1.1", "--out", "{loop}"],
    ["predict", "--speedup", "gemv=1.1", "--out", "{loop}"],
    # the traceback came from the refusal being built (config.load_yaml -> paths.rel)
    ["predict", "--round", "final", "--speedups", "{loop}"],
    [*E2E, "--model", "{model}", "--out", "{loop}"],
    [*E2E, "--model", "{model}", "--out", "{tmp}/e2e", "--pack", "{loop}"],
    [*E2E, "--model", "{model}", "--out", "{tmp}/e2e", "--pack", "{loop}/e2e.tgz"],
    ["pack-run", "{loop}"],
])
def test_a_symlink_loop_given_as_a_path_is_refused(tmp_path, model, args):
    lp = loop(tmp_path)
    args = [a.replace("{loop}", str(lp)).replace("{model}", str(model)).replace("{tmp}", str(tmp_path)) for a in args]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, timeout=60)
    refused(r, f"{lp}", "a symlink loop")
    assert "leads back to itself" in fix_line(r.stderr)


def test_pack_run_refuses_a_symlink_loop_inside_the_run_folder(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUNS / "fast", run / "runs" / "fast")
    (run / "summary.json").write_text("{}\n")
    lp = loop(run / "runs", "hostname")
    with writes_nothing(tmp_path):             # a traceback from the check for links leading out
        refused(forge(tmp_path, "pack-run", str(run)), f"{lp}", "a symlink loop", "nothing was packed")


# --- a YAML file that is a named pipe or a device ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_yaml_file_that_is_not_a_regular_file_is_named_so(tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "speedups.yaml"
        os.mkfifo(path)                        # nobody writes to it: a blocking open would wait for ever
    else:
        path = Path("/dev/zero")
    with writes_nothing(tmp_path):             # "file not found", though the file is there
        r = forge(tmp_path, "predict", "--round", "final", "--speedups", str(path), "--out", str(tmp_path / "p"),
                  timeout=30)
    refused(r, str(path), "not a regular file", "a named pipe (FIFO)" if kind == "fifo" else "a device")
    assert "file not found" not in r.stderr


# --- Ctrl-C: what the line says is true of the verb ------------------------------------------------------

@pytest.mark.parametrize("verb", ["plan", "predict"])
def test_ctrl_c_in_a_verb_with_nothing_to_resume_does_not_promise_a_resume(tmp_path, monkeypatch, capsys, verb):
    """Ctrl-C while plan or predict --round final computes (their --out not written yet) said "finished
    stages are kept, rerun to resume": neither keeps a stage or resumes one."""
    from forge import cli
    from forge.run import plan, predict_final

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(plan, "plan", ctrl_c)
    monkeypatch.setattr(predict_final, "predict_final", ctrl_c)
    out = tmp_path / "out"
    args = ["plan", "--round", "final"] if verb == "plan" else ["predict", "--round", "final", "--speedup", "gemv=1.1"]
    with writes_nothing(tmp_path):
        rc = cli.main([*args, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 130, err
    assert err.strip() == f"forge {verb}: interrupted; it has no stages to resume: rerun the command", err
    # the verbs that do resume keep the line their tests and users know; each is a verb of the tool
    verbs = set(next(a.choices for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)))
    assert cli.RESUMES <= verbs and {"bench-all-tiers", "sweep", "e2e-gpu", "calibrate"} <= cli.RESUMES
