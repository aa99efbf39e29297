"""Inputs found to be taken wrongly in the nineteenth round of input hardening.

`forge pack-run OUTER OUTER/runs/fast` (a run folder and one inside it): OUTER was packed, its raw.tgz holding every
file under it, the inner folder's among them, and removed them; the inner one then failed as "not a folder", exit 2
with the command half done. Given inner first, the inner folder was packed and OUTER's raw.tgz then held its
raw.tgz, an archive in an archive, exit 0. Such a pair is now refused before anything is packed, naming both.

`forge e2e-gpu --fixed-output 20000` (any N past what a tier's longest prompt leaves of the servers' --max-model-len
32768; above 2304 at 16-32K with six prompts): taken, the servers started, and vLLM refused every request of the
tier, each recorded as failed (exit 1). It is now refused before anything is written or started, naming the tier,
its longest prompt and the server's --max-model-len, with the largest N that fits; a tier left out of --tier-order
is not counted, and the earlier runs' 1024 is taken.

`forge e2e-gpu --out DIR --pack DIR/e2e.tgz`: taken; the archive is rewritten after every step from the results
folder's files, so each rewrite held the one before, growing at every step. A --pack inside the results folder is
now refused before anything is written, with a place beside it as the fix.

`forge e2e-gpu --triton-cache DIR --triton-cache-pack DIR` (or DIR/pack, or `--triton-cache-pack /tmp/forge-triton`,
the cache's default): taken; the parts were written among the files they pack, so each pack held the one before
and the cache grew by its own archive every run. A pack folder in the cache is now refused before anything is
written, naming the cache (or its default) and a folder beside it.

`forge e2e-gpu --round final --finals-servers --capacity contest:max-num-seqs=1024` with MAX_NUM_BATCHED_TOKENS=512
in the environment (or MAX_NUM_SEQS_4_8K=1024 with `--capacity contest:max-num-batched-tokens=512`): the value
was checked against the round's baseline for the option not given (4096 batched tokens), while the finals' start
script gives that server the environment's (or the profile's) value; the server got --max-num-batched-tokens 512
--max-num-seqs 1024, which vLLM refuses, after the results folder was written. The pair is now checked as that
server gets it, naming where each value came from, before anything is written or started.

`forge unpack-run F --to F/raw` (F a packed run folder outside the checkout): taken; the raw files landed in a
subfolder of F, which then no longer read as packed (`pack-run F` refused it). A --to inside the folder whose
archive it unpacks is now refused before anything is extracted, with a folder beside it as the fix.

`forge sweep upstream --image forge:typo` (and `sweep --round final`, `serve`; or $IMAGE): taken; the sweep's
record and the first run's folder were written, and the missing image failed only as its container started.
docker is now asked for the image (`docker image inspect`) before anything is written, and a missing one (or no
docker on PATH, or a daemon docker cannot reach, said as such) is refused, naming the image and what docker said.

`forge e2e-gpu --round final --capacity contest:max-num-seqs=4,` (or `contest:,max-num-seqs=4`): refused as
"'(empty)' is not one of max-num-seqs=N, ...", as if an option named "(empty)" had been typed. It is now refused as
an empty item, as the other comma-separated options say it.
"""

from __future__ import annotations

import os
import shutil

import pytest
from helpers import FIXTURE_RUNS, forge, free_port
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round4 import _model
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round12 import BENCH, FAKE, SWEEP_ONE
from test_bad_inputs_round12 import model as model  # noqa: F401  (the fixture)
from test_bad_inputs_round17 import e2e_gpu_writes_nothing

# --- pack-run: a run folder inside another given with it ----------------------------------------------------------

@pytest.mark.parametrize("inner_first", [False, True])
def test_pack_run_refuses_a_folder_inside_another_given_with_it(tmp_path, inner_first):
    outer = tmp_path / "e2e"
    inner = outer / "runs" / "fast"
    shutil.copytree(FIXTURE_RUNS / "fast", inner)
    (outer / "summary.json").write_text("{}\n")
    folders = [str(inner), str(outer)] if inner_first else [str(outer), str(inner)]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "pack-run", *folders)
    refused(r, f"{inner}: inside {outer}, given too", "nothing was packed")
    assert f"forge pack-run {outer} packs both" in fix_line(r), r.stderr


