"""Incremental detokenization with prefix/read offsets (UTF-8 safe streaming deltas)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# how many prompt tokens to keep as decoding context for the first output tokens
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each step decodes the window ids[prefix_offset:] and compares it with the text of
    ids[prefix_offset:read_offset]; the difference is emitted unless it ends in U+FFFD
    (an incomplete UTF-8 sequence), in which case it is held until more ids arrive.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self.num_prompt_ids = len(self._ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(len(self._ids) - PROMPT_CONTEXT_TOKENS, 0)
        self.output_text = ""
        self.mid_character = False  # the text so far ends in U+FFFD (an incomplete UTF-8 sequence, held back)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self.num_prompt_ids:]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end],
                                     skip_special_tokens=self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self.mid_character = new_text.endswith(_REPLACEMENT) and not final
        if len(new_text) <= len(prefix_text) or self.mid_character:
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def add(self, new_ids: Iterable[int] | int) -> str:
        """Append token ids; return the newly printable text (possibly "")."""
        if not hasattr(new_ids, "__iter__"):
            new_ids = (new_ids,)
        out = []
        for i in new_ids:
            self._ids.append(int(i))
            out.append(self._step(final=False))
        delta = "".join(out)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a trailing incomplete character)."""
        delta = self._step(final=True) if self._read_offset < len(self._ids) else ""
        self.output_text += delta
        return delta
