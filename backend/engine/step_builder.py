"""Scheduled batch (Python `Sequence` objects) -> `StepInput` (host tensors): the one place the engine turns its
request state into what a worker can receive.

A speculating sequence (k drafts) feeds its anchor and k placeholder tokens at the next k positions (slots in its
lookahead pages); its sampling row points at the anchor, and `StepInput.speculative` tells the worker where the drafts
go."""
from __future__ import annotations

import numpy as np
import torch

from m3serve.engine.scheduler import ScheduledBatch
from m3serve.engine.sequence import Sequence
from m3serve.step_io import SamplingInput, SpeculativeInput, StepInput


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """int64 [len(rows), max(1, longest)], -1 padded."""
    out = torch.full((len(rows), max([1] + [len(r) for r in rows])), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


def as_int64(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class StepBuilder:
    def __init__(self, block_size: int, eos_token_ids: set[int], pin_memory: bool = False,
                 num_speculative_tokens: int = 0):
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids  # shared with the engine (a set)
        self.pin_memory = pin_memory  # page-locked tensors: the copy to the GPU does not block the host
        self.num_speculative_tokens = num_speculative_tokens  # K (0: speculative decoding is off)

    def build(self, batch: ScheduledBatch, prev_rows: list[int] | None = None) -> tuple[StepInput, list[Sequence]]:
        """The step's input, and the sequences whose next token it samples (one per logits index, in order).

        `prev_rows` (async scheduling): the batch's sequences are decodes launched while the step sampling their
        newest token still runs; that token is the last of row prev_rows[i] of its result and goes in at position
        `num_tokens` (the host does not know it yet). After a speculative step, which may emit several, everything
        here assumes one: the device moves each sequence's tokens by the rest (executor/ahead.py). A row of -1: a
        sequence whose tokens are all known (built as without `prev_rows`): a decode, or a prompt's next chunk after
        the `batch.num_pending` tokens of the chunk still running."""
        bs = self.block_size
        rows_ahead = [0] * len(batch.seqs) if prev_rows is None else [int(r >= 0) for r in prev_rows]
        ids, pos, qsl, seq_lens = [], [], [0], []
        sample_rows, sample_seqs, speculating, sample_ahead = [], [], [], []
        drafts = batch.num_draft_tokens or [0] * len(batch.seqs)
        pending = batch.num_pending or [0] * len(batch.seqs)
        for i, (seq, n, k, ahead, done) in enumerate(zip(batch.seqs, batch.num_new_tokens, drafts, rows_ahead,
                                                         pending)):
            start = seq.num_tokens if ahead else seq.num_computed_tokens + done
            end = start + n
            known = seq.token_ids[start:end - k]
            ids += known + [0] * (n - len(known))  # the worker writes the drafts (or the pending token) over these
            pos += range(start, end)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if k:
                speculating.append((len(sample_rows), i, qsl[-2], k))
                sample_rows.append(qsl[-2])
                sample_seqs.append(seq), sample_ahead.append(ahead)
            elif end == seq.num_tokens + ahead:
                sample_rows.append(qsl[-1] - 1)
                sample_seqs.append(seq), sample_ahead.append(ahead)
        tables = np.zeros((len(batch.seqs), max([1] + [len(s.pages) for s in batch.seqs])), dtype=np.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, :len(seq.pages)] = seq.pages.array
        positions = np.array(pos, dtype=np.int64)
        token_seq = np.repeat(np.arange(len(batch.seqs)), batch.num_new_tokens)
        slots = tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
        step = StepInput(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.from_numpy(positions),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, is_decode=all(n == 1 for n in batch.num_new_tokens),
            max_query_len=max(batch.num_new_tokens), max_seq_len=max(seq_lens), block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(slots),
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64),
            sampling=self.sampling(sample_seqs, sample_ahead) if sample_seqs else None,
            speculative=SpeculativeInput.from_rows(speculating, len(sample_rows), self.num_speculative_tokens)
            if speculating else None,
            prev_token_rows=torch.from_numpy(np.repeat(np.asarray(prev_rows, dtype=np.int64), batch.num_new_tokens))
            if prev_rows is not None else None)
        return (step.pin_memory() if self.pin_memory else step), sample_seqs

    def sampling(self, seqs: list[Sequence], ahead: list[int] | None = None) -> SamplingInput:
        """`ahead`: per sequence, its tokens (0 or 1) sampled by a step still running (async scheduling; no
        penalties then: they read the output tokens)."""
        ahead = ahead or [0] * len(seqs)
        sps = [s.sampling_params for s in seqs]
        greedy = [sp.greedy for sp in sps]
        f32 = torch.float32
        s = SamplingInput(
            temperature=torch.tensor([0.0 if g else sp.temperature for sp, g in zip(sps, greedy)], dtype=f32),
            top_k=torch.tensor([max(sp.top_k, 0) for sp in sps], dtype=torch.int32),
            top_p=torch.tensor([sp.top_p for sp in sps], dtype=f32),
            min_p=torch.tensor([sp.min_p for sp in sps], dtype=f32),
            seeds=torch.tensor([as_int64(s.seed) for s in seqs], dtype=torch.int64),
            positions=torch.tensor([s.num_tokens + a for s, a in zip(seqs, ahead)], dtype=torch.int64),
            all_greedy=all(greedy),
            needs_top_k=any(sp.top_k > 0 and not g for sp, g in zip(sps, greedy)),
            needs_top_p=any(sp.top_p < 1.0 and not g for sp, g in zip(sps, greedy)),
            needs_min_p=any(sp.min_p > 0.0 and not g for sp, g in zip(sps, greedy)),
            max_num_logprobs=max(-1 if sp.logprobs is None else sp.logprobs for sp in sps))
        if any(sp.has_penalties for sp in sps):
            self._penalties(s, seqs)
        suppress = [self._suppressed(s, a) for s, a in zip(seqs, ahead)]
        if any(suppress):
            s.suppress_token_ids = _padded(suppress)
        return s

    @staticmethod
    def _penalties(s: SamplingInput, seqs: list[Sequence]) -> None:
        """The penalty fields of `s` (some request has a penalty)."""
        sps, f32 = [seq.sampling_params for seq in seqs], torch.float32
        rep = [sp.repetition_penalty for sp in sps]
        freq = [sp.frequency_penalty for sp in sps]
        pres = [sp.presence_penalty for sp in sps]
        if any(r != 1.0 for r in rep):
            s.repetition_penalty = torch.tensor(rep, dtype=f32)
            s.prompt_token_ids = _padded([seq.prompt_token_ids for seq in seqs])
        if any(f != 0.0 for f in freq):
            s.frequency_penalty = torch.tensor(freq, dtype=f32)
        if any(p != 0.0 for p in pres):
            s.presence_penalty = torch.tensor(pres, dtype=f32)
        s.output_token_ids = _padded([seq.output_token_ids for seq in seqs])

    def _suppressed(self, seq: Sequence, ahead: int = 0) -> list[int]:
        """Token ids the sequence may not produce yet: its stop ids and EOS until min_tokens outputs."""
        sp = seq.sampling_params
        if seq.num_output_tokens + ahead >= sp.min_tokens:
            return []
        return sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_token_ids))
