"""Compile at load what a served model can reach, before the engine reports ready: no request waits on a compile.

Triton compiles a kernel the first time it meets a new specialization: its constexpr tiles (picked by token count:
the MoE and linear dispatch rows, `kernels/dispatch.py`, the router's token tile for up to 8 tokens; by the block
table's width: the indexer's top-k tile; by batch and context: the decode split-K merge; by rows: the sampling
kernel's vocabulary split) and the classes of its integer arguments (1, a multiple of 16, other). `warm_up` runs
dummy steps through the worker's model runner that reach each of them: single-sequence prefills at the token counts
on both sides of every limit, a prefill of several sequences, a mixed step (a chunk with decodes), 16-token chunks at
the end of contexts of every power of two of pages, and, when no decode graphs were captured (the capture compiles
the decode steps of every bucket), eager decodes at every batch size and block-table width (`table_widths`); then
the sampling kernel for every row count. With speculative decoding these steps go through the speculative runner
(target forward, draft features), and speculative decode steps follow (drafts, verification) at every batch size
and table width, then speculative steps beside a prefill chunk (every phase eager there).
Tensor-parallel ranks run the same forwards in lockstep (rank 0
alone samples).

The steps write pages that no request holds yet (the engine starts after this, with every page free) and their
tokens are dropped. CUDA only: elsewhere nothing compiles (the torch references, the interpreter). Called once, from
`Worker.init_cache`; the report (seconds, steps, compiles seen) lands in the log and the engine's stats.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from m3serve.executor.speculative.confidence import verify_widths
from m3serve.step_io import SamplingInput, SpeculativeInput, StepInput

log = logging.getLogger(__name__)


@dataclass
class WarmupReport:
    seconds: float
    steps: int
    compiles: int  # kernel compiles during the warm-up (fresh or from Triton's disk cache)


def token_counts(max_tokens: int) -> list[int]:
    """Token counts of the single-sequence prefills: each integer class, the router's token tiles (1, 2, 4, 8) and
    both sides of every dispatch limit."""
    from m3serve.kernels import dispatch

    counts = {1, 2, 3, 4, 8, 15, 16, 17, 64, 65, max_tokens}
    t = dispatch.tuning()
    for table in (t.moe_table, t.linear_table):
        for limit, *_ in table:
            if limit is not None:
                counts |= {limit, limit + 1}
    return sorted(n for n in counts if 1 <= n <= max_tokens)


def _sampling(n: int, kind: str, device) -> SamplingInput:
    if kind == "greedy":
        return SamplingInput.full(n, temperature=0.0, device=device)
    return SamplingInput.full(n, temperature=0.8, seed=1, device=device)


def dummy_step(seqs: list[tuple[int, int]], block_size: int, num_pages: int, device, sampling: str | None,
               k: int = 0, prefills: int = 0) -> StepInput:
    """A step over sequences given as (new tokens, tokens already cached): pages taken in turn from page 0 (modulo
    the pool), token ids 0, the last token of each sequence sampled. With `k` (the step's drafts per sequence:
    speculative decoding) every sequence after the first `prefills` (prefill chunks, their last token sampled)
    speculates: its first new token is the anchor, the others (q - 1 <= k) its drafts' placeholders."""
    qsl, positions, lens, slots, tables = [0], [], [], [], []
    page = 0
    for q, cached in seqs:
        length = cached + q
        pages = [(page + j) % num_pages for j in range(-(-length // block_size))]
        page += len(pages)
        tables.append(pages)
        qsl.append(qsl[-1] + q)
        lens.append(length)
        for pos in range(cached, length):
            positions.append(pos)
            slots.append(pages[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for s, t in enumerate(tables):
        block_tables[s, :len(t)] = torch.tensor(t, dtype=torch.int32)
    n = len(seqs)
    speculative = None
    if k:
        speculative = SpeculativeInput.from_rows([(s, s, qsl[s], q - 1) for s, (q, _) in enumerate(seqs)
                                                  if s >= prefills], n, k)
    return StepInput(
        input_ids=torch.zeros(qsl[-1], dtype=torch.int64), positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens, is_decode=all(q == 1 for q, _ in seqs),
        max_query_len=max(q for q, _ in seqs), max_seq_len=max(lens), block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor([qsl[s] if k and s >= prefills else qsl[s + 1] - 1 for s in range(n)],
                                    dtype=torch.int64),
        sampling=_sampling(n, sampling, "cpu") if sampling else None, speculative=speculative).to(device)


def plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
         eager_decodes: bool) -> list[list[tuple[int, int]]]:
    """The warm-up steps, each a list of (new tokens, cached tokens) per sequence."""
    room = max(2, max_model_len - 1)  # the longest sequence a request can make
    steps = [[(t, 0)] for t in token_counts(min(max_num_batched_tokens, room))]
    several = min(max_num_seqs, 5)
    steps.append([(max(1, min(max_num_batched_tokens // several, room)), 0)] * several)  # several prefills
    if max_num_seqs > 1:  # a mixed step: a chunk of a prompt with decodes of long contexts
        decodes = min(max_num_seqs - 1, 8)
        chunk = max(1, min(max_num_batched_tokens - decodes, room))
        steps.append([(chunk, 0)] + [(1, min(room, 17 * block_size) - 1)] * decodes)
    q = min(16, max_num_batched_tokens, room - 1)
    pages = 16  # the indexer's top-k tile covers max(16, next power of two) table columns
    while pages * block_size <= room:
        steps.append([(q, pages * block_size - q)])
        pages *= 2
    steps.append([(q, room - q)])
    if eager_decodes:
        for b in range(1, max_num_seqs + 1):
            steps += [[(1, 1)] * b] + [[(1, min(room, w * block_size) - 1)] * b
                                       for w in table_widths(max_num_seqs, room, block_size)]
    return steps


EXHAUSTIVE_DECODES = 4096  # batch sizes x table widths up to which every pair gets an eager decode step


def table_widths(max_num_seqs: int, room: int, block_size: int) -> list[int]:
    """Block-table widths (pages) the decode steps of each batch size are warmed at. A decode kernel's
    specialization follows the width: its row stride and block count (each integer's class: 1, a multiple of 16,
    other), the top-k tile (the next power of two) and, with the batch, the split-K count and tiles per split. On the
    H200 (2026-12-04) eager decodes warmed only at the shortest and longest contexts still compiled the MSA decode,
    index-scan and top-k kernels at contexts in between. So every width, where batch sizes x widths stay under
    EXHAUSTIVE_DECODES; else each class in each power-of-two range: 1, 2, 16, then 2^j + 1 and 2^(j+1), and the
    widest."""
    widest = max(1, -(-room // block_size))
    if max_num_seqs * widest <= EXHAUSTIVE_DECODES:
        return list(range(1, widest + 1))
    widths = {1, 2, 16, widest}
    j = 16
    while j < widest:
        widths |= {j + 1, 2 * j}
        j *= 2
    return sorted(w for w in widths if w <= widest)


def speculative_plan(max_num_seqs: int, max_model_len: int, k: int, block_size: int = 0) -> list[list[tuple[int, int]]]:
    """Speculative decode steps (anchor + k drafts per sequence): every batch size with K drafts at short and at the
    longest contexts and, with `block_size`, at every table width where batch sizes x widths stay under
    EXHAUSTIVE_DECODES; then one sequence with each smaller number of drafts (a sequence near its end drafts fewer)."""
    room = max(k + 3, max_model_len - 1)
    steps = [[(1 + k, 1)] * b for b in range(1, max_num_seqs + 1)]
    steps += [[(1 + k, room - 1 - k)] * b for b in range(1, max_num_seqs + 1)]
    widest = -(-room // block_size) if block_size else 0
    if block_size and max_num_seqs * widest <= EXHAUSTIVE_DECODES:  # (larger: minutes of steps at load)
        for b in range(1, max_num_seqs + 1):
            steps += [[(1 + k, min(room, w * block_size) - 1 - k)] * b
                      for w in range(1, widest + 1) if w * block_size > k + 2]
    return steps + [[(1 + j, 1)] for j in range(1, k)]


def mixed_speculative_plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, k: int,
                           block_size: int) -> list[list[tuple[int, int]]]:
    """Speculative steps with a prefill chunk first (a request admitted beside speculating decodes: every phase
    eager): 1, 2, 17 and 33 speculating sequences (the Markov kernel's row tiles of 16, 32 and 64), each with 1, 2
    and K drafts, at a short and a longer context. On the H100 (2026-12-06) such steps were missing here, and the
    learned model's first tool-call prompts at batch 8 compiled the Markov kernel in the middle of serving."""
    room = max(k + 3, max_model_len - 1)
    steps = []
    for b in sorted({1, 2, 17, 33, max_num_seqs - 1}):
        for j in sorted({1, min(2, k), k}):
            chunk = min(16, max_num_batched_tokens - b * (1 + j), room)
            if not 1 <= b < max_num_seqs or chunk < 1:
                continue
            for cached in sorted({1, max(1, min(room, 17 * block_size) - 1 - j)}):
                steps.append([(chunk, 0)] + [(1 + j, cached)] * b)
    return steps


def warm_up(runner, config, max_model_len: int, rank: int = 0) -> WarmupReport | None:
    """Run the warm-up steps on `runner` (a `ModelRunner`); None off CUDA."""
    if runner.device.type != "cuda":
        return None
    t0 = time.perf_counter()
    compiles = []
    listener = _count_compiles(compiles)
    try:
        bs, pool, dev = runner.cache.block_size, runner.cache.num_pages, runner.device
        steps = plan(config.max_num_seqs, config.max_num_batched_tokens, max_model_len, bs, runner.graphs is None)
        for seqs in steps:  # the same forwards on every rank; rank 0 alone samples
            runner.execute(dummy_step(seqs, bs, pool, dev, "greedy" if rank == 0 else None))
        if runner.drafter is not None:  # drafts, then the target's verify (greedy and sampled verification)
            k = runner.drafter.config.num_speculative_tokens
            # (drafts per sequence, the step's sequences, how many of them are prefill chunks first)
            plans = [(k, seqs, 0) for seqs in speculative_plan(config.max_num_seqs, max_model_len, k, bs)]
            if runner.drafter.config.confidence_scheduling:  # steps whose K is a smaller verify width: their own shapes
                plans += [(w, [(1 + w, 1)] * b, 0) for w in verify_widths(k)[:-1] for b in (1, config.max_num_seqs)]
            mixed = mixed_speculative_plan(config.max_num_seqs, config.max_num_batched_tokens, max_model_len, k, bs)
            plans += [(k, seqs, 1) for seqs in mixed]
            for width, seqs, prefills in plans:
                for kind in ("greedy", "sampled"):
                    runner.execute(dummy_step(seqs, bs, pool, dev, kind, k=width, prefills=prefills))
                    steps.append(seqs)
        if rank == 0:  # the sampling kernel's vocabulary split depends on the rows: every row count a step can have
            vocab = runner.model.config.vocab_size
            for n in range(1, config.max_num_seqs + 1):
                for kind in ("greedy", "sampled"):
                    runner.sampler(torch.zeros(n, vocab, device=dev), _sampling(n, kind, dev))
        torch.cuda.synchronize(dev)
        n = len(steps)
    finally:
        listener()
    report = WarmupReport(time.perf_counter() - t0, n, len(compiles))
    log.info("warm-up: %d steps, %d kernel compiles, %.1f s (every kernel a served step can reach is compiled)",
             report.steps, report.compiles, report.seconds)
    return report


def _count_compiles(out: list):
    """Chain a counter onto Triton's compilation listener (keeping one already installed, e.g. the benchmarks'
    `geometry.log_compiles`); returns the function that restores the previous listener."""
    try:
        import triton
        knobs = triton.knobs.compilation
    except (ImportError, AttributeError):
        return lambda: None
    prev = knobs.listener

    def listener(**kw):
        out.append(kw.get("src"))
        if prev is not None:
            prev(**kw)

    knobs.listener = listener

    def restore():
        knobs.listener = prev
    return restore
