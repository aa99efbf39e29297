"""One scheduler step's time on one rank, from the DCU time model's components (model/dcu_time.py) and
a build's speed-ups of them: Vidur's method (an iteration's time as the sum of its operators' times,
each a light function of its work) with the operators the public DCU profiles priced.

A step schedules items (new tokens n, tokens already computed a) of several requests; N = sum of n.
Per rank at tensor parallel size tp (heads, columns or rows split; launches and the host are not):
- linear layers: a step of at most `gemv_rows` tokens runs the GEMV route: gemv / speed-up / tp (63.1 ms
  at one token on the card's rocBLAS, weight-bandwidth bound); a larger step runs the GEMM library:
  max(63.1 ms, N x 0.153 ms / prefill_gemm speed-up) / tp (the weights' read, or the compute roofline);
  never below the rank's streamed weights at the fastest read measured on the card (1.45 TB/s)
- prefill attention (n > 1): 196,608 x ((a + n)^2 - a^2) FLOPs at ~4 TFLOP/s x speed-up, / tp
- decode attention (n = 1): 2.9 ms x context / 14,000 / speed-up per request, / tp (the KV read; x
  int8's factor with an int8 cache)
- GDN: prefill tokens x 0.61 s / 21.7K / speed-up / tp; decode max(0.9 ms / speed-up, requests x 48
  state pages / the card's bandwidth) (launch bound, then the state read)
- elementwise: prefill tokens x 0.42 s / 21.7K / speed-up / tp; decode max(2.5 ms / speed-up, that)
- host: 1.6 ms / speed-up per step
- collectives at tp > 1: 2 all-reduces per layer and the embedding's of N x hidden bf16 each, and the
  logits' gather of (sampled requests) x vocab / tp bf16: each latency + bytes / bus bandwidth. The
  link's figures are public: NCCL over PCIe ~20 us for a 10 KB all-reduce; RCCL bus bandwidth ~40 GB/s
  between two BW-series cards over PCIe (contest-facts "The final round"); custom all-reduce off.
The per-request fixed prefill cost (0.1 s: the server's and client's handling of a request) delays the
request's arrival at the scheduler instead of occupying the step: the API server works beside the
engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ForgeError
from .dcu_time import ATTN_BASE_FLOPS, ATTN_FLOPS_PER_S2, BEST_PUBLIC, COMPONENTS, DECODE_ATTN_REF_CTX, REF_PROMPT
from .shape import Shape

CARD_BW = 1.206e12                    # the card's measured HBM read bandwidth (B/s)
WEIGHT_BW_MAX = 1.45e12               # the fastest weight read measured on the card (custom GEMVs: 1.31-1.45 TB/s)
GEMV_MS, GEMM_MS_PER_TOKEN = 63.1, 0.153e-3 * 1000


@dataclass(frozen=True)
class Link:
    name: str
    latency_s: float
    bus_bytes_per_s: float
    note: str


LINKS = {
    "pcie": Link("pcie", 20e-6, 40e9, "RCCL over PCIe, custom all-reduce off: ~20 us per 10 KB all-reduce (NCCL over "
                                      "PCIe, public), ~40 GB/s bus bandwidth (RCCL, two BW-series cards, public)"),
    "oneshot": Link("oneshot", 5e-6, 40e9, "a one-shot all-reduce kernel: ~5 us (public), the same bus"),
}


@dataclass(frozen=True)
class Build:
    """What runs on the card: speed-ups of the DCU time model's components (1 = vLLM 0.18.1 upstream),
    the most tokens a step may have for the GEMV route to serve its linear layers, and the time factors
    of int8 KV (decode and prefill attention) against bf16."""
    name: str
    speedups: dict = field(default_factory=dict)
    gemv_rows: int = 4
    int8_decode_attn: float = 1.0
    int8_prefill_attn: float = 1.0
    source: str = ""

    def sp(self, comp: str) -> float:
        return float(self.speedups.get(comp, 1.0))


UPSTREAM = Build("upstream", {}, gemv_rows=0, source="vLLM 0.18.1 upstream on gfx936 (the DCU time model's baseline)")
BEST_PUBLIC_BUILD = Build("best-public", {k: v for k, (v, _) in BEST_PUBLIC.items()}, gemv_rows=4,
                          source="the DCU time model's best public components (contest-facts), the GEMV route "
                                 "up to 4 tokens as vLLM's skinny GEMMs")


def check_build(b: Build) -> Build:
    for k, v in b.speedups.items():
        if k not in COMPONENTS:
            raise ForgeError(f"build {b.name}: unknown component {k!r}", hint=f"components: {', '.join(COMPONENTS)}")
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ForgeError(f"build {b.name}: speed-up of {k} {v!r} is not a finite positive factor")
    return b


class StepCost:
    """Seconds of one step on one rank for a build, the model's shape, tp, KV dtype and link."""

    def __init__(self, build: Build, shape: Shape, tp: int = 1, kv_dtype: str = "bf16", link: Link = LINKS["pcie"],
                 card_bw: float = CARD_BW):
        self.b, self.shape, self.tp, self.link = check_build(build), shape, tp, link
        self.int8 = kv_dtype == "int8"
        self.gdn_state_s = shape.gdn_layers * shape.gdn_page(tp) / card_bw
        self.weights_s = shape.streamed_bytes_per_rank(tp) / WEIGHT_BW_MAX
        self.prefill_tok_s = {k: f(REF_PROMPT) / REF_PROMPT for k, (_, f) in COMPONENTS.items()
                              if k in ("prefill_gdn", "prefill_elementwise")}

    def arrival_delay(self) -> float:
        return COMPONENTS["prefill_other"][1](0) / self.b.sp("prefill_other")

    def parts(self, items: list[tuple[int, int]]) -> dict[str, float]:
        """Seconds per component of a step that schedules `items` [(new tokens, computed before)]."""
        b, tp = self.b, self.tp
        n_tok = sum(n for n, _ in items)
        pre = [(n, a) for n, a in items if n > 1]
        dec = [a + 1 for n, a in items if n == 1]
        pre_tok = sum(n for n, _ in pre)
        if 0 < n_tok <= b.gemv_rows:
            linear = GEMV_MS / b.sp("gemv") / tp / 1000
        else:
            linear = max(GEMV_MS, n_tok * GEMM_MS_PER_TOKEN / b.sp("prefill_gemm")) / tp / 1000
        linear = max(linear, self.weights_s) if n_tok else 0.0
        flops = sum(ATTN_FLOPS_PER_S2 * ((a + n) ** 2 - a * a) for n, a in pre)
        p_attn = flops / (ATTN_BASE_FLOPS * b.sp("prefill_attn")) / tp * (b.int8_prefill_attn if self.int8 else 1.0)
        d_attn = sum(2.9e-3 * c / DECODE_ATTN_REF_CTX for c in dec) / b.sp("decode_attn") / tp \
            * (b.int8_decode_attn if self.int8 else 1.0)
        gdn = pre_tok * self.prefill_tok_s["prefill_gdn"] / b.sp("prefill_gdn") / tp
        if dec:
            gdn += max(0.9e-3 / b.sp("decode_gdn"), len(dec) * self.gdn_state_s)
        elt = pre_tok * self.prefill_tok_s["prefill_elementwise"] / b.sp("prefill_elementwise") / tp
        if dec:
            elt = max(elt, 2.5e-3 / b.sp("decode_elementwise"))
        out = {"linear": linear, "prefill_attn": p_attn, "decode_attn": d_attn, "gdn": gdn, "elementwise": elt,
               "host": 1.6e-3 / b.sp("host"), "collectives": 0.0}
        if tp > 1 and n_tok:
            s = self.shape
            ar = (2 * s.layers + 1) * (self.link.latency_s + n_tok * s.hidden * 2 / self.link.bus_bytes_per_s)
            sampled = len(items)
            gather = self.link.latency_s + sampled * (s.vocab // tp) * 2 / self.link.bus_bytes_per_s
            out["collectives"] = ar + gather
        return out

    def __call__(self, items: list[tuple[int, int]]) -> float:
        return sum(self.parts(items).values())
