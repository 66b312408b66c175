"""The wire schema of the four roles (declared tensors), the error codes, and the tensor readers.

No Triton import: everything works on plain numpy arrays (a dict name -> array of the inputs present), so
the contracts are unit-testable without a server. `auto_complete_config` declares these lists, and
tests/server checks the shipped config.pbtxt files against them. Design: /work/shared/design/triton-interface.md.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

# error codes (pb_utils.TritonError names); the responder maps them to the server's values
INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
CANCELLED = "CANCELLED"
INTERNAL = "INTERNAL"
UNSUPPORTED = "UNSUPPORTED"
NOT_FOUND = "NOT_FOUND"


class RequestError(Exception):
    """A request cannot be served; `field` names the offending input or option as the client sent it."""

    def __init__(self, field_name: str | None, message: str, code: str = INVALID_ARG):
        super().__init__(f"{field_name}: {message}" if field_name else message)
        self.field = field_name
        self.code = code


# --------------------------------------------------------------------------------------------
# declared tensors
# --------------------------------------------------------------------------------------------
def io_spec(name: str, dtype: str, dims: list[int], optional: bool = True) -> dict:
    d = {"name": name, "data_type": dtype, "dims": dims}
    if optional:
        d["optional"] = True
    return d


TEXT_RETURN_SWITCHES = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
                        "return_num_input_tokens", "return_num_output_tokens", "return_reasoning")
# alias tensor -> SamplingParams key (genai-perf's TRT-LLM payload, TRT-LLM-style clients)
TEXT_ALIASES = {
    "max_tokens": ("max_tokens", "TYPE_INT32"),
    "min_tokens": ("min_tokens", "TYPE_INT32"),
    "min_length": ("min_tokens", "TYPE_INT32"),
    "top_k": ("top_k", "TYPE_INT32"),
    "top_p": ("top_p", "TYPE_FP32"),
    "temperature": ("temperature", "TYPE_FP32"),
    "seed": ("seed", "TYPE_UINT64"),
    "repetition_penalty": ("repetition_penalty", "TYPE_FP32"),
    "presence_penalty": ("presence_penalty", "TYPE_FP32"),
    "frequency_penalty": ("frequency_penalty", "TYPE_FP32"),
    "ignore_eos": ("ignore_eos", "TYPE_BOOL"),
}
TEXT_INPUTS = (
    [io_spec("text_input", "TYPE_STRING", [1]),  # optional so that `messages` can stand in; checked here
     io_spec("stream", "TYPE_BOOL", [1]),
     io_spec("sampling_parameters", "TYPE_STRING", [1]),
     io_spec("exclude_input_in_output", "TYPE_BOOL", [1]),
     io_spec("messages", "TYPE_STRING", [1]),
     io_spec("tools", "TYPE_STRING", [1]),
     io_spec("chat_template_kwargs", "TYPE_STRING", [1]),
     io_spec("assistant_prefix", "TYPE_STRING", [1])]
    + [io_spec(n, "TYPE_BOOL", [1]) for n in TEXT_RETURN_SWITCHES + ("returns_on_final_only",)]
    + [io_spec(n, t, [1]) for n, (_, t) in TEXT_ALIASES.items()]
)
TEXT_OUTPUTS = [
    io_spec("text_output", "TYPE_STRING", [-1], False),
    io_spec("reasoning_output", "TYPE_STRING", [-1], False),
    io_spec("finish_reason", "TYPE_STRING", [-1], False),
    io_spec("cumulative_logprob", "TYPE_FP32", [-1], False),
    io_spec("logprobs", "TYPE_STRING", [-1], False),
    io_spec("num_input_tokens", "TYPE_UINT32", [1], False),
    io_spec("num_output_tokens", "TYPE_UINT32", [-1], False),
]

IDS_INPUTS = [
    io_spec("input_ids", "TYPE_INT32", [-1], False),
    io_spec("input_lengths", "TYPE_INT32", [1]),
    io_spec("request_output_len", "TYPE_INT32", [1]),
    io_spec("streaming", "TYPE_BOOL", [1]),
    io_spec("end_id", "TYPE_INT32", [1]),
    io_spec("pad_id", "TYPE_INT32", [1]),
    io_spec("beam_width", "TYPE_INT32", [1]),
    io_spec("num_return_sequences", "TYPE_INT32", [1]),
    io_spec("temperature", "TYPE_FP32", [1]),
    io_spec("runtime_top_k", "TYPE_INT32", [1]),
    io_spec("runtime_top_p", "TYPE_FP32", [1]),
    io_spec("len_penalty", "TYPE_FP32", [1]),
    io_spec("repetition_penalty", "TYPE_FP32", [1]),
    io_spec("presence_penalty", "TYPE_FP32", [1]),
    io_spec("frequency_penalty", "TYPE_FP32", [1]),
    io_spec("min_tokens", "TYPE_INT32", [1]),
    io_spec("min_length", "TYPE_INT32", [1]),
    io_spec("seed", "TYPE_UINT64", [1]),
    io_spec("random_seed", "TYPE_UINT64", [1]),
    io_spec("stop_words_list", "TYPE_INT32", [2, -1]),
    io_spec("bad_words_list", "TYPE_INT32", [2, -1]),
    io_spec("embedding_bias", "TYPE_FP32", [-1]),
    io_spec("exclude_input_in_output", "TYPE_BOOL", [1]),
    io_spec("return_log_probs", "TYPE_BOOL", [1]),
    io_spec("return_context_logits", "TYPE_BOOL", [1]),
    io_spec("return_generation_logits", "TYPE_BOOL", [1]),
    io_spec("stop", "TYPE_BOOL", [1]),
]
IDS_OUTPUTS = [
    io_spec("output_ids", "TYPE_INT32", [-1, -1], False),
    io_spec("sequence_length", "TYPE_INT32", [-1], False),
    io_spec("cum_log_probs", "TYPE_FP32", [-1], False),
    io_spec("output_log_probs", "TYPE_FP32", [-1, -1], False),
    io_spec("batch_index", "TYPE_INT32", [1], False),
    io_spec("sequence_index", "TYPE_INT32", [1], False),
]

PRE_INPUTS = [
    io_spec("QUERY", "TYPE_STRING", [1], False),
    io_spec("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]),
    io_spec("BAD_WORDS_DICT", "TYPE_STRING", [-1]),
    io_spec("STOP_WORDS_DICT", "TYPE_STRING", [-1]),
    io_spec("END_ID", "TYPE_INT32", [1]),
    io_spec("PAD_ID", "TYPE_INT32", [1]),
]
PRE_OUTPUTS = [
    io_spec("INPUT_ID", "TYPE_INT32", [-1], False),
    io_spec("REQUEST_INPUT_LEN", "TYPE_INT32", [1], False),
    io_spec("BAD_WORDS_IDS", "TYPE_INT32", [2, -1], False),
    io_spec("STOP_WORDS_IDS", "TYPE_INT32", [2, -1], False),
    io_spec("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1], False),
    io_spec("OUT_END_ID", "TYPE_INT32", [1], False),
    io_spec("OUT_PAD_ID", "TYPE_INT32", [1], False),
]
POST_INPUTS = [
    io_spec("TOKENS_BATCH", "TYPE_INT32", [-1, -1], False),
    io_spec("SEQUENCE_LENGTH", "TYPE_INT32", [-1], False),
]
POST_OUTPUTS = [io_spec("OUTPUT", "TYPE_STRING", [-1], False)]

ROLES = {  # role -> (declared inputs, declared outputs)
    "text": (TEXT_INPUTS, TEXT_OUTPUTS),
    "ids": (IDS_INPUTS, IDS_OUTPUTS),
    "preprocessing": (PRE_INPUTS, PRE_OUTPUTS),
    "postprocessing": (POST_INPUTS, POST_OUTPUTS),
}


# --------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------
def one(arr: np.ndarray, name: str):
    if arr.size != 1:
        raise RequestError(name, f"must hold exactly one element, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def utf8(value, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(name, f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    raise RequestError(name, f"must be a string (TYPE_STRING), got {type(value).__name__}")


def str_scalar(tensors: dict, name: str) -> str | None:
    if name not in tensors:
        return None
    return utf8(one(tensors[name], name), name)


def bool_scalar(tensors: dict, name: str) -> bool | None:
    if name not in tensors:
        return None
    v = one(tensors[name], name)
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    raise RequestError(name, f"must be TYPE_BOOL, got {tensors[name].dtype}")


def number(v, name: str):
    """A tensor element as a Python number: ints exactly (UINT64 included), floats finite."""
    if isinstance(v, (np.floating, float)):
        f = float(v)
        if not math.isfinite(f):
            raise RequestError(name, f"must be finite, got {f}")
        return f
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, (np.integer, int)):
        return int(v)
    raise RequestError(name, f"must be numeric, got {type(v).__name__}")


def json_value(text: str, name: str, want: type) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RequestError(name, f"is not valid JSON ({e})") from None
    if not isinstance(value, want):
        raise RequestError(name, f"must be a JSON {'object' if want is dict else 'array'}, "
                                 f"got {type(value).__name__}")
    return value


def str_array(*values: str) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def batch_rows(arr: np.ndarray, batch: int, name: str, what: str = "input_ids") -> np.ndarray:
    """[B, ...] -> [B, rest] with B checked against the batch of `what`."""
    if arr.ndim == 0 or arr.shape[0] != batch:
        raise RequestError(name, f"batch dimension {list(arr.shape[:1])} does not match {what} ({batch})")
    return arr.reshape(batch, -1)


def int_rows(arr: np.ndarray, batch: int, name: str, what: str) -> np.ndarray:
    """One integer per batch item ([B] or [B, 1]) -> int64 [B, 1]."""
    rows = batch_rows(arr, batch, name, what)
    if rows.shape[1] != 1:
        raise RequestError(name, f"must hold one value per batch item, got shape {list(arr.shape)}")
    if not np.issubdtype(rows.dtype, np.integer):
        raise RequestError(name, f"must be TYPE_INT32, got {arr.dtype}")
    return rows.astype(np.int64)
