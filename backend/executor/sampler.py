"""Next-token sampling for a batch of sequences, each with its own `SamplingParams` (vLLM semantics).

Order: penalties (repetition on prompt + output tokens, then frequency / presence on output counts),
min_tokens (EOS and stop ids masked until reached), then greedy argmax, or temperature -> min_p ->
top_k -> top_p and a draw with the request's own `torch.Generator` (seeded requests give the same
tokens whatever else is in the batch). Logprobs are those of the raw model distribution (vLLM V1
"raw_logprobs"): the sampled token's plus the top-n.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # raw logprob of the sampled token
    top_logprobs: dict[int, float] | None = None  # sampled + top-n, when logprobs were asked for


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    for row, seq in enumerate(seqs):
        sp = seq.sampling_params
        if sp.repetition_penalty == 1.0 and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0:
            continue
        x = logits[row]
        vocab = x.shape[0]
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=x.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(x.dtype)
        if sp.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=x.device)] = True
            rp = sp.repetition_penalty
            x[:] = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(x.dtype)
    return logits


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int]) -> torch.Tensor:
    for row, seq in enumerate(seqs):
        sp = seq.sampling_params
        if seq.num_output_tokens < sp.min_tokens:
            ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos_ids)
            ids = [i for i in ids if i < logits.shape[1]]
            if ids:
                logits[row, ids] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Row-wise temperature, min_p, top_k (0 = off), top_p (1 = off) -> masked scaled logits."""
    x = logits / temperature[:, None]
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_x, order = x.sort(-1, descending=True)
        rank = torch.arange(x.shape[1], device=x.device)[None, :]
        k = torch.where(top_k > 0, top_k, x.shape[1])
        drop = rank >= k[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_x, -1)
        # drop a token when the mass strictly before it already reaches top_p (the first is always kept)
        before = probs.cumsum(-1) - probs
        drop = drop | (before >= top_p[:, None])
        drop[:, 0] = False
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_ids = eos_token_ids  # shared with the engine (a set)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """`logits` fp32 [N, V], one row per sequence of `seqs`."""
        raw_logprobs = torch.log_softmax(logits, -1)
        logits = apply_min_tokens(apply_penalties(logits.clone(), seqs), seqs, self.eos_ids)
        tokens = logits.argmax(-1)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.sampling_params.greedy]
        if sampled_rows:
            dev = logits.device
            sps = [seqs[i].sampling_params for i in sampled_rows]
            x = filter_logits(
                logits[sampled_rows],
                torch.tensor([sp.temperature for sp in sps], device=dev, dtype=logits.dtype),
                torch.tensor([max(sp.top_k, 0) for sp in sps], device=dev),
                torch.tensor([sp.top_p for sp in sps], device=dev, dtype=logits.dtype),
                torch.tensor([sp.min_p for sp in sps], device=dev, dtype=logits.dtype))
            probs = torch.softmax(x, -1)
            # exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i
            noise = torch.stack([torch.empty(x.shape[1], device=dev).exponential_(generator=seqs[i].generator)
                                 for i in sampled_rows])
            tokens[sampled_rows] = (probs / noise).argmax(-1)
        token_list = tokens.tolist()
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        out = []
        for row, (seq, tok, lp) in enumerate(zip(seqs, token_list, chosen)):
            n = seq.sampling_params.logprobs
            top = None
            if n is not None:
                top = {tok: lp}
                if n > 0:
                    vals, ids = raw_logprobs[row].topk(n)
                    top.update(zip(ids.tolist(), vals.tolist()))
            out.append(SampledToken(tok, lp, top))
        return out
