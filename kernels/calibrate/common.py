# SPDX-License-Identifier: Apache-2.0
"""What every calibration family shares: the model's shapes, the workload's prefill chunks and decode
contexts, timing, error measures, and the record format the tool's selection reads.

A family writes one JSON document: {"family", "device", "records": [...], "notes": [...]}. A record is
one candidate at one point of one decision:

    {"decision": "gemv.plain.14336x5120.1", "candidate": "forge b640 r2", "launch": [640, 2],
     "kind": "ours" | "upstream" | "builtin" | "vendor", "selectable": bool, "point": "M=1",
     "weight": 1.0, "ok": bool, "err": float | None, "tol": float, "error": str | None,
     "us": {"median": float, "p10": float, "p90": float, "n": int} | None}

plus "not_timed": str on a candidate that was not run at that point because the kernel in use cannot take it
(the GEMV family's skinny GEMM from a wheel built before its 32-row tile, at 24 or 32 tokens): ok false,
no error, no time; it is neither chosen nor counted as failed.

"upstream" is what vLLM 0.18.1 runs without our change (the anchor a tie goes to), "builtin" our
kernel's launch without a table (today's hand-picked choice), "ours" every other launch of our
kernel, "vendor" a vendor library path that is measured but that this build cannot route to. A launch
is a list of integers, or (GEMV family) the string "mma": the Triton skinny GEMM at its built-in launch,
written as that string into the table when it wins.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

# Qwen3.5-27B on one card
HQ, HKV, D = 24, 4, 256
LINEAR = [  # (layer, N, K): the bf16 linear layers a decode step runs (o_proj and out_proj share a shape)
    ("qkv_gate", 14336, 5120), ("o_proj/out_proj", 5120, 6144), ("in_proj_qkvz", 16384, 5120),
    ("in_proj_ba", 96, 5120), ("gate_up", 34816, 5120), ("down", 5120, 17408), ("lm_head", 248320, 5120),
]
# how each layer is split over tensor-parallel ranks: column-parallel layers split N, row-parallel ones K
ROW_PARALLEL = ("o_proj/out_proj", "down")


def linear(tp: int = 1) -> list[tuple[str, int, int]]:
    """LINEAR on one rank at tensor-parallel degree `tp`: column-parallel layers split N (the fused
    q + gate + K + V projection keeps one KV head per rank once tp exceeds the KV heads, as vLLM's
    QKVParallelLinear copies it), row-parallel ones split K."""
    hq, hkv = rank_heads(tp)
    out = []
    for layer, n, k in LINEAR:
        if layer == "qkv_gate":
            out.append((layer, 2 * hq * D + 2 * hkv * D, k))
        elif layer in ROW_PARALLEL:
            out.append((layer, n, k // tp))
        else:
            if n % tp:
                raise ValueError(f"tensor-parallel degree {tp} does not divide {layer}'s {n} outputs")
            out.append((layer, n // tp, k))
    return out


CALLS_PER_TOKEN = {"qkv_gate": 16, "o_proj/out_proj": 64, "in_proj_qkvz": 48, "in_proj_ba": 48,
                   "gate_up": 64, "down": 64, "lm_head": 1}
# the organizers' server prefills in chunks of --max-num-batched-tokens 4096; each tier's median
# prompt (configs/workload.yaml) is cut the way the scheduler cuts it
CHUNK = 4096
TIER_PROMPTS = {"4-8K": 6677, "8-16K": 14156, "16-32K": 21679}
DECODE_CONTEXTS = (4096, 8192, 16384, 32768)
BLOCK_BF16, BLOCK_INT8 = 784, 1552
MAX_CONTEXT = 32768
# The decode steps the rounds' servers run, as (requests decoding at once on a rank, the server's
# --max-num-seqs): the preliminary's one request; the planner's caps at 16-32K (4, bf16; 7, int8) and 8-16K
# (5); a DP2 replica's share (5) of the finals' concurrency 10, and the concurrency itself (10), at the
# baseline's 128; and the time model's picks at TP2 (16 at 4-8K, 24 at 8-16K and 16-32K). Each is measured
# as the server runs it: at the batch its attention backend plans (decode_key; padded with empty rows where
# a FULL CUDA graph runs it).
DECODE_SERVED = ((1, 128), (4, 4), (5, 5), (7, 7), (5, 128), (10, 128), (16, 128), (24, 128))
DECODE_SERVED_QUICK = ((1, 128), (10, 128))


def graph_batch(batch: int) -> int:
    """The CUDA graph a pure-decode step of `batch` requests runs in under vLLM's default compilation
    config: the smallest of its capture sizes (1, 2, 4, multiples of 8 below 256, then of 16:
    vllm/config/vllm.py, `_set_cudagraph_sizes`) that holds it. Where that graph is a FULL one
    (decode_key), the runner pads the step to its size with rows of length 0 (block-table rows -1)."""
    if batch < 1:
        raise ValueError(f"a decode batch of {batch} requests")
    step = 8 if batch <= 248 else 16
    return batch if batch <= 2 else 4 if batch <= 4 else -(-batch // step) * step


def decode_key(batch: int, max_num_seqs: int) -> int:
    """The batch the attention backend plans a pure-decode step of `batch` requests at (and looks the
    table's segments up by) on a server with --max-num-seqs `max_num_seqs`: vLLM registers FULL decode
    graphs only for capture sizes up to max-num-seqs (vllm/v1/cudagraph_dispatcher.py), so the step is
    padded to `graph_batch(batch)` where that is at most max-num-seqs, and otherwise runs a PIECEWISE
    graph whose attention sees the real batch (5 requests under --max-num-seqs 5: 5; under 128: 8)."""
    if not 1 <= batch <= max_num_seqs:
        raise ValueError(f"{batch} requests decoding at once under --max-num-seqs {max_num_seqs}")
    padded = graph_batch(batch)
    return padded if padded <= max_num_seqs else batch


def decode_plan(served) -> dict[int, list[int]]:
    """{planned batch: [requests decoding at once, ...]} of (requests, --max-num-seqs) pairs, in order."""
    plan: dict[int, list[int]] = {}
    for batch, seqs in served:
        reals = plan.setdefault(decode_key(batch, seqs), [])
        if batch not in reals:
            reals.append(batch)
    return plan


def rank_heads(tp: int, hq: int = HQ, hkv: int = HKV) -> tuple[int, int]:
    """(q heads, KV heads) of one tensor-parallel rank: KV heads split, or copied once tp exceeds them."""
    if tp < 1 or hq % tp:
        raise ValueError(f"tensor-parallel degree {tp} does not divide the {hq} query heads")
    return hq // tp, max(1, hkv // tp)


def chunks(prompt: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """(prefix, chunk tokens) of each forward step that prefills `prompt` tokens."""
    return [(p, min(chunk, prompt - p)) for p in range(0, prompt, chunk)]


def prefill_points(prompts: dict | None = None, chunk: int = CHUNK) -> list[tuple[int, int, float]]:
    """Distinct (prefix, chunk) steps of the tiers' median prompts, each with how often it occurs."""
    count: dict[tuple[int, int], float] = {}
    for prompt in (prompts or TIER_PROMPTS).values():
        for pc in chunks(prompt, chunk):
            count[pc] = count.get(pc, 0.0) + 1.0
    return [(p, c, w) for (p, c), w in sorted(count.items())]


def record(decision, candidate, kind, *, point, weight=1.0, launch=None, selectable=True, ok=False,
           err=None, tol=None, error=None, us=None, not_timed=None) -> dict:
    """One record; `not_timed` (a reason) marks a candidate that was not run at this point because the
    kernel in use cannot take it (not ok, yet no failure: the record says why and what to do)."""
    r = {"decision": decision, "candidate": candidate, "kind": kind, "launch": launch,
         "selectable": selectable and kind != "vendor", "point": point, "weight": weight, "ok": ok,
         "err": err, "tol": tol, "error": error, "us": us}
    if not_timed:
        r.update(ok=False, err=None, error=None, us=None, not_timed=not_timed)
    return r


def failed(r: dict) -> bool:
    """A record of a candidate that ran and failed (wrong or an error), not one that was not timed."""
    return not r["ok"] and not r.get("not_timed")


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:240]


