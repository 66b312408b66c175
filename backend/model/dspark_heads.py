"""The DSpark draft's two small heads (design/dspark.md 1.5, 1.6).

Markov head: the logit bias `B_k(x_{k-1})` added to the backbone's base logits `U_k`, so draft token k
is conditioned on the *sampled* token k-1 (semi-autoregressive). Types:
  vanilla  B_k = W2 W1[x_{k-1}]                               (W1 `markov_w1` [V, r], W2 `markov_w2` [V, r])
  gated    B_k = W2 (sigmoid(gate_proj [h_k ; W1[x_{k-1}]]) * W1[x_{k-1}])
  rnn      z = [s_{k-1} ; W1[x_{k-1}] ; h_k] -> joint_proj -> gate | cand | out;
           s_k = sig(gate) s_{k-1} + (1 - sig(gate)) tanh(cand);  B_k = W2 tanh(out);  s_0 = 0
`position` is one draft position of the sequential sampling loop; `block` the same bias teacher-forced over a block
(what training computes): both give the same numbers for the same previous tokens.

Confidence head: c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b) (or w . h_k + b without the Markov features),
in fp32; it reads x_{k-1}, never x_k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _frozen(*modules: nn.Module) -> None:
    for m in modules:
        m.requires_grad_(False)


class MarkovHead(nn.Module):
    def __init__(self, kind: str, vocab_size: int, rank: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank, dtype=dtype)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False, dtype=dtype)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank, dtype=dtype)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, dtype=dtype)
        elif kind != "vanilla":
            raise ValueError(f"unknown Markov head type {kind!r}")
        _frozen(self)

    def prev_embedding(self, prev: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [..., r]."""
        return self.markov_w1(prev)

    def init_state(self, h: torch.Tensor) -> torch.Tensor:
        """The recurrent state s_0 = 0 [S, r] (used by the rnn type only)."""
        return h.new_zeros(h.shape[0], self.rank)

    def position(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [S, H] (block hidden of slot k), prev [S] -> (bias fp32 [S, V], W1[prev] [S, r], next state)."""
        e = self.prev_embedding(prev)
        if self.kind == "vanilla":
            latent = e
        elif self.kind == "gated":
            latent = torch.sigmoid(self.gate_proj(torch.cat([h.to(e.dtype), e], -1))) * e
        else:
            gate, cand, out = self.joint_proj(torch.cat([state, e, h.to(e.dtype)], -1)).chunk(3, -1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1.0 - gate) * torch.tanh(cand)
            latent = torch.tanh(out)
        return self.markov_w2(latent).float(), e, state

    def block(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced bias over a block: h [S, K, H], prev [S, K] = [x0, x1..x_{K-1}] -> fp32 [S, K, V]."""
        if self.kind != "rnn":
            flat = self.position(h.flatten(0, 1), prev.flatten(), h.new_zeros(0))[0]
            return flat.view(*prev.shape, -1)
        state, out = self.init_state(h), []
        for k in range(prev.shape[1]):
            bias, _, state = self.position(h[:, k], prev[:, k], state)
            out.append(bias)
        return torch.stack(out, 1)


class ConfidenceHead(nn.Module):
    """P(x_k accepted | x_1..x_{k-1} accepted), from [h_k ; W1[x_{k-1}]]; parameters and math in fp32."""

    def __init__(self, hidden_size: int, markov_rank: int = 0):
        super().__init__()
        self.with_markov = markov_rank > 0
        self.proj = nn.Linear(hidden_size + markov_rank, 1, dtype=torch.float32)
        _frozen(self)

    def forward(self, h: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        """h [..., H], prev_embedding W1[x_{k-1}] [..., r] (read only with the Markov features) ->
        confidence in (0, 1), fp32 [...]."""
        x = torch.cat([h.float(), prev_embedding.float()], -1) if self.with_markov else h.float()
        return torch.sigmoid(F.linear(x, self.proj.weight.float(), self.proj.bias.float())[..., 0])
