"""The gateway's only way to the engine: tritonserver's gRPC API, one bidirectional stream per request to the
decoupled `m3` model (model_repository/README.md, the vLLM backend's tensors), and the model-ready RPC.

`TritonModel.generate(inputs)` yields one `Delta` per Triton response; closing the generator early (the
HTTP client went away) cancels the gRPC call, which Triton turns into a cancelled request: the model's
responder aborts the engine request within its cancellation check period (50 ms in the shipped config).

Errors: Triton's stream carries an error's text but not its code, so `api_error` reads the code back from
the text the m3 model writes: "<field>: <reason>" (INVALID_ARG, 400), "<ExceptionType>: <reason>"
(INTERNAL, 500), the unavailable / unloading / cancelled wordings (503), Triton's unknown-model reply (503:
the gateway serves one model, so its absence means it is not loaded). The words are passed on unchanged.
"""
from __future__ import annotations

import json
import re
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from m3serve.gateway.protocol import APIError

RETURNS = ("finish_reason", "num_input_tokens", "num_output_tokens")

_UNAVAILABLE = re.compile(r"unavailable|not healthy|being unloaded|not ready|no available version|"
                          r"unknown model|failed to connect|connection refused|deadline", re.I)
_EXCEPTION = re.compile(r"^[A-Z][A-Za-z0-9_.]*(Error|Exception|Failed|Fault)\b")


def tensor(name: str, value) -> grpcclient.InferInput:
    """A [1] input: str -> BYTES, bool -> BOOL."""
    if isinstance(value, str):
        arr = np.array([value.encode("utf-8")], dtype=np.object_)
    else:
        arr = np.array([value], dtype=bool if isinstance(value, bool) else None)
    t = grpcclient.InferInput(name, [1], np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def m3_inputs(*, prompt: str | None = None, messages: list | None = None, tools: list | None = None,
              chat_template_kwargs: dict | None = None, sampling: dict, logprobs: bool, reasoning: bool,
              assistant_prefix: str | None = None) -> list[grpcclient.InferInput]:
    """The `m3` request: always streamed (deltas), with the counts and finish reason the API reports on the final
    response only (`returns_on_final_only`: a response of text alone costs the server's response thread least)."""
    ins = [tensor("stream", True), tensor("returns_on_final_only", True),
           tensor("sampling_parameters", json.dumps(sampling))]
    if messages is not None:
        ins.append(tensor("messages", json.dumps(messages, ensure_ascii=False)))
        if tools is not None:
            ins.append(tensor("tools", json.dumps(tools, ensure_ascii=False)))
        if chat_template_kwargs:
            ins.append(tensor("chat_template_kwargs", json.dumps(chat_template_kwargs, ensure_ascii=False)))
        if assistant_prefix:
            ins.append(tensor("assistant_prefix", assistant_prefix))
    else:
        ins.append(tensor("text_input", prompt))
    for name in RETURNS:
        ins.append(tensor(f"return_{name}", True))
    if logprobs:
        ins.append(tensor("return_logprobs", True))
    if reasoning:
        ins.append(tensor("return_reasoning", True))
    return ins


@dataclass
class Delta:
    """One Triton response of a streamed `m3` request."""

    text: str = ""
    reasoning: str = ""
    num_output_tokens: int = 0  # on the final response: the tokens of the whole output (returns_on_final_only)
    num_input_tokens: int = 0  # on the final response
    finish_reason: str | None = None  # on the final response
    logprobs: list = field(default_factory=list)  # one {token id: {logprob, rank, decoded_token}} per token
    final: bool = False


def _string(result, name: str) -> str | None:
    a = result.as_numpy(name)
    if a is None or a.size == 0:
        return None
    return b"".join(a.reshape(-1).tolist()).decode("utf-8", "replace")


def _delta(result) -> Delta:
    params = result.get_response().parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    d = Delta(text=_string(result, "text_output") or "", reasoning=_string(result, "reasoning_output") or "",
              final=final)
    n = result.as_numpy("num_output_tokens")
    d.num_output_tokens = int(n.sum()) if n is not None else 0
    n = result.as_numpy("num_input_tokens")
    d.num_input_tokens = int(n.reshape(-1)[0]) if n is not None and n.size else 0
    fr = _string(result, "finish_reason")
    if fr and fr != "None":
        d.finish_reason = fr
        d.final = True
    lp = _string(result, "logprobs")
    if lp:
        d.logprobs = json.loads(lp) or []
    return d


def api_error(message: str, grpc_code=None) -> APIError:
    """The HTTP error of a Triton error (see the module docstring)."""
    if grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, message, "RateLimitError")
    if grpc_code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or _UNAVAILABLE.search(message):
        return APIError(503, message, "ServiceUnavailableError")
    if grpc_code == grpc.StatusCode.CANCELLED or message.startswith("Request was cancelled"):
        return APIError(503, message, "ServiceUnavailableError")
    if grpc_code not in (None, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN) \
            or _EXCEPTION.match(message):
        return APIError(500, message, "InternalServerError")
    message = message.removeprefix("sampling_parameters.")  # the m3 input the gateway fills: name the field
    name, sep, _ = message.partition(": ")
    return APIError(400, message, "BadRequestError", param=name if sep and " " not in name else None)


class TritonModel:
    """The `m3` model on one tritonserver, reached over gRPC (one channel, one stream per request)."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.client = grpcaio.InferenceServerClient(url)

    async def ready(self, timeout: float = 2.0) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model, client_timeout=timeout))
        except InferenceServerException:
            return False

    async def generate(self, inputs: list[grpcclient.InferInput], request_id: str) -> AsyncIterator[Delta]:
        """The responses of one request, up to its final one; an error raises APIError. Closing the generator
        before the end cancels the request on the server."""
        async def request():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        call = None
        try:
            call = self.client.stream_infer(request())
            async with aclosing(_responses(call)) as responses:
                async for result, error in responses:
                    if error is not None:
                        raise api_error(error.message())
                    d = _delta(result)
                    yield d
                    if d.final:
                        return
            raise APIError(502, "the Triton stream ended before the request's final response", "BadGatewayError")
        except grpc.aio.AioRpcError as e:
            raise api_error(e.details() or str(e.code()), e.code()) from None
        except InferenceServerException as e:
            raise api_error(e.message() or str(e), _grpc_status(e)) from None
        finally:
            if call is not None:
                call.cancel()  # no-op after the final response; cancels the Triton request otherwise

    async def close(self) -> None:
        await self.client.close()


async def _responses(call):
    async for item in call:
        yield item


def _grpc_status(e: InferenceServerException):
    s = e.status()
    if isinstance(s, str) and s.startswith("StatusCode."):
        return getattr(grpc.StatusCode, s[len("StatusCode."):], None)
    return None
