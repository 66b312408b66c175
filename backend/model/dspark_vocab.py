"""A reduced draft vocabulary: the DSpark draft proposes only from N chosen tokens (the idea of EAGLE-3's draft
vocabulary and FR-Spec), so its base logits read N rows of the lm_head instead of V, and the Markov head's W2
N rows per draft position. Verification stays exact: the draft's Q is zero outside the subset
(executor/speculative/verify.py reads Q_i(x_i) and one residual row per sequence).

Checkpoint: an optional tensor `draft_vocab_ids`, int64 (or int32) [M]: vocabulary ids ordered by frequency, most
frequent first. `speculative_config.draft_vocab_size = N` takes its first N (1 <= N <= M); they must lie in
[0, V) and be distinct. Without the option the tensor is ignored (the full vocabulary). In the engine the N ids are
sorted ascending: column j of the draft's logits and of its Q is the vocabulary id `ids[j]`.

Tensor parallelism: the target's lm_head holds V/P vocabulary rows per rank. Each rank copies, once at load, the
lm_head rows of the subset ids in its own range into an [n, H] weight, zero-padded to the largest rank's n; the
ranks' logits are all-gathered as before ([..., P * n]) and the N real columns picked out (`cols`): rank order is
vocabulary order, so they come out in ascending id order. A subset crowded into one rank's range makes that rank
read more rows than the others (at most min(N, V / P)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from m3serve.distributed.parallel import Parallel
from m3serve.errors import ConfigError

DRAFT_VOCAB_TENSOR = "draft_vocab_ids"
OPTION = "speculative_config.draft_vocab_size"


def select_draft_vocab(stored: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The first `size` ids of the checkpoint's `draft_vocab_ids`, checked, sorted ascending (int64)."""
    if stored.dim() != 1 or stored.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"the draft checkpoint's {DRAFT_VOCAB_TENSOR} must be a 1-D int64 tensor, found "
                          f"{stored.dtype} {list(stored.shape)}")
    m = stored.numel()
    if not 1 <= size <= min(m, vocab_size):
        raise ConfigError(f"{OPTION}: {size} is out of range: the draft checkpoint's {DRAFT_VOCAB_TENSOR} holds {m} "
                          f"ids and the vocabulary {vocab_size} (1..{min(m, vocab_size)})")
    ids = stored[:size].long()
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        raise ConfigError(f"the draft checkpoint's {DRAFT_VOCAB_TENSOR}: id(s) {outside[:5].tolist()} outside the "
                          f"vocabulary [0, {vocab_size})")
    ids = ids.sort().values
    dup = ids[1:][ids[1:] == ids[:-1]].unique()
    if dup.numel():
        raise ConfigError(f"the draft checkpoint's {DRAFT_VOCAB_TENSOR}: duplicate id(s) {dup[:5].tolist()} among "
                          f"its first {size}")
    return ids


def rank_rows(ids: torch.Tensor, vocab_size: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's lm_head rows of the subset, local indices [n_max] padded with -1; the N subset columns' places
    in the ranks' gathered logits [N]) for sorted ids [N] and a vocabulary split in `size` equal parts."""
    part = vocab_size // size
    owner = ids // part
    counts = torch.bincount(owner, minlength=size)
    width = int(counts.max())
    first = torch.cumsum(counts, 0) - counts  # each rank's first subset column
    slot = torch.arange(ids.numel(), device=ids.device) - first[owner]
    cols = owner * width + slot
    mine = ids[owner == rank] - rank * part
    rows = torch.full((width,), -1, dtype=torch.long, device=ids.device)
    rows[:mine.numel()] = mine
    return rows, cols


@dataclass(frozen=True)
class DraftVocab:
    """The draft's vocabulary subset on one rank (not a module: nothing of it is saved with the draft)."""

    ids: torch.Tensor  # int64 [N]: the subset, ascending; column j = vocabulary id ids[j]
    head: torch.Tensor  # [n, H]: this rank's lm_head rows of the subset (zero rows past its own)
    cols: torch.Tensor | None  # int64 [N]: the subset's columns in the ranks' gathered logits (None: one rank)

    @classmethod
    def build(cls, ids: torch.Tensor, lm_head_weight: torch.Tensor, vocab_size: int, parallel: Parallel | None
              ) -> "DraftVocab":
        """From sorted ids [N] and the target's lm_head weight (this rank's [V / P, H] rows)."""
        rank, size = (parallel.rank, parallel.size) if parallel is not None else (0, 1)
        ids = ids.to(lm_head_weight.device)
        rows, cols = rank_rows(ids, vocab_size, rank, size)
        head = torch.where((rows >= 0)[:, None], lm_head_weight.detach()[rows.clamp(min=0)], 0.0).contiguous()
        return cls(ids, head, cols if size > 1 else None)

    @property
    def size(self) -> int:
        return self.ids.numel()

    def logits(self, h: torch.Tensor, parallel: Parallel | None) -> torch.Tensor:
        """h [..., H] -> the subset's logits, fp32 [..., N], on every rank."""
        u = F.linear(h, self.head).float()
        if self.cols is None:
            return u
        return parallel.all_gather(u, -1).index_select(-1, self.cols)


def subset_columns(ids: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For sorted ids [N]: (the column of each token [...] (clamped where outside), whether it is in the subset)."""
    col = torch.searchsorted(ids, tokens.long().contiguous()).clamp(max=ids.numel() - 1)
    return col, ids[col] == tokens


def full_rows(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Subset probabilities [..., N] -> the same distributions over the vocabulary [..., V] (zero outside)."""
    return probs.new_zeros(*probs.shape[:-1], vocab_size).scatter_(-1, ids.expand_as(probs), probs)
