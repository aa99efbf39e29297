"""Synthetic tier datasets for when the official tier files are absent, in `vllm bench serve`'s
custom format (one {"prompt": ..., "output_tokens": N} object per line).

The default is the contest's own request shape (configs/workload.yaml): one prompt per
(input_len, output_len) pair of the official upstream run on the DCU, exactly input_len tokens as
vLLM's client counts them (the served model's tokenizer, chat template applied), each with its own
output length (client option --custom-output-len -1). `build_tier` (prompts spread over a tier's
range, no output length) remains for the GPU harness's fixed-output mode."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from .. import records
from ..config import Field, load
from ..errors import ForgeError
from ..paths import CONFIGS, NAME_HINT, name_problem, rel


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
                from tokenizers import Tokenizer  # optional (the contest extra): the model's tokenizer
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
                from transformers import AutoTokenizer  # heavy and optional: a model without tokenizer.json
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

    def count(self, text: str) -> int:
        """Tokens of `text` as vLLM's client counts a prompt: `tokenizer(prompt).input_ids`, special
        tokens (if the tokenizer adds any) included."""
        if self._fast is not None:
            return len(self._fast.encode(text, add_special_tokens=True).ids)
        return len(self._hf(text).input_ids)


def chat_template(model_dir: Path) -> str | None:
    """The model's chat template: chat_template.jinja, or tokenizer_config.json's chat_template."""
    model_dir = Path(model_dir)
    j = model_dir / "chat_template.jinja"
    if j.is_file():
        return j.read_text()
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        c = records.read_json(cfg)
        t = c.get("chat_template") if isinstance(c, dict) else None
        if isinstance(t, list):        # named templates: the default one
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return None


class ChatWrap:
    """Renders a user message the way vLLM's custom dataset does before counting it
    (`apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)`), with
    jinja2 as transformers does; without a template the prompt is sent as is."""

    def __init__(self, model_dir: Path):
        self.template = chat_template(model_dir)
        self._t = None
        self.specials: dict = {}
        if self.template is None:
            return
        try:
            # optional: the chat template's renderer, only where a model's template is applied
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:
            raise ForgeError(f"{model_dir}: the chat template needs jinja2 ({e})", hint="pip install jinja2")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)
        env.globals["raise_exception"] = raise_exception
        self._t = env.from_string(self.template)
        cfg = Path(model_dir) / "tokenizer_config.json"
        if cfg.is_file():
            c = records.read_json(cfg)
            c = c if isinstance(c, dict) else {}
            for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
                v = c.get(k)
                self.specials[k] = v.get("content") if isinstance(v, dict) else v

    def __call__(self, text: str) -> str:
        if self._t is None:
            return text
        return self._t.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True,
                              **self.specials)


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


def synthetic_prompt(model: Path, n_tokens: int, seed: str) -> str:
    """About `n_tokens` of the model's own words, the same for the same seed (warm-ups, probes)."""
    tok = Tok(model)
    text, _ = make_prompt(tok, word_pool(tok), n_tokens, random.Random(seed))
    return text


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


# --- the contest's request shape (configs/workload.yaml) -----------------------------------------

