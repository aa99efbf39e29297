"""The plumbing check: greedy completions of the same prompts from two servers with the same random
weights, compared token by token and by the first token's top logprobs."""

from __future__ import annotations

import math

from .client import complete

PLUMBING_PROMPT_TOKENS = [1000, 4000, 12000]
PLUMBING_MAX_TOKENS = 32


def _choice(resp: dict) -> dict:
    ch = (resp.get("choices") or [{}])[0]
    lp = ch.get("logprobs") or {}
    return {"text": ch.get("text", ""), "tokens": lp.get("tokens") or [],
            "token_logprobs": lp.get("token_logprobs") or [], "top": lp.get("top_logprobs") or []}


def compare_outputs(ref: dict, test: dict) -> dict:
    """Greedy outputs of two servers with the same weights: where the token streams part, and how far
    the first token's top logprobs moved, against their own spread."""
    rt, tt = ref["tokens"], test["tokens"]
    same = 0
    for a, b in zip(rt, tt):
        if a != b:
            break
        same += 1
    vals = [x for x in test["token_logprobs"] if x is not None]
    finite = all(math.isfinite(x) for x in vals) and all(
        math.isfinite(v) for d in test["top"] if d for v in d.values())
    r0 = ref["top"][0] if ref["top"] else {}
    t0 = test["top"][0] if test["top"] else {}
    common = sorted(set(r0) & set(t0))
    diffs = [abs(r0[k] - t0[k]) for k in common]
    spread = (max(r0.values()) - min(r0.values())) if len(r0) > 1 else None
    collapse_test = len(tt) > 4 and len(set(tt)) == 1
    collapse_ref = len(rt) > 4 and len(set(rt)) == 1
    gross = []
    if not tt:
        gross.append("no tokens")
    if not finite:
        gross.append("non-finite logprobs")
    if collapse_test and not collapse_ref:
        gross.append("one token repeated throughout (the reference does not)")
    if r0 and t0 and not common:
        gross.append("first-token top candidates share nothing with the reference")
    return {"tokens": len(tt), "same_prefix": same, "identical": rt == tt,
            "first_token_same": bool(rt and tt and rt[0] == tt[0]),
            "top_common": len(common), "top_k": len(r0),
            "max_abs_logprob_diff": max(diffs) if diffs else None,
            "ref_top_spread": spread, "finite": finite, "gross": gross}


def plumbing(test: dict, ref: dict, prompts: list[str], left=lambda: 600.0) -> dict:
    rows = []
    for p in prompts:
        a = _choice(complete(ref, p, PLUMBING_MAX_TOKENS, logprobs=5, timeout=max(5.0, left())))
        b = _choice(complete(test, p, PLUMBING_MAX_TOKENS, logprobs=5, timeout=max(5.0, left())))
        row = compare_outputs(a, b)
        row["prompt_words"] = len(p.split())
        row["ref_text"], row["test_text"] = a["text"][:200], b["text"][:200]
        rows.append(row)
    failed = [r for r in rows if r["gross"]]
    return {"test": test["profile"], "reference": ref["profile"], "max_tokens": PLUMBING_MAX_TOKENS,
            "prompts": rows, "ok": not failed,
            "verdict": "no gross mismatch" if not failed else
            "; ".join(f"{r['prompt_words']} words: {', '.join(r['gross'])}" for r in failed)}
