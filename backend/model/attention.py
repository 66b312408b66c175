"""The attention interface between the model and whoever owns the KV cache.

The model computes q, k, v (QK-normed, RoPE'd) and, on sparse layers, the index query/key; the
`ForwardBatch` says which tokens belong to which sequence and carries the cache. `TorchAttention`
is the reference backend: store the new K/V/index-key through the cache, read the sequence's whole
history back (dequantized), run the indexer and the block-sparse attention references. The engine
can page the cache (any object with `store`/`load`) or swap in a kernel backend.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from m3serve.kernels.indexer import indexer_topk_ref
from m3serve.kernels.msa_attention import msa_attention_ref


class AttentionCache(Protocol):
    def store(self, layer: int, seq: int, batch: "ForwardBatch", k: torch.Tensor, v: torch.Tensor,
              ik: torch.Tensor | None) -> None:
        """Write the new tokens' K [t, H_kv, D], V, index key [t, D_idx] of batch sequence `seq`."""

    def load(self, layer: int, seq: int, batch: "ForwardBatch"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Return the whole history (dequantized) of batch sequence `seq`: K [L, H_kv, D], V, IK [L, D_idx]."""


@dataclass
class ForwardBatch:
    """Step metadata, built once per step and shared by every layer."""

    positions: torch.Tensor  # [T] absolute position of every token of the step
    query_start_loc: list[int]  # S + 1 offsets: sequence s owns tokens [qsl[s], qsl[s+1])
    cache: Any  # an AttentionCache
    backend: Any = None  # an attention backend; None = TorchAttention
    extra: dict = field(default_factory=dict)  # backend-specific metadata (block tables, slot mapping)

    @property
    def num_seqs(self) -> int:
        return len(self.query_start_loc) - 1


class TorchAttention:
    """Reference attention over any AttentionCache (runs anywhere, used on CPU and in tests)."""

    def __init__(self, block_size: int, topk: int, local_blocks: int, scale: float):
        self.block_size, self.topk, self.local_blocks, self.scale = block_size, topk, local_blocks, scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                iq: torch.Tensor | None, ik: torch.Tensor | None, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        qsl = batch.query_start_loc
        for s in range(batch.num_seqs):
            sl = slice(qsl[s], qsl[s + 1])
            if sl.start == sl.stop:
                continue
            batch.cache.store(layer, s, batch, k[sl], v[sl], None if ik is None else ik[sl])
            keys, values, index_keys = batch.cache.load(layer, s, batch)
            pos = batch.positions[sl]
            block_ids = None
            if iq is not None:
                block_ids = indexer_topk_ref(iq[sl], index_keys, pos, self.block_size, self.topk,
                                             self.local_blocks)
            out[sl] = msa_attention_ref(q[sl], keys.to(q.dtype), values.to(q.dtype), pos, self.scale,
                                        block_ids, self.block_size)
        return out
