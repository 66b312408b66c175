"""CUDA graphs for decode steps: captured once per (batch bucket, block-table width bucket), replayed every step.

Persistent device buffers (`DecodeBuffers`) hold a decode step's input at the largest sizes; each step copies its
`StepInput` into their leading rows, pads the rest of its bucket with harmless rows (slot -1: nothing is written;
one token of page 0 is read; their outputs are dropped) and replays:
  forward graph [batch, width]   the model over the paged cache, logits of every row into one logits buffer
  sampler graph [batch]          greedy / temperature sampling from that buffer (`SamplingInput.is_simple`)
Steps whose sampling needs more (penalties, min_tokens, top-k/top-p/min-p, top-n logprobs) replay the forward
graph and sample eagerly from the logits buffer. Prefill and mixed steps run eagerly (`ModelRunner`).

Tensor parallelism (NCCL): every rank captures the same forward graphs in the same order (at `Worker.init_cache`,
together), the all-reduces and the logits all-gather inside them; the ranks other than 0 get no logits and
capture no sampler graphs, and replay their forward graph on each decode step rank 0 sends them.

The block-table width is bucketed too because the indexer scores every block-table column (past the sequence end
it only writes -inf) and the full-attention kernels split their work by the table's width: a 4K-token context
should not pay for a 256K-token table.
"""
from __future__ import annotations

import logging
import time

import torch

