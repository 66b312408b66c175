"""One engine step on the device: build the step metadata once, run the model, take the logits of each
sequence whose last scheduled token is its newest token (a finished prefill chunk, or a decode), sample.

`ForwardBatch.extra` (read by the cache and the kernel backend):
  block_tables       int32 [S, max_pages] page ids per sequence (0-padded), on the device
  seq_lens           int32 [S] tokens in the cache after this step, on the device (seq_lens_cpu: a list)
  slot_mapping       int64 [T] cache slot of every token of the step (page * block_size + offset)
  query_start_loc_t  int32 [S + 1] token offsets of the sequences, on the device
  max_seq_len, max_query_len   ints;  cache   the PagedKVCache
"""
from __future__ import annotations

import logging

import torch

from m3serve.engine.kv_cache import PagedKVCache
from m3serve.engine.sampler import SampledToken, Sampler
from m3serve.engine.scheduler import ScheduledBatch
from m3serve.engine.sequence import Sequence
from m3serve.model.attention import ForwardBatch

log = logging.getLogger(__name__)


def select_attention_backend(model, device: torch.device):
    """The Triton kernel backend on CUDA when it imports and builds; else None (= TorchAttention)."""
    if device.type != "cuda":
        return None
    try:
        from m3serve.engine.kernel_attention import TritonAttention
    except ImportError as e:
        log.warning("Triton attention backend unavailable (%s); using the torch reference attention", e)
        return None
    ref = model.reference_backend
    log.info("attention backend: Triton kernels (block-sparse MSA over the paged cache)")
    return TritonAttention(block_size=ref.block_size, topk=ref.topk, local_blocks=ref.local_blocks, scale=ref.scale)


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, sampler: Sampler, device: torch.device, backend=None):
        self.model, self.cache, self.sampler, self.device = model, cache, sampler, torch.device(device)
        self.backend = backend
        self.block_size = cache.block_size

    def prepare(self, batch: ScheduledBatch):
        """input_ids [T], ForwardBatch, indices of the tokens to sample from, and their sequences."""
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
        dev = self.device
        extra = {
            "block_tables": tables.to(dev),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            "seq_lens_cpu": seq_lens,
            "slot_mapping": torch.tensor(slots, dtype=torch.int64, device=dev),
            "query_start_loc_t": torch.tensor(qsl, dtype=torch.int32, device=dev),
            "max_seq_len": max(seq_lens),
            "max_query_len": max(batch.num_new_tokens),
            "cache": self.cache,
        }
        fb = ForwardBatch(torch.tensor(pos, dtype=torch.int64, device=dev), qsl, self.cache, self.backend, extra)
        return torch.tensor(ids, dtype=torch.int64, device=dev), fb, sample_rows, sample_seqs

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> list[tuple[Sequence, SampledToken]]:
        input_ids, fb, rows, seqs = self.prepare(batch)
        hidden = self.model(input_ids, fb)
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return list(zip(seqs, self.sampler(logits, seqs)))
