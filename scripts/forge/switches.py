"""dcu-forge's switches (VLLM_FORGE_*) as the tool checks them: the validator the patched vLLM reads
its switches with (kernels/forge_switches.py, placed in the tree as vllm/forge_switches.py) loaded from
this checkout, so a serve profile is refused exactly the values the server would refuse or misread."""

from __future__ import annotations

import importlib.util
from functools import cache
from types import ModuleType

from . import paths
from .errors import ForgeError

PREFIX = "VLLM_FORGE_"


@cache
def validator() -> ModuleType:
    """kernels/forge_switches.py as a module of its own (no sys.path change; standard library only)."""
    spec = importlib.util.spec_from_file_location("forge_switches_validator", paths.KERNELS / "forge_switches.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def names() -> list[str]:
    return list(validator().SWITCHES)


def check(name: str, value, where: str) -> str:
    """`value` of switch `name`, checked; refused naming `where`, the switch and the values it takes."""
    V = validator()
    try:
        return V.check(name, value)
    except V.SwitchError as e:
        raise ForgeError(f"{where}: {e}", hint="set one of the switch's values (README: Switches for A/B runs), "
                                               "or leave the variable out for its default") from None


def gemv_launches(spec: str, where: str) -> "dict[tuple[int, int], dict[int, str]] | None":
    """A VLLM_FORGE_GEMV_SHAPES value parsed as the patched vLLM parses it: (N, K) -> {token count: "gemv"
    or "mma"} (None: "all")."""
    V = validator()
    try:
        return V.gemv_launches(spec)
    except V.SwitchError as e:
        raise ForgeError(f"{where}: {e}", hint=f"the form the server reads: {V.GEMV_SHAPES_FORM}") from None


def gemv_shapes(spec: str, where: str) -> "dict[tuple[int, int], set[int]] | None":
    """The token counts per (N, K) that take one of our kernels (None: "all"), as `gemv_launches`."""
    launches = gemv_launches(spec, where)
    return None if launches is None else {nk: set(rows) for nk, rows in launches.items()}
