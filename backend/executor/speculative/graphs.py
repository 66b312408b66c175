"""CUDA graphs for DSpark speculative steps (executor/speculative/decoder.py), per (batch bucket, block-table width bucket,
greedy or sampled), like the decode graphs (cuda_graph.py).

A step is graphed when every sequence in it speculates: S sequences x (K+1) rows (the anchor, then K
placeholders), nothing else (no prefill chunk, no top-n logprobs; plain decodes only in all-greedy steps, as k = 0).
A sequence near its max_tokens verifies k < K drafts: its rows past its k+1 tokens are padding (`fill_spec`). Such
a step has one shape per bucket, so its tensors are static: `SpecBuffers` holds them at the largest sizes, each
step copies its `StepInput` into their leading rows (sequences past S are padding: slot -1, nothing written to
either cache; page 0 read; greedy; their outputs dropped) and replays. Any other step (mixed batches, penalties)
runs the same phases eagerly. The step's K is the configured one, or, with confidence-scheduled verification, the
width the engine chose for the step (executor/speculative/confidence.py: one of a few), so buffers, views and graphs
are kept per K too.

The phases of the step (`SpeculativeDecoder.phases`: draft backbone, Markov steps, target forward over the K+1
tokens of every sequence, sampling and the acceptance rule, the draft-cache insert) are captured as ONE graph, so
a step costs one replay and no synchronisation: the only one is the copy of its tokens to the host
(`PendingOutput`). With `timing` set (benchmarks), each phase is a graph of its own instead (captured in order,
into the same memory pool, handing each other their tensors) and a CUDA event is recorded between them
(`phase_ms`); the two kinds are kept apart per bucket.

A bucket's graphs are captured at its first step: that step runs its phases eagerly over the buffers (compiling
the kernels; its result is the step's), then each phase is captured (should a capture fail, the error is logged
and speculative steps run eagerly from then on). A new proposal hook drops them (`clear`).
On the CPU (the tests) nothing is captured: every step runs the same static-buffer path eagerly.
"""
from __future__ import annotations

import logging
import time

import torch

from m3serve.step_io import SamplerOutput, SpecInput, StepInput
from m3serve.executor.cuda_graph import DecodeBuffers, _bucket, batch_buckets, width_buckets

log = logging.getLogger(__name__)


