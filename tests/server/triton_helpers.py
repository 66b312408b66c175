"""Small tritonclient.grpc helpers for the server tests."""
from __future__ import annotations

import json
import queue
import re
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype


def inp(name: str, value, dtype=None, shape=None) -> grpcclient.InferInput:
    """An input tensor; str/bytes values become BYTES. `shape` defaults to [len] of a list, else [1]."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if dtype is None and all(isinstance(v, (str, bytes)) for v in values):
        arr = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)
    else:
        arr = np.array(values, dtype=dtype)
    if shape is not None:
        arr = arr.reshape(shape)
    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def text_inputs(prompt: str | bytes | None = None, *, stream: bool = False, max_tokens: int = 16,
                temperature: float = 0.0, extra: dict | None = None, returns=("finish_reason",
                "num_input_tokens", "num_output_tokens"), exclude: bool | None = True, **tensors):
    ins = []
    if prompt is not None:
        ins.append(inp("text_input", prompt))
    ins.append(inp("stream", stream, bool))
    if exclude is not None:
        ins.append(inp("exclude_input_in_output", exclude, bool))
    sp = {"max_tokens": max_tokens, "temperature": temperature}
    sp.update(extra or {})
    ins.append(inp("sampling_parameters", json.dumps(sp)))
    for r in returns:
        ins.append(inp(f"return_{r}", True, bool))
    for name, (value, dtype) in tensors.items():
        ins.append(inp(name, value, dtype))
    return ins


def is_final(result) -> bool:
    p = result.get_response().parameters
    return "triton_final_response" in p and p["triton_final_response"].bool_param


def run_stream(url: str, model: str, inputs, *, timeout: float = 120.0, request_id: str = "r",
               parameters: dict | None = None, empty_final: bool = True, first=None):
    """One request over its own gRPC stream; returns (responses, error) at FINAL or error. `first` (an Event) is set
    when the first response arrives."""
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    responses, error = [], None
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, parameters=parameters,
                                  enable_empty_final_response=empty_final)
        deadline = time.monotonic() + timeout
        while True:
            r, e = q.get(timeout=max(0.1, deadline - time.monotonic()))
            if e is not None:
                error = e
                break
            responses.append(r)
            if first is not None:
                first.set()
            if is_final(r):
                break
    finally:
        client.stop_stream()
        client.close()
    return responses, error


def texts(responses, name: str = "text_output") -> list[str]:
    out = []
    for r in responses:
        a = r.as_numpy(name)
        if a is not None:
            out.append(b"".join(a.reshape(-1).tolist()).decode("utf-8"))
    return out


def scalar(result, name: str):
    a = result.as_numpy(name)
    return None if a is None else a.reshape(-1)[0]


_METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$')


def metrics(url: str) -> dict[tuple, float]:
    """{(name, (("label", "value"), ...)): value} from the Prometheus text endpoint."""
    with urllib.request.urlopen(url, timeout=10) as f:
        text = f.read().decode()
    out = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(values: dict, name: str, **labels) -> float | None:
    want = set(labels.items())
    for (n, ls), v in values.items():
        if n == name and want <= set(ls):
            return v
    return None
