"""Distributions and draws on tensors for speculative decoding, with no host synchronisation.

`sampling_probs` is the request's sampling transform as a probability vector: the same semantics as
`engine.sampler.filter_logits` (temperature -> min_p -> top_k -> top_p, vLLM's), but branch-free so a
batch of mixed requests (and a CUDA graph) runs one path; rows with temperature ~ 0 become the one-hot
argmax (greedy). Both the draft's Q and the target's T of a verification go through it, so a greedy
target gives one-hot rows, which the verification rules then handle exactly.

`draw` takes one token per row from a (possibly unnormalised) probability vector by inverse CDF with a
caller-supplied uniform in [0, 1): the engine feeds its counter-based per-request RNG, so results do not
depend on what else is in the batch. A token of probability 0 is never drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-5  # SamplingParams.greedy's threshold


@dataclass
class SamplingTensors:
    """Per-row sampling options (vLLM names). top_k 0 = off, top_p 1 = off, min_p 0 = off."""

    temperature: torch.Tensor  # fp32 [S]
    top_k: torch.Tensor  # int [S]
    top_p: torch.Tensor  # fp32 [S]
    min_p: torch.Tensor | None = None  # fp32 [S]

    @classmethod
    def full(cls, n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             device: torch.device | str = "cpu") -> "SamplingTensors":
        """The same options for n rows (tests, single-request use)."""
        f = lambda v: torch.full((n,), float(v), device=device)  # noqa: E731
        return cls(f(temperature), torch.full((n,), int(top_k), device=device), f(top_p), f(min_p))

    def repeat(self, k: int) -> "SamplingTensors":
        """Each row's options k times over, rows [S] -> [S * k] (row-major), for [S, k, V] logits."""
        rep = lambda t: None if t is None else t.repeat_interleave(k)  # noqa: E731
        return SamplingTensors(rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.min_p))


def sampling_probs(logits: torch.Tensor, st: SamplingTensors | None) -> torch.Tensor:
    """logits [S, V] -> fp32 probabilities [S, V] after the row's transform (None = plain softmax)."""
    x = logits.float()
    if st is None:
        return torch.softmax(x, -1)
    greedy = st.temperature < GREEDY_TEMPERATURE
    x = x / torch.where(greedy, 1.0, st.temperature.float())[:, None]
    if st.min_p is not None:
        p = torch.softmax(x, -1)
        x = x.masked_fill(p < st.min_p.float()[:, None] * p.amax(-1, keepdim=True), float("-inf"))
    vocab = x.shape[-1]
    sorted_x, order = x.sort(-1, descending=True)
    rank = torch.arange(vocab, device=x.device)[None, :]
    keep_k = torch.where(st.top_k > 0, st.top_k.long(), vocab)
    cut = rank >= keep_k[:, None]
    p_sorted = torch.softmax(sorted_x.masked_fill(cut, float("-inf")), -1)
    # a token goes when the mass strictly before it already reaches top_p; the first always stays
    cut = cut | ((p_sorted.cumsum(-1) - p_sorted) >= st.top_p.float()[:, None])
    cut[:, 0] = False
    drop = torch.empty_like(cut).scatter_(1, order, cut)
    probs = torch.softmax(x.masked_fill(drop, float("-inf")), -1)
    onehot = torch.zeros_like(probs).scatter_(1, logits.float().argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


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
