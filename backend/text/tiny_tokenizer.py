"""Byte-level BPE tokenizers with MiniMax-M3 special strings: the tests' tiny one (`build_tiny_tokenizer`), and the
shared pieces (`train_bpe`, `write_tokenizer`) the learned model's tokenizer (m3serve.learn.tokenizer) uses too."""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from .tiny_chat_template import TINY_M3_CHAT_TEMPLATE

# (content, special) in id order; think markers stay visible in decoded text (special=False)
# so reasoning parsers can see them even with skip_special_tokens=True.
M3_SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("]~!b[", True),
    ("]~b]", True),
    ("[e~[", True),
    ("]<]minimax[>[", True),
    ("<mm:think>", False),
    ("</mm:think>", False),
    ("]<]image[>[", True),
    ("]<]video[>[", True),
]
BOS_TOKEN = "]~!b["
EOS_TOKEN = "[e~["
BASE_VOCAB_SIZE = 504  # + 8 added tokens = 512
MODEL_MAX_LENGTH = 8192

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A helpful assistant answers questions
clearly and honestly. What is the weather like in Paris today? It is sunny and warm.
Please write a short poem about the sea, the sky, and the stars at night.
The user asked for a summary of the report; the assistant replied with three points.
Thinking step by step, we first compute the sum, then divide by the count.
Let me check the weather for you. I will call the tool now and report back.
system developer user ai tool response tools tool_call invoke name item
You are a helpful assistant. Current thinking mode: enabled, disabled, adaptive.
<thinking_instructions> </thinking_instructions> <tools> </tools> <response> </response>
{"name": "get_weather", "description": "Get the weather for a city", "parameters":
{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
"required": ["city"]}}
def add(a, b):
    return a + b

class Counter:
    def __init__(self, start=0):
        self.value = start

    def step(self, n=1):
        self.value += n
        return self.value

for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)

import json, os, sys
data = json.loads('{"key": [1, 2, 3], "ok": true, "none": null}')
x = [v * 2 for v in data["key"] if v > 1]
int main(void) { printf("hello, world\\n"); return 0; }
SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name;
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-5
Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Ærøskøbing, El Niño.
Ünïcödé text with accents: à é è ê ë î ï ô ö ù û ü ç ñ ß ø å œ.
Привет, мир! Это пример текста на русском языке.
你好，世界！今天天气很好。我们一起学习编程吧。
日本語のテキストです。東京は大きな都市です。
안녕하세요, 세계! 한국어 문장입니다.
Emoji: 😀 😂 🚀 👍 👍🏽 ❤️ 🎉 🌍 🇫🇷 👩‍💻 ✨
Mixed: The café serves 拿铁 ☕ and croissants 🥐 every morning.
Math: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14, → ← ↑ ↓.
"""


def _corpus_lines() -> list[str]:
    # repeat English/code more so common merges dominate; keep non-ASCII mostly byte-split
    lines = _CORPUS.splitlines(keepends=True)
    return lines * 3


def train_bpe(lines, vocab_size: int, split_digits: bool = False) -> Tokenizer:
    """A byte-level BPE trained on `lines` (`vocab_size` before M3's added tokens), M3's special tokens added
    after it; `split_digits` makes every digit a token of its own (so numbers are read digit by digit)."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(lines, trainer=trainer)
    for content, special in M3_SPECIAL_TOKENS:
        added = AddedToken(content, special=special, normalized=False, single_word=False,
                           lstrip=False, rstrip=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    return tok


def write_tokenizer(out_dir: str, tok: Tokenizer, model_max_length: int = MODEL_MAX_LENGTH) -> dict:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (M3's layout); return key ids."""
    os.makedirs(out_dir, exist_ok=True)
    template = TINY_M3_CHAT_TEMPLATE
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=True))
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    ids = {c: tok.token_to_id(c) for c, _ in M3_SPECIAL_TOKENS}
    config = {
        "added_tokens_decoder": {
            str(ids[c]): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": s}
            for c, s in M3_SPECIAL_TOKENS
        },
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[EOS_TOKEN],
    }


def build_tiny_tokenizer(out_dir: str) -> dict:
    """The tests' tiny tokenizer (512 ids) in `out_dir`; return key ids."""
    return write_tokenizer(out_dir, train_bpe(_corpus_lines(), BASE_VOCAB_SIZE))
