"""Every test session: the git work tree is the same at the end as at the start (tests/support/clean_tree.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from clean_tree import pytest_sessionfinish, pytest_sessionstart  # noqa: E402,F401
