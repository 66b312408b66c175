"""The randomness of a speculative step: counter-based uniforms, one independent stream per use, keyed by the
request's seed and the position of the step's first new token (its anchor's position + 1), like the sampler's
generator (executor/sampler.py). So a request's draws depend on its seed and its own progress only: never on the
rest of the batch, and a recomputed (preempted) sequence draws the same ones again.

Streams (32-bit tags XORed into the row key; all >= 2^24, above any token id, so none meets the sampler's
per-token Gumbel stream of the same position):
  DRAFT + j    slot j's draw of the draft token x_{j+1} (proposer)
  ACCEPT + j   the acceptance test of x_{j+1} (verifier)
  FINAL        the draw of the correction / bonus token (verifier)
Keying by the step's first position rather than by each token's own position gives every step a fresh set:
rule B's decision reads every u_i, so uniforms of positions past the accepted run must not be used again
by the next step (which starts inside that range).
"""
from __future__ import annotations

import torch

from m3serve.kernels.sampling import hash32, row_keys

DRAFT, ACCEPT, FINAL = 0x5D000000, 0x5E000000, 0x5F000000
MAX_VOCAB = 1 << 24


def stream_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int = 1) -> torch.Tensor:
    """fp32 [S, n] in (0, 1): stream `stream`'s uniforms number 0..n-1 of each row's (seed, position)."""
    tags = stream + torch.arange(n, device=seeds.device, dtype=torch.int64)
    h = hash32(row_keys(seeds, positions)[:, None] ^ tags[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
