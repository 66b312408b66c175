"""The learned model's tokenizer: a byte-level BPE trained with `tokenizers` on the tasks' text (every digit a token
of its own), M3's special tokens and chat template, written as the tiny model's tokenizer is
(m3serve.text.tiny_tokenizer)."""
from __future__ import annotations

import os
import shutil

from m3serve.learn.tasks import END_OF_TURN, TASKS, make_examples
from m3serve.text.chat_template import render_chat_template
from m3serve.text.tiny_chat_template import TINY_M3_CHAT_TEMPLATE
from m3serve.text.tiny_tokenizer import train_bpe, write_tokenizer

BASE_VOCAB_SIZE = 2040  # + 8 added tokens = 2048
CORPUS_EXAMPLES = 300  # train examples per task the BPE is trained on
MODEL_MAX_LENGTH = 4096


def corpus(seed: int = 0, n: int = CORPUS_EXAMPLES) -> list[str]:
    """Whole rendered conversations (prompt + reply) from the train split of every task."""
    texts = []
    for task in TASKS:
        for ex in make_examples(task, "train", n, seed=seed):
            prompt = render_chat_template(TINY_M3_CHAT_TEMPLATE, ex.messages, tools=ex.tools,
                                          add_generation_prompt=True, **ex.chat_template_kwargs)
            texts.append(prompt + ex.answer + END_OF_TURN)
    return texts


def build_tokenizer(out_dir: str, seed: int = 0) -> dict:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja to `out_dir`; return
    {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"}."""
    tok = train_bpe(corpus(seed), BASE_VOCAB_SIZE, split_digits=True)
    return write_tokenizer(out_dir, tok, model_max_length=MODEL_MAX_LENGTH)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(src_dir: str, out_dir: str) -> dict:
    """An earlier checkpoint's tokenizer files into `out_dir` (a run that goes on from its weights keeps its ids, even
    where the tasks' text, and so a BPE trained on it now, has changed); returns what `build_tokenizer` returns."""
    from m3serve.text.tiny_tokenizer import BOS_TOKEN, EOS_TOKEN
    from m3serve.text.tokenizer import Tokenizer

    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src_dir, name)):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(out_dir, name))
    tok = Tokenizer.from_pretrained(out_dir)
    eos = tok.token_id(EOS_TOKEN)
    return {"vocab_size": tok.vocab_size, "bos_token_id": tok.token_id(BOS_TOKEN), "eos_token_id": eos,
            "pad_token_id": eos}
