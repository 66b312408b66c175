"""What the two LLM contracts share: the engine request a Triton request becomes, and the way back from the
engine's option names to the names the client sent.

A contract (`TextContract` in text_contract.py, `IdsContract` in ids_contract.py) turns one Triton request
into `GenRequest`s and builds the response tensors of each from the engine's outputs. It checks only what
is the wire's business (shapes, types, JSON, which inputs go together, the server's policies); the range of
every option is the engine's business (`SamplingParams.validate`, `LLMEngine.prepare_request`), and an
engine `InvalidRequest` comes back to the client under the name the client used (`client_error`):
`request_output_len` when it sent that tensor, `sampling_parameters.max_tokens` when it sent JSON. The contracts
hold no tokenizer: text the responses need beyond the engine's deltas (a chat prompt's echo, the logprobs' tokens,
multi-token stop words) the engine decodes, asked by `GenRequest.text_options`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from m3serve.engine.sampling_params import InvalidRequest, SamplingParams, TextOptions
from m3serve.triton.schema import RequestError, json_value


@dataclass
class Defaults:
    """Model-level settings (config.pbtxt parameters, model.json) a request falls back on."""

    max_tokens: int = 16
    reasoning_parser: str | None = None  # model.json `reasoning_parser`
    utf8_stream_boundaries: bool = True  # m3_ids: hold back tokens that end inside a UTF-8 character
    trust_request_chat_template: bool = False  # accept chat_template_kwargs.chat_template from clients


@dataclass
class GenRequest:
    """One engine request, and where each of its options came from."""

    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list | None = None  # rendered by the engine with the chat template
    chat_template_kwargs: dict | None = None  # `tools` travels in here
    stream: bool = False
    prepend_input: bool = False
    returns: frozenset = frozenset()
    returns_on_final_only: bool = False  # streamed: the whole-request returns on the final response only
    reasoning_parser: str | None = None
    batch_index: int = 0
    sources: dict[str, str] = field(default_factory=dict)  # engine option -> the name the client sent
    text_options: TextOptions | None = None  # text the engine decodes for the responses (this process has no tokenizer)

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments of `EngineClient.prepare` / `generate`."""
        return dict(prompt=self.messages if self.messages is not None else self.prompt,
                    prompt_token_ids=self.prompt_token_ids, sampling_params=self.sampling,
                    reasoning_parser=self.reasoning_parser, chat_template_kwargs=self.chat_template_kwargs,
                    text_options=self.text_options)


@dataclass
class StopRequest:
    """TensorRT-LLM style explicit stop: cancel the work of the request with this id."""

    request_id: str


# keys a vLLM client may send that we know about but do not support
UNSUPPORTED_SAMPLING = {
    "lora_name": "LoRA adapters are not supported",
    "best_of": "best_of > 1 is not supported",
    "use_beam_search": "beam search is not supported",
    "guided_decoding": "guided decoding is not supported",
    "logit_bias": "logit_bias is not supported",
    "prompt_logprobs": "prompt logprobs are not supported",
}


def request_parameters(params_json: str | dict | None) -> dict:
    """The request's parameters without Triton's own switches (triton_enable_empty_final_response, ...)."""
    if not params_json:
        return {}
    params = params_json if isinstance(params_json, dict) else json_value(params_json, "parameters", dict)
    return {k: v for k, v in params.items() if not k.startswith("triton_")}


def source_name(key: str, source: str | None) -> str:
    """Name an option by where the client put it: a JSON key, a request parameter or a tensor."""
    if source in ("sampling_parameters", "parameters"):
        return f"{source}.{key}"
    return source or key


def sampling_params(d: dict[str, Any], sources: dict[str, str]) -> SamplingParams:
    """SamplingParams from merged options; an invalid one is named as the client sent it."""
    try:
        return SamplingParams.from_dict(d)
    except InvalidRequest as e:
        raise RequestError(source_name(e.field, sources.get(e.field)), e.message) from None


class Contract:
    """One request contract (a model role): Triton tensors -> engine requests; engine outputs -> responses."""

    # engine option -> client name, for options no source was recorded for
    ENGINE_FIELDS: dict[str, str] = {}

    def __init__(self, defaults: Defaults):
        self.defaults = defaults

    def parse(self, tensors: dict, params: str | dict | None, request_id: str = ""
              ) -> list[GenRequest] | StopRequest:
        raise NotImplementedError

    def stream(self, req: GenRequest):
        """The response builder of one engine request (`add(out)`, `take(final)`)."""
        raise NotImplementedError

    def client_field(self, req: GenRequest, engine_field: str) -> str:
        source = req.sources.get(engine_field)
        if source:
            return source_name(engine_field, source)
        return self.ENGINE_FIELDS.get(engine_field, engine_field)

    def client_error(self, req: GenRequest, e: InvalidRequest) -> RequestError:
        """An engine InvalidRequest, renamed to what the client sent."""
        return RequestError(self.client_field(req, e.field), getattr(e, "message", str(e)))