class SpecBuffers(DecodeBuffers):
    """A speculative step's persistent inputs: `max_seqs` sequences of K+1 tokens, `max_pages` table columns."""

    def __init__(self, max_seqs: int, max_pages: int, block_size: int, k: int, device: torch.device):
        super().__init__(max_seqs, max_pages, block_size, device)
        i64, w, z = torch.int64, k + 1, dict(device=device)
        self.k = k
        self.input_ids = torch.zeros(max_seqs * w, dtype=i64, **z)
        self.positions = torch.zeros(max_seqs * w, dtype=i64, **z)
        self.slot_mapping = torch.full((max_seqs * w,), -1, dtype=i64, **z)
        self.query_start_loc = (torch.arange(max_seqs + 1, **z) * w).to(torch.int32)
        self.logits_indices = torch.arange(max_seqs, dtype=i64, **z) * w  # each sequence samples at its anchor
        self.seq_index = torch.arange(max_seqs, dtype=i64, **z)
        self.num_drafts = torch.full((max_seqs,), k, dtype=i64, **z)
        self.draft_rows = (self.logits_indices[:, None] + 1 + torch.arange(k, **z)[None, :]).flatten()
        self.draft_index = torch.arange(max_seqs * k, dtype=i64, **z)
        self.no_rows = torch.zeros(0, dtype=i64, **z)

    def spec_step(self, batch: int, width: int, greedy: bool) -> StepInput:
        """A speculative StepInput over the buffers' leading rows (`batch` sequences, `width` table columns)."""
        w, k = self.k + 1, self.k
        s = self.sampling(batch)
        s.all_greedy = greedy
        s.needs_top_k = s.needs_top_p = s.needs_min_p = not greedy
        spec = SpecInput(self.seq_index[:batch], self.seq_index[:batch], self.logits_indices[:batch],
                         self.num_drafts[:batch], self.draft_rows[:batch * k], self.draft_index[:batch * k],
                         self.no_rows, k)
        return StepInput(
            input_ids=self.input_ids[:batch * w], positions=self.positions[:batch * w],
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            query_start_loc_cpu=list(range(0, batch * w + 1, w)), seq_lens_cpu=[w] * batch, is_decode=False,
            max_query_len=w, max_seq_len=width * self.block_size, block_tables=self.block_tables[:batch, :width],
            slot_mapping=self.slot_mapping[:batch * w], logits_indices=self.logits_indices[:batch], sampling=s,
            spec=spec)

    def fill_spec(self, step: StepInput, view: StepInput) -> None:
        """Copy a speculative step of S <= batch sequences into `view`'s buffers; the rows past S become padding.
        A sequence with k < K drafts (near its max_tokens) takes K+1 rows all the same: rows past its k+1 tokens
        repeat its last token at its position with no slot (nothing written to either cache; the prefill attention
        is causal by position, so they read only its written keys), and its k in `num_drafts` bounds what the rule
        verifies, as on the eager path. The view's host lists take the step's (read by host-side reference paths
        only, never by a graph)."""
        n, w, k1, sp = step.num_seqs, step.block_tables.shape[1], self.k + 1, step.spec
        batch, nb = view.num_seqs, dict(non_blocking=True)
        ids, pos, slots = step.input_ids, step.positions, step.slot_mapping
        if sp is not None and sp.num_seqs == n:
            drafts = sp.num_drafts
        else:  # plain decodes of a greedy step (`supports`): 0 drafts
            drafts = torch.zeros(n, dtype=torch.int64, device=ids.device if sp is None else sp.num_drafts.device)
            if sp is not None:
                drafts.index_copy_(0, sp.seq_index, sp.num_drafts)
        if step.num_tokens != n * k1:  # spread each sequence over its K+1 rows (where the step's tensors are)
            dev = ids.device
            j, d = torch.arange(k1, device=dev), drafts.to(dev)
            first = torch.tensor(step.query_start_loc_cpu[:n], dtype=torch.int64, device=dev)
            src = (first[:, None] + torch.minimum(j[None, :], d[:, None])).flatten()
            past = (j[None, :] > d[:, None]).flatten()
            ids, pos = ids[src], pos[src.to(pos.device)]
            slots = slots[src.to(slots.device)].masked_fill(past.to(slots.device), -1)
            if self.input_ids.is_cuda and not ids.is_cuda:  # page-locked: copies that do not block
                ids, pos, slots = ids.pin_memory(), pos.pin_memory(), slots.pin_memory()
        t = n * k1
        for buf, src in ((self.input_ids, ids), (self.positions, pos), (self.slot_mapping, slots)):
            buf[:t].copy_(src, **nb)
            buf[t:batch * k1].fill_(-1 if buf is self.slot_mapping else 0)
        self.num_drafts[:n].copy_(drafts, **nb)
        self.num_drafts[n:batch].fill_(self.k)
        self.seq_lens[:n].copy_(step.seq_lens, **nb)
        self.block_tables[:n, :w].copy_(step.block_tables, **nb)
        s = step.sampling
        for buf, src, pad in ((self.temperature, s.temperature, 0), (self.top_k, s.top_k, 0), (self.top_p, s.top_p, 1),
                              (self.min_p, s.min_p, 0), (self.seeds, s.seeds, 0),
                              (self.sample_positions, s.positions, 0)):
            buf[:n].copy_(src, **nb)
            buf[n:batch].fill_(pad)
        self.seq_lens[n:batch].fill_(self.k + 1)
        self.block_tables[n:batch, 0].zero_()
        view.seq_lens_cpu[:] = list(step.seq_lens_cpu) + [self.k + 1] * (batch - n)


