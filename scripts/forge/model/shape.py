"""Qwen3.5-27B's shape (configs/models/qwen3.5-27b/config.json), its weights per tensor-parallel rank,
and vLLM 0.18.1's page math for the hybrid model, as vLLM computes it:

- GDN state page per rank (`MambaSpec.page_size_bytes` of `get_mamba_state_shape_from_config`): conv
  state (kernel - 1) x conv_dim / tp in bf16 + SSM state (value heads / tp, key dim, value dim) in fp32;
  3,207,168 B at TP1.
- attention bytes per token per layer per rank (`FullAttentionSpec(block_size=1)` with the patched
  tree's in-page scales): 2 x kv_heads_rank x (head_dim x element + scale), element 2 (bf16) or 1
  (int8), scale 4 (int8's fp32 per token and head) or 0.
- the attention block (`HybridAttentionMambaModelConfig`, models/config.py, mamba_cache_mode none):
  16 x cdiv(gdn_page, 16 x bytes_per_token) -> 784 (bf16), 1552 (int8); the page = block x bytes per
  token, the GDN page padded up to it.
- the groups (`_get_kv_cache_groups_uniform_page_size`, v1/core/kv_cache_utils.py): layers of one kind
  grouped by the smaller count (16 attention, 48 GDN -> group size 16): 1 attention group and 3 GDN
  groups, 16 tensors each shared by one layer of every group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import options
from ..errors import ForgeError
from ..paths import CONFIGS, rel

MODEL_DIR = CONFIGS / "models" / "qwen3.5-27b"
KV_DTYPES = {"bf16": (2, 0), "int8": (1, 4)}      # (bytes per element, scale bytes per token and head)
ALIGN = 16                                        # kernel_block_alignment_size (non-MLA)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    attn_layers: int
    gdn_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    conv_kernel: int
    intermediate: int
    vocab: int
    vision_params: int          # the vision tower vLLM loads beside the text model (sharded like it)

    # --- weights ------------------------------------------------------------------------------
    def params(self) -> dict[str, int]:
        """Parameters by part: embedding, LM head, attention, GDN, MLP, norms (replicated), vision."""
        h, d = self.hidden, self.head_dim
        attn = h * 2 * self.q_heads * d + 2 * h * self.kv_heads * d + self.q_heads * d * h
        qk, v = self.gdn_k_heads * self.gdn_k_dim, self.gdn_v_heads * self.gdn_v_dim
        conv_dim = 2 * qk + v
        gdn = h * (2 * qk + 2 * v) + h * 2 * self.gdn_v_heads + conv_dim * self.conv_kernel \
            + 2 * self.gdn_v_heads + v * h
        norms = self.layers * 2 * h + h + self.attn_layers * 2 * d + self.gdn_layers * self.gdn_v_dim
        return {"embedding": self.vocab * h, "lm_head": self.vocab * h, "attention": self.attn_layers * attn,
                "gdn": self.gdn_layers * gdn, "mlp": self.layers * 3 * h * self.intermediate,
                "norms": norms, "vision": self.vision_params}

    def weight_bytes_per_rank(self, tp: int, vision: bool = True) -> int:
        """bf16 weights one rank holds: every part split over the ranks but the norms (without the
        vision tower when the server runs --language-model-only)."""
        p = self.params()
        skip = ("norms",) if vision else ("norms", "vision")
        return 2 * (sum(v for k, v in p.items() if k not in skip) // tp + p["norms"])

    def streamed_bytes_per_rank(self, tp: int) -> int:
        """bf16 weights one decode step reads on a rank: all but the embedding and the vision tower."""
        p = self.params()
        return 2 * (sum(v for k, v in p.items() if k not in ("norms", "embedding", "vision")) // tp + p["norms"])

    # --- pages ----------------------------------------------------------------------------------
    def check_tp(self, tp: int) -> None:
        for what, n in (("query heads", self.q_heads), ("GDN key heads", self.gdn_k_heads),
                        ("GDN value heads", self.gdn_v_heads)):
            if tp < 1 or n % tp:
                raise ForgeError(f"tensor parallel size {tp} does not divide the model's {n} {what}",
                                 hint="tensor parallel 1, 2, 4 or 8")

    def kv_heads_per_rank(self, tp: int) -> int:
        return max(1, self.kv_heads // tp)          # copied when tp > kv heads

    def gdn_page(self, tp: int) -> int:
        self.check_tp(tp)
        conv_dim = 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim
        conv = (self.conv_kernel - 1) * (conv_dim // tp) * 2
        ssm = (self.gdn_v_heads // tp) * self.gdn_k_dim * self.gdn_v_dim * 4
        return conv + ssm

    def attn_bytes_per_token(self, tp: int, kv_dtype: str) -> int:
        elt, scale = kv_dtype_bytes(kv_dtype)
        return 2 * self.kv_heads_per_rank(tp) * (self.head_dim * elt + scale)

    def block_size(self, tp: int, kv_dtype: str) -> int:
        return ALIGN * cdiv(self.gdn_page(tp), ALIGN * self.attn_bytes_per_token(tp, kv_dtype))

    def page_bytes(self, tp: int, kv_dtype: str) -> int:
        return self.block_size(tp, kv_dtype) * self.attn_bytes_per_token(tp, kv_dtype)

    def groups(self) -> tuple[int, int, int]:
        """(group size = layers per group = tensors, attention groups, GDN groups), as
        _get_kv_cache_groups_uniform_page_size forms them."""
        lo, hi = min(self.attn_layers, self.gdn_layers), max(self.attn_layers, self.gdn_layers)
        size = hi if hi < lo * 1.5 else lo
        return size, cdiv(self.attn_layers, size), cdiv(self.gdn_layers, size)


# vLLM's --kv-cache-dtype values the planner knows, by the planner's name (absent or auto: the model's bf16)
SERVED_KV_DTYPES = {None: "bf16", "auto": "bf16", "bfloat16": "bf16", "int8": "int8"}


def served_kv_dtype(argv: list[str]) -> str | None:
    """The KV dtype a server command runs (bf16 or int8), or None for one the planner does not know (fp8...)."""
    return SERVED_KV_DTYPES.get(options.last_value(argv, "--kv-cache-dtype"))


def kv_dtype_bytes(kv_dtype: str) -> tuple[int, int]:
    if kv_dtype not in KV_DTYPES:
        raise ForgeError(f"KV cache dtype {kv_dtype!r} is not one the planner knows",
                         hint=f"one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[kv_dtype]


def _vision_params(v: dict) -> int:
    """The Qwen3-VL-style vision tower: blocks (qkv, proj, two-layer MLP, two LayerNorms, with biases),
    the patch embedding, the position embedding and the 2x2 patch merger into the text's hidden size."""
    h, i, n = v["hidden_size"], v["intermediate_size"], v["depth"]
    block = (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * h + h
    pos = v["num_position_embeddings"] * h
    m = h * v["spatial_merge_size"] ** 2
    merger = 2 * h + (m * m + m) + (m * v["out_hidden_size"] + v["out_hidden_size"])
    return n * block + patch + pos + merger


def load_shape(model_dir: Path | None = None) -> Shape:
    """The shape from a model's config.json (default: the committed Qwen3.5-27B one)."""
    path = Path(model_dir or MODEL_DIR) / "config.json"
    try:
        cfg = json.loads(path.read_text())
        t = cfg.get("text_config", cfg)
        kinds = t["layer_types"]
        vision = _vision_params(cfg["vision_config"]) if "vision_config" in cfg else 0
        return Shape(hidden=t["hidden_size"], layers=t["num_hidden_layers"],
                     attn_layers=kinds.count("full_attention"), gdn_layers=kinds.count("linear_attention"),
                     q_heads=t["num_attention_heads"], kv_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                     gdn_k_heads=t["linear_num_key_heads"], gdn_v_heads=t["linear_num_value_heads"],
                     gdn_k_dim=t["linear_key_head_dim"], gdn_v_dim=t["linear_value_head_dim"],
                     conv_kernel=t["linear_conv_kernel_dim"], intermediate=t["intermediate_size"],
                     vocab=t["vocab_size"], vision_params=vision)
    except OSError as e:
        raise ForgeError(f"{rel(path)}: cannot be read ({e.strerror})", hint="give the model's folder with config.json")
    except (ValueError, KeyError, TypeError) as e:
        raise ForgeError(f"{rel(path)}: not a Qwen3.5 config.json ({e.__class__.__name__}: {e})",
                         hint="the planner models the hybrid Qwen3.5 (GDN + full attention) family")

