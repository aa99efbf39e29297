"""A name from data never becomes a path unchecked: `forge stop` deletes only the server record it derives
itself (never the file a record's `state_file` names), a tier's name or file in configs/contest.yaml or a
tier key of configs/workload.yaml is refused on load unless it is a plain name, and `forge pack-run` never
packs what a link outside the run folder points to. Each refusal: exit 2, one line naming the file, key or
link, nothing written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkout_copy import forge_in, make_checkout, status
from helpers import FIXTURE_RUNS, forge
from test_bad_inputs import refused, writes_nothing

TIERS = ["4-8K", "8-16K", "16-32K"]


# --- forge stop: the record's own path, never the one it names -------------------------------------------

def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_deletes_the_record_it_reads_not_the_file_the_record_names(tmp_path):
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("not forge's\n")
    # the "server": a process of a session of its own that this test does not parent (so it is reaped
    # when it ends, as a server forge started is)
    argv = [sys.executable, "-c", "import time; time.sleep(120)"]
    pid = int(subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen(sys.argv[1:], "
                              "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)", *argv], capture_output=True, text=True, check=True).stdout)
    try:
        time.sleep(0.2)
        st = {"pid": pid, "pgid": pid, "start_time": _start_time(pid), "run_id": "x", "boot_id": None,
              "cmdline": argv, "server_args": argv[1:], "state_file": str(victim)}
        state = tmp_path / "build" / "serve" / "server.json"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps(st))
        r = forge(tmp_path, "stop")
        assert r.returncode == 0, r.stderr
        assert not _alive(pid), "the recorded server was stopped"
        assert victim.read_text() == "not forge's\n", "a file the record named was deleted"
        assert not state.exists(), "the record forge stop reads is dropped"
    finally:
        if _alive(pid):
            os.kill(pid, 9)


# --- tier names from the configs ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return make_checkout(tmp_path_factory.mktemp("round3-paths") / "checkout")


@pytest.fixture
def config_edit(checkout):
    """Edit a config of the checkout for one case; it is put back after."""
    kept = {}

    def edit(rel: str, fn) -> None:
        p = checkout / rel
        kept.setdefault(p, p.read_text())
        text = p.read_text()
        p.write_text(fn(text))
        assert p.read_text() != text, rel
    yield edit
    for p, text in kept.items():
        p.write_text(text)


def _organizers(folder: Path, names: list[str]) -> Path:
    for name, t in zip(names, TIERS):
        d = folder / "test" / f"{name}_throughput"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FIXTURE_RUNS / "fast" / f"{t}.json", d / "result.json")
    return folder


def _rename_tier(edit, old: str, new: str) -> None:
    """Rename tier `old` to `new` everywhere the two configs name it (tiers, baselines, rounds, workload)."""
    for rel in ("configs/contest.yaml", "configs/workload.yaml"):
        edit(rel, lambda text: re.sub(rf"(?<![\w-]){re.escape(old)}(?![\w-])", lambda m: json.dumps(new), text))


@pytest.mark.parametrize("tier,new,words", [
    ("4-8K", "../../evil48", ["configs/contest.yaml", "tiers[0].name", "not a plain name"]),
    ("8-16K", "/tmp/evil", ["configs/contest.yaml", "tiers[1].name", "not a plain name"]),
    ("16-32K", "16-32K\nx", ["configs/contest.yaml", "tiers[2].name", "control character"]),
])
def test_a_tier_name_that_is_a_path_is_refused_on_load(tmp_path, checkout, config_edit, tier, new, words):
    _rename_tier(config_edit, tier, new)
    # the organizers' results where the tool would look for them (a relative name climbs out of test/)
    src = _organizers(tmp_path / "org" / "a" / "testdata", [new if new.startswith("..") else t for t in TIERS])
    runs = tmp_path / "deep" / "er" / "runs"
    with writes_nothing(tmp_path):
        r = forge_in(checkout, tmp_path, "import-throughput", str(src), "--run-id", "evil", FORGE_RUNS_DIR=str(runs))
        refused(r, *words)
    assert not [p for p in tmp_path.rglob("evil*.json")], "nothing was written for the tier"
    assert status(checkout) == " M configs/contest.yaml\n M configs/workload.yaml\n"


def test_a_tier_file_that_is_a_path_is_refused_on_load(tmp_path, checkout, config_edit):
    config_edit("configs/contest.yaml", lambda text: text.replace("file: 4-8K_throughput.jsonl", "file: ../x.jsonl"))
    with writes_nothing(tmp_path):
        refused(forge_in(checkout, tmp_path, "score", "--tok-s", "1,2,3"), "configs/contest.yaml", "tiers[0].file")


def test_a_workload_tier_key_that_is_a_path_is_refused_on_load(tmp_path, checkout, config_edit):
    config_edit("configs/workload.yaml", lambda text: text.replace("  4-8K:\n", '  "../4-8K":\n'))
    with writes_nothing(tmp_path):
        r = forge_in(checkout, tmp_path, "predict", "--speedup", "gemv=1.2", "--out", str(tmp_path / "p"))
        refused(r, "configs/workload.yaml", "tiers.../4-8K", "not a plain name")


# --- pack-run: no link out of the folder ---------------------------------------------------------------

@pytest.mark.parametrize("link", ["file", "folder"])
def test_pack_run_refuses_a_link_out_of_the_run_folder(tmp_path, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the machine's, not the run's\n")
    run = tmp_path / "run"
    (run / "runs" / "fast").mkdir(parents=True)
    (run / "summary.md").write_text("# a run\n")
    shutil.copyfile(FIXTURE_RUNS / "fast" / "4-8K.json", run / "runs" / "fast" / "4-8K.json")
    target = outside / "secret.txt" if link == "file" else outside
    os.symlink(target, run / "runs" / "hostname")
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "pack-run", str(run)), "runs/hostname", "outside the run folder")
    assert not (run / "raw.tgz").exists()
