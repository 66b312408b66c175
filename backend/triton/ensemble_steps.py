"""The tokenizer steps of the TensorRT-LLM-style ensemble: `preprocessing` (text -> the tensors `m3_ids`
takes) and `postprocessing` (token ids -> text). Stateless, one response per request. Errors name the step's own
tensor and, for preprocessing, the ensemble input it comes from: "QUERY (ensemble: text_input): is empty". Triton
2.51 gives a step no sign of its caller (a request from the ensemble has the client's id, parameters and flags, and
asks for the outputs the ensemble maps, which are all of them), so a direct caller and an ensemble caller each
find their own name in the one message. A missing QUERY is "QUERY: is required": the ensemble requires text_input,
so only a direct caller meets it.
"""
from __future__ import annotations

import numpy as np

from m3serve.engine.sampling_params import INT32_MAX
from m3serve.triton.ids_contract import to_word_list
from m3serve.triton.schema import RequestError, int_rows, one, utf8


def _str_list(arr: np.ndarray, name: str) -> list[str]:
    return [s for s in (utf8(v, name) for v in arr.reshape(-1).tolist()) if s]


def _required(tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
    if name not in tensors:
        raise RequestError(name, "is required")
    return tensors[name]


# preprocessing's inputs -> the ensemble inputs mapped onto them (model_repository/ensemble/config.pbtxt)
ENSEMBLE_NAMES = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
                  "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id"}


def _named(tensor: str) -> str:
    """How an error names a preprocessing input: its own name, and the ensemble input it comes from."""
    return f"{tensor} (ensemble: {ENSEMBLE_NAMES[tensor]})"


QUERY = _named("QUERY")


class Preprocessing:
    """QUERY [B, 1] (+ REQUEST_OUTPUT_LEN, BAD/STOP_WORDS_DICT, END_ID, PAD_ID) -> INPUT_ID and friends."""

    def __init__(self, tokenizer, default_max_tokens: int, max_model_len: int | None = None):
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.max_model_len = max_model_len

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        q = _required(tensors, "QUERY")
        q = q.reshape(q.shape[0] if q.ndim > 1 else 1, -1)
        batch = q.shape[0]
        prompts = [self._prompt(q[b]) for b in range(batch)]
        width = max(len(p) for p in prompts)
        input_ids = np.zeros((batch, width), dtype=np.int32)
        for b, p in enumerate(prompts):
            input_ids[b, :len(p)] = p
        if "REQUEST_OUTPUT_LEN" in tensors:
            out_len = int_rows(tensors["REQUEST_OUTPUT_LEN"], batch, _named("REQUEST_OUTPUT_LEN"), QUERY)
        else:
            out_len = np.full((batch, 1), self.default_max_tokens, dtype=np.int64)
        for b, p in enumerate(prompts):
            self._check_length(len(p), int(out_len[b, 0]))
        tok = self.tokenizer
        return {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": np.array([[len(p)] for p in prompts], dtype=np.int32),
            "BAD_WORDS_IDS": to_word_list(self._words(tensors, "BAD_WORDS_DICT", batch)),
            "STOP_WORDS_IDS": to_word_list(self._words(tensors, "STOP_WORDS_DICT", batch)),
            "REQUEST_OUTPUT_LEN": out_len.astype(np.int32),
            "OUT_END_ID": self._scalar(tensors, "END_ID", batch, tok.eos_token_id),
            "OUT_PAD_ID": self._scalar(tensors, "PAD_ID", batch,
                                       tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
        }

    def _prompt(self, row: np.ndarray) -> list[int]:
        text = utf8(one(row, QUERY), QUERY)
        if not text:
            raise RequestError(QUERY, "is empty")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise RequestError(QUERY, "tokenizes to nothing")
        if self.max_model_len and len(ids) >= self.max_model_len:
            raise RequestError(QUERY, f"prompt of {len(ids)} tokens leaves no room under max_model_len "
                                             f"({self.max_model_len})")
        return ids

    def _check_length(self, n_prompt: int, max_tokens: int) -> None:
        name = _named("REQUEST_OUTPUT_LEN")
        if not 1 <= max_tokens <= INT32_MAX:
            raise RequestError(name, f"must be in [1, {INT32_MAX}], got {max_tokens}")
        if self.max_model_len and n_prompt + max_tokens > self.max_model_len:
            raise RequestError(name, f"{n_prompt} prompt tokens + max_tokens={max_tokens} exceed "
                                             f"max_model_len={self.max_model_len}")

    def _words(self, tensors, name: str, batch: int) -> list[list[list[int]]]:
        if name not in tensors:
            return [[] for _ in range(batch)]
        rows = tensors[name].reshape(batch, -1) if tensors[name].ndim > 1 else tensors[name].reshape(1, -1)
        if rows.shape[0] != batch:
            raise RequestError(_named(name), f"batch dimension does not match {QUERY}")
        return [[self.tokenizer.encode(w) for w in _str_list(rows[b], _named(name))] for b in range(batch)]

    @staticmethod
    def _scalar(tensors, name: str, batch: int, default: int | None) -> np.ndarray:
        if name in tensors:
            return int_rows(tensors[name], batch, _named(name), QUERY).astype(np.int32)
        return np.full((batch, 1), -1 if default is None else default, dtype=np.int32)


class Postprocessing:
    """TOKENS_BATCH [B, beams, T] + SEQUENCE_LENGTH [B, beams] -> OUTPUT [B, beams] text.

    Ids past SEQUENCE_LENGTH are padding (TensorRT-LLM pads with -1) and ignored; an id inside it that is
    not a vocabulary id is an error naming TOKENS_BATCH and its position."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tok = _required(tensors, "TOKENS_BATCH")
        if not np.issubdtype(tok.dtype, np.integer):
            raise RequestError("TOKENS_BATCH", f"must be TYPE_INT32, got {tok.dtype}")
        if tok.ndim == 2:
            tok = tok[None]
        if tok.ndim != 3:
            raise RequestError("TOKENS_BATCH", f"must have shape [batch, beams, tokens], got {list(tok.shape)}")
        lens = self._lengths(tensors.get("SEQUENCE_LENGTH"), tok.shape)
        vocab = self.tokenizer.vocab_size
        out = np.empty(tok.shape[:2], dtype=np.object_)
        for b in range(tok.shape[0]):
            for k in range(tok.shape[1]):
                ids = [int(t) for t in tok[b, k, :lens[b, k]]]
                bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
                if bad is not None:
                    raise RequestError("TOKENS_BATCH", f"token id {ids[bad]} at [{b}, {k}, {bad}] is not in "
                                                       f"[0, {vocab})")
                out[b, k] = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens).encode("utf-8")
        return {"OUTPUT": out}

    @staticmethod
    def _lengths(lens: np.ndarray | None, shape: tuple) -> np.ndarray:
        if lens is None:
            return np.full(shape[:2], shape[2], dtype=np.int64)
        if not np.issubdtype(lens.dtype, np.integer):
            raise RequestError("SEQUENCE_LENGTH", f"must be TYPE_INT32, got {lens.dtype}")
        if lens.size != shape[0] * shape[1]:
            raise RequestError("SEQUENCE_LENGTH", f"shape {list(lens.shape)} does not match TOKENS_BATCH "
                                                  f"{list(shape[:2])}")
        return np.clip(lens.reshape(shape[:2]).astype(np.int64), 0, shape[2])
