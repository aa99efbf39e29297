"""Synthetic tier datasets for when the official tier files are absent: prompts whose length in the
served model's own tokens falls in the tier's range, written in `vllm bench serve`'s custom format
(one {"prompt": ...} object per line)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from .errors import ForgeError


class Tok:
    """encode/decode over either the `tokenizers` library (tokenizer.json) or transformers."""

    OTHER_FILES = ("tokenizer_config.json", "tokenizer.model", "vocab.json")

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ForgeError(f"model directory {model_dir} does not exist",
                             hint="pass --model (or MODEL=) with the served model's directory")
        tj = model_dir / "tokenizer.json"
        self._hf = None
        self._fast = None
        fast_error = None
        if tj.is_file():
            try:
                from tokenizers import Tokenizer
            except ImportError as e:
                fast_error = f"importing `tokenizers` failed: {e}"
            else:
                try:
                    self._fast = Tokenizer.from_file(str(tj))
                except Exception as e:  # a damaged or foreign file
                    raise ForgeError(f"{tj}: cannot be read as a tokenizer: {e}",
                                     hint="copy the model's tokenizer.json again")
        if self._fast is None:
            others = [f for f in self.OTHER_FILES if (model_dir / f).is_file()]
            if not tj.is_file() and not others:
                raise ForgeError(f"{model_dir}: no tokenizer: {tj.name} is missing "
                                 f"(and so are {', '.join(self.OTHER_FILES)})",
                                 hint="pass --model with the served model's directory, which holds tokenizer.json")
            try:
                from transformers import AutoTokenizer
            except ImportError as e:
                why = f"{fast_error}; " if fast_error else (f"{tj.name} is missing, so " if not tj.is_file() else "")
                raise ForgeError(f"{model_dir}: cannot load the tokenizer: {why}importing `transformers` failed: {e}",
                                 hint="pip install tokenizers (requirements/dev.txt), or put the model's "
                                      "tokenizer.json in the folder")
            try:
                self._hf = AutoTokenizer.from_pretrained(str(model_dir))
            except Exception as e:  # transformers raises many types for a bad folder
                missing = "" if tj.is_file() else f"{tj.name} is missing and "
                raise ForgeError(f"{model_dir}: cannot load the tokenizer: {missing}transformers failed: {e}",
                                 hint="pass --model with the served model's directory")

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids)
        return self._hf.decode(ids)

    def vocab(self) -> dict[str, int]:
        return self._fast.get_vocab() if self._fast is not None else self._hf.get_vocab()


def word_pool(tok: Tok, limit: int = 20000) -> list[int]:
    """Ids of ordinary word tokens (letters, then letters or digits), so prompts read as text and
    re-tokenize stably."""
    pool = []
    for _, i in sorted(tok.vocab().items(), key=lambda kv: kv[1]):
        s = tok.decode([i]).strip()
        if len(s) >= 2 and s.isascii() and s.isalnum() and s[0].isalpha():
            pool.append(i)
            if len(pool) >= limit:
                break
    if len(pool) < 50:
        raise ForgeError("the tokenizer has too few plain word tokens to build synthetic prompts")
    return pool


def make_prompt(tok: Tok, pool: list[int], target: int, rng: random.Random) -> tuple[str, int]:
    """A prompt of close to `target` tokens (exact for tokenizers that do not merge across words)."""
    ids = [rng.choice(pool) for _ in range(target)]
    text = tok.decode(ids)
    for _ in range(8):
        n = len(tok.encode(text))
        if n == target:
            break
        if n > target:
            ids = ids[: max(1, len(ids) - (n - target))]
        else:
            ids = ids + [rng.choice(pool) for _ in range(target - n)]
        text = tok.decode(ids)
    return text, len(tok.encode(text))


def build_tier(model_dir: Path, tier: dict, n: int, out: Path, seed: int = 0) -> dict:
    lo, hi = tier["prompt_tokens"]
    tok = Tok(model_dir)
    pool = word_pool(tok)
    rng = random.Random(f"{seed}:{tier['name']}")
    lens = []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(n):
            target = lo + int((hi - lo) * (i + 0.5) / n)
            text, got = make_prompt(tok, pool, target, rng)
            if not lo <= got <= hi:
                raise ForgeError(f"synthetic prompt for tier {tier['name']} came out at {got} tokens, "
                                 f"outside {lo}-{hi}", hint="this tokenizer merges words heavily; use DATA_DIR")
            lens.append(got)
            f.write(json.dumps({"prompt": text}) + "\n")
    tmp.replace(out)
    return {"prompt_tokens": lens, "seed": seed}
