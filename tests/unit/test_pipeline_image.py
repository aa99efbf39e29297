"""Dockerfile.rocm: multi-stage shape, lint-clean, and the build command the tool runs."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forge.builder import buildah, image
from forge.errors import ForgeError
from forge.paths import ROOT

DOCKERFILE = ROOT / "Dockerfile.rocm"


def parsed():
    from dockerfile_parse import DockerfileParser
    d = DockerfileParser(fileobj=open(DOCKERFILE, "rb"))
    return d.structure


def test_stages_in_order_and_base_by_arg():
    froms = [i["value"] for i in parsed() if i["instruction"] == "FROM"]
    assert froms == ["${BASE_IMAGE} AS base", "base AS source", "source AS wheel", "base AS runtime"]


def test_runtime_stage_contract():
    s = parsed()
    start = max(i for i, x in enumerate(s) if x["instruction"] == "FROM")
    runtime = s[start:]
    kinds = {x["instruction"] for x in runtime}
    assert {"HEALTHCHECK", "LABEL", "ENTRYPOINT", "EXPOSE"} <= kinds
    text = " ".join(x["value"] for x in runtime)
    assert "/health" in text and "--no-deps" in text and "warm-kernels" in text and "self-check" in text
    assert "io.dcu-forge.upstream.sdist-sha256" in text and "io.dcu-forge.series-hash" in text


def test_every_run_calls_the_tool_or_pip():
    for x in parsed():
        if x["instruction"] == "RUN":
            assert "make " in x["value"] or "pip install" in x["value"], x["value"]


def test_source_stage_is_offline():
    text = DOCKERFILE.read_text()
    assert "COPY . ." in text and "VLLM_SRC=/forge/.cache/forge/src/vllm-0.18.1.tar.gz" in text
    assert "!.cache/forge/src/vllm-0.18.1.tar.gz" in (ROOT / ".dockerignore").read_text()


def test_hadolint_clean():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint is missing: it is in requirements/dev.txt (make venv)")
    res = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_build_commands(monkeypatch):
    cmd, env = image.build_command("docker", "t:1", {"BASE_IMAGE": "b@sha256:" + "0" * 64})
    assert cmd[:2] == ["docker", "build"] and env == {"DOCKER_BUILDKIT": "1"}
    assert "--target" in cmd and "runtime" in cmd and f"BASE_IMAGE=b@sha256:{'0' * 64}" in cmd
    monkeypatch.setenv("BUILDAH_STORAGE", "vfs")
    cmd, env = image.build_command("buildah", "t:1", {})
    assert cmd[0] == "buildah" and "chroot" in cmd and cmd[cmd.index("--storage-driver") + 1] == "vfs"


FAKE_BUILDAH = """#!/bin/sh
echo "$*" >> "$BUILDAH_LOG"
case "$3" in
  from) echo working-container-7 ;;
  mount) [ "$MOUNT_RC" = 0 ] && echo /var/lib/containers/storage/overlay/x/merged; exit "$MOUNT_RC" ;;
esac
"""


@pytest.mark.parametrize("mount_rc,want", [(0, "overlay"), (32, "vfs")])
def test_buildah_takes_overlay_only_where_an_overlay_container_mounts(monkeypatch, tmp_path, mount_rc, want):
    fake = tmp_path / "bin" / "buildah"
    fake.parent.mkdir()
    fake.write_text(FAKE_BUILDAH)
    fake.chmod(0o755)
    log = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setenv("BUILDAH_LOG", str(log))
    monkeypatch.setenv("MOUNT_RC", str(mount_rc))
    monkeypatch.delenv("BUILDAH_STORAGE", raising=False)
    monkeypatch.setattr(buildah, "_DRIVER", [])
    assert buildah.storage_driver() == want
    assert buildah.storage_driver() == want                          # probed once per run
    calls = log.read_text().splitlines()
    assert calls[0] == "--storage-driver overlay from scratch" and len(calls) == (4 if mount_rc == 0 else 3)
    assert calls[-1] == "--storage-driver overlay rm working-container-7"   # the probe leaves nothing behind
    assert buildah.builder_cmd("buildah")[1:] == ["--storage-driver", want]
    monkeypatch.setenv("BUILDAH_STORAGE", "vfs")                  # the user's choice wins, unprobed
    assert buildah.storage_driver() == "vfs"
    assert len(log.read_text().splitlines()) == len(calls)


def test_unpinned_base_refused(monkeypatch):
    monkeypatch.delenv("BASE_IMAGE", raising=False)
    b = {"base_image": "vllm:tag", "base_image_digest": None}
    with pytest.raises(ForgeError, match="not pinned"):
        image.base_ref(b)
    assert image.base_ref({**b, "base_image_digest": "sha256:" + "1" * 64}) == "vllm:tag@sha256:" + "1" * 64
    monkeypatch.setenv("BASE_IMAGE", "x@sha256:" + "2" * 64)
    assert image.base_ref(b) == "x@sha256:" + "2" * 64


def test_make_n_image_prints_the_exact_command():
    res = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = [l for l in res.stdout.splitlines() if "build -f" in l]
    assert line and "Dockerfile.rocm" in line[-1] and "--build-arg BASE_IMAGE=" in line[-1]
