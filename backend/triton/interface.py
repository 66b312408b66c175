"""Triton tensors <-> engine requests, with no Triton import: parse and validate, build responses.

Two contracts (docs: /work/shared/design/triton-interface.md):
  * text (model `m3`, vLLM backend names, `max_batch_size: 0`): text_input -> text_output deltas;
  * token ids (model `m3_ids`, TensorRT-LLM `tensorrt_llm` names, `[B, ...]` shapes): input_ids -> output_ids;
plus the tokenizer helpers of the `preprocessing` / `postprocessing` ensemble steps.

Everything here works on plain numpy arrays (a dict name -> array of the inputs present), so it is
unit-testable without a server. Errors are `RequestError(field, message, code)`; the model turns them
into one FINAL error response for that request only.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from m3serve.engine.sampling_params import InvalidRequest, SamplingParams

INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
CANCELLED = "CANCELLED"
INTERNAL = "INTERNAL"
UNSUPPORTED = "UNSUPPORTED"
NOT_FOUND = "NOT_FOUND"

REASONING_PARSERS = ("minimax_m3",)


class RequestError(Exception):
    """A request cannot be served; `field` names the offending input or option."""

    def __init__(self, field_name: str | None, message: str, code: str = INVALID_ARG):
        super().__init__(f"{field_name}: {message}" if field_name else message)
        self.field = field_name
        self.code = code


# --------------------------------------------------------------------------------------------
# declared tensors (also used by auto_complete_config and checked against the shipped configs)
# --------------------------------------------------------------------------------------------
def _io(name: str, dtype: str, dims: list[int], optional: bool = True) -> dict:
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
    [_io("text_input", "TYPE_STRING", [1]),  # optional so that `messages` can stand in; checked here
     _io("stream", "TYPE_BOOL", [1]),
     _io("sampling_parameters", "TYPE_STRING", [1]),
     _io("exclude_input_in_output", "TYPE_BOOL", [1]),
     _io("messages", "TYPE_STRING", [1]),
     _io("tools", "TYPE_STRING", [1]),
     _io("chat_template_kwargs", "TYPE_STRING", [1])]
    + [_io(n, "TYPE_BOOL", [1]) for n in TEXT_RETURN_SWITCHES]
    + [_io(n, t, [1]) for n, (_, t) in TEXT_ALIASES.items()]
)
TEXT_OUTPUTS = [
    _io("text_output", "TYPE_STRING", [-1], False),
    _io("reasoning_output", "TYPE_STRING", [-1], False),
    _io("finish_reason", "TYPE_STRING", [-1], False),
    _io("cumulative_logprob", "TYPE_FP32", [-1], False),
    _io("logprobs", "TYPE_STRING", [-1], False),
    _io("num_input_tokens", "TYPE_UINT32", [1], False),
    _io("num_output_tokens", "TYPE_UINT32", [-1], False),
]

IDS_INPUTS = [
    _io("input_ids", "TYPE_INT32", [-1], False),
    _io("input_lengths", "TYPE_INT32", [1]),
    _io("request_output_len", "TYPE_INT32", [1]),
    _io("streaming", "TYPE_BOOL", [1]),
    _io("end_id", "TYPE_INT32", [1]),
    _io("pad_id", "TYPE_INT32", [1]),
    _io("beam_width", "TYPE_INT32", [1]),
    _io("num_return_sequences", "TYPE_INT32", [1]),
    _io("temperature", "TYPE_FP32", [1]),
    _io("runtime_top_k", "TYPE_INT32", [1]),
    _io("runtime_top_p", "TYPE_FP32", [1]),
    _io("len_penalty", "TYPE_FP32", [1]),
    _io("repetition_penalty", "TYPE_FP32", [1]),
    _io("presence_penalty", "TYPE_FP32", [1]),
    _io("frequency_penalty", "TYPE_FP32", [1]),
    _io("min_tokens", "TYPE_INT32", [1]),
    _io("min_length", "TYPE_INT32", [1]),
    _io("seed", "TYPE_UINT64", [1]),
    _io("random_seed", "TYPE_UINT64", [1]),
    _io("stop_words_list", "TYPE_INT32", [2, -1]),
    _io("bad_words_list", "TYPE_INT32", [2, -1]),
    _io("embedding_bias", "TYPE_FP32", [-1]),
    _io("exclude_input_in_output", "TYPE_BOOL", [1]),
    _io("return_log_probs", "TYPE_BOOL", [1]),
    _io("return_context_logits", "TYPE_BOOL", [1]),
    _io("return_generation_logits", "TYPE_BOOL", [1]),
    _io("stop", "TYPE_BOOL", [1]),
]
IDS_OUTPUTS = [
    _io("output_ids", "TYPE_INT32", [-1, -1], False),
    _io("sequence_length", "TYPE_INT32", [-1], False),
    _io("cum_log_probs", "TYPE_FP32", [-1], False),
    _io("output_log_probs", "TYPE_FP32", [-1, -1], False),
    _io("batch_index", "TYPE_INT32", [1], False),
    _io("sequence_index", "TYPE_INT32", [1], False),
]


# --------------------------------------------------------------------------------------------
# scalar readers
# --------------------------------------------------------------------------------------------
def _one(arr: np.ndarray, name: str):
    if arr.size != 1:
        raise RequestError(name, f"must hold exactly one element, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _utf8(value, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(name, f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    raise RequestError(name, f"must be a string (TYPE_STRING), got {type(value).__name__}")


def _str_scalar(tensors: dict, name: str) -> str | None:
    if name not in tensors:
        return None
    return _utf8(_one(tensors[name], name), name)


def _bool_scalar(tensors: dict, name: str) -> bool | None:
    if name not in tensors:
        return None
    v = _one(tensors[name], name)
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    raise RequestError(name, f"must be TYPE_BOOL, got {tensors[name].dtype}")


def _num(v, name: str):
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


def _json(text: str, name: str, want: type) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RequestError(name, f"is not valid JSON ({e})") from None
    if not isinstance(value, want):
        raise RequestError(name, f"must be a JSON {'object' if want is dict else 'array'}, "
                                 f"got {type(value).__name__}")
    return value


def _sampling(d: dict, sources: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams.from_dict(d)
    except InvalidRequest as e:
        msg = str(e)
        prefix = f"{e.field}: "
        msg = msg[len(prefix):] if msg.startswith(prefix) else msg
        raise RequestError(_source_name(e.field, sources.get(e.field)), msg) from None


def _source_name(key: str, source: str | None) -> str:
    """Name an option by where the client put it: a JSON key, a request parameter or a tensor."""
    if source in ("sampling_parameters", "parameters"):
        return f"{source}.{key}"
    return source or key


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------
@dataclass
class Defaults:
    """Model-level settings a request falls back on."""

    max_tokens: int = 16
    max_model_len: int | None = None
    vocab_size: int | None = None
    reasoning_parser: str | None = None  # model.json `reasoning_parser`
    utf8_stream_boundaries: bool = True  # m3_ids: hold back tokens that end inside a UTF-8 character


@dataclass
class GenRequest:
    """One engine request."""

    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list | None = None
    tools: list | None = None
    chat_template_kwargs: dict | None = None
    stream: bool = False
    prepend_input: bool = False
    returns: frozenset = frozenset()
    reasoning_parser: str | None = None
    batch_index: int = 0


@dataclass
class StopRequest:
    """TensorRT-LLM style explicit stop: cancel the work of the request with this id."""

    request_id: str


# keys a vLLM client may send that we know about but do not support
_UNSUPPORTED_SAMPLING = {
    "lora_name": "LoRA adapters are not supported",
    "best_of": "best_of > 1 is not supported",
    "use_beam_search": "beam search is not supported",
    "guided_decoding": "guided decoding is not supported",
    "logit_bias": "logit_bias is not supported",
    "prompt_logprobs": "prompt logprobs are not supported",
}


def _filtered_request_parameters(params_json: str | dict | None) -> dict:
    if not params_json:
        return {}
    params = params_json if isinstance(params_json, dict) else _json(params_json, "parameters", dict)
    # Triton's own switches (triton_enable_empty_final_response, ...) are not sampling options
    return {k: v for k, v in params.items() if not k.startswith("triton_")}


def parse_text_request(tensors: dict[str, np.ndarray], params_json: str | dict | None,
                       defaults: Defaults) -> GenRequest:
    """The `m3` (vLLM-contract) request -> one GenRequest; RequestError on bad input."""
    prompt = _str_scalar(tensors, "text_input")
    messages_json = _str_scalar(tensors, "messages")
    messages = tools = None
    if messages_json is not None:
        messages = _json(messages_json, "messages", list)
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError("messages", "must be a non-empty JSON array of {\"role\", \"content\"} objects")
        tools_json = _str_scalar(tensors, "tools")
        if tools_json is not None:
            tools = _json(tools_json, "tools", list)
    elif "tools" in tensors:
        raise RequestError("tools", "is only allowed together with messages")
    if prompt is None and messages is None:
        raise RequestError("text_input", "is required (or give `messages`)")
    if prompt is not None and messages is not None:
        raise RequestError("messages", "give either text_input or messages, not both")
    if prompt is not None and not prompt:
        raise RequestError("text_input", "is empty")
    ctk = None
    ctk_json = _str_scalar(tensors, "chat_template_kwargs")
    if ctk_json is not None:
        ctk = _json(ctk_json, "chat_template_kwargs", dict)

    stream = bool(_bool_scalar(tensors, "stream"))
    exclude = _bool_scalar(tensors, "exclude_input_in_output")
    if stream and exclude is False:
        raise RequestError("exclude_input_in_output",
                           "false is not supported with stream=true (streamed deltas never repeat the prompt)")
    prepend = (not stream) and (exclude is False if messages is not None else exclude is not True)

    returns = {n[len("return_"):] for n in TEXT_RETURN_SWITCHES if _bool_scalar(tensors, n)}
    # reasoning: the model.json parser is always on (reasoning never leaks into text_output); without
    # one, return_reasoning=true turns the minimax_m3 parser on for this request
    want_reasoning = _bool_scalar(tensors, "return_reasoning")
    parser = defaults.reasoning_parser or ("minimax_m3" if want_reasoning else None)
    returns.discard("reasoning")
    if parser and want_reasoning is not False:
        returns.add("reasoning")

    # sampling: defaults < request parameters < sampling_parameters JSON < explicit tensors
    merged: dict[str, Any] = {"max_tokens": defaults.max_tokens}
    sources: dict[str, str] = {}
    rp = _filtered_request_parameters(params_json)
    for k, v in rp.items():
        merged[k] = v
        sources[k] = "parameters"
    sp_json = _str_scalar(tensors, "sampling_parameters")
    if sp_json is not None:
        for k, v in _json(sp_json, "sampling_parameters", dict).items():
            merged[k] = v
            sources[k] = "sampling_parameters"
    for tname, (key, _) in TEXT_ALIASES.items():
        if tname in tensors:
            merged[key] = _num(_one(tensors[tname], tname), tname)
            sources[key] = tname
    for k, why in _UNSUPPORTED_SAMPLING.items():
        if k in merged and merged[k] not in (None, False, 1 if k == "best_of" else None):
            raise RequestError(_source_name(k, sources.get(k)), why)
        merged.pop(k, None)
    sp = _sampling(merged, sources)
    _check_max_tokens(sp, defaults, sources.get("max_tokens"))
    return GenRequest(sampling=sp, prompt=prompt, messages=messages, tools=tools, chat_template_kwargs=ctk,
                      stream=stream, prepend_input=prepend, returns=frozenset(returns),
                      reasoning_parser=parser)


def _check_max_tokens(sp: SamplingParams, defaults: Defaults, source: str | None) -> None:
    if defaults.max_model_len and sp.max_tokens is not None and sp.max_tokens > defaults.max_model_len:
        raise RequestError(_source_name("max_tokens", source), f"{sp.max_tokens} exceeds max_model_len ({defaults.max_model_len})")


def render_chat(tokenizer, req: GenRequest) -> None:
    """Turn `messages` into the prompt with the model's chat template (in place)."""
    if req.messages is None:
        return
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        req.prompt = tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True,
                                                   **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise RequestError("messages", f"cannot apply the chat template: {e}") from None
    except Exception as e:  # jinja2 errors and friends
        raise RequestError("messages", f"cannot apply the chat template: {type(e).__name__}: {e}") from None


