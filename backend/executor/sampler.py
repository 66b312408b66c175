"""Next-token sampling on tensors: logits [N, V] and a `SamplingInput` in, a `SamplerOutput` out (vLLM semantics).

Order: penalties (repetition on prompt + output tokens, then frequency / presence on output counts), min_tokens
(EOS and stop ids suppressed), then greedy argmax, or temperature -> min_p -> top_k -> top_p and a draw.
Logprobs are those of the raw model distribution (vLLM V1 "raw_logprobs"): the sampled token's, plus the top-n.

The draw is a Gumbel-max over a counter-based generator (kernels/sampling.py): the uniform of (row, token) is a hash
of the request's seed, the position being sampled and the token id. So a request's tokens depend on its seed alone,
whatever else is in the batch, a recomputed (preempted) sequence draws the same tokens again, and nothing here keeps
state between steps or synchronises with the host (it can run inside a CUDA graph). On CUDA, steps whose rows are
all greedy or temperature-only sample in one kernel pass over the logits (`sample_simple`, the same tokens).
"""
from __future__ import annotations

import torch

from m3serve.step_io import SamplerOutput, SamplingInput
from m3serve.kernels.sampling import inverse_temperature, sample_simple, uniforms


def apply_penalties(logits: torch.Tensor, s: SamplingInput) -> torch.Tensor:
    """In place: repetition (prompt + output tokens), then frequency and presence (output counts)."""
    if s.output_token_ids is None:
        return logits
    n, v = logits.shape
    out = s.output_token_ids
    counts = torch.zeros(n, v + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, torch.where(out >= 0, out, v), torch.ones_like(out, dtype=logits.dtype))
    counts = counts[:, :v]
    if s.repetition_penalty is not None:
        seen = counts > 0
        if s.prompt_token_ids is not None:
            p = s.prompt_token_ids
            seen_p = torch.zeros(n, v + 1, dtype=torch.bool, device=logits.device)
            seen_p.scatter_(1, torch.where(p >= 0, p, v), True)
            seen = seen | seen_p[:, :v]
        rp = s.repetition_penalty[:, None]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits))
    if s.frequency_penalty is not None:
        logits -= s.frequency_penalty[:, None] * counts
    if s.presence_penalty is not None:
        logits -= s.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_suppression(logits: torch.Tensor, s: SamplingInput) -> torch.Tensor:
    """In place: -inf at the ids a row may not produce yet (min_tokens)."""
    if s.suppress_token_ids is not None:
        ids = s.suppress_token_ids
        v = logits.shape[1]
        pad = torch.full((logits.shape[0], 1), float("-inf"), dtype=logits.dtype, device=logits.device)
        masked = torch.cat([logits, pad], 1)
        masked.scatter_(1, torch.where((ids >= 0) & (ids < v), ids, v), float("-inf"))
        logits.copy_(masked[:, :v])
    return logits


def filter_logits(x: torch.Tensor, s: SamplingInput) -> torch.Tensor:
    """Row-wise temperature, min_p, top_k (0 = off), top_p (1 = off) -> masked scaled logits (greedy rows are
    scaled by 1: their draw is replaced by the argmax anyway)."""
    x = x * inverse_temperature(s.temperature)[:, None]
    if s.needs_min_p:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < s.min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    if s.needs_top_k or s.needs_top_p:
        sorted_x, order = x.sort(-1, descending=True)
        rank = torch.arange(x.shape[1], device=x.device)[None, :]
        k = torch.where(s.top_k > 0, s.top_k, x.shape[1])
        drop = rank >= k[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_x, -1)
        # drop a token when the mass strictly before it already reaches top_p (the first is always kept)
        before = probs.cumsum(-1) - probs
        drop = drop | (before >= s.top_p[:, None])
        drop[:, 0] = False
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


class Sampler:
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, s: SamplingInput) -> SamplerOutput:
        """`logits` fp32 [N, V], one row per sampling row of `s` (modified in place)."""
        if logits.is_cuda and s.is_simple:
            return SamplerOutput(*sample_simple(logits, s.temperature, s.seeds, s.positions))
        raw_logprobs = torch.log_softmax(logits, -1)
        logits = apply_suppression(apply_penalties(logits, s), s)
        tokens = logits.argmax(-1)
        if not s.all_greedy:
            x = filter_logits(logits, s)
            gumbel = -torch.log(-torch.log(uniforms(s.seeds, s.positions, x.shape[1])))
            drawn = (x + gumbel).argmax(-1)
            tokens = torch.where(s.temperature < SamplingInput.GREEDY_EPS, tokens, drawn)
        out = SamplerOutput(tokens, raw_logprobs.gather(1, tokens[:, None])[:, 0])
        if s.max_num_logprobs > 0:
            out.top_logprobs, out.top_token_ids = raw_logprobs.topk(s.max_num_logprobs, dim=-1)
        return out
