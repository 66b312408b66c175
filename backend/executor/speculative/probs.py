"""Distributions and draws on tensors for speculative decoding, with no host synchronisation.

`sampling_probs` is the request's sampling transform as a probability vector: the engine sampler's
`filter_logits` (temperature -> min_p -> top_k -> top_p, vLLM's), each filter run where the step's flags say some
row needs it, as the plain sampler does (a temperature-only step: no sort of the vocabulary; a CUDA graph is
captured per set of flags, executor/speculative/graphs.py); rows with temperature ~ 0 become the one-hot argmax
(greedy). Both
the draft's Q and the target's T of a verification go through it, so a greedy target gives one-hot rows, which
the verification rules then handle exactly.

`draw` takes one token per row from a (possibly unnormalised) probability vector by inverse CDF with a
caller-supplied uniform in [0, 1): the engine feeds its counter-based per-request RNG, so results do not
depend on what else is in the batch. A token of probability 0 is never drawn.
"""
from __future__ import annotations

import torch

from m3serve.step_io import SamplingInput
from m3serve.executor.sampler import filter_logits



def sampling_probs(logits: torch.Tensor, st: SamplingInput | None) -> torch.Tensor:
    """logits [S, V] -> fp32 probabilities [S, V] after the row's transform (None = plain softmax)."""
    x = logits.float()
    if st is None:
        return torch.softmax(x, -1)
    onehot = torch.zeros_like(x).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
    if st.all_greedy:
        return onehot
    probs = torch.softmax(filter_logits(x, st), -1)
    return torch.where((st.temperature < SamplingInput.GREEDY_EPS)[:, None], onehot, probs)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [S, V] (>= 0, any positive total) with uniforms u [S] in [0, 1)."""
    cdf = probs.float().cumsum(-1)
    idx = torch.searchsorted(cdf, (u.float() * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total can round up to the total: fall back to the last token of positive probability
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last)


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """tokens [...] -> fp32 [..., V] (a greedy draft's Q)."""
    return torch.zeros(*tokens.shape, vocab, device=tokens.device).scatter_(-1, tokens[..., None].long(), 1.0)
