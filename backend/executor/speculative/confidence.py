"""How many drafted tokens to verify, from the draft's confidence head (design/dspark.md section 3).

Static threshold (DeepSpec's `--confidence-threshold`): verify the drafts before the first position whose
confidence c_k falls below the threshold; that token and all later ones are dropped (0 = verify all).
Lossless: keeping x_k depends only on c_1..c_k, which depend on x_0..x_{k-1}, never on x_k itself nor on
the target.

Confidence-scheduled verification (`VerifyScheduler`; the paper's Algorithm 1 restricted to one width for every
sequence, chosen from stale confidences as its production form chooses its budget, section 5.2; the per-request
allocation inside a budget, which needs variable query lengths decided on the device, is not built): before a step the engine picks ONE verify width W for every speculating sequence, from a small set (`widths`: so a
step keeps one shape per batch bucket and its CUDA graphs, executor/speculative/graphs.py), to maximise the expected tokens
per unit of step time
    Theta(W) = sum_r (1 + sum_{j <= min(W, k_r)} a_{r,j}) / cost(sum_r (1 + min(W, k_r)))
where a_{r,j} = c_{r,1} ... c_{r,j} is sequence r's prefix survival (the chance its first j drafts are accepted),
k_r its own draft limit, and cost(B) the step time at B verify tokens (`cost_table`, measured on the serving
machine: bench_spec prints one; there is no default, as a guessed cost would trim against made-up figures).
The confidences are STALE: those of each sequence's previous speculative step (positions
past the drafts it had then take its last one). So W depends only on committed history, never on this step's drafts
or the target's verdict on them, and the rule stays exact for every sequence (a sequence verifying W < K drafts is
one that drafted W: it still gets its correction or bonus token from the target's distribution). At batch 1 the step
costs about the same at every width and W = K; as the batch grows, the verify tokens' cost makes low-confidence
drafts not worth their rows and W falls. A step with width W drafts W tokens per sequence (the draft's logits, the
Markov positions and the verify rows all shrink), so the confidences past W that the next choice reads are
extrapolated from the last one.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from m3serve.speculative_config import CostTable

def confident_prefix_length(confidence: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """confidence fp32 [S, K] in (0, 1), threshold (scalar or [S]) -> verify lengths L int64 [S], 0..K."""
    thr = threshold[:, None] if isinstance(threshold, torch.Tensor) and threshold.dim() == 1 else threshold
    return (confidence >= thr).long().cumprod(-1).sum(-1)  # a float threshold stays a scalar: no copy to the device


def verify_widths(k: int) -> list[int]:
    """The widths a step may verify with K drafts: 1, 2, 3, 5 below K, and K (one graph set per width)."""
    return [w for w in (1, 2, 3, 5) if w < k] + [k]


def prefix_survival(confidence: Seq[float], width: int) -> list[float]:
    """a_1..a_width from a sequence's last conditional confidences c_1..c_m (positions past m repeat c_m; no
    confidences yet: 1, optimistic, so a new sequence is scheduled as if it would be accepted)."""
    out, a = [], 1.0
    for j in range(width):
        c = confidence[min(j, len(confidence) - 1)] if confidence else 1.0
        a *= min(max(float(c), 0.0), 1.0)
        out.append(a)
    return out


class VerifyScheduler:
    """Picks the step's verify width from the speculating sequences' stale confidences (see the module docstring)."""

    def __init__(self, k: int, cost_table: Seq[Seq[float]]):
        self.k = k
        self.widths = verify_widths(k)
        self.cost = CostTable(cost_table)

    def width(self, seqs: Seq[tuple[Seq[float], int]]) -> int:
        """seqs: (last conditional confidences, own draft limit k_r) per speculating sequence -> W."""
        if not seqs:
            return self.k
        survival = [(prefix_survival(c, min(self.k, kr)), kr) for c, kr in seqs]
        best, best_theta = self.k, -1.0
        for w in self.widths:
            tau = sum(1.0 + sum(a[:min(w, kr)]) for a, kr in survival)
            tokens = sum(1 + min(w, kr) for _, kr in survival)
            theta = tau / self.cost(tokens)
            if theta > best_theta * (1 + 1e-9):  # ties keep the smaller width (fewer rows for the same tokens)
                best, best_theta = w, theta
        return best