# --- e2e-gpu --fixed-output: a tier's longest prompt and the output past --max-model-len ---------------------------

def test_e2e_gpu_refuses_a_fixed_output_past_the_servers_model_length(tmp_path):
    """Taken before: the servers started and vLLM refused every request of the 16-32K tier."""
    r = e2e_gpu_writes_nothing(tmp_path, "--fixed-output", "20000", "--deadline-s", "100000")
    refused(r, "--fixed-output 20000: tier 16-32K's longest prompt", "--max-model-len 32768")
    assert "or less, or leave 16-32K out of --tier-order" in fix_line(r), r.stderr


@pytest.mark.parametrize("args", [["--fixed-output", "1024"], ["--fixed-output", "20000", "--tier-order", "4-8K"]])
def test_e2e_gpu_takes_a_fixed_output_the_tiers_run_hold(tmp_path, args):
    """The earlier runs' 1024 fits every tier, and 20000 fits 4-8K alone: the deadline is what refuses these."""
    r = e2e_gpu_writes_nothing(tmp_path, *args, "--deadline-s", "30", "--reserve-s", "0")
    refused(r, "--deadline-s 30", "no tier would be measured")


# --- e2e-gpu --pack, --triton-cache-pack: inside what they pack -----------------------------------------------------

@pytest.mark.parametrize("where", ["out/e2e.tgz", "out/logs/e2e.tgz"])
def test_e2e_gpu_refuses_a_pack_inside_the_results_folder(tmp_path, where):
    """Taken before: each rewrite of the archive held the one before."""
    r = e2e_gpu_writes_nothing(tmp_path, "--pack", str(tmp_path / where))
    refused(r, f"--pack {tmp_path / where}: inside the results folder {tmp_path / 'out'}")
    assert f"--pack {tmp_path / 'out.tgz'}" in fix_line(r), r.stderr


@pytest.mark.parametrize("pack", ["tc", "tc/pack"])
def test_e2e_gpu_refuses_a_triton_pack_in_the_cache_it_packs(tmp_path, pack):
    """Taken before: each pack held the parts of the one before."""
    r = e2e_gpu_writes_nothing(tmp_path, "--triton-cache", str(tmp_path / "tc"), "--triton-cache-pack",
                               str(tmp_path / pack))
    refused(r, f"--triton-cache-pack {tmp_path / pack}: in the Triton cache it packs, --triton-cache {tmp_path / 'tc'}")
    assert f"--triton-cache-pack {tmp_path / 'triton-pack'}" in fix_line(r), r.stderr


# --- e2e-gpu --finals-servers --capacity: checked with the values that server gets --------------------------------

@pytest.mark.parametrize("capacity,env,words,fix", [
    ("contest:max-num-seqs=1024", {"MAX_NUM_BATCHED_TOKENS": "512"},
     ["--max-num-batched-tokens 512 (env MAX_NUM_BATCHED_TOKENS) is below --max-num-seqs 1024 (--capacity)"],
     "raise MAX_NUM_BATCHED_TOKENS"),
    ("contest:max-num-batched-tokens=512", {"MAX_NUM_SEQS_4_8K": "1024"},
     ["--max-num-batched-tokens 512 (--capacity) is below --max-num-seqs 1024 (env MAX_NUM_SEQS_4_8K)"],
     "raise --max-num-batched-tokens"),
])
def test_e2e_gpu_finals_servers_capacity_is_checked_with_the_servers_own_values(tmp_path, capacity, env, words, fix):
    """Checked against the round's baseline (4096 batched tokens, 128 sequences) before: taken, and the server
    started with a pair vLLM refuses."""
    model = _model(tmp_path)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(model), "--round", "final", "--finals-servers",
                  "--profiles", "contest,upstream", "--out", str(tmp_path / "out"), "--vllm", "false", "--client",
                  "false", "--no-plumbing", "--no-fault", "--start-guess-s", "0", "--capacity", capacity,
                  CUDA_VISIBLE_DEVICES="0,1", timeout=60, **env)
    refused(r, "--capacity contest (with the other values of its --finals-servers server, tier 4-8K)", *words)
    assert fix in fix_line(r), r.stderr


# --- unpack-run --to: inside the folder it unpacks ------------------------------------------------------------------

