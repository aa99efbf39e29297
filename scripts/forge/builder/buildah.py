"""buildah's storage for the image builds: the overlay driver where an overlay container mounts (each
layer a diff), else vfs (every layer a full copy of the root filesystem), BUILDAH_STORAGE when set."""

from __future__ import annotations

import os
import shutil

from .. import proc, ui


def builder_cmd(builder: str) -> list[str]:
    if builder == "buildah":
        return ["buildah", "--storage-driver", storage_driver()]
    return ["docker"]


# buildah's storage driver, decided once per run (see storage_driver)
_DRIVER: list[str] = []
# What the image rehearsal needs free while it builds, by driver (measured on a fresh machine: with vfs
# every layer is a full copy of the root filesystem, 11.1 GB at the build's peak and 3.8 GB kept; with
# overlay 5.4 GB at the stand-in's import, before the stand-in's tarball was removed ahead of its
# commit, and 1.3 GB kept).
NEED_GB = {"overlay": 4.0, "vfs": 12.0}


def storage_driver() -> str:
    """buildah's storage driver: BUILDAH_STORAGE when set; else overlay where this machine can mount an
    overlay container (root with overlayfs), else vfs, which works everywhere but copies the whole root
    filesystem for every layer."""
    env = os.environ.get("BUILDAH_STORAGE")
    if env:
        return env
    if not _DRIVER:
        _DRIVER.append("overlay" if overlay_mounts() else "vfs")
        if _DRIVER[0] == "vfs":
            ui.info(f"buildah: overlay storage does not mount here; using vfs (every layer a full copy: "
                    f"about {NEED_GB['vfs']:.0f} GB free needed while the image builds)")
    return _DRIVER[0]


def overlay_mounts() -> bool:
    """Create, mount and remove an empty overlay container: what every RUN step of a build does."""
    if not shutil.which("buildah"):
        return False
    cmd = ["buildah", "--storage-driver", "overlay"]
    made = proc.run([*cmd, "from", "scratch"], capture=True, check=False)
    if made.returncode != 0 or not made.stdout.strip():
        return False
    ctr = made.stdout.strip().splitlines()[-1]
    try:
        ok = proc.run([*cmd, "mount", ctr], capture=True, check=False).returncode == 0
        if ok:
            proc.run([*cmd, "umount", ctr], capture=True, check=False)
    finally:
        proc.run([*cmd, "rm", ctr], capture=True, check=False)
    return ok
