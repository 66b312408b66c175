"""The token-id contract (model `m3_ids`): TensorRT-LLM `tensorrt_llm` names and `[B, ...]` shapes.

input_ids (+ input_lengths, request_output_len, end_id, stop_words_list, ...) -> output_ids per batch
item, tagged with batch_index; a batch of B becomes B engine requests answered on one response stream.
`stop=true` with the request id of a running request stops it (TensorRT-LLM's explicit stop).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from m3serve.engine.sampling_params import TextOptions
from m3serve.triton.contract import Contract, GenRequest, StopRequest, request_parameters, sampling_params
from m3serve.triton.schema import RequestError, batch_rows, number


class IdsContract(Contract):
    ENGINE_FIELDS = {"prompt": "input_ids", "prompt_token_ids": "input_ids", "request_id": "request_id",
                     "stop_words": "stop_words_list", "stop": "stop_words_list"}

    def parse(self, tensors: dict[str, np.ndarray], params: str | dict | None, request_id: str = ""
              ) -> list[GenRequest] | StopRequest:
        """One `m3_ids` request -> one GenRequest per batch item (or a StopRequest)."""
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
        rp = request_parameters(params)
        unknown = sorted(set(rp) - {"max_tokens"})
        if unknown:
            raise RequestError(f"parameters.{unknown[0]}", "unknown request parameter for m3_ids")
        return [self._item(tensors, ids[b], b, batch, rp) for b in range(batch)]

    def _item(self, tensors, row: np.ndarray, b: int, batch: int, rp: dict) -> GenRequest:
        def get(name):
            return _row_scalar(tensors, name, b, batch)
        n = get("input_lengths")
        if n is not None:
            if not 1 <= n <= row.shape[0]:
                raise RequestError("input_lengths", f"{n} is outside [1, {row.shape[0]}]")
            row = row[:n]
        for name in ("beam_width", "num_return_sequences"):
            v = get(name)
            if v is not None and v != 1:
                raise RequestError(name, f"only 1 is supported, got {v}")
        for name in ("return_context_logits", "return_generation_logits"):
            if get(name):
                raise RequestError(name, "is not supported")
        if "bad_words_list" in tensors and parse_word_list(_word_rows(tensors, "bad_words_list", batch)[b],
                                                           "bad_words_list"):
            raise RequestError("bad_words_list", "bad words are not supported")
        if "embedding_bias" in tensors:
            eb = batch_rows(tensors["embedding_bias"], batch, "embedding_bias")[b]
            if eb.size and np.any(eb != 0):
                raise RequestError("embedding_bias", "is not supported")

        d: dict[str, Any] = {}
        sources: dict[str, str] = {}

        def put(key, value, src):
            if value is not None:
                d[key] = value
                sources[key] = src
        put("max_tokens", rp.get("max_tokens"), "parameters")
        put("max_tokens", get("request_output_len"), "request_output_len")
        default = "max_tokens" not in d  # the model's default: the engine cuts it to the prompt's room
        if default:
            d["max_tokens"] = self.defaults.max_tokens
        temperature = get("temperature")
        put("temperature", 0.0 if temperature is None else temperature, "temperature")
        put("top_k", get("runtime_top_k"), "runtime_top_k")
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
        stop_words = []  # words of several tokens: the engine decodes them into stop strings
        if "stop_words_list" in tensors:
            for w in parse_word_list(_word_rows(tensors, "stop_words_list", batch)[b], "stop_words_list"):
                if len(w) == 1:
                    stop_ids.append(w[0])
                else:
                    stop_words.append(tuple(w))
        if stop_ids:
            names = [n for n in ("end_id", "stop_words_list") if n in tensors]
            put("stop_token_ids", stop_ids, ", ".join(names))
        log_probs = bool(get("return_log_probs"))
        if log_probs:
            d["logprobs"] = 0
        stream = bool(get("streaming"))
        exclude = bool(get("exclude_input_in_output"))
        return GenRequest(sampling=sampling_params(d, sources), prompt_token_ids=[int(t) for t in row.tolist()],
                          stream=stream, prepend_input=not stream and not exclude,
                          returns=frozenset({"log_probs"} if log_probs else ()), batch_index=b, sources=sources,
                          text_options=TextOptions(stop_words=tuple(stop_words), default_max_tokens=default)
                          if stop_words or default else None)

    def stream(self, req: GenRequest) -> "IdsStream":
        return IdsStream(req, self.defaults.utf8_stream_boundaries)


def _row_scalar(tensors: dict, name: str, b: int, batch: int):
    if name not in tensors:
        return None
    rows = batch_rows(tensors[name], batch, name)
    if rows.shape[1] != 1:
        raise RequestError(name, f"must hold one value per batch item, got shape {list(tensors[name].shape)}")
    return number(rows[b, 0], name)


def _word_rows(tensors: dict, name: str, batch: int) -> np.ndarray:
    rows = tensors[name]
    if rows.ndim != 3 or rows.shape[0] != batch:
        raise RequestError(name, f"must have shape [batch, 2, L], got {list(rows.shape)}")
    if not np.issubdtype(rows.dtype, np.integer):
        raise RequestError(name, f"must be TYPE_INT32, got {rows.dtype}")
    return rows


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


class IdsStream:
    """Engine outputs -> TensorRT-LLM-contract tensors for one batch item ([1, beam=1, T] shapes).

    Streaming responses carry only the new tokens; with `hold`, tokens that end inside a UTF-8 character (the
    engine's detokenizer says so: `RequestOutput.mid_character`) are held back until the character completes, so
    a detokenizer after this model (the ensemble's postprocessing) decodes every response on its own correctly.
    """

    def __init__(self, req: GenRequest, hold: bool = False):
        self.req = req
        self.hold = hold
        self._mid_character = False
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
        self._mid_character = out.mid_character
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
            if not final and (not self._pending or (self.hold and self._mid_character)):
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