@pytest.mark.parametrize("sub", ["raw", "runs/x"])
def test_unpack_run_refuses_a_to_inside_the_folder_it_unpacks(tmp_path, sub):
    folder = tmp_path / "e2e"
    shutil.copytree(FIXTURE_RUNS / "fast", folder / "runs" / "fast")
    (folder / "summary.json").write_text("{}\n")
    r = forge(tmp_path, "pack-run", str(folder))
    assert r.returncode == 0, r.stderr
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "unpack-run", str(folder), "--to", str(folder / sub))
    refused(r, f"--to {folder / sub}: inside", "nothing was extracted")
    assert f"--to {tmp_path / 'e2e-raw'}" in fix_line(r), r.stderr
    r = forge(tmp_path, "unpack-run", str(folder), "--to", str(tmp_path / "e2e-raw"))     # the fix works
    assert r.returncode == 0 and (tmp_path / "e2e-raw" / "summary.json").is_file(), r.stderr


# --- --image: asked of docker before anything is written ------------------------------------------------------------

FAKE_DOCKER = """#!/bin/sh
# docker as far as `image inspect` goes: this machine has forge:have and nothing else
if [ "$1 $2" = "image inspect" ]; then
  for a; do last=$a; done
  [ "$last" = "forge:have" ] && { echo sha256:1; exit 0; }
  echo "Error response from daemon: No such image: $last" >&2; exit 1
fi
echo "fake docker: $*" >&2; exit 3
"""
DOWN_DOCKER = """#!/bin/sh
echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2; exit 1
"""


def _docker_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize("verb", ["sweep", "sweep-final", "serve"])
def test_a_missing_image_is_refused_before_anything_is_written(tmp_path, model, verb):  # noqa: F811
    args = {"sweep": ["sweep", "upstream", "--model", str(model), "--vllm", FAKE, "--client", BENCH,
                      "--port", str(free_port()), "--num-prompts", "2", "--timeout", "30"],
            "sweep-final": ["sweep", "--round", "final", "--model", str(model), "--baseline-profile", "upstream",
                            *SWEEP_ONE, "--vllm", FAKE, "--client", BENCH, "--port", str(free_port()),
                            "--tier-env", str(tmp_path / "tier-env.json")],
            "serve": ["serve", "--profile", "upstream", "--model", str(model), "--port", str(free_port())]}[verb]
    path = _docker_path(tmp_path)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--image", "forge:typo", PATH=path, CUDA_VISIBLE_DEVICES="0,1", timeout=120)
    refused(r, "--image forge:typo: docker has no such image (Error response from daemon: No such image: forge:typo)")
    assert "make image" in fix_line(r), r.stderr


def test_the_image_may_come_from_the_environment_and_docker_must_be_there(tmp_path, model):  # noqa: F811
    args = ["sweep", "upstream", "--model", str(model), "--vllm", FAKE, "--client", BENCH, "--port", str(free_port()),
            "--num-prompts", "2", "--timeout", "30"]
    path, no_docker = _docker_path(tmp_path), tmp_path / "nodocker"
    no_docker.mkdir()
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, PATH=path, IMAGE="forge:typo", timeout=120)
    refused(r, "--image forge:typo: docker has no such image")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--image", "forge:have", PATH=str(no_docker), timeout=120)
    refused(r, "--image forge:have: docker is not on this machine's PATH")

    down = tmp_path / "down"
    down.mkdir()
    (down / "docker").write_text(DOWN_DOCKER)
    (down / "docker").chmod(0o755)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--image", "forge:have", PATH=f"{down}{os.pathsep}{os.environ['PATH']}", timeout=120)
    refused(r, "--image forge:have: docker could not say whether it has the image (Cannot connect to the Docker daemon")
    assert "start the docker daemon" in fix_line(r), r.stderr


@pytest.mark.parametrize("spec", ["contest:max-num-seqs=4,", "contest:,max-num-seqs=4",
                                  "contest:max-num-seqs=4,,max-num-batched-tokens=2048"])
def test_e2e_gpu_capacity_refuses_an_empty_item_as_one(tmp_path, spec):
    r = e2e_gpu_writes_nothing(tmp_path, "--round", "final", "--profiles", "contest,upstream", "--capacity", spec)
    refused(r, f"--capacity {spec!r}: an empty item (a comma too many)")
    assert "(empty)" not in r.stderr, r.stderr
