"""The one reader of `vllm bench serve` result files (<run>/<tier>.json): every field the tools read
(score, compare, predict) is type-checked on the way in, so a damaged file is an error naming the
file and the key, never a crash or a wrong number. Also the per-request output lengths of two runs
compared (output_drift)."""

from __future__ import annotations

import math
from pathlib import Path

from .. import paths
from ..errors import ForgeError
from . import runs

DAMAGED = "the result file is damaged; rerun that tier (forge bench-all-tiers --run-id ...)"


def finite_positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def number(v) -> bool:
    """A finite number >= 0 (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def check_result(res, file: str) -> None:
    """The fields the tools read from a `vllm bench serve` result, type-checked: a damaged file is
    an error naming the file and key, never a crash."""
    def bad(key: str, v, want: str) -> ForgeError:
        return ForgeError(f"{file}: key '{key}' is {repr(v)[:60]}, expected {want}", hint=DAMAGED)

    for key in ("completed", "failed", "output_throughput"):
        if not isinstance(res, dict) or key not in res:
            what = f"no '{key}'" if isinstance(res, dict) else f"a JSON {type(res).__name__}, not an object"
            raise ForgeError(f"{file}: not a `vllm bench serve` result ({what})",
                             hint="results are written by forge bench-all-tiers")
    for key, ok, want in (("completed", _count, "a whole number >= 0"), ("failed", _count, "a whole number >= 0"),
                          ("output_throughput", number, "a finite number >= 0"),
                          ("p99_ttft_ms", number, "a finite number >= 0 or null"),
                          ("p99_tpot_ms", number, "a finite number >= 0 or null"),
                          ("mean_ttft_ms", number, "a finite number >= 0 or null"),
                          ("mean_tpot_ms", number, "a finite number >= 0 or null")):
        if not ok(res.get(key)) and not (key.startswith(("p99", "mean")) and res.get(key) is None):
            raise bad(key, res.get(key), want)
    for key, ok, want in (("output_lens", _count, "a whole number >= 0"),     # one entry per request
                          ("input_lens", _count, "a whole number >= 0"),
                          ("ttfts", number, "a finite number >= 0 (seconds)"),
                          ("itls", lambda x: isinstance(x, list) and all(map(number, x)),
                           "a list of finite numbers >= 0"),
                          ("errors", lambda x: x is None or isinstance(x, str), "a string or null")):
        v, lens = res.get(key), res.get("output_lens")
        if v is not None and not isinstance(v, list):
            raise bad(key, v, "a list, one entry per request")
        i = next((i for i, x in enumerate(v or []) if not ok(x)), None)
        if i is not None:
            raise bad(f"{key}[{i}]", v[i], want)
        if v and lens is not None and len(v) != len(lens):
            raise ForgeError(f"{file}: key '{key}' has {len(v)} entries, 'output_lens' {len(lens)}; expected "
                             "one per request", hint=DAMAGED)


def read_result(path: Path) -> dict:
    """A tier's result file, read and checked (check_result)."""
    res = runs.read_json(path)
    check_result(res, paths.rel(path))
    return res


def request_tpots_ms(res: dict) -> list[float] | None:
    """Per-request TPOT (ms) of the successful requests: time after the first token over the
    remaining tokens, as vLLM's client defines it (needs --save-detailed)."""
    if res.get("itls") is None or res.get("output_lens") is None:
        return None
    errors = res.get("errors") or [""] * len(res["output_lens"])
    out = []
    for itl, n, err in zip(res["itls"], res["output_lens"], errors):
        if err or not n or n <= 1:
            continue
        out.append(1000.0 * sum(itl) / (n - 1))
    return out


def mean_times_ms(res: dict, file: str) -> tuple[float, float]:
    """Mean TTFT and mean TPOT (ms) of a checked result's successful requests, as vLLM's client
    defines them (from the per-request lists where the file has them, else its own means); a result
    without a positive mean of both is an error naming the file."""
    ttfts, lens = res.get("ttfts"), res.get("output_lens")
    if ttfts and lens:
        errors = res.get("errors") or [""] * len(ttfts)
        ttft = [1000 * ttfts[i] for i, e in enumerate(errors) if not e]
        tpot = request_tpots_ms(res) or []
        if ttft and tpot:
            t, q = sum(ttft) / len(ttft), sum(tpot) / len(tpot)
            if not (finite_positive(t) and finite_positive(q)):
                raise ForgeError(f"{file}: mean TTFT {t:g} ms, mean TPOT {q:g} ms over its completed requests; "
                                 "both must be positive", hint=DAMAGED)
            return t, q
    t, q = res.get("mean_ttft_ms"), res.get("mean_tpot_ms")
    if not (finite_positive(t) and finite_positive(q)):
        raise ForgeError(f"{file}: no completed request with a TTFT and a TPOT",
                         hint="a tier needs requests of at least two output tokens that completed")
    return float(t), float(q)


def output_drift(run: dict, base: dict) -> dict:
    """Per-request output-length differences against a baseline run: greedy decoding should give
    the same lengths; a drift changes tok/s for reasons unrelated to speed."""
    out = {}
    for name, m in run["tiers"].items():
        a, b = m.get("output_lens"), base["tiers"][name].get("output_lens")
        if not a or not b:
            continue
        n = min(len(a), len(b))
        diff = [i for i in range(n) if a[i] != b[i]]
        out[name] = {"compared": n, "differ": len(diff), "requests": diff[:20],
                     "total_run": sum(a[:n]), "total_baseline": sum(b[:n]),
                     "count_mismatch": len(a) != len(b)}
    return out
