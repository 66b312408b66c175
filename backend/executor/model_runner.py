"""One engine step on the device: build the step input once, run the model, take the logits of each
sequence whose last scheduled token is its newest token (a finished prefill chunk, or a decode), sample."""
from __future__ import annotations

import logging

import torch

from m3serve.engine.scheduler import ScheduledBatch
from m3serve.engine.sequence import Sequence
from m3serve.engine.step import StepInput
from m3serve.executor.kv_cache import PagedKVCache
from m3serve.executor.sampler import SampledToken, Sampler
from m3serve.model.layers.attention import TorchAttention

log = logging.getLogger(__name__)


def select_attention_backend(model, cache: PagedKVCache, device: torch.device):
    """The Triton kernel backend on CUDA when it imports; else the torch reference attention."""
    if device.type == "cuda":
        try:
            from m3serve.model.layers.triton_attention import TritonAttention
        except ImportError as e:
            log.warning("Triton attention backend unavailable (%s); using the torch reference attention", e)
        else:
            log.info("attention backend: Triton kernels (block-sparse MSA over the paged cache)")
            cfg = model.config
            return TritonAttention(model.attention_spec, cache, cfg.num_attention_heads, cfg.index_n_heads)
    return TorchAttention(model.attention_spec, cache)


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, sampler: Sampler, device: torch.device, backend=None):
        self.model, self.cache, self.sampler, self.device = model, cache, sampler, torch.device(device)
        self.backend = backend if backend is not None else select_attention_backend(model, cache, self.device)
        self.block_size = cache.block_size

    def prepare(self, batch: ScheduledBatch):
        """The StepInput, and the sequences whose next token is sampled (one per logits index)."""
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        sample_rows, sample_seqs = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            pages = seq.pages
            slots += [pages[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
                sample_seqs.append(seq)
        max_pages = max(len(s.pages) for s in batch.seqs)
        tables = torch.zeros(len(batch.seqs), max_pages, dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, :len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
        step = StepInput(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.tensor(pos, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, is_decode=all(n == 1 for n in batch.num_new_tokens),
            max_query_len=max(batch.num_new_tokens), max_seq_len=max(seq_lens), block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64))
        return step.to(self.device), sample_seqs

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> list[tuple[Sequence, SampledToken]]:
        step, seqs = self.prepare(batch)
        if hasattr(self.backend, "plan"):
            self.backend.plan(step)
        hidden = self.model(step, self.backend)
        if not seqs:
            return []
        logits = self.model.compute_logits(hidden[step.logits_indices])
        return list(zip(seqs, self.sampler(logits, seqs)))
