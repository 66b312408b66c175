"""Tokenizer wrapper over `tokenizers` with HF-style config and chat-template support."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from .chat_template import render_chat_template


def _token_str(value: Any) -> str | None:
    """tokenizer_config token entries are strings or {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


class Tokenizer:
    """Encode/decode plus chat templating for one model directory."""

    def __init__(self, tok: _HFTokenizer, config: dict | None = None,
                 chat_template: str | None = None):
        self._tok = tok
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.pad_token = _token_str(self.config.get("pad_token"))
        self.model_max_length = self.config.get("model_max_length")
        self.bos_token_id = self._maybe_id(self.bos_token)
        self.eos_token_id = self._maybe_id(self.eos_token)
        self.pad_token_id = self._maybe_id(self.pad_token)
        added = tok.get_added_tokens_decoder()
        self.special_token_ids: set[int] = {i for i, t in added.items() if t.special}
        self.special_token_ids |= {i for i in (self.bos_token_id, self.eos_token_id,
                                                self.pad_token_id) if i is not None}
        self.added_token_ids: set[int] = set(added)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja (if present)."""
        tok = _HFTokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        config: dict = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        template = _pick_template(config.get("chat_template"))
        tpl_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(tpl_path):  # a separate file takes precedence, as in HF
            with open(tpl_path, encoding="utf-8") as f:
                template = f.read()
        return cls(tok, config, template)

    def _maybe_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        """Id of one vocabulary entry; KeyError if absent."""
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, **template_kwargs):
        """Render messages (str), or token ids when tokenize=True; ValueError on template errors."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("tokenizer has no chat template")
        ctx = {"bos_token": self.bos_token, "eos_token": self.eos_token,
               "pad_token": self.pad_token}
        ctx.update(template_kwargs)
        text = render_chat_template(source, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt, **ctx)
        return self.encode(text) if tokenize else text
