"""CUDA graphs for DSpark speculative steps (executor/speculative/decoder.py), per (batch bucket, block-table width bucket,
greedy or sampled with the sampling filters some row needs), like the decode graphs (cuda_graph.py).

A step is graphed when every sequence in it speculates: S sequences x (K+1) rows (the anchor, then K
placeholders), nothing else (no prefill chunk, no top-n logprobs; plain decodes only in all-greedy steps, as k = 0;
a step of such plain decodes alone is K wide, or with draft backoff 0 wide: one row per sequence, no draft phase).
A sequence near its max_tokens verifies k < K drafts: its rows past its k+1 tokens are padding (`fill_speculative`).
Such a step has one shape per bucket, so its tensors are static: `SpeculativeBuffers` holds them at the largest
sizes, each step copies its `StepInput` into their leading rows (two copies to the device: its small inputs packed
in one buffer, `_Arena`, and its block table's rows) (sequences past S are padding: slot -1, nothing written to
either cache; page 0 read; greedy; their outputs dropped) and replays. Any other step (mixed batches, penalties)
runs the same phases eagerly. The step's K is the configured one, or, with confidence-scheduled verification, the
width the engine chose for the step (executor/speculative/confidence.py: one of a few), so buffers, views and graphs
are kept per K too.

The phases of the step (`SpeculativeDecoder.phases`: draft backbone, Markov positions, target forward over the K+1
tokens of every sequence, sampling and the acceptance rule, the draft-cache insert) are captured as ONE graph, so
a step costs one replay and no synchronisation: the only one is the copy of its tokens to the host
(`PendingOutput`). With `timing` set (benchmarks), each phase is a graph of its own instead (captured in order,
into the same memory pool, handing each other their tensors) and a CUDA event is recorded between them
(`phase_ms`); the two kinds are kept apart per bucket.

A bucket's graphs are captured at its first step: that step runs its phases eagerly over the buffers (compiling
the kernels; its result is the step's), then each phase is captured (should a capture fail, the error is logged
and speculative steps run eagerly from then on). A new proposal hook drops them (`clear`).
A step launched ahead of the previous step's result (async scheduling) is filled as built (one token per sequence
from that step) and its sequences' rows of the buffers are then moved by their accepted runs on the device
(executor/ahead.py), before the replay.
On the CPU (the tests) nothing is captured: every step runs the same static-buffer path eagerly.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from m3serve.step_io import SamplerOutput, SpeculativeInput, StepInput
from m3serve.executor.ahead import follow_previous
from m3serve.executor.cuda_graph import DecodeBuffers, _bucket, batch_buckets, width_buckets

log = logging.getLogger(__name__)


class _Arena:
    """Small per-row tensors packed in one device byte buffer, with a host twin (page-locked on CUDA) of the same
    layout: a step writes its values into the host views (numpy, no device work) and `upload` moves them all in
    ONE copy. The device views are the graphs' persistent inputs (fixed addresses)."""

    def __init__(self, fields: dict[str, tuple[int, torch.dtype]], device: torch.device):
        offsets, total = {}, 0
        for name, (n, dtype) in fields.items():
            offsets[name] = total
            total += -(-n * dtype.itemsize // 8) * 8  # every field 8-byte aligned
        self.device = torch.zeros(total, dtype=torch.uint8, device=device)
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._uploaded: torch.cuda.Event | None = None
        self.views, self.host_views = {}, {}
        for name, (n, dtype) in fields.items():
            o, nb = offsets[name], n * dtype.itemsize
            self.views[name] = self.device[o:o + nb].view(dtype)
            self.host_views[name] = self.host[o:o + nb].view(dtype).numpy()

    def writable(self) -> dict:
        """The host views (numpy), once the previous upload (and any copy queued before it) has left the host
        buffers."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None
        return self.host_views

    def upload(self) -> None:
        self.device.copy_(self.host, non_blocking=True)
        if self.device.is_cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()


class SpeculativeBuffers(DecodeBuffers):
    """A speculative step's persistent inputs: `max_seqs` sequences of K+1 tokens, `max_pages` table columns. Its
    per-token and per-sequence inputs live in one `_Arena` (a step uploads them in one copy), the block table in
    its own buffer (one copy of the step's rows)."""

    def __init__(self, max_seqs: int, max_pages: int, block_size: int, k: int, device: torch.device):
        super().__init__(max_seqs, max_pages, block_size, device)
        i32, i64, f32, w, z = torch.int32, torch.int64, torch.float32, k + 1, dict(device=device)
        self.k = k
        rows = max_seqs * w
        self.arena = _Arena({"input_ids": (rows, i64), "positions": (rows, i64), "slot_mapping": (rows, i64),
                             "prev_rows": (rows, i64),
                             "num_drafts": (max_seqs, i64), "seq_lens": (max_seqs, i32),
                             "temperature": (max_seqs, f32), "top_k": (max_seqs, i32), "top_p": (max_seqs, f32),
                             "min_p": (max_seqs, f32), "seeds": (max_seqs, i64), "sample_positions": (max_seqs, i64)},
                            device)
        for name, view in self.arena.views.items():  # these replace DecodeBuffers' own tensors
            setattr(self, name, view)
        hv = self.arena.host_views
        hv["slot_mapping"][:] = -1
        hv["num_drafts"][:] = k
        hv["seq_lens"][:] = 1
        hv["top_p"][:] = 1.0
        self.arena.upload()
        self.host_tables = torch.zeros(max_seqs, max_pages, dtype=i32, pin_memory=device.type == "cuda")
        self.query_start_loc = (torch.arange(max_seqs + 1, **z) * w).to(torch.int32)
        self.logits_indices = torch.arange(max_seqs, dtype=i64, **z) * w  # each sequence samples at its anchor
        self.seq_index = torch.arange(max_seqs, dtype=i64, **z)
        self.draft_rows = (self.logits_indices[:, None] + 1 + torch.arange(k, **z)[None, :]).flatten()
        self.draft_index = torch.arange(max_seqs * k, dtype=i64, **z)
        self.no_rows = torch.zeros(0, dtype=i64, **z)

    def speculative_step(self, batch: int, width: int, greedy: bool,
                         filters: tuple[bool, bool, bool] = (True,) * 3) -> StepInput:
        """A speculative StepInput over the buffers' leading rows (`batch` sequences, `width` table columns);
        `filters`: a sampled step's (needs_top_k, needs_top_p, needs_min_p)."""
        w, k = self.k + 1, self.k
        s = self.sampling(batch)
        s.all_greedy = greedy
        s.needs_top_k, s.needs_top_p, s.needs_min_p = (False,) * 3 if greedy else filters
        speculative = SpeculativeInput(self.seq_index[:batch], self.seq_index[:batch], self.logits_indices[:batch],
                                       self.num_drafts[:batch], self.draft_rows[:batch * k],
                                       self.draft_index[:batch * k], self.no_rows, k)
        return StepInput(
            input_ids=self.input_ids[:batch * w], positions=self.positions[:batch * w],
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            query_start_loc_cpu=list(range(0, batch * w + 1, w)), seq_lens_cpu=[w] * batch, is_decode=False,
            max_query_len=w, max_seq_len=width * self.block_size, block_tables=self.block_tables[:batch, :width],
            slot_mapping=self.slot_mapping[:batch * w], logits_indices=self.logits_indices[:batch], sampling=s,
            speculative=speculative)

    def fill_speculative(self, step: StepInput, view: StepInput) -> None:
        """Copy a speculative step of S <= batch sequences (host tensors) into `view`'s buffers; the rows past S
        become padding. A sequence with k < K drafts (near its max_tokens) takes K+1 rows all the same: rows past
        its k+1 tokens repeat its last token at its position with no slot (nothing written to either cache; the
        prefill attention is causal by position, so they read only its written keys), and its k in `num_drafts`
        bounds what the rule verifies, as on the eager path. Two copies to the device: the arena and the table's
        rows. The view's host lists take the step's (read by host-side reference paths only, never by a graph)."""
        if step.input_ids.device.type != "cpu":  # the warm-up's dummy steps are made on the device
            step = step.to("cpu")
        n, w, k1, sp = step.num_seqs, step.block_tables.shape[1], self.k + 1, step.speculative
        batch, t = view.num_seqs, n * k1
        ids, pos, slots = step.input_ids.numpy(), step.positions.numpy(), step.slot_mapping.numpy()
        ahead = step.prev_token_rows is not None  # launched ahead: each token's row of the previous result
        prev = step.prev_token_rows.numpy() if ahead else ids
        if sp is not None and sp.num_seqs == n:
            drafts = sp.num_drafts.numpy()
        else:  # plain decodes of a greedy step (`supports`): 0 drafts
            drafts = np.zeros(n, dtype=np.int64)
            if sp is not None:
                drafts[sp.seq_index.numpy()] = sp.num_drafts.numpy()
        if step.num_tokens != t:  # spread each sequence over its K+1 rows
            j = np.arange(k1)
            src = (np.asarray(step.query_start_loc_cpu[:n])[:, None] + np.minimum(j[None, :], drafts[:, None]))
            ids, pos, slots, prev = ids[src.ravel()], pos[src.ravel()], slots[src.ravel()], prev[src.ravel()]
            slots[(j[None, :] > drafts[:, None]).ravel()] = -1
        hv, s = self.arena.writable(), step.sampling
        for name, src, pad in (("input_ids", ids, 0), ("positions", pos, 0), ("slot_mapping", slots, -1)):
            hv[name][:t], hv[name][t:batch * k1] = src, pad
        if ahead:  # read by `follow_previous` over the step's own rows only
            hv["prev_rows"][:t] = prev
        for name, src, pad in (("num_drafts", drafts, self.k), ("seq_lens", step.seq_lens.numpy(), k1),
                               ("temperature", s.temperature.numpy(), 0), ("top_k", s.top_k.numpy(), 0),
                               ("top_p", s.top_p.numpy(), 1), ("min_p", s.min_p.numpy(), 0),
                               ("seeds", s.seeds.numpy(), 0), ("sample_positions", s.positions.numpy(), 0)):
            hv[name][:n], hv[name][n:batch] = src, pad
        tables = self.host_tables.numpy()
        tables[:n, :w] = step.block_tables.numpy()
        tables[n:batch, 0] = 0
        self.block_tables[:batch, :w].copy_(self.host_tables[:batch, :w], non_blocking=True)
        self.arena.upload()  # its event also covers the table's copy (the same stream, before it)
        view.seq_lens_cpu[:] = list(step.seq_lens_cpu) + [k1] * (batch - n)


class SpeculativeGraphs:
    """The speculative steps' graphs of one `SpeculativeDecoder` (its runner's model, bound to its cache)."""

    def __init__(self, decoder, new_state, max_num_seqs: int, max_pages: int):
        """new_state(step): what the decoder's phases hand each other (its `StepState`)."""
        r = decoder.runner
        self.decoder, self.new_state, self.k = decoder, new_state, decoder.config.num_speculative_tokens
        # a step of greedy plain decodes only: with draft backoff (speculative_config.draft_backoff, where such steps
        # are common) a width-0 step (no draft, no Markov positions: the target's forward, its argmaxes, the
        # draft-cache insert); else the K-wide one, each sequence verifying 0 drafts
        self.plain_k = 0 if decoder.config.draft_backoff else self.k
        self.batches = batch_buckets(max_num_seqs)
        self.widths = width_buckets(max_pages)
        self.max_pages = max_pages
        self.buffers: dict[int, SpeculativeBuffers] = {}  # per step K (drafts per sequence)
        self.capture_graphs = r.device.type == "cuda"
        # (batch, width, greedy, step K, filters: a sampled step's needs_top_k / top_p / min_p, only the sampling
        # transform's passes it needs) -> the bucket's static step
        self.views: dict[tuple[int, int, bool, int, tuple[bool, ...]], StepInput] = {}
        # (batch, width, greedy, step K, timing, filters) -> graphs, their StepState: one graph for the whole step,
        # or with `timing` one per phase (events between them)
        self.graphs: dict[tuple, tuple[list[torch.cuda.CUDAGraph], object]] = {}
        self.pool = None
        self.num_steps = 0  # steps it ran (replayed, or eagerly over the buffers)
        self.num_ahead = 0  # of which launched ahead of the previous step's result (async scheduling)
        self.timing = False  # record CUDA events between the phases of every replay (benchmarks)
        self.phase_ms: list[list[float]] = []  # per timed replay, each phase's device time (ms); read after a sync
        self._events: list[torch.cuda.Event] | None = None

    def supports(self, step: StepInput) -> bool:
        """Every sequence of the step speculates (k <= K drafts) and nothing else is in it, or, all greedy, some or
        all decode plainly (k = 0: verifying no draft emits the target's argmax, the plain decode's token), with no
        prefill chunk (host fields only)."""
        sp, s, n, k = step.speculative, step.sampling, step.num_seqs, self._step_k(step)
        return (s is not None and (s.all_greedy or sp is not None and sp.num_seqs == n) and n == s.num_rows
                and n <= self.batches[-1] and (1 <= k or sp is None) and k <= self.k
                and step.num_tokens == n + (0 if sp is None else sp.draft_rows.shape[0]) <= n * (k + 1)
                and step.block_tables.shape[1] <= self.widths[-1] and s.max_num_logprobs <= 0
                and s.repetition_penalty is None and s.frequency_penalty is None and s.presence_penalty is None
                and s.suppress_token_ids is None)

    def clear(self) -> None:
        self.graphs.clear()

    def _step_k(self, step: StepInput) -> int:
        """The step's K (rows per sequence - 1): its drafts per sequence, a confidence-scheduled width or the
        configured K, and `plain_k` for a step of plain decodes only."""
        return step.speculative.num_speculative_tokens if step.speculative is not None else self.plain_k

    def _buffers(self, k: int) -> SpeculativeBuffers:
        if k not in self.buffers:
            r = self.decoder.runner
            self.buffers[k] = SpeculativeBuffers(self.batches[-1], self.max_pages, r.cache.block_size, k, r.device)
        return self.buffers[k]

    def _view(self, key: tuple[int, int, bool, int, tuple[bool, ...]]) -> StepInput:
        """The bucket's static step, its attention tile maps planned once (a graph may not copy them in)."""
        if key not in self.views:
            view = self._buffers(key[3]).speculative_step(*key[:3], key[4])
            self.decoder.runner.model.plan(view)
            self.views[key] = view
        return self.views[key]

    @torch.inference_mode()
    def execute(self, step: StepInput, prev: SamplerOutput | None = None) -> SamplerOutput:
        """`prev`: the previous step's device result, for a step launched ahead of it: its sequences' rows of the
        buffers are completed from it on the device after the upload (executor/ahead.py), before the replay."""
        n, k, s = step.num_seqs, self._step_k(step), step.sampling
        filters = () if s.all_greedy else (s.needs_top_k, s.needs_top_p, s.needs_min_p)
        key = (_bucket(self.batches, n), _bucket(self.widths, step.block_tables.shape[1]), s.all_greedy, k, filters)
        view, buffers = self._view(key), self.buffers[k]
        buffers.fill_speculative(step, view)
        if prev is not None:
            follow_previous(view, prev, buffers.prev_rows, buffers.block_size, n)
            self.num_ahead += 1
        self.num_steps += 1
        gkey = key[:4] + (self.timing,) + key[4:]
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
                 "%.2f s", len(graphs), view.num_seqs, view.speculative.num_speculative_tokens,
                 view.block_tables.shape[1], "greedy" if view.sampling.all_greedy else "sampled",
                 time.perf_counter() - t0)
        return graphs, state


def _rows(out: SamplerOutput, n: int) -> SamplerOutput:
    """The first n rows of a graphed step's output (the rest is padding)."""
    return SamplerOutput(out.token_ids[:n], out.logprobs[:n], num_tokens=out.num_tokens[:n],
                         num_draft_tokens=out.num_draft_tokens[:n], draft_confidence=out.draft_confidence[:n])
