"""A tiny fake upstream (tarball + hashes), overlay and patch series, so the pipeline's git and
hash logic is tested in seconds without the 30 MB vLLM source."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from forge.hashing import sha256_file, tree_sha256

UPSTREAM_FILES = {
    "pkg/config.py": "".join(f"LINE_{i} = {i}\n" for i in range(40)),
    "pkg/sched/scheduler.py": "def schedule():\n    return 1\n",
    "README": "fake upstream\n",
}


def make_sdist(tmp: Path, files: dict[str, str] = UPSTREAM_FILES) -> tuple[Path, str, str]:
    """(tarball, sha256, tree_sha256) of a fake sdist whose top dir is vllm-0.18.1."""
    tb = tmp / "vllm-0.18.1.tar.gz"
    with tarfile.open(tb, "w:gz") as tf:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-0.18.1/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tf.addfile(info, io.BytesIO(data))
    ex = tmp / "ex"
    with tarfile.open(tb) as tf:
        tf.extractall(ex)
    return tb, sha256_file(tb), tree_sha256(ex / "vllm-0.18.1")


def upstream_cfg(sha: str, tree_hash: str) -> dict:
    return {"name": "vllm", "version": "0.18.1",
            "sdist": {"project": "vllm", "filename": "vllm-0.18.1.tar.gz", "sha256": sha, "tree_sha256": tree_hash},
            "git": {"url": None, "tag": "v0.18.1", "commit": "a26e8dc7f"}}


REVIEW = "Why: because.\nWhat: a change.\nRisk: low.\nEvidence: test_x.\nRule check: allowed.\n"


def make_patch(tree: Path, rel: str, old: str, new: str, subject: str, body: str = REVIEW) -> str:
    """Commit a one-line change in a scratch git copy of `tree` and return its format-patch text."""
    p = tree / rel
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "-C", tree, "commit", "-qam", f"{subject}\n\n{body}"], check=True, env=env)
    return subprocess.run(["git", "-C", tree, "format-patch", "-1", "--stdout", "--zero-commit",
                           "--no-signature", "--full-index"], check=True, capture_output=True, text=True,
                          env=env).stdout
