"""The attention seam between the model and its KV cache.

The model computes q, k, v (QK-normed, RoPE'd) and, on sparse layers, the index query/key; the
`StepInput` says which tokens belong to which sequence. An attention backend is built over ONE layer's cache
(its K/V pages and, on sparse layers, the indexer's key pages) and bound to that layer once, when the cache is
allocated (`M3ForCausalLM.bind_kv_cache`): it stores the new K/V/index keys and attends. `TorchAttention` here
is the reference (any `AttentionCache`: store the new rows, read the sequence's whole history back
dequantized, run the indexer and block-sparse attention references); `triton_attention.TritonAttention` runs
the kernels over the layer's pages.

Backend protocol: `cache` (the layer's cache), `forward(q, k, v, iq, ik, step) -> out [T, H_q, D]`; optionally
`packed_qkv = True` and `forward_packed(qkv, attn, cos, sin, step)` (norm + RoPE + insert from the fused
projection output); optionally `plan(step)` (per-step metadata every layer shares, made once per step before
the layers by `M3ForCausalLM.plan`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from m3serve.config import ModelConfig
from m3serve.step_io import StepInput
from m3serve.kernels.indexer import indexer_topk_ref
from m3serve.kernels.msa_attention import msa_attention_ref


@dataclass(frozen=True)
class AttentionGeometry:
    """What every attention backend needs to know of the model."""

    block_size: int  # tokens per MSA block = per KV page
    topk: int  # blocks the indexer selects
    local_blocks: int  # the query's own (most recent) blocks always kept
    scale: float  # softmax scale

    @classmethod
    def of(cls, cfg: ModelConfig) -> "AttentionGeometry":
        return cls(cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks, cfg.head_dim ** -0.5)


class AttentionCache(Protocol):
    """One layer's cache as the reference attention uses it."""

    def store(self, seq: int, step: StepInput, k: torch.Tensor, v: torch.Tensor, ik: torch.Tensor | None) -> None:
        """Write the new tokens' K [t, H_kv, D], V, index key [t, D_idx] of step sequence `seq`."""

    def load(self, seq: int, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Return the whole history (dequantized) of step sequence `seq`: K [L, H_kv, D], V, IK [L, D_idx]."""


class TorchAttention:
    """Reference attention over one layer's AttentionCache (runs anywhere, used on CPU and in tests)."""

    def __init__(self, geometry: AttentionGeometry, cache: AttentionCache):
        self.geometry, self.cache = geometry, cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                iq: torch.Tensor | None, ik: torch.Tensor | None, step: StepInput) -> torch.Tensor:
        out = torch.empty_like(q)
        qsl, sp = step.query_start_loc_cpu, self.geometry
        for s in range(step.num_seqs):
            sl = slice(qsl[s], qsl[s + 1])
            if sl.start == sl.stop:
                continue
            self.cache.store(s, step, k[sl], v[sl], None if ik is None else ik[sl])
            keys, values, index_keys = self.cache.load(s, step)
            pos = step.positions[sl]
            block_ids = None
            if iq is not None:
                block_ids = indexer_topk_ref(iq[sl], index_keys, pos, sp.block_size, sp.topk, sp.local_blocks)
            out[sl] = msa_attention_ref(q[sl], keys.to(q.dtype), values.to(q.dtype), pos, sp.scale,
                                        block_ids, sp.block_size)
        return out
