"""The inputs of `forge e2e-gpu` (ports, prompt counts, tiers, the extra server arguments, the pack and
the Triton cache folders, the KV cache's reason), `forge calibrate` (--redo, --seed, --install of a smoke
calibration) and `forge pack-run` / `forge unpack-run` (several folders, --to inside the checkout). Each
bad value is refused before anything is written, packed or started: exit code 2, one error line naming
the option or folder and a `fix:` line, `git status` as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from checkout_copy import forge_in, make_checkout, status
from helpers import FIXTURE_RUNS, ROOT, args_with, forge
from test_bad_inputs import member, refused, tgz, writes_nothing
from test_bad_inputs_records import CAL_ARGS, family_doc, measured_folder

from forge.lab import gpu_bundle

# --- e2e-gpu: every value checked before the results folder, the pack or a server -------------------------


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    gpu_bundle.write_model_dir({"model": {"config": "configs/models/qwen3.5-27b/config.json",
                                          "vocab_size": 248320, "eos_token_id": 248044}}, model)
    return model


@pytest.mark.parametrize("args,words", [
    # refused only once the results folder and its summary were written
    (["--num-prompts", "0"], ["--num-prompts", "'0'", "1 or more"]),
    # reached the client as --custom-output-len 0 / -5
    (["--fixed-output", "0"], ["--fixed-output", "'0'"]),
    (["--fixed-output", "-5"], ["--fixed-output", "'-5'"]),
    # servers started on port 70000 and 0
    (["--first-port", "70000"], ["--first-port", "TCP port"]),
    (["--first-port", "0"], ["--first-port", "TCP port"]),
    # the second profile's server on port 65536
    (["--first-port", "65535"], ["--first-port 65535", "65535-65536", "past 65535"]),
    # a traceback (shlex's ValueError) after the results folder was made
    (["--server-args", '--max-model-len "4096'], ["--server-args", "No closing quotation"]),
    # the run went on, warning at every step that the pack could not be written
    (["--pack", "{tmp}"], ["--pack", "a folder"]),
    # refused only after the results folder was made
    (["--triton-cache-from", "{tmp}/nothing"], ["--triton-cache-from", "triton-cache.json"]),
    # the tier measured twice (the second invocation's client over the first's results)
    (["--tier-order", "4-8K,4-8K"], ["--tier-order 4-8K,4-8K", "4-8K given twice"]),
    # servers started with a TRITON_CACHE_DIR that is a file; the pack failed at the end
    (["--triton-cache", "{tmp}/afile"], ["--triton-cache", "a file, not a folder"]),
    (["--triton-cache-pack", "{tmp}/afile"], ["--triton-cache-pack", "a file, not a folder"]),
    # a reason recorded for nothing: silently dropped
    (["--kv-why", "a DCU card's"], ["--kv-why", "--kv-cache-memory-bytes"]),
    # empty values taken as omitted: every profile of harness.yaml, the results under reports/e2e/
    (["--profiles", ""], ["--profiles", "empty value"]),
    (["--out", ""], ["--out", "empty value"]),
    (["--pack", ""], ["--pack", "empty value"]),
    # the results folder, the pack or the Triton cache's parts written among the tool's sources
    (["--out", "scripts/forge/e2e"], ["--out scripts/forge/e2e", "inside this checkout"]),
    (["--pack", "scripts/e2e.tgz"], ["--pack scripts/e2e.tgz", "outside build/ and reports/"]),
    (["--triton-cache-pack", "."], ["--triton-cache-pack .", "inside this checkout"]),
    (["--triton-cache", "scripts/triton"], ["--triton-cache scripts/triton", "inside this checkout"]),
    # a profile file's path: refused as a "run id" once the results folder and the prompts were written
    (["--profiles", "configs/serve/fast.yaml,upstream"], ["--profiles", "'configs/serve/fast.yaml'", "not a plain name"]),
    (["--client", ""], ["--client", "empty value"]),
    (["--reference", ""], ["--reference", "empty value"]),
    (["--server-arg="], ["--server-arg", "empty value"]),     # an empty argument given to every server
    (["--model", ""], ["--model", "empty value"]),
    # 0 was taken as no profiling, -1 profiled a prompt of -1 tokens; a negative delay reached the fault check
    (["--profile-prefill", "0"], ["--profile-prefill", "'0'"]),
    (["--profile-prefill", "-1"], ["--profile-prefill", "'-1'"]),
    (["--fault-delay-s", "-1"], ["--fault-delay-s", "'-1'"]),
    # a batch profile: B from 1 to 64, and B requests of --profile-prefill tokens, --profile-decode steps of them
    (["--profile-batch", "0"], ["--profile-batch", "'0'"]),
    (["--profile-batch", "65"], ["--profile-batch", "'65'", "at most 64"]),
    (["--profile-batch", "4"], ["--profile-batch 4", "neither is given"]),
    (["--profile-batch", "4", "--profile-prefill", "20000"], ["--profile-batch 4", "--profile-decode is not given"]),
    # an extra server argument after the harness's own wins in vLLM: the server on port 9, the harness
    # waiting on --first-port; a KV cache other than the one the summary records
    (["--server-arg=--port", "--server-arg=9"], ["--server-arg/--server-args --port", "--first-port"]),
    (["--server-arg=--host=0.0.0.0"], ["--server-arg/--server-args --host=0.0.0.0"]),
    (["--server-args=--seed 7 --kv_cache_memory_bytes=5"], ["--kv_cache_memory_bytes=5", "the harness sets it"]),
])
def test_e2e_gpu_values_are_checked_before_the_results_folder(tmp_path, args, words):
    model = _model(tmp_path)
    (tmp_path / "afile").write_text("x")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(model), "--vllm", "false", "--client", "false",
                  "--no-plumbing", "--no-fault", "--start-guess-s", "0", *out, *args, timeout=60)
    refused(r, *words)


def test_e2e_gpu_into_a_packed_record_is_refused(tmp_path):
    model = _model(tmp_path)
    out = tmp_path / "e2e"
    (out / "runs" / "upstream").mkdir(parents=True)
    (out / "runs" / "upstream" / "serve.json").write_text("{}")
    (out / "summary.json").write_text("{}")
    assert forge(tmp_path, "pack-run", str(out)).returncode == 0
    with writes_nothing(tmp_path):             # a new summary.json and runs/ beside raw.tgz, the record's unread
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(model), "--vllm", "false", "--client", "false",
                  "--no-plumbing", "--no-fault", "--start-guess-s", "0", "--out", str(out), timeout=60)
    refused(r, "--out", "a packed record")
    assert "forge unpack-run" in r.stderr


def test_e2e_gpu_with_a_model_folder_without_a_tokenizer_is_refused_first(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with writes_nothing(tmp_path):             # refused once the results folder and its summary were written
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(tmp_path / "model"), "--vllm", "false",
                  "--out", str(tmp_path / "out"), timeout=60)
    refused(r, "--model", "no tokenizer")


def test_e2e_gpu_without_a_model_or_bundle_is_refused_before_the_results_folder(tmp_path):
    with writes_nothing(tmp_path):             # refused only after the results folder was made
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--vllm", "false", "--out", str(tmp_path / "out"), timeout=60)
    refused(r, "--model is needed")


# --- calibrate: a family, a seed and an install that mean what they say ----------------------------------

@pytest.mark.parametrize("args,words", [
    # the redo of a family not measured was silently ignored
    (["--families", "gemv", "--redo", "decode"], ["--redo decode", "not among --families gemv"]),
    # int() read 1_0 as seed 10
    (["--seed", "1_0"], ["--seed", "'1_0'", "plain digits"]),
    # a table of the interpreter on a CPU (no decision) installed as configs/kernels/tuned/cpu-cpu-0cu.json
    (["--smoke", "--install"], ["--install with --smoke", "measures nothing real"]),
    (["--smoke", "--quick", "--install-vllm"], ["--install-vllm with --smoke"]),
    # the calibration's records, logs and report written among the tool's sources
    (["--smoke", "--families", "gemv", "--out", "scripts/forge/calibration"], ["--out scripts/forge/calibration",
                                                                            "inside this checkout"]),
    (["--smoke", "--families", "gemv", "--out", "."], ["--out .", "outside build/ and reports/"]),
])
def test_calibrate_options_are_refused_before_anything_runs(tmp_path, args, words):
    with writes_nothing(tmp_path, ROOT / "configs" / "kernels"):
        r = forge(tmp_path, *args_with(["calibrate", "--out", str(tmp_path / "cal"), *CAL_ARGS], args), timeout=120)
    refused(r, *words)


@pytest.mark.parametrize("family", ["gemm", "decode"])
def test_calibrate_installs_no_table_of_an_unfinished_calibration(tmp_path_factory, tmp_path, family):
    checkout = make_checkout(tmp_path_factory.mktemp("round4-cal") / "checkout")
    cal = measured_folder(tmp_path / "cal")
    doc = family_doc(family, [])
    doc["failed"] = "timed out after 1800 s"        # the family's process was stopped
    (cal / f"{family}.json").write_text(json.dumps(doc))
    before = status(checkout)
    r = forge_in(checkout, tmp_path, "calibrate", "--out", str(cal), "--install", *CAL_ARGS)
    # the table without that family's decisions went into configs/kernels/tuned/ as the device's
    refused(r, "--install", "not finished", f"{family} failed (timed out after 1800 s)")
    assert status(checkout) == before


# --- pack-run / unpack-run: every folder checked first; nothing unpacked into the checkout ----------------

def test_pack_run_checks_every_folder_before_packing_one(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    (tmp_path / "afile").write_text("x")
    for bad in ("missing", "afile"):           # the first folder was packed, then the second refused
        with writes_nothing(tmp_path):
            refused(forge(tmp_path, "pack-run", str(run), str(tmp_path / bad)), bad, "not a folder")


@pytest.mark.parametrize("folder,words", [
    # packed the tool's sources into scripts/forge/lab/raw.tgz and removed them; "." took .git too
    ("scripts/forge/lab", ["scripts/forge/lab", "outside reports/ and build/"]),
    ("reports", ["reports", "outside reports/ and build/"]),
    (".", ["this checkout or a folder holding it"]),
    ("..", ["this checkout or a folder holding it"]),
])
def test_pack_run_of_the_checkouts_own_folders_is_refused(tmp_path_factory, tmp_path, folder, words):
    checkout = make_checkout(tmp_path_factory.mktemp("round4-pack") / "checkout")
    (checkout / "reports").mkdir()
    (checkout / "reports" / "notes.txt").write_text("a record\n")
    before = status(checkout)
    with writes_nothing(tmp_path):
        r = forge_in(checkout, tmp_path, "pack-run", folder)
    refused(r, *words)
    assert status(checkout) == before and (checkout / "scripts" / "forge" / "lab" / "e2e.py").is_file()


@pytest.mark.parametrize("into", ["scripts/forge/unpacked-run", "reports/e2e/unpacked-run", "."])
def test_unpack_run_to_a_folder_inside_the_checkout_is_refused(tmp_path, into):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    assert forge(tmp_path, "pack-run", str(run)).returncode == 0
    with writes_nothing(tmp_path):             # files of a record went into the tool's own tree
        r = forge(tmp_path, "unpack-run", str(run), "--to", into)
    refused(r, "--to", "inside this checkout")
    assert "fix: leave --to out to unpack in place" in r.stderr and "--to /tmp/run" in r.stderr


# --- e2e-decode: the reference is a profile's folder under runs/, the files are named -------------------

@pytest.mark.parametrize("args,words", [
    # read runs/../x/serve.json: a record outside the results folder's runs/
    (["--reference", "../x"], ["--reference '../x'", "not a plain name"]),
    # looked for runs//serve.json
    (["--reference", ""], ["--reference ''", "empty"]),
    # an empty file name read as the current folder ("kernel benchmark not found: .")
    (["--bench", ""], ["--bench", "empty value"]),
    (["--config", ""], ["--config", "empty value"]),
])
def test_e2e_decode_names_are_checked(tmp_path, args, words):
    folder = tmp_path / "e2e"
    (folder / "runs" / "upstream").mkdir(parents=True)
    (folder / "runs" / "upstream" / "serve.json").write_text('{"command": ["vllm", "serve", "m"], "env": {}}')
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-decode", str(folder), *args)
    refused(r, *words)


@pytest.mark.parametrize("name,force", [("raw.tgz", []), ("./raw.tgz", ["--force"])])
def test_unpack_run_refuses_a_member_that_would_replace_the_archive(tmp_path, name, force):
    run = tmp_path / "run"
    run.mkdir()
    tgz(run / "raw.tgz", [(member("summary.json", body=b"{}")), member(name, body=b"not an archive")])
    with writes_nothing(tmp_path):             # with --force the record's archive became the member's bytes
        r = forge(tmp_path, "unpack-run", str(run), *force)
    refused(r, "raw.tgz", "would replace the archive itself")