def rel_err(torch, got, ref) -> float:
    """Max |got - ref| / max(|ref|, 1 % of ref's RMS): inf when got has a NaN (an unwritten output)."""
    got = got.double()
    ref = ref.double()
    if bool(torch.isnan(got).any()) or bool(torch.isinf(got).any()):
        return math.inf
    floor = max(1e-2 * ref.pow(2).mean().sqrt().item(), 1e-30)
    return ((got - ref).abs() / ref.abs().clamp_min(floor)).max().item()


def frob_err(torch, got, ref) -> float:
    """||got - ref|| / ||ref|| (attention outputs: a few rows sampled); inf for NaN."""
    got = got.double()
    ref = ref.double()
    if bool(torch.isnan(got).any()) or bool(torch.isinf(got).any()):
        return math.inf
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def stats(samples: list[float]) -> dict:
    s = sorted(samples)
    n = len(s)
    return {"median": round(statistics.median(s), 3), "p10": round(s[max(0, int(0.1 * (n - 1)))], 3),
            "p90": round(s[min(n - 1, int(math.ceil(0.9 * (n - 1))))], 3), "n": n}


def on_gpu(torch) -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def time_graph(torch, fns, reps: int = 15) -> dict:
    """Per-launch time (us) of a CUDA/HIP graph that runs each of `fns` once (they rotate over
    inputs so caches do not hold the next launch's data), replayed `reps` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return stats(graph_replay_us(torch, fns, reps))


def graph_replay_us(torch, fns, reps: int) -> list[float]:
    """Capture one CUDA/HIP graph that runs each of `fns` once (warm them up first), replay it once,
    then time `reps` replays, one event pair each: the per-launch time (us) of each, in replay order.
    Also kernels/bench/graph_timing.py's."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / len(fns))
    del g
    return out


