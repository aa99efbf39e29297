"""The per-device tuned table's one validator, as the tool uses it: the loader the patched vLLM runs
(kernels/forge_tuned, placed in the tree as vllm/forge_tuned) loaded from this checkout, so `make tree`,
`forge calibrate --install` and the submission's pre-flight refuse exactly what the server would refuse,
and, for a table that is shipped, what its provenance must not carry."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType

from . import paths
from .errors import ForgeError


@cache
def loader() -> ModuleType:
    """kernels/forge_tuned/__init__.py as a module of its own (no sys.path change; its top level needs no
    torch)."""
    spec = importlib.util.spec_from_file_location("forge_tuned_loader", paths.KERNELS / "forge_tuned" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def problem(path: Path, *, shipped: bool = True) -> str | None:
    """Why the table at `path` cannot be used (or, `shipped`, carried into a tree): one line, or None."""
    T = loader()
    try:
        table = T.read(str(path))
    except T.TableError as e:
        return str(e)
    if shipped:
        probs = T.shipping_problems(table)
        if probs:
            return "; ".join(probs)
    return None


def check_table(path: Path, *, shipped: bool = True, fix: str) -> None:
    """Refuse the table at `path` with its file, its reason and `fix`."""
    why = problem(path, shipped=shipped)
    if why:
        raise ForgeError(f"{paths.rel(path)}: {why}", hint=fix)


def check_text(text: str, where: str, *, shipped: bool = True, fix: str) -> dict:
    """The table in `text` (about to be written to `where`), validated; refused naming `where`."""
    T = loader()
    try:
        table = T.parse(text)
    except T.TableError as e:
        raise ForgeError(f"{where}: {e}", hint=fix) from None
    probs = T.shipping_problems(table) if shipped else []
    if probs:
        raise ForgeError(f"{where}: {'; '.join(probs)}", hint=fix)
    return table
