"""Per-request sampling options, under vLLM's `SamplingParams` names."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


class InvalidRequest(ValueError):
    """A request option is invalid. `field` names the offending option (for INVALID_ARG replies)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


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
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise InvalidRequest(name, msg)

        need(self.n == 1, "n", f"only n=1 is supported, got {self.n}")
        need(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or self.top_k >= 0, "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"must be in [-2, 2], got {self.frequency_penalty}")
        need(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             f"must be in (0, 2], got {self.repetition_penalty}")
        need(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        need(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", f"must be in [0, 20], got {self.logprobs}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers")
        need(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys raise InvalidRequest naming the key.
        String-valued numbers (Triton clients often send "0.7") are converted by the field's type."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise InvalidRequest(key, "unknown sampling parameter")
            kwargs[key] = _coerce(key, known[key].type, value)
        return cls(**kwargs)


def _coerce(name: str, type_str: str, value: Any) -> Any:
    try:
        if type_str.startswith("list"):
            if name == "stop":
                return [value] if isinstance(value, str) else [str(v) for v in value]
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            return [int(v) for v in value]
        if value is None:
            if "None" in type_str:
                return None
            raise TypeError("null")
        if type_str.startswith("bool"):
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("true", "1", "yes"):
                    return True
                if low in ("false", "0", "no"):
                    return False
                raise ValueError(value)
            if isinstance(value, (bool, int)):
                return bool(value)
            raise TypeError(type(value).__name__)
        if type_str.startswith("int"):
            if isinstance(value, bool):
                raise TypeError("bool")
            f = float(value)
            if not f.is_integer():
                raise ValueError(value)
            return int(f)
        if type_str.startswith("float"):
            if isinstance(value, bool):
                raise TypeError("bool")
            f = float(value)
            if f != f or f in (float("inf"), float("-inf")):
                raise ValueError(value)
            return f
    except (TypeError, ValueError) as e:
        raise InvalidRequest(name, f"invalid value {value!r} ({e})") from None
    return value
