"""What the two request contracts (chat.py, completions.py) share: the error every endpoint returns, the
sampling fields of vLLM's OpenAI server, and their translation to the `m3` model's `sampling_parameters`.

Fields are declared, so an unknown one is a 400 (never ignored); fields the server cannot honour
(`logit_bias`, `n` > 1, a JSON `response_format`...) are declared too, and refused by name in `refuse()`.
Ranges are the server's business: its error names the field ("top_p: must be in (0, 1], got 2.0").
"""
from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error reply in OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad_request(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "BadRequestError", param)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(StrictModel):
    """The fields both endpoints take (OpenAI's, and vLLM's sampling extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="refused unless empty")
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')

    SAMPLING: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
                "presence_penalty", "frequency_penalty", "repetition_penalty")

    def refuse(self) -> None:
        """400 for what the server cannot do (rather than ignoring it)."""
        if self.n is not None and self.n != 1:
            raise bad_request("n", f"only n=1 is supported (one sequence per request), got {self.n}")
        if self.logit_bias:
            raise bad_request("logit_bias", "logit_bias is not supported")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise bad_request("response_format", "only {\"type\": \"text\"} is supported (no guided decoding), got "
                                                 f"{str(self.response_format.get('type'))[:40]!r}")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "is only allowed with stream=true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise bad_request("stream_options.continuous_usage_stats", "is not supported")

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict:
        """`sampling_parameters` of the m3 request. max_tokens null: up to the context limit (vLLM's default)."""
        sp: dict[str, Any] = {"max_tokens": max_tokens}
        for k in self.SAMPLING:
            v = getattr(self, k)
            if v is not None:
                sp[k] = v
        if logprobs is not None:
            sp["logprobs"] = logprobs
        return sp

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class Reply:
    """What both contracts' request objects share: ids, the refusals, the token counts, the usage chunk."""

    endpoint = ""  # the metrics' label
    prefix = ""  # of the reply's id
    object = ""  # of a streamed chunk

    def __init__(self, req: SamplingRequest, model_name: str):
        self.req, self.model_name = req, model_name
        self.id, self.created = new_id(self.prefix), now()
        self.num_input = self.num_output = 0
        req.refuse()

    def count(self, d) -> None:
        """Add one Triton response's token counts."""
        self.num_input = d.num_input_tokens or self.num_input
        self.num_output += d.num_output_tokens

    def envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def usage_chunk(self) -> dict:
        """The last chunk of a stream with stream_options.include_usage."""
        return {**self.envelope(self.object), "choices": [], "usage": usage(self.num_input, self.num_output)}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def ranked_tops(entry: dict, n: int) -> list[tuple[str, float | None]]:
    """(decoded token, logprob) of the top-n of one server logprob entry (rank order)."""
    tops = sorted(((v.get("rank") or 1 << 30, v.get("decoded_token") or "", v.get("logprob"))
                   for v in entry.values()), key=lambda x: x[0])
    return [(tok, lp) for rank, tok, lp in tops if rank <= n]


def sampled(entry: dict) -> tuple[str, float | None]:
    """(decoded token, logprob) of the sampled token: the first of the server's entry."""
    v = next(iter(entry.values()), {}) if entry else {}
    return v.get("decoded_token") or "", v.get("logprob")


Role = Literal["system", "developer", "user", "assistant", "tool"]