def time_events(torch, fn, reps: int = 10, warmup: int = 2) -> dict:
    """Per-call time (us) of a long call (milliseconds: launch overhead is noise), one event pair
    per call; on the CPU (the smoke run under Triton's interpreter) wall time."""
    for _ in range(warmup):
        fn()
    if not on_gpu(torch):
        out = []
        for _ in range(max(2, reps // 4)):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return stats(out)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return stats(out)


def write_doc(path: str, doc: dict) -> None:
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


def progress(family: str, done: int, total: int, what: str) -> None:
    print(f"[calibrate {family}] {done}/{total} {what}", flush=True)


class Ledger:
    """A family's records as they are made, kept on disk, so a candidate that kills the process (a GPU
    fault, a compiler crash) costs only itself: before a candidate runs, OUT.inflight names it; each
    record is appended to OUT.partial.jsonl. `forge calibrate` moves the candidate in flight of a
    process that died to OUT.killers.jsonl and starts the family again with resume: candidates already
    measured are taken from the partial file, a killer is recorded as failed without running again.

    FORGE_CALIBRATE_FAULT="<decision>|<candidate>" kills the process at that candidate (the tool's own
    fault-injection tests)."""

    def __init__(self, out: str, resume: bool):
        self.partial, self.inflight, self.killers = out + ".partial.jsonl", out + ".inflight", out + ".killers.jsonl"
        self.records: list[dict] = []
        self.reuse: dict[tuple, list[dict]] = {}
        self.dead: dict[tuple, dict] = {}
        if resume:
            for r in _jsonl(self.partial):
                self.reuse.setdefault((r["decision"], r["candidate"]), []).append(r)
            for k in _jsonl(self.killers):
                self.dead[(k["decision"], k["candidate"])] = k
        else:
            for f in (self.partial, self.inflight, self.killers):
                if os.path.exists(f):
                    os.remove(f)
        # the partial file is rewritten with what this run keeps, as it goes
        if os.path.exists(self.partial):
            os.remove(self.partial)

    def begin(self, decision: str, candidate: str, kind: str, launch=None) -> bool:
        """True when the candidate is to be measured now; False when its records are already here
        (measured before this process, or a candidate that killed an earlier one)."""
        key = (decision, candidate)
        if key in self.reuse:
            for r in self.reuse.pop(key):
                self.add(r)
            return False
        if key in self.dead:
            k = self.dead[key]
            self.add(record(decision, candidate, kind, point="(every point)", launch=launch, ok=False,
                            error=f"killed the calibration process ({k.get('why', 'it died')}); not run again"))
            return False
        with open(self.inflight, "w", encoding="utf-8") as f:
            json.dump({"decision": decision, "candidate": candidate, "kind": kind, "launch": launch}, f)
        if os.environ.get("FORGE_CALIBRATE_FAULT") == f"{decision}|{candidate}":
            import signal
            os.kill(os.getpid(), signal.SIGSEGV)
        return True

    def add(self, rec: dict) -> dict:
        self.records.append(rec)
        with open(self.partial, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        return rec

    def finish(self) -> None:
        for f in (self.partial, self.inflight, self.killers):
            if os.path.exists(f):
                os.remove(f)


def _jsonl(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    break                # a line cut short by the process dying: the rest is measured again
    except FileNotFoundError:
        pass
    return out
