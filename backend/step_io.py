"""The typed step input and output: what the engine hands a worker for one forward, and what comes back.

Plain tensors, lists and scalars only, so a step can be pickled, broadcast to tensor-parallel ranks
(`torch.distributed.broadcast_object_list`) or copied into a CUDA graph's persistent buffers field by field.
Every layer shares these types, so this module sits below all of them and imports none.
The engine builds it on the host (`engine/step_builder.py`); the worker moves it to its device once
(`StepInput.to`) and every layer reads the same fields.

Token layout: the step's T tokens are the new tokens of S sequences, flattened in sequence order;
sequence s owns tokens [query_start_loc[s], query_start_loc[s + 1]).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from m3serve.config import GREEDY_TEMPERATURE


def _map_tensors(obj, fn):
    """A copy of the dataclass `obj` with `fn` applied to its tensor fields (and its nested dataclasses')."""
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = fn(v)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _map_tensors(v, fn)
    return dataclasses.replace(obj, **changes)


def _move(obj, device: torch.device, non_blocking: bool, copy: bool = False):
    return _map_tensors(obj, lambda t: t.to(device, non_blocking=non_blocking, copy=copy))


@dataclass
class SamplingInput:
    """Sampling options per sampled row (one row per entry of `StepInput.logits_indices`).

    Random rows draw with a counter-based generator keyed by (seed, position): a request's draws depend on
    its own seed and on the position of the token being sampled only, never on the rest of the batch.
    The optional tensors are None when no row of the step needs them (the `needs_*` flags are host bools,
    so the sampler never synchronises to find out).
    """

    temperature: torch.Tensor  # fp32 [N]; rows with temperature < GREEDY_EPS are greedy
    top_k: torch.Tensor  # int32 [N]; 0 = off
    top_p: torch.Tensor  # fp32 [N]; 1 = off
    min_p: torch.Tensor  # fp32 [N]; 0 = off
    seeds: torch.Tensor  # int64 [N]: the request's uint64 seed, two's complement
    positions: torch.Tensor  # int64 [N]: position of the token being sampled (the generator's counter)
    all_greedy: bool = False
    needs_top_k: bool = False
    needs_top_p: bool = False
    needs_min_p: bool = False
    # penalties (vLLM semantics): None when every row is neutral
    repetition_penalty: torch.Tensor | None = None  # fp32 [N]
    frequency_penalty: torch.Tensor | None = None  # fp32 [N]
    presence_penalty: torch.Tensor | None = None  # fp32 [N]
    prompt_token_ids: torch.Tensor | None = None  # int64 [N, Lp], -1 padded (repetition penalty)
    output_token_ids: torch.Tensor | None = None  # int64 [N, Lo], -1 padded
    # token ids masked to -inf (EOS and stop ids of rows still below min_tokens), -1 padded [N, k]
    suppress_token_ids: torch.Tensor | None = None
    max_num_logprobs: int = -1  # top-n raw logprobs to return per row (max over rows); -1 = none

    GREEDY_EPS = GREEDY_TEMPERATURE

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def is_simple(self) -> bool:
        """Greedy or temperature-only rows, no top-n logprobs: one pass over the logits samples them."""
        return (self.max_num_logprobs <= 0 and not (self.needs_top_k or self.needs_top_p or self.needs_min_p)
                and self.repetition_penalty is None and self.frequency_penalty is None
                and self.presence_penalty is None and self.suppress_token_ids is None)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SamplingInput":
        return _move(self, torch.device(device), non_blocking)

    def repeat_rows(self, k: int) -> "SamplingInput":
        """Each row k times over, rows [N] -> [N * k] (row-major): the options of [N, k, V] logits."""
        return _map_tensors(self, lambda t: t.repeat_interleave(k, dim=0))

    def select(self, rows: torch.Tensor) -> "SamplingInput":
        """The options of the rows `rows` (int64 [n], on the tensors' device), in that order."""
        return _map_tensors(self, lambda t: t[rows])

    @classmethod
    def full(cls, n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int = 0, device: torch.device | str = "cpu") -> "SamplingInput":
        """The same options for n rows (tests, a single request)."""
        f = lambda v, dt=torch.float32: torch.full((n,), v, dtype=dt, device=device)  # noqa: E731
        return cls(f(float(temperature)), f(int(top_k), torch.int32), f(float(top_p)), f(float(min_p)),
                   f(int(seed), torch.int64), f(0, torch.int64), all_greedy=temperature < cls.GREEDY_EPS,
                   needs_top_k=top_k > 0, needs_top_p=top_p < 1.0, needs_min_p=min_p > 0.0)


@dataclass
class SpeculativeInput:
    """The step's speculating sequences (DSpark, executor/speculative/). Each feeds its anchor (its last token, position t)
    followed by k placeholders at positions t+1..t+k; the worker drafts K tokens per sequence, writes the first k
    into the placeholders, runs the target over all of them in one forward and verifies (executor/speculative/decoder.py).
    R speculating sequences, D = sum of their k."""

    sample_rows: torch.Tensor  # int64 [R]: their rows among the step's sampling rows (logits_indices order)
    seq_index: torch.Tensor  # int64 [R]: their index among the step's sequences (block_tables row)
    anchor_rows: torch.Tensor  # int64 [R]: the token index of each anchor in the step
    num_drafts: torch.Tensor  # int64 [R]: k, 1..K drafts fed and verified
    draft_rows: torch.Tensor  # int64 [D]: token indices of the placeholders, sequence by sequence
    draft_index: torch.Tensor  # int64 [D]: r * K + j, the draft (row r, slot j) each placeholder takes
    plain_rows: torch.Tensor  # int64 [N - R]: the other sampling rows (one token sampled the usual way)
    num_speculative_tokens: int  # K: the length of every sequence's drafted block

    @property
    def num_seqs(self) -> int:
        return int(self.sample_rows.shape[0])

    @classmethod
    def from_rows(cls, rows: list[tuple[int, int, int, int]], num_sample_rows: int, K: int) -> SpeculativeInput:
        """rows: (sampling row, step sequence, anchor token index, drafts k) of each speculating sequence."""
        r = np.array(rows, dtype=np.int64).reshape(-1, 4)
        k = r[:, 3]
        first = np.cumsum(k) - k  # each sequence's first entry among the D drafts
        j = np.arange(int(k.sum())) - np.repeat(first, k)  # slot of each draft in its sequence's block
        plain = np.ones(num_sample_rows, dtype=bool)
        plain[r[:, 0]] = False
        t = torch.from_numpy
        return cls(sample_rows=t(r[:, 0].copy()), seq_index=t(r[:, 1].copy()), anchor_rows=t(r[:, 2].copy()),
                   num_drafts=t(k.copy()), draft_rows=t(np.repeat(r[:, 2] + 1, k) + j),
                   draft_index=t(np.repeat(np.arange(len(r)) * K, k) + j), plain_rows=t(np.flatnonzero(plain)),
                   num_speculative_tokens=K)


@dataclass
class StepInput:
    """One forward of the model over a batch of sequences (prefill chunks and/or decodes)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T] absolute position of every token
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S] tokens in the cache after this step
    query_start_loc_cpu: list[int]  # the same offsets on the host (tile planning, reference paths)
    seq_lens_cpu: list[int]  # on the host; a step launched ahead of a speculative step's result: a lower bound
    is_decode: bool  # every sequence has exactly one new token (the decode kernels; CUDA graphs)
    max_query_len: int
    max_seq_len: int  # likewise a lower bound
    # the paged cache (None for a contiguous, per-sequence cache: the reference paths)
    block_tables: torch.Tensor | None = None  # int32 [S, W] page ids (0 padded)
    slot_mapping: torch.Tensor | None = None  # int64 [T] page * block_size + offset of every token
    logits_indices: torch.Tensor | None = None  # int64 [N] tokens whose next token is sampled
    sampling: SamplingInput | None = None  # one row per logits index
    # prefill query tiles (sequence, first token, end token), made by the attention backend's `plan`
    attn_tiles: torch.Tensor | None = None  # int32 [n, 3], full attention (and block-sparse where its tiles agree)
    sparse_tiles: torch.Tensor | None = None  # int32 [n, 3], block-sparse attention (None: attn_tiles)
    index_tiles: torch.Tensor | None = None  # int32 [n, 3], the indexer
    speculative: SpeculativeInput | None = None  # the sequences that speculate this step (None: none)
    # async scheduling: the step was launched before the previous step's tokens reached the host; token t belongs to
    # the sequence of row prev_token_rows[t] of that step's result (still on the device), which completes the
    # step's input ids (zeros here) and, after a speculative step, its positions (executor/ahead.py)
    prev_token_rows: torch.Tensor | None = None  # int64 [T]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def to(self, device: torch.device | str, non_blocking: bool = False, copy: bool = False) -> "StepInput":
        """`copy`: new tensors even where they are on `device` already (a step completed in place)."""
        return _move(self, torch.device(device), non_blocking, copy)

    def pin_memory(self) -> "StepInput":
        """A copy in page-locked host memory (its copy to a CUDA device does not block the host)."""
        return _map_tensors(self, torch.Tensor.pin_memory)

    @classmethod
    def contiguous(cls, chunks: list[list[int]], starts: list[int], device: torch.device | str = "cpu",
                   sample_last: bool = True) -> "StepInput":
        """A step for a contiguous (per-sequence) cache: sequence s feeds `chunks[s]` at positions starting at
        `starts[s]`; with `sample_last` its last token's logits are taken."""
        qsl, pos, lens = [0], [], []
        for chunk, start in zip(chunks, starts):
            qsl.append(qsl[-1] + len(chunk))
            pos += range(start, start + len(chunk))
            lens.append(start + len(chunk))
        ids = [t for c in chunks for t in c]
        dev = torch.device(device)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens, is_decode=all(len(c) == 1 for c in chunks),
            max_query_len=max(len(c) for c in chunks), max_seq_len=max(lens),
            logits_indices=torch.tensor(qsl[1:], dtype=torch.int64, device=dev) - 1 if sample_last else None)


@dataclass
class SamplerOutput:
    """What a step returns: one sampled token per sampling row (tensors on the host after the step).

    A step with speculating sequences returns up to K+1 tokens per row instead: `num_tokens` is set, token_ids and
    logprobs are [N, K+1] (row i's first num_tokens[i] entries count, then -1 / 0), top_* are [N, K+1, n]."""

    token_ids: torch.Tensor  # int64 [N] (or [N, K+1])
    logprobs: torch.Tensor  # fp32 [N] raw logprob of the sampled token (or [N, K+1])
    top_token_ids: torch.Tensor | None = None  # int64 [N, n] the top-n raw logprobs' tokens (or [N, K+1, n])
    top_logprobs: torch.Tensor | None = None  # fp32 [N, n] (or [N, K+1, n])
    num_tokens: torch.Tensor | None = None  # int64 [N]: tokens each row emitted (speculative steps only)
    num_draft_tokens: torch.Tensor | None = None  # int64 [N]: drafts verified per row (0: the row did not speculate)
    draft_confidence: torch.Tensor | None = None  # fp32 [N, K]: the drafts' confidence-head scores c_k (0: no draft)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SamplerOutput":
        return _move(self, torch.device(device), non_blocking)
