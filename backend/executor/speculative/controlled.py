"""Controlled acceptance, for benchmarks and tests: a proposal hook (`SpeculativeDecoder.proposal_hook`) that keeps
the real draft's cost but decides how often its proposals are right.

At draft position q of the request with seed s, with probability p the draft's token is replaced by a known token
`sequences[s][q]` (e.g. the target's own greedy continuation, recorded beforehand), otherwise the draft's own token
is kept. The verifier is handed the true proposal distribution, Q' = p * onehot(known) + (1 - p) * Q (Q = the
draft's distribution, one-hot for greedy drafts), so verification stays exact at any temperature. The coin is a
counter-based uniform of (seed, step position), like every other draw of a speculative step, so the hook gives the
same proposals whatever the batch. Positions with no known token (past the recording, other seeds) keep the draft's.

With a greedy target and the target's own greedy continuation as `sequences`, a drafted position whose prefix was
accepted is accepted with probability p (plus the rare case that the draft's own token is right): the per-position
acceptance is ~p and a step's expected accepted run is sum_{i=1..K} p^i. So the proposals' confidence is p at the
positions with a known token (a calibrated confidence head; confidence-scheduled verification reads it), the
draft's own elsewhere.

With a reduced draft vocabulary (`Proposal.vocab_ids`) the hook stays inside it: a known token outside the subset
is not proposed (that position keeps the draft's token, as one with no known token does), since Q' must be a
distribution over the subset's columns. A benchmark that controls acceptance gives the draft a subset holding the
tokens the target produces (benchmarks/bench_spec.py `--draft-vocab`: the recorded continuations' tokens first).
"""
from __future__ import annotations

import torch

from m3serve.executor.speculative.probs import one_hot
from m3serve.executor.speculative.proposer import Proposal
from m3serve.executor.speculative.rng import stream_uniforms
from m3serve.model.dspark_vocab import subset_columns

HOOK = 0x60000000  # the hook's own uniform stream (executor/speculative/rng.py lists the others)


class ControlledProposals:
    def __init__(self, sequences: dict[int, list[int]], p: float, vocab_size: int,
                 device: torch.device | str = "cpu"):
        """sequences: request seed (int64 bits, as `SamplingInput.seeds`) -> its known tokens by position (the
        prompt included, so index = absolute position)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p, self.vocab_size = p, vocab_size
        width = max(len(s) for s in sequences.values())
        self.table = torch.full((len(sequences), width), -1, dtype=torch.int64, device=device)
        for i, toks in enumerate(sequences.values()):
            self.table[i, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
        self.seeds = torch.tensor(list(sequences), dtype=torch.int64, device=device)

    def __call__(self, prop: Proposal, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
                 seeds: torch.Tensor) -> Proposal:
        k, width = prop.tokens.shape[1], self.table.shape[1]
        match = seeds[:, None] == self.seeds[None, :]  # [S, B]
        pos = anchor_positions[:, None] + 1 + torch.arange(k, device=seeds.device)[None, :]
        known = self.table[match.int().argmax(1)[:, None], pos.clamp(max=width - 1)]
        known = torch.where(match.any(1)[:, None] & (pos < width), known, -1)  # [S, K], -1: none
        ids, cols, drafted = prop.vocab_ids, known.clamp(min=0), prop.tokens
        if ids is not None:  # Q's columns are the draft vocabulary's: known tokens outside it are not proposed
            cols, inside = subset_columns(ids, cols)
            known = torch.where(inside, known, -1)
            drafted = subset_columns(ids, drafted)[0]
        n = self.vocab_size if ids is None else ids.numel()
        coin = stream_uniforms(seeds, anchor_positions + 1, HOOK, k) < self.p
        tokens = torch.where((known >= 0) & coin, known, prop.tokens)
        q = prop.probs if prop.probs is not None else one_hot(drafted, n)
        mixed = self.p * one_hot(cols, n) + (1.0 - self.p) * q
        conf = torch.where(known >= 0, self.p, prop.confidence)
        return Proposal(tokens, torch.where((known >= 0)[..., None], mixed, q), conf, None, ids)