def _batch_rows(arr: np.ndarray, batch: int, name: str) -> np.ndarray:
    if arr.ndim == 0 or arr.shape[0] != batch:
        raise RequestError(name, f"batch dimension {arr.shape[:1]} does not match input_ids ({batch})")
    return arr.reshape(batch, -1)


def _row_scalar(tensors: dict, name: str, b: int, batch: int):
    if name not in tensors:
        return None
    rows = _batch_rows(tensors[name], batch, name)
    if rows.shape[1] != 1:
        raise RequestError(name, f"must hold one value per batch item, got shape {list(tensors[name].shape)}")
    return _num(rows[b, 0], name)


def parse_word_list(arr: np.ndarray, name: str) -> list[list[int]]:
    """TensorRT-LLM word-list format for one item: [2, L] = (concatenated ids, end offsets padded -1)."""
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise RequestError(name, f"must have shape [2, L] per item, got {list(arr.shape)}")
    ids, offsets = arr[0].tolist(), [int(o) for o in arr[1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        if end < start or end > len(ids):
            raise RequestError(name, f"offset {end} out of range")
        if end > start:
            words.append([int(t) for t in ids[start:end]])
        start = end
    return words


def to_word_list(batch_words: list[list[list[int]]]) -> np.ndarray:
    """Per item a list of token sequences -> int32 [B, 2, L] (ids padded 0, offsets padded -1)."""
    flat, offs = [], []
    for words in batch_words:
        ids, ends = [], []
        for w in words:
            ids.extend(w)
            ends.append(len(ids))
        flat.append(ids)
        offs.append(ends)
    width = max([1] + [len(f) for f in flat] + [len(o) for o in offs])
    out = np.zeros((len(batch_words), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for i, (ids, ends) in enumerate(zip(flat, offs)):
        out[i, 0, :len(ids)] = ids
        out[i, 1, :len(ends)] = ends
    return out


def parse_ids_request(tensors: dict[str, np.ndarray], params_json: str | dict | None, defaults: Defaults,
                      request_id: str = "", decode: Callable[[list[int]], str] | None = None
                      ) -> list[GenRequest] | StopRequest:
    """The `m3_ids` (TensorRT-LLM contract) request -> one GenRequest per batch item."""
    if "stop" in tensors and bool(np.any(tensors["stop"])):
        if not request_id:
            raise RequestError("stop", "an explicit stop needs the request_id of the request to stop")
        return StopRequest(request_id)
    if "input_ids" not in tensors:
        raise RequestError("input_ids", "is required")
    ids = tensors["input_ids"]
    if ids.ndim == 1:
        ids = ids.reshape(1, -1)
    if ids.ndim != 2:
        raise RequestError("input_ids", f"must have shape [batch, tokens], got {list(ids.shape)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestError("input_ids", f"must be TYPE_INT32, got {ids.dtype}")
    batch = ids.shape[0]
    if batch < 1:
        raise RequestError("input_ids", "empty batch")
    rp = _filtered_request_parameters(params_json)
    unknown = sorted(set(rp) - {"max_tokens"})
    if unknown:
        raise RequestError(f"parameters.{unknown[0]}", "unknown request parameter for m3_ids")
    reqs = []
    for b in range(batch):
        def get(name):
            return _row_scalar(tensors, name, b, batch)
        n = get("input_lengths")
        row = ids[b]
        if n is not None:
            if not 1 <= n <= row.shape[0]:
                raise RequestError("input_lengths", f"{n} is outside [1, {row.shape[0]}]")
            row = row[:n]
        prompt_ids = [int(t) for t in row.tolist()]
        if not prompt_ids:
            raise RequestError("input_ids", "empty prompt")
        if defaults.vocab_size:
            bad = [t for t in prompt_ids if not 0 <= t < defaults.vocab_size]
            if bad:
                raise RequestError("input_ids", f"token id {bad[0]} is outside [0, {defaults.vocab_size})")
        if defaults.max_model_len and len(prompt_ids) > defaults.max_model_len:
            raise RequestError("input_ids", f"prompt of {len(prompt_ids)} tokens exceeds max_model_len "
                                            f"({defaults.max_model_len})")
        for name in ("beam_width", "num_return_sequences"):
            v = get(name)
            if v is not None and v != 1:
                raise RequestError(name, f"only 1 is supported, got {v}")
        for name in ("return_context_logits", "return_generation_logits"):
            if get(name):
                raise RequestError(name, "is not supported")
        if "bad_words_list" in tensors:
            rows = tensors["bad_words_list"]
            if rows.ndim != 3 or rows.shape[0] != batch:
                raise RequestError("bad_words_list", f"must have shape [batch, 2, L], got {list(rows.shape)}")
            if parse_word_list(rows[b], "bad_words_list"):
                raise RequestError("bad_words_list", "bad words are not supported")
        if "embedding_bias" in tensors:
            eb = _batch_rows(tensors["embedding_bias"], batch, "embedding_bias")[b]
            if eb.size and np.any(eb != 0):
                raise RequestError("embedding_bias", "is not supported")

        d: dict[str, Any] = {}
        sources: dict[str, str] = {}

        def put(key, value, src):
            if value is not None:
                d[key] = value
                sources[key] = src
        put("max_tokens", rp.get("max_tokens", defaults.max_tokens), "parameters")
        put("max_tokens", get("request_output_len"), "request_output_len")
        temperature = get("temperature")
        put("temperature", 0.0 if temperature is None else temperature, "temperature")
        top_k = get("runtime_top_k")
        put("top_k", None if top_k is None else top_k, "runtime_top_k")
        top_p = get("runtime_top_p")
        put("top_p", None if top_p in (None, 0.0) else top_p, "runtime_top_p")  # TRT-LLM: 0 = off
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            put(name, get(name), name)
        put("min_tokens", get("min_length"), "min_length")
        put("min_tokens", get("min_tokens"), "min_tokens")
        put("seed", get("random_seed"), "random_seed")
        put("seed", get("seed"), "seed")
        # TensorRT-LLM: end_id is THE end token (-1: none, only the length ends it); absent: the model's EOS
        end_id = get("end_id")
        stop_ids = [end_id] if end_id is not None and end_id >= 0 else []
        if end_id is not None:
            put("ignore_eos", True, "end_id")
        stop_strs = []
        if "stop_words_list" in tensors:
            rows = tensors["stop_words_list"]
            if rows.ndim != 3 or rows.shape[0] != batch:
                raise RequestError("stop_words_list", f"must have shape [batch, 2, L], got {list(rows.shape)}")
            for w in parse_word_list(rows[b], "stop_words_list"):
                if len(w) == 1:
                    stop_ids.append(w[0])
                elif decode is not None:
                    s = decode(w)
                    if s:
                        stop_strs.append(s)
        if stop_ids:
            put("stop_token_ids", stop_ids, "end_id")
        if stop_strs:
            put("stop", stop_strs, "stop_words_list")
        log_probs = bool(get("return_log_probs"))
        if log_probs:
            d["logprobs"] = 0
        sp = _sampling(d, sources)
        _check_max_tokens(sp, defaults, sources.get("max_tokens"))
        stream = bool(get("streaming"))
        exclude = bool(get("exclude_input_in_output"))
        reqs.append(GenRequest(sampling=sp, prompt_token_ids=prompt_ids, stream=stream,
                               prepend_input=not stream and not exclude,
                               returns=frozenset({"log_probs"} if log_probs else ()), batch_index=b))
    return reqs


# --------------------------------------------------------------------------------------------
# responses
# --------------------------------------------------------------------------------------------
def str_array(*values: str) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


class TextStream:
    """Turns a request's engine outputs into vLLM-contract response tensors.

    `add(out)` accumulates; `take(final)` returns the tensors of the next response, or None when a
    non-final response would carry nothing (no empty "priming" responses: TTFT stays honest).
    Streaming: text_output / logprobs / num_output_tokens are deltas, cumulative_logprob is cumulative,
    finish_reason reads "None" until the FINAL response. Non-streaming: one response with everything.
    """

    def __init__(self, req: GenRequest, decode_token: Callable[[int], str] | None = None):
        self.req = req
        self.decode_token = decode_token
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._n_new = 0
        self._logprobs: list | None = [] if "logprobs" in req.returns else None
        self.num_input = 0
        self.num_output = 0
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.finished = False

    def add(self, out) -> None:
        if out.num_prompt_tokens:
            self.num_input = out.num_prompt_tokens
        if out.text:
            self._text.append(out.text)
        if out.reasoning_text:
            self._reasoning.append(out.reasoning_text)
        n = len(out.new_token_ids)
        self._n_new += n
        self.num_output += n
        if out.cumulative_logprob is not None:
            self.cumulative_logprob = float(out.cumulative_logprob)
        if self._logprobs is not None and out.logprobs:
            for tid, entry in zip(out.new_token_ids, out.logprobs):
                self._logprobs.append(self._logprob_entry(tid, entry))
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason

    def _logprob_entry(self, tid: int, entry: dict) -> dict:
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        res = {}
        for rank, (t, lp) in enumerate(ranked, 1):
            res[str(int(t))] = {"logprob": float(lp), "rank": rank,
                                "decoded_token": self.decode_token(int(t)) if self.decode_token else None}
        if str(int(tid)) not in res:
            res[str(int(tid))] = {"logprob": None, "rank": None, "decoded_token": None}
        return res

    @property
    def has_content(self) -> bool:
        return bool(self._text or self._reasoning)

    def take(self, final: bool) -> dict[str, np.ndarray] | None:
        r = self.req
        if not final and (not r.stream or not self.has_content):
            return None
        text = "".join(self._text)
        if final and not r.stream and r.prepend_input and r.prompt:
            text = r.prompt + text
        t = {"text_output": str_array(text)}
        if "reasoning" in r.returns:
            t["reasoning_output"] = str_array("".join(self._reasoning))
        if "finish_reason" in r.returns:
            t["finish_reason"] = str_array(str(self.finish_reason) if final else "None")
        if "cumulative_logprob" in r.returns:
            t["cumulative_logprob"] = np.array(
                [self.cumulative_logprob if self.cumulative_logprob is not None else 0.0], dtype=np.float32)
        if "logprobs" in r.returns:
            t["logprobs"] = str_array(json.dumps(self._logprobs if self._logprobs or r.sampling.logprobs
                                                 is not None else None))
        if "num_input_tokens" in r.returns:
            t["num_input_tokens"] = np.array([self.num_input], dtype=np.uint32)
        if "num_output_tokens" in r.returns:
            t["num_output_tokens"] = np.array([self._n_new if r.stream else self.num_output], dtype=np.uint32)
        self._text.clear()
        self._reasoning.clear()
        self._n_new = 0
        if self._logprobs is not None:
            self._logprobs = []
        return t


class IdsStream:
    """Engine outputs -> TensorRT-LLM-contract tensors for one batch item ([1, beam=1, T] shapes).

    Streaming responses carry only the new tokens; with `hold` (a predicate on the pending ids) tokens that
    end inside a UTF-8 character are held back until the character completes, so a detokenizer after
    this model (the ensemble's postprocessing) decodes every response on its own correctly.
    """

    def __init__(self, req: GenRequest, hold: Callable[[list[int]], bool] | None = None):
        self.req = req
        self.hold = hold
        self._pending: list[int] = []
        self._pending_lp: list[float] = []
        self._all: list[int] = []
        self._all_lp: list[float] = []
        self.num_input = len(req.prompt_token_ids or [])
        self.num_output = 0
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.finished = False

    def add(self, out) -> None:
        ids = [int(t) for t in out.new_token_ids]
        self.num_output += len(ids)
        lps = []
        if out.logprobs:
            lps = [float(e.get(t, e.get(str(t), 0.0))) for t, e in zip(ids, out.logprobs)]
        lps += [0.0] * (len(ids) - len(lps))
        self._pending += ids
        self._pending_lp += lps
        if out.cumulative_logprob is not None:
            self.cumulative_logprob = float(out.cumulative_logprob)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason

    @property
    def has_content(self) -> bool:
        return bool(self._pending)

    def take(self, final: bool) -> dict[str, np.ndarray] | None:
        r = self.req
        if r.stream:
            if not final and (not self._pending or (self.hold is not None and self.hold(self._pending))):
                return None
            ids, lps = self._pending, self._pending_lp
        else:
            self._all += self._pending
            self._all_lp += self._pending_lp
            if not final:
                self._pending, self._pending_lp = [], []
                return None
            ids, lps = self._all, self._all_lp
            if r.prepend_input:
                ids = list(r.prompt_token_ids or []) + ids
                lps = [0.0] * self.num_input + lps
        self._pending, self._pending_lp = [], []
        t = {
            "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": np.array([[len(ids)]], dtype=np.int32),
            "batch_index": np.array([[r.batch_index]], dtype=np.int32),
            "sequence_index": np.array([[0]], dtype=np.int32),
        }
        if "log_probs" in r.returns:
            t["cum_log_probs"] = np.array([[self.cumulative_logprob or 0.0]], dtype=np.float32)
            t["output_log_probs"] = np.array(lps, dtype=np.float32).reshape(1, 1, -1)
        return t


def utf8_incomplete(decode: Callable[[list[int]], str]) -> Callable[[list[int]], bool]:
    """A `hold` predicate: the pending ids decode to text ending in U+FFFD (a split character)."""
    def hold(ids: list[int]) -> bool:
        return decode(ids).endswith("\ufffd")
    return hold


# --------------------------------------------------------------------------------------------
# preprocessing / postprocessing (TensorRT-LLM ensemble step names)
# --------------------------------------------------------------------------------------------
PRE_INPUTS = [
    _io("QUERY", "TYPE_STRING", [1], False),
    _io("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]),
    _io("BAD_WORDS_DICT", "TYPE_STRING", [-1]),
    _io("STOP_WORDS_DICT", "TYPE_STRING", [-1]),
    _io("END_ID", "TYPE_INT32", [1]),
    _io("PAD_ID", "TYPE_INT32", [1]),
]
PRE_OUTPUTS = [
    _io("INPUT_ID", "TYPE_INT32", [-1], False),
    _io("REQUEST_INPUT_LEN", "TYPE_INT32", [1], False),
    _io("BAD_WORDS_IDS", "TYPE_INT32", [2, -1], False),
    _io("STOP_WORDS_IDS", "TYPE_INT32", [2, -1], False),
    _io("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1], False),
    _io("OUT_END_ID", "TYPE_INT32", [1], False),
    _io("OUT_PAD_ID", "TYPE_INT32", [1], False),
]
POST_INPUTS = [
    _io("TOKENS_BATCH", "TYPE_INT32", [-1, -1], False),
    _io("SEQUENCE_LENGTH", "TYPE_INT32", [-1], False),
]
POST_OUTPUTS = [_io("OUTPUT", "TYPE_STRING", [-1], False)]


def _str_list(arr: np.ndarray, name: str) -> list[str]:
    out = []
    for v in arr.reshape(-1).tolist():
        s = _utf8(v, name)
        if s:
            out.append(s)
    return out


def preprocess(tensors: dict[str, np.ndarray], tokenizer, default_max_tokens: int,
               max_model_len: int | None = None) -> dict[str, np.ndarray]:
    """One preprocessing request ([B, 1] QUERY ...) -> the tensors `m3_ids` takes."""
    q = tensors.get("QUERY")
    if q is None:
        raise RequestError("QUERY", "is required")
    q = q.reshape(q.shape[0] if q.ndim > 1 else 1, -1)
    batch = q.shape[0]
    prompts = []
    for b in range(batch):
        text = _utf8(_one(q[b], "text_input"), "text_input")
        if not text:
            raise RequestError("text_input", "is empty")
        ids = tokenizer.encode(text)
        if not ids:
            raise RequestError("text_input", "tokenizes to nothing")
        if max_model_len and len(ids) > max_model_len:
            raise RequestError("text_input", f"prompt of {len(ids)} tokens exceeds max_model_len ({max_model_len})")
        prompts.append(ids)
    width = max(len(p) for p in prompts)
    input_ids = np.zeros((batch, width), dtype=np.int32)
    for b, p in enumerate(prompts):
        input_ids[b, :len(p)] = p
    if "REQUEST_OUTPUT_LEN" in tensors:
        out_len = _batch_rows(tensors["REQUEST_OUTPUT_LEN"], batch, "max_tokens").astype(np.int32)[:, :1]
    else:
        out_len = np.full((batch, 1), default_max_tokens, dtype=np.int32)

    def words(name):
        if name not in tensors:
            return [[] for _ in range(batch)]
        rows = tensors[name].reshape(batch, -1) if tensors[name].ndim > 1 else tensors[name].reshape(1, -1)
        if rows.shape[0] != batch:
            raise RequestError(name, "batch dimension does not match text_input")
        return [[tokenizer.encode(w) for w in _str_list(rows[b], name)] for b in range(batch)]

    def scalar_or(name, default):
        if name in tensors:
            return _batch_rows(tensors[name], batch, name).astype(np.int32)[:, :1]
        return np.full((batch, 1), -1 if default is None else default, dtype=np.int32)

    return {
        "INPUT_ID": input_ids,
        "REQUEST_INPUT_LEN": np.array([[len(p)] for p in prompts], dtype=np.int32),
        "BAD_WORDS_IDS": to_word_list(words("BAD_WORDS_DICT")),
        "STOP_WORDS_IDS": to_word_list(words("STOP_WORDS_DICT")),
        "REQUEST_OUTPUT_LEN": out_len,
        "OUT_END_ID": scalar_or("END_ID", tokenizer.eos_token_id),
        "OUT_PAD_ID": scalar_or("PAD_ID", tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                else tokenizer.eos_token_id),
    }


def postprocess(tensors: dict[str, np.ndarray], decode: Callable[[list[int]], str]) -> dict[str, np.ndarray]:
    """TOKENS_BATCH [B, beams, T] + SEQUENCE_LENGTH [B, beams] -> OUTPUT [B, beams] text."""
    tok = tensors.get("TOKENS_BATCH")
    if tok is None:
        raise RequestError("TOKENS_BATCH", "is required")
    if tok.ndim == 2:
        tok = tok[None]
    lens = tensors.get("SEQUENCE_LENGTH")
    lens = np.full(tok.shape[:2], tok.shape[2]) if lens is None else lens.reshape(tok.shape[:2])
    out = np.empty(tok.shape[:2], dtype=np.object_)
    for b in range(tok.shape[0]):
        for k in range(tok.shape[1]):
            n = int(max(0, min(lens[b, k], tok.shape[2])))
            out[b, k] = decode([int(t) for t in tok[b, k, :n]]).encode("utf-8")
    return {"OUTPUT": out}
