"""The gateway's reading of Triton errors (backend/gateway/triton.py): the m3 model's error text has no code on
the gRPC stream, so the HTTP status comes from its wording (and from the RPC status when there is one)."""
from __future__ import annotations

import grpc
import pytest

from m3serve.gateway.triton import api_error


@pytest.mark.parametrize("message, code, status, param", [
    ("sampling_parameters.top_p: must be in (0, 1], got 3.0", None, 400, "top_p"),
    ("max_tokens: 2 prompt tokens + max_tokens=3000 exceed max_model_len=1024", None, 400, "max_tokens"),
    ("prompt: chat template failed: a tool message must follow", None, 400, "prompt"),
    ("RuntimeError: injected step fault", None, 500, None),  # INTERNAL: "<ExceptionType>: ..."
    ("RequestFailed: the step failed", None, 500, None),
    ("the engine is not healthy; the model is unavailable (killed)", None, 503, None),
    ("the model is being unloaded", None, 503, None),
    ("Request for unknown model: 'm3' is not found", None, 503, None),
    ("failed to connect to all addresses", grpc.StatusCode.UNAVAILABLE, 503, None),
    ("too many requests", grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
    ("boom", grpc.StatusCode.INTERNAL, 500, None),
])
def test_status_from_the_triton_error(message, code, status, param):
    e = api_error(message, code)
    assert e.status == status and e.param == param
    assert message.removeprefix("sampling_parameters.") == e.message  # the server's words, carried through
    assert e.body()["error"]["code"] == status