def load_workload(contest: dict, path: Path | str | None = None) -> dict:
    """configs/workload.yaml, validated: one entry per contest tier, each request [input_len,
    output_len] with input_len inside the tier's prompt range and 1 <= output_len <= output_cap."""
    path = Path(path) if path else CONFIGS / "workload.yaml"
    num = Field(float)
    schema = {
        "source": Field(str), "measured_on": Field(str), "output_cap": Field(int),
        "tiers": Field(dict, value={
            "baseline": Field({"output_tok_s": num, "mean_ttft_ms": num, "p99_ttft_ms": num,
                               "mean_tpot_ms": num, "p99_tpot_ms": num, "duration_s": num}),
            "requests": Field(list, item=list)}),
    }
    data = load(str(path), schema)
    f = rel(path)
    for name in data["tiers"]:          # a tier's name names its files: the one rule for such names
        if name_problem(name):
            raise ForgeError(f"{f}: key 'tiers.{name}': {name_problem(name)}", hint=NAME_HINT)
    names = [t["name"] for t in contest["tiers"]]
    if sorted(data["tiers"]) != sorted(names):
        raise ForgeError(f"{f}: key 'tiers': needs exactly the contest's tiers {', '.join(names)}, "
                         f"has {', '.join(data['tiers']) or 'none'}")
    cap = data["output_cap"]
    if cap < 1:
        raise ForgeError(f"{f}: key 'output_cap': expected a positive integer, got {cap}")
    for t in contest["tiers"]:
        name = t["name"]
        lo, hi = t["prompt_tokens"]
        w = data["tiers"][name]
        for k, v in w["baseline"].items():
            if not (math.isfinite(v) and v > 0):
                raise ForgeError(f"{f}: key 'tiers.{name}.baseline.{k}': expected a finite positive number, got {v}")
        if not w["requests"]:
            raise ForgeError(f"{f}: key 'tiers.{name}.requests': no requests")
        pairs = []
        for i, r in enumerate(w["requests"]):
            key = f"tiers.{name}.requests[{i}]"
            if len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r):
                raise ForgeError(f"{f}: key '{key}': expected [input_len, output_len] (two integers), got {r!r}")
            if not lo <= r[0] <= hi:
                raise ForgeError(f"{f}: key '{key}': input_len {r[0]} is outside the tier's {lo}-{hi} "
                                 "(configs/contest.yaml tiers.prompt_tokens)")
            if not 1 <= r[1] <= cap:
                raise ForgeError(f"{f}: key '{key}': output_len {r[1]} is outside 1-{cap} (output_cap)")
            pairs.append((r[0], r[1]))
        w["requests"] = pairs
    data["path"] = str(path)
    return data


def stratified(pairs: list[tuple[int, int]], n: int | None) -> list[tuple[int, int]]:
    """n of the pairs, evenly spaced through them ranked by output length (ties by input length), in
    their original order; all of them when n is None or not smaller."""
    if n is None or n >= len(pairs):
        return list(pairs)
    if n < 1:
        raise ForgeError(f"--num-prompts {n}: needs at least 1")
    ranked = sorted(range(len(pairs)), key=lambda i: (pairs[i][1], pairs[i][0], i))
    pick = sorted(ranked[int((k + 0.5) * len(pairs) / n)] for k in range(n))
    return [pairs[i] for i in pick]


def exact_prompt(tok: Tok, wrap: ChatWrap, pool: list[int], input_len: int, rng: random.Random) -> tuple[str, int]:
    """A prompt of plain words that the client counts as exactly `input_len` tokens once wrapped in
    the chat template; returns (raw prompt, its own token count)."""
    overhead = tok.count(wrap("")) if wrap.template else tok.count("")
    target = input_len - overhead
    if target < 1:
        raise ForgeError(f"input_len {input_len} is shorter than the chat template ({overhead} tokens)")
    ids = [rng.choice(pool) for _ in range(target)]
    for _ in range(16):
        text = tok.decode(ids)
        got = tok.count(wrap(text))
        if got == input_len:
            return text, len(tok.encode(text))
        if got > input_len:
            ids = ids[: max(1, len(ids) - (got - input_len))]
        else:
            ids = ids + [rng.choice(pool) for _ in range(input_len - got)]
    raise ForgeError(f"could not build a prompt of exactly {input_len} tokens with this tokenizer (last {got})",
                     hint="use the official tier files (DATA_DIR)")


def build_workload_tier(model_dir: Path, tier: str, pairs: list[tuple[int, int]], out: Path,
                        seed: int = 0) -> dict:
    """One prompt per (input_len, output_len) pair, written as {"prompt", "output_tokens"} lines."""
    tok = Tok(model_dir)
    wrap = ChatWrap(model_dir)
    pool = word_pool(tok)
    rng = random.Random(f"{seed}:{tier}:workload")
    raw, counted = [], []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for input_len, output_len in pairs:
            text, n_raw = exact_prompt(tok, wrap, pool, input_len, rng)
            raw.append(n_raw)
            counted.append(tok.count(wrap(text)))
            f.write(json.dumps({"prompt": text, "output_tokens": output_len}) + "\n")
    tmp.replace(out)
    return {"input_lens": counted, "prompt_tokens": raw, "output_tokens": [o for _, o in pairs],
            "chat_template": wrap.template is not None, "seed": seed}
