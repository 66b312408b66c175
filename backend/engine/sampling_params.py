"""Per-request sampling options, under vLLM's `SamplingParams` names, validated to what the engine can hold.

`validate()` checks types and ranges (ints are Python ints, never bools or floats; floats are finite), so a
request that passes cannot overflow a tensor or a generator later in the step. `from_dict` takes a JSON-like
dict (Triton's `sampling_parameters`): integers stay exact (a seed is never rounded through a float), numeric
strings are parsed by the field's type ("0.7", "16", "true"), anything else of the wrong type is an error
naming the key, never a silent conversion.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from m3serve.config import GREEDY_TEMPERATURE

INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**64  # seeds are exact integers in [0, 2^64)
MAX_LOGPROBS = 20


class InvalidRequest(ValueError):
    """A request option is invalid. `field` names the offending option (for INVALID_ARG replies)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # pickles (the engine process sends it back) with both arguments
        return (type(self), (self.field, self.message))

    @classmethod
    def already_running(cls, request_id: str) -> "InvalidRequest":
        """A request id that is running (or starting) already."""
        return cls("request_id", f"request {request_id!r} is already running")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Repetition, frequency or presence penalty: sampling reads the tokens generated so far."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        """Raise InvalidRequest naming the first option of a wrong type or out of range."""
        _int(self.n, "n", 1, 1, "only n=1 is supported")
        _float(self.temperature, "temperature", 0.0, 100.0, "[0, 100]")
        _float(self.top_p, "top_p", 0.0, 1.0, "(0, 1]", low_open=True)
        if not (_is_int(self.top_k) and self.top_k == -1):
            _int(self.top_k, "top_k", 0, INT32_MAX, f"must be -1, 0 or in [1, {INT32_MAX}]")
        _float(self.min_p, "min_p", 0.0, 1.0, "[0, 1]")
        if self.seed is not None:
            _int(self.seed, "seed", 0, SEED_LIMIT - 1, "must be an integer in [0, 2^64)")
        _float(self.presence_penalty, "presence_penalty", -2.0, 2.0, "[-2, 2]")
        _float(self.frequency_penalty, "frequency_penalty", -2.0, 2.0, "[-2, 2]")
        _float(self.repetition_penalty, "repetition_penalty", 0.0, 2.0, "(0, 2]", low_open=True)
        if self.max_tokens is not None:
            _int(self.max_tokens, "max_tokens", 1, INT32_MAX, f"must be in [1, {INT32_MAX}]")
        if self.max_tokens is None:
            _int(self.min_tokens, "min_tokens", 0, INT32_MAX, f"must be in [0, {INT32_MAX}]")
        else:
            _int(self.min_tokens, "min_tokens", 0, self.max_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None:
            _int(self.logprobs, "logprobs", 0, MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop", f"must be a string or a list of non-empty strings, got {_show(self.stop)}")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequest("stop_token_ids", f"must be a list of token ids, got {_show(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _int(t, "stop_token_ids", 0, INT32_MAX, f"must hold token ids in [0, {INT32_MAX}]")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, f"must be true or false, got {_show(getattr(self, name))}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys and values of the wrong type raise InvalidRequest naming
        the key. Numeric strings (Triton clients often send "0.7") are parsed by the field's type."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise InvalidRequest(key, "unknown sampling parameter")
            kwargs[key] = _coerce(key, known[key].type, value)
        return cls(**kwargs)


@dataclass(frozen=True)
class TextOptions:
    """What a request asks of the engine's tokenizer beyond `SamplingParams` (vLLM has no names for these; the Triton
    contracts need them). The engine, the one process that loads the tokenizer, does the decoding; its caller gets
    text only through the outputs.

    `default_max_tokens`: the request's max_tokens is the model's default, not a value the client sent. Where the
    prompt leaves less room under max_model_len, the engine cuts it to that room (as vLLM's OpenAI server cuts its
    default), where a max_tokens the client sent over the room is an error."""

    stop_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose text (decoded at `prepare`) is a stop string
    prompt_text: bool = False  # the first output carries the prompt decoded (`RequestOutput.prompt_text`)
    logprob_tokens: bool = False  # each logprobs entry's tokens decoded (`RequestOutput.logprob_tokens`)
    default_max_tokens: bool = False  # max_tokens is the model's default: cut to the prompt's room (docstring)

    def validate(self) -> None:
        """Raise InvalidRequest naming a stop word that is not a sequence of token ids in [0, 2^31)."""
        for word in self.stop_words:
            if not isinstance(word, (tuple, list)):
                raise InvalidRequest("stop_words", f"must hold sequences of token ids, got {_show(word)}")
            for t in word:
                _int(t, "stop_words", 0, INT32_MAX, f"must hold token ids in [0, {INT32_MAX}]")


def _show(v: Any, limit: int = 60) -> str:
    """A value for an error message, cut short (a client may send a 10^6-digit number)."""
    text = repr(v) if not _is_int(v) or v.bit_length() < 200 else f"<an integer of {v.bit_length()} bits>"
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any, name: str, lo: int, hi: int, rule: str) -> None:
    if not _is_int(v):
        raise InvalidRequest(name, f"must be an integer, got {_show(v)}")
    if not lo <= v <= hi:
        raise InvalidRequest(name, f"{rule}, got {_show(v)}")


def _float(v: Any, name: str, lo: float, hi: float, interval: str, low_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(name, f"must be a number, got {_show(v)}")
    if not math.isfinite(v) or v > hi or v < lo or (low_open and v == lo):
        raise InvalidRequest(name, f"must be in {interval}, got {_show(v)}")


_INT_TEXT = re.compile(r"^[+-]?\d+$")


def _to_int(value: Any) -> int:
    """An exact integer: an int, an integral float within 2^53 (JSON writers emit 3.0), or a decimal string."""
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        if abs(value) <= 2**53:
            return int(value)
        raise ValueError("a float above 2^53 is not an exact integer: send it as a JSON integer or a string")
    if isinstance(value, str) and _INT_TEXT.match(value.strip()):
        return int(value.strip())
    raise ValueError("not an integer")


def _coerce(name: str, type_str: str, value: Any) -> Any:
    if value is None:
        if "None" in type_str:
            return None
        raise InvalidRequest(name, "must not be null")
    try:
        if name == "stop":
            if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                return value
            raise ValueError("must be a string or a list of strings")
        if type_str.startswith("list"):  # stop_token_ids: a list of ints, or "1, 2 3"
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            if not isinstance(value, list):
                raise ValueError("must be a list of integers")
            return [_to_int(v) for v in value]
        if type_str.startswith("bool"):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if _is_int(value) and value in (0, 1):
                return bool(value)
            raise ValueError("must be true or false")
        if type_str.startswith("int"):
            return _to_int(value)
        if type_str.startswith("float"):
            if isinstance(value, bool):
                raise ValueError("must be a number")
            if isinstance(value, str):
                value = float(value.strip())
            if not isinstance(value, (int, float)):
                raise ValueError("must be a number")
            if not math.isfinite(value):
                raise ValueError("must be finite")
            return float(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidRequest(name, f"invalid value {_show(value)} ({e})") from None
    return value
