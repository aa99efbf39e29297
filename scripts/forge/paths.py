"""Where things live. Everything is relative to the repository root unless overridden by env."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
PATCHES = ROOT / "patches"
KERNELS = ROOT / "kernels"
REPORTS = ROOT / "reports"
BUILD = Path(os.environ.get("FORGE_BUILD_DIR", ROOT / "build"))
DIST = Path(os.environ.get("FORGE_DIST_DIR", ROOT / "dist"))
CACHE = Path(os.environ.get("FORGE_CACHE_DIR", ROOT / ".cache" / "forge"))
TREE = BUILD / "vllm"


def rel(path: Path) -> str:
    """Path for messages: relative to the repo root when inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
