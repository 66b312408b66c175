"""`minimax_m3` reasoning parser: split `<mm:think>...</mm:think>` from the answer.

Rules (formats.md 5.2): with thinking_mode "enabled" the output starts inside reasoning
(a redundant leading `<mm:think>` is dropped). Otherwise a leading `</mm:think>` is dropped
once and the rest is content; else text between the first `<mm:think>` and the next
`</mm:think>` is reasoning, text around it is content, and an unterminated block stays
reasoning. Later markers are kept as literal text.
"""

from __future__ import annotations

from .stop_strings import partial_suffix_len

THINK_START = "<mm:think>"
THINK_END = "</mm:think>"


def extract(text: str, thinking_mode: str | None = None) -> tuple[str, str]:
    """Non-streaming split of a full output into (reasoning, content); "" when absent."""
    if thinking_mode == "enabled":
        if text.startswith(THINK_START):
            text = text[len(THINK_START):]
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content
    if text.startswith(THINK_END):
        return "", text[len(THINK_END):]
    before, start, after = text.partition(THINK_START)
    if not start:
        return "", text
    reasoning, _, content = after.partition(THINK_END)
    return reasoning, before + content


# parser states
_LEAD = "lead"            # at the very start; deciding on a leading marker
_PRE = "pre"              # content, looking for <mm:think>
_THINK = "think"          # reasoning, looking for </mm:think>
_POST = "post"            # content, no more markers


class MiniMaxM3ReasoningParser:
    """Streaming version of `extract`; markers are matched as text across deltas. `prefix`: text the reply
    was started with in the prompt (an assistant prefix, e.g. `</mm:think>` + a tool-call opening): the parser
    reads it first, so its state is the reply's after it, and what it returns for the prefix is dropped."""

    def __init__(self, thinking_mode: str | None = None, prefix: str = ""):
        self.thinking_mode = thinking_mode
        self._enabled = thinking_mode == "enabled"
        self._state = _LEAD
        self._buf = ""
        if prefix:
            self.feed(prefix)

    @property
    def in_reasoning(self) -> bool:
        return self._state == _THINK or (self._state == _LEAD and self._enabled)

    @property
    def reasoning_ended(self) -> bool:
        return self._state == _POST

    def _lead(self, buf: str) -> tuple[str, str] | None:
        """Resolve the leading marker; returns (next_state, remaining) or None to wait."""
        marker = THINK_START if self._enabled else THINK_END
        if buf.startswith(marker):
            return (_THINK if self._enabled else _POST), buf[len(marker):]
        if marker.startswith(buf):
            return None
        return (_THINK if self._enabled else _PRE), buf

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        buf = self._buf
        while True:
            if self._state == _LEAD:
                r = self._lead(buf)
                if r is None:
                    if not final:
                        break
                    r = ((_THINK if self._enabled else _PRE), buf)
                self._state, buf = r
            elif self._state == _POST:
                content.append(buf)
                buf = ""
                break
            else:
                marker = THINK_START if self._state == _PRE else THINK_END
                sink = content if self._state == _PRE else reasoning
                i = buf.find(marker)
                if i >= 0:
                    sink.append(buf[:i])
                    buf = buf[i + len(marker):]
                    self._state = _THINK if self._state == _PRE else _POST
                    continue
                keep = 0 if final else partial_suffix_len(buf, (marker,))
                sink.append(buf[:len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
        self._buf = buf
        return "".join(reasoning), "".join(content)

    def feed(self, delta: str) -> tuple[str, str]:
        """Add generated text; return (reasoning_delta, content_delta)."""
        self._buf += delta
        return self._run(final=False)

    def flush(self) -> tuple[str, str]:
        """End of output: release held partial markers as ordinary text."""
        return self._run(final=True)
