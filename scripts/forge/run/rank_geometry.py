"""One tensor-parallel rank's attention geometry, from the model's own config
(configs/models/qwen3.5-27b/config.json): what `forge calibrate --tp N` measures and writes into its
table's validators, so the patched loader takes the table only at that degree.

Per rank: query heads num_attention_heads / tp, KV heads num_key_value_heads / tp (copied once tp
exceeds them: one per rank), the GDN key / value heads split the same way. A degree that does not
divide the query or GDN heads is not one vLLM can run."""

from __future__ import annotations

import argparse

from .. import paths, tunedtable
from ..errors import ForgeError

MAX_TP = 64


def parse_tp(text: str) -> int:
    """--tp: a whole number 1-64 (whether it divides the model's heads is checked against its config)."""
    v = int(text) if text.isascii() and text.isdigit() else 0
    if not 1 <= v <= MAX_TP:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tensor-parallel degree (a whole number, 1 to {MAX_TP})")
    return v


def rank_heads(tp: int, cfg: dict | None = None) -> tuple[int, int]:
    """(query heads, KV heads) of one rank at tensor-parallel degree `tp` (tunedtable.split_heads)."""
    heads, bad = tunedtable.split_heads(tp, cfg)
    if bad:
        raise ForgeError(f"--tp {tp}: does not divide the model's {', '.join(bad)} "
                         f"({paths.rel(tunedtable.MODEL_CONFIG)})",
                         hint="give a degree that divides every head count (1, 2, 4 or 8 for Qwen3.5-27B)")
    return heads


def validators(tp: int) -> dict:
    """What a table measured at `tp` carries beside the device's identity (kernels/forge_tuned matches it)."""
    return {"tp": tp, "heads": list(rank_heads(tp))}


def worker_args(tp: int) -> list[str]:
    """The calibration family's arguments for `tp` (none at 1: the families' defaults are TP1)."""
    if tp == 1:
        return []
    hq, hkv = rank_heads(tp)
    return ["--tp", str(tp), "--heads", f"{hq},{hkv}"]


def options(tp: int) -> dict:
    """The degree among a family's recorded options (absent at 1, as before the option existed)."""
    return {"tp": tp} if tp != 1 else {}


def suffix(tp: int) -> str:
    """The table's and the default folder's name after the device's (nvidia-h200-sm_90-132cu-tp2)."""
    return f"-tp{tp}" if tp != 1 else ""


def add_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=parse_tp, default=1,
                   help="tensor-parallel degree: measure one rank's shapes and heads (derived from the model's config) "
                        "and write a table the server takes only at this degree (default 1)")
