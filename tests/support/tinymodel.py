"""A tiny model directory for tests: config.json plus a WordLevel tokenizer built locally with the
`tokenizers` library (no downloads), with a chat template, so vLLM's benchmark client and our
synthetic-dataset builder can tokenize against it."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_WORDS = 2000
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def word(i: int) -> str:
    return f"w{i}"


def build(dest: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for i in range(VOCAB_WORDS):
        vocab[word(i)] = len(vocab)
    for extra in ["user", "assistant", "system", "Answer", "the", "is", "and", "key:", "Question:", "Paris",
                  "London", "Rome", "Berlin", "apple", "pear", "plum"]:
        vocab.setdefault(extra, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE,
    }))
    (dest / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "unk_token": "<unk>"}))
    (dest / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": len(vocab),
        "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
        "intermediate_size": 128, "max_position_embeddings": 32768, "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }))
    return dest


if __name__ == "__main__":
    import sys
    print(build(Path(sys.argv[1])))