class SpecGraphs:
    """The speculative steps' graphs of one `SpeculativeDecoder` (its runner's model, bound to its cache)."""

    def __init__(self, decoder, new_state, max_num_seqs: int, max_pages: int):
        """new_state(step): what the decoder's phases hand each other (its `StepState`)."""
        r = decoder.runner
        self.decoder, self.new_state, self.k = decoder, new_state, decoder.spec.num_speculative_tokens
        self.batches = batch_buckets(max_num_seqs)
        self.widths = width_buckets(max_pages)
        self.max_pages = max_pages
        self.buffers: dict[int, SpecBuffers] = {}  # per step K (drafts per sequence)
        self.capture_graphs = r.device.type == "cuda"
        self.views: dict[tuple[int, int, bool, int], StepInput] = {}
        # (batch, width, greedy, step K, timing) -> graphs, their StepState: one graph for the whole step, or with
        # `timing` one per phase (events between them)
        self.graphs: dict[tuple[int, int, bool, int, bool], tuple[list[torch.cuda.CUDAGraph], object]] = {}
        self.pool = None
        self.num_steps = 0  # steps it ran (replayed, or eagerly over the buffers)
        self.timing = False  # record CUDA events between the phases of every replay (benchmarks)
        self.phase_ms: list[list[float]] = []  # per timed replay, each phase's device time (ms); read after a sync
        self._events: list[torch.cuda.Event] | None = None

    def supports(self, step: StepInput) -> bool:
        """Every sequence of the step speculates (k <= K drafts) and nothing else is in it, or, all greedy, some or
        all decode plainly (k = 0: verifying no draft emits the target's argmax, the plain decode's token), with no
        prefill chunk (host fields only)."""
        sp, s, n, k = step.spec, step.sampling, step.num_seqs, self._step_k(step)
        return (s is not None and (s.all_greedy or sp is not None and sp.num_seqs == n) and n == s.num_rows
                and n <= self.batches[-1] and 1 <= k <= self.k
                and step.num_tokens == n + (0 if sp is None else sp.draft_rows.shape[0]) <= n * (k + 1)
                and step.block_tables.shape[1] <= self.widths[-1] and s.max_num_logprobs <= 0
                and s.repetition_penalty is None and s.frequency_penalty is None and s.presence_penalty is None
                and s.suppress_token_ids is None)

    def clear(self) -> None:
        self.graphs.clear()

    def _step_k(self, step: StepInput) -> int:
        """The step's K (rows per sequence - 1): its drafts per sequence, a confidence-scheduled width or the
        configured K, and the configured K for a step of plain decodes only."""
        return step.spec.num_speculative_tokens if step.spec is not None else self.k

    def _buffers(self, k: int) -> SpecBuffers:
        if k not in self.buffers:
            r = self.decoder.runner
            self.buffers[k] = SpecBuffers(self.batches[-1], self.max_pages, r.cache.block_size, k, r.device)
        return self.buffers[k]

    def _view(self, key: tuple[int, int, bool, int]) -> StepInput:
        """The bucket's static step, its attention tile maps planned once (a graph may not copy them in)."""
        if key not in self.views:
            view = self._buffers(key[3]).spec_step(*key[:3])
            self.decoder.runner.model.plan(view)
            self.views[key] = view
        return self.views[key]

    @torch.inference_mode()
    def execute(self, step: StepInput) -> SamplerOutput:
        n, k = step.num_seqs, self._step_k(step)
        key = (_bucket(self.batches, n), _bucket(self.widths, step.block_tables.shape[1]), step.sampling.all_greedy, k)
        view = self._view(key)
        self.buffers[k].fill_spec(step, view)
        self.num_steps += 1
        gkey = key + (self.timing,)
        if gkey in self.graphs:
            graphs, state = self.graphs[gkey]
            self._replay(graphs)
            out = state.out
        else:
            out = self.decoder.run(view)  # eager over the buffers: this step's result, and the warm-up
            if self.capture_graphs:
                try:
                    self.graphs[gkey] = self._capture(view, split=self.timing)
                except Exception:  # the step's result stands; later steps run the same phases eagerly
                    log.exception("capturing the speculative step's graphs failed: speculative steps run eagerly")
                    self.capture_graphs = False
                    torch.cuda.synchronize(self.decoder.runner.device)
        return _rows(out, n)

    def _replay(self, graphs: list[torch.cuda.CUDAGraph]) -> None:
        if not self.timing:
            for g in graphs:
                g.replay()
        else:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)]
            events[0].record()
            for g, e in zip(graphs, events[1:]):
                g.replay()
                e.record()
            if self._events is not None:  # the previous step's phases are done by now or soon: read them
                self._events[-1].synchronize()
                self.phase_ms.append([a.elapsed_time(b) for a, b in zip(self._events, self._events[1:])])
            self._events = events

    def flush_timing(self) -> None:
        """Read the last timed replay's events (after the caller is done stepping)."""
        if self._events is not None:
            self._events[-1].synchronize()
            self.phase_ms.append([a.elapsed_time(b) for a, b in zip(self._events, self._events[1:])])
            self._events = None

    def _capture(self, view: StepInput, split: bool):
        """One graph for the whole step, or (`split`) one per phase captured in order into the shared pool; their
        StepState links them."""
        d, t0 = self.decoder, time.perf_counter()
        torch.cuda.synchronize(d.runner.device)
        state, graphs = self.new_state(view), []
        for group in ([p] for p in d.phases) if split else [d.phases]:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):  # mid-serving: other threads
                for phase in group:
                    phase(state)
            if self.pool is None:
                self.pool = g.pool()
            graphs.append(g)
        torch.cuda.synchronize(d.runner.device)
        log.info("captured the speculative step as %d graph(s) for %d sequences x %d drafts, %d table columns, %s in "
                 "%.2f s", len(graphs), view.num_seqs, view.spec.num_speculative_tokens, view.block_tables.shape[1],
                 "greedy" if view.sampling.all_greedy else "sampled", time.perf_counter() - t0)
        return graphs, state


def _rows(out: SamplerOutput, n: int) -> SamplerOutput:
    """The first n rows of a graphed step's output (the rest is padding)."""
    return SamplerOutput(out.token_ids[:n], out.logprobs[:n], num_tokens=out.num_tokens[:n],
                         num_draft_tokens=out.num_draft_tokens[:n], draft_confidence=out.draft_confidence[:n])
