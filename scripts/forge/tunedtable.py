"""The per-device tuned table's one validator, as the tool uses it: the loader the patched vLLM runs
(kernels/forge_tuned, placed in the tree as vllm/forge_tuned) loaded from this checkout, so `make tree`,
`forge calibrate --install` and the submission's pre-flight refuse exactly what the server would refuse,
and, for a table that is shipped, what its provenance must not carry."""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path
from types import ModuleType

from . import paths
from .errors import ForgeError

MODEL_CONFIG = paths.CONFIGS / "models" / "qwen3.5-27b" / "config.json"


@cache
def loader() -> ModuleType:
    """kernels/forge_tuned/__init__.py as a module of its own (no sys.path change; its top level needs no
    torch)."""
    spec = importlib.util.spec_from_file_location("forge_tuned_loader", paths.KERNELS / "forge_tuned" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_config() -> dict:
    """The served model's config (its text part): the head counts one rank's geometry follows from."""
    try:
        cfg = json.loads(MODEL_CONFIG.read_text())
    except (OSError, ValueError) as e:
        raise ForgeError(f"{paths.rel(MODEL_CONFIG)}: cannot read the model's config ({e})",
                         hint="restore it from git (the per-rank shapes are derived from it)") from None
    return cfg.get("text_config", cfg)


def split_heads(tp: int, cfg: dict | None = None) -> tuple[tuple[int, int], list[str]]:
    """((query heads, KV heads) of one rank at tensor-parallel degree `tp`, the model's head counts `tp`
    does not divide, e.g. ["16 GDN key heads"]). KV heads are copied once `tp` exceeds them (one per rank)."""
    cfg = cfg or model_config()
    try:
        hq, hkv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
        gdn = (int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ForgeError(f"{paths.rel(MODEL_CONFIG)}: key {e} missing or not a number",
                         hint="restore the model's config from git") from None
    bad = [f"{n} {name}" for n, name in ((hq, "query heads"), (gdn[0], "GDN key heads"), (gdn[1], "GDN value heads"))
           if n % tp]
    return (hq // tp, max(1, hkv // tp)), bad


def geometry_problem(table: dict) -> str | None:
    """Why a valid table's degree and heads (validators tp, heads) are not one rank of the served model
    (the loader checks their form alone: a table with another model's heads, or at a degree vLLM cannot
    run, would be taken and never match a shape): one line, or None."""
    geo = loader().geometry(table)
    heads, bad = split_heads(geo["tp"])
    if bad:
        return (f"key 'validators.tp': {geo['tp']} does not divide the model's {', '.join(bad)} "
                f"({paths.rel(MODEL_CONFIG)}); vLLM cannot run that degree")
    if list(geo["heads"]) != list(heads):
        return (f"key 'validators.heads': {geo['heads']} is not one rank of the model at tp {geo['tp']} "
                f"({list(heads)}, {paths.rel(MODEL_CONFIG)})")
    return None


def problem(path: Path, *, shipped: bool = True) -> str | None:
    """Why the table at `path` cannot be used (or, `shipped`, carried into a tree): one line, or None."""
    T = loader()
    try:
        table = T.read(str(path))
    except T.TableError as e:
        return str(e)
    why = geometry_problem(table)
    if why:
        return why
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
    why = geometry_problem(table)
    if why:
        raise ForgeError(f"{where}: {why}", hint=fix)
    probs = T.shipping_problems(table) if shipped else []
    if probs:
        raise ForgeError(f"{where}: {'; '.join(probs)}", hint=fix)
    return table