from m3serve.step_io import SamplerOutput, SamplingInput, StepInput

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 128, every 32 beyond; `max_num_seqs` itself last."""
    sizes, b = [1, 2, 4, 8], 8
    while b < max_num_seqs:
        b += 8 if b < 64 else 16 if b < 128 else 32
        sizes.append(b)
    return sorted({min(s, max_num_seqs) for s in sizes})


def width_buckets(max_pages: int) -> list[int]:
    """Block-table widths (pages): 32, then x4 each, the largest = `max_pages`."""
    widths, w = [], 32
    while w < max_pages:
        widths.append(w)
        w *= 4
    return widths + [max_pages]


def graph_reserve_bytes(max_num_seqs: int, hidden_size: int, vocab_size: int) -> int:
    """What the graphs' memory pool is expected to hold (checked against the measured pool in the log): the
    logits buffer and the sampler's [batch, vocab] temporaries, and one decode forward's activations."""
    return batch_buckets(max_num_seqs)[-1] * (vocab_size * 40 + hidden_size * 2 * 64)


def _bucket(sizes: list[int], n: int) -> int:
    return next(s for s in sizes if s >= n)


class DecodeBuffers:
    """The persistent inputs of the decode graphs, at `max_seqs` rows and `max_pages` block-table columns."""

    def __init__(self, max_seqs: int, max_pages: int, block_size: int, device: torch.device):
        self.block_size = block_size
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        z = dict(device=device)
        self.input_ids = torch.zeros(max_seqs, dtype=i64, **z)
        self.positions = torch.zeros(max_seqs, dtype=i64, **z)
        self.seq_lens = torch.ones(max_seqs, dtype=i32, **z)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=i32, **z)
        self.block_tables = torch.zeros(max_seqs, max_pages, dtype=i32, **z)
        self.slot_mapping = torch.full((max_seqs,), -1, dtype=i64, **z)
        self.logits_indices = torch.arange(max_seqs, dtype=i64, **z)
        self.prev_rows = torch.zeros(max_seqs, dtype=i64, **z)  # a step launched ahead: rows of the previous ids
        self.temperature = torch.zeros(max_seqs, dtype=f32, **z)
        self.top_k = torch.zeros(max_seqs, dtype=i32, **z)
        self.top_p = torch.ones(max_seqs, dtype=f32, **z)
        self.min_p = torch.zeros(max_seqs, dtype=f32, **z)
        self.seeds = torch.zeros(max_seqs, dtype=i64, **z)
        self.sample_positions = torch.zeros(max_seqs, dtype=i64, **z)

    def step(self, batch: int, width: int) -> StepInput:
        """A decode StepInput whose tensors are views of the buffers (`batch` rows, `width` table columns)."""
        return StepInput(
            input_ids=self.input_ids[:batch], positions=self.positions[:batch],
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[1] * batch, is_decode=True,
            max_query_len=1, max_seq_len=width * self.block_size, block_tables=self.block_tables[:batch, :width],
            slot_mapping=self.slot_mapping[:batch], logits_indices=self.logits_indices[:batch],
            sampling=self.sampling(batch))

    def sampling(self, batch: int) -> SamplingInput:
        return SamplingInput(self.temperature[:batch], self.top_k[:batch], self.top_p[:batch], self.min_p[:batch],
                             self.seeds[:batch], self.sample_positions[:batch])

    def fill(self, step: StepInput, batch: int, prev_token_ids: torch.Tensor | None = None) -> None:
        """Copy a decode step of S <= batch sequences in; rows S..batch become padding. A step launched ahead of
        its input ids gathers them from the previous step's sampled ids on the device (`prev_token_ids`), but for
        rows -1 (tokens the host knows: a prompt's last token, its chunk before still running), which keep the
        step's own."""
        n, w = step.num_seqs, step.block_tables.shape[1]
        nb = dict(non_blocking=True)
        if prev_token_ids is None:
            self.input_ids[:n].copy_(step.input_ids, **nb)
        else:
            rows = self.prev_rows[:n]
            rows.copy_(step.prev_token_rows, **nb)
            if step.prev_token_rows.is_cuda or bool((step.prev_token_rows < 0).any()):
                self.input_ids[:n].copy_(step.input_ids, **nb)
                torch.where(rows < 0, self.input_ids[:n], prev_token_ids.index_select(0, rows.clamp(min=0)),
                            out=self.input_ids[:n])
            else:
                torch.index_select(prev_token_ids, 0, rows, out=self.input_ids[:n])
        self.positions[:n].copy_(step.positions, **nb)
        self.seq_lens[:n].copy_(step.seq_lens, **nb)
        self.block_tables[:n, :w].copy_(step.block_tables, **nb)
        self.slot_mapping[:n].copy_(step.slot_mapping, **nb)
        if n < batch:
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.seq_lens[n:batch].fill_(1)
            self.block_tables[n:batch, 0].zero_()
            self.slot_mapping[n:batch].fill_(-1)
        s = step.sampling
        if s is None:  # a tensor-parallel rank other than 0: it does not sample
            return
        self.temperature[:n].copy_(s.temperature, **nb)
        self.seeds[:n].copy_(s.seeds, **nb)
        self.sample_positions[:n].copy_(s.positions, **nb)
        self.temperature[n:batch].zero_()


class CudaGraphRunner:
    """Captures and replays the decode graphs of one `ModelRunner` (its model, whose attention layers read the pages
    of the cache bound to them: the graphs capture those pointers; its sampler)."""

    def __init__(self, runner, max_num_seqs: int, max_pages: int):
        self.runner = runner
        self.batches = batch_buckets(max_num_seqs)
        self.widths = width_buckets(max_pages)
        self.buffers = DecodeBuffers(self.batches[-1], max_pages, runner.cache.block_size, runner.device)
        self.pool = None
        self.forward_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.sampler_graphs: dict[int, tuple[torch.cuda.CUDAGraph, SamplerOutput]] = {}
        self.logits: torch.Tensor | None = None  # [max batch, V] fp32, written by every forward graph
        self.pool_bytes = 0
        self.capture_s = 0.0
        self.num_replays = 0
        cfg = runner.model.config
        self.reserve_bytes = graph_reserve_bytes(max_num_seqs, cfg.hidden_size, cfg.vocab_size)

    def _graph(self, fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    @torch.inference_mode()
    def capture(self) -> None:
        """Every forward graph (largest first, one shared memory pool), then the sampler graphs."""
        r, t0 = self.runner, time.perf_counter()
        before = torch.cuda.memory_allocated(r.device)
        big = self.batches[-1]
        for width in reversed(self.widths):
            for batch in reversed(self.batches):
                step = self.buffers.step(batch, width)

                def fwd(step=step, batch=batch):
                    logits = r.model.compute_logits(r.forward(step))  # None on tensor-parallel ranks but 0
                    if self.logits is None or logits is None:
                        return logits
                    self.logits[:batch].copy_(logits)
                    return self.logits

                fwd()  # warm up: compiles the kernels, sizes the allocator's blocks
                torch.cuda.synchronize(r.device)
                g, out = self._graph(fwd)
                if self.logits is None and out is not None:  # the first (largest) graph's logits: the buffer
                    assert batch == big
                    self.logits = out
                self.forward_graphs[(batch, width)] = g
        for batch in reversed(self.batches if self.logits is not None else []):
            s = self.buffers.sampling(batch)
            r.sampler(self.logits[:batch].clone(), s)  # warm up
            self.sampler_graphs[batch] = self._graph(lambda b=batch, s=s: r.sampler(self.logits[:b], s))
        torch.cuda.synchronize(r.device)
        self.pool_bytes = torch.cuda.memory_allocated(r.device) - before
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch %s, table width %s pages) in %.1f s, %.2f GiB (%.2f GiB reserved)",
                 len(self.forward_graphs) + len(self.sampler_graphs), self.batches, self.widths, self.capture_s,
                 self.pool_bytes / 2**30, self.reserve_bytes / 2**30)

    def supports(self, step: StepInput) -> bool:
        samples = self.logits is not None  # rank 0 (its decode steps carry sampling; the other ranks' do not)
        return (step.is_decode and (step.sampling is not None or not samples) and step.num_seqs <= self.batches[-1]
                and step.block_tables.shape[1] <= self.widths[-1])

    def execute(self, step: StepInput, prev_token_ids: torch.Tensor | None = None) -> SamplerOutput | None:
        """Replay the graphs for a decode step (host tensors, or already on the device)."""
        n = step.num_seqs
        batch = _bucket(self.batches, n)
        width = _bucket(self.widths, step.block_tables.shape[1])
        self.buffers.fill(step, batch, prev_token_ids)
        self.forward_graphs[(batch, width)].replay()
        self.num_replays += 1
        if self.logits is None:  # a tensor-parallel rank other than 0
            return None
        if step.sampling.is_simple:
            g, out = self.sampler_graphs[batch]
            g.replay()
        else:
            s = step.sampling.to(self.runner.device, non_blocking=True)
            out = self.runner.sampler(self.logits[:n], s)
        return SamplerOutput(out.token_ids[:n], out.logprobs[:n],
                             None if out.top_token_ids is None else out.top_token_ids[:n],
                             None if out.top_logprobs is None else out.top_logprobs[:n])
