"""The Triton kernel attention backend over one layer's pages (`M3ForCausalLM.bind_kv_cache` binds one to each
layer on CUDA, once, when the page pool is allocated).

Same protocol as `attention.TorchAttention`: `forward(q, k, v, iq, ik, step)`, and
`forward_packed(qkv, attn, cos, sin, step)`, which the model calls instead once its projections are
fused (`packed_qkv`): from the one QKV GEMM's output, one launch norms and rotates q / k / index q / index key
and quantizes K, V and the index key into the layer's pages (`qkv_insert`). `forward` does the insert alone
(`kv_insert`). Then on sparse layers the indexer (block scores + top-k over the layer's index pages), then
block-sparse attention. Decode steps (every sequence has exactly one new token) use the decode kernels
(split-K); any other step uses the prefill kernels (query tiles, causal by position), which also cover decode
sequences mixed into a prefill step. `plan(step)` makes the prefill tile maps once per step (every layer shares
them: the model calls it before the layers). Which kernel runs, and its launch parameters, is the kernels' own
choice (`m3serve.kernels.dispatch`).
"""
from __future__ import annotations

import torch

from m3serve.step_io import StepInput
from m3serve.model.kv_cache import LayerKVCache
from m3serve.kernels.dispatch import attention_block_t, index_block_t, prefill_tiles
from m3serve.kernels.indexer import indexer_decode, indexer_prefill
from m3serve.kernels.kv_insert import kv_insert
from m3serve.kernels.msa_attention import msa_decode, msa_prefill
from m3serve.kernels.qkv_insert import QKVLayout, qkv_insert
from m3serve.model.layers.attention import AttentionGeometry


class TritonAttention:
    packed_qkv = True  # takes the fused projection output (forward_packed)

    def __init__(self, geometry: AttentionGeometry, cache: LayerKVCache, num_q_heads: int, num_index_heads: int):
        if cache.block_size != geometry.block_size:
            raise ValueError(f"cache pages hold {cache.block_size} tokens, the indexer block is {geometry.block_size}")
        self.geometry, self.cache = geometry, cache
        self.group = num_q_heads // cache.k.shape[1]  # query heads per KV head
        self.index_heads = num_index_heads

    def plan(self, step: StepInput) -> None:
        """The prefill tile maps of this step (decode steps need none)."""
        if step.is_decode:
            return
        qsl, dev = step.query_start_loc_cpu, step.positions.device
        step.attn_tiles = prefill_tiles(qsl, attention_block_t(self.group), dev)
        if self.index_heads:
            step.index_tiles = prefill_tiles(qsl, index_block_t(self.index_heads), dev)
            sparse_t = attention_block_t(self.group, sparse=True)
            if sparse_t != attention_block_t(self.group):
                step.sparse_tiles = prefill_tiles(qsl, sparse_t, dev)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor | None,
                ik: torch.Tensor | None, step: StepInput) -> torch.Tensor:
        c = self.cache
        sparse = iq is not None and c.has_index
        kv_insert(k, v, step.slot_mapping, c, ik=ik if sparse else None)
        return self._attend(c, q, iq if sparse else None, step)

    def forward_packed(self, qkv: torch.Tensor, attn, cos: torch.Tensor, sin: torch.Tensor,
                       step: StepInput) -> torch.Tensor:
        """qkv: the fused projection output of `attn` (an `m3.Attention`); cos/sin ``[T, rotary_dim]``."""
        ix, c = attn.indexer, self.cache
        sparse = ix is not None and c.has_index
        layout = QKVLayout(attn.n_heads, attn.n_kv, attn.head_dim, attn.rotary_dim,
                           ix.n_heads if sparse else 0, ix.head_dim if sparse else 0)
        if not sparse and ix is not None:
            qkv = qkv[:, :layout.width]  # a cache without index pages: the index columns go unused
        q, iq = qkv_insert(qkv, layout, attn.norm_weights, attn.eps, cos, sin, step.slot_mapping, c)
        return self._attend(c, q, iq, step)

    def _attend(self, c: LayerKVCache, q: torch.Tensor, iq: torch.Tensor | None, step: StepInput) -> torch.Tensor:
        """Indexer (when iq is given) and block-sparse attention over the pages the new tokens are already in."""
        sp = self.geometry
        bt, seq_lens = step.block_tables, step.seq_lens
        q = q.contiguous()
        block_ids = pages = None
        if step.is_decode:
            if iq is not None:
                block_ids, pages = indexer_decode(iq.contiguous(), c, bt, seq_lens, sp.topk, sp.local_blocks,
                                                  return_pages=True)
            return msa_decode(q, c, bt, seq_lens, sp.scale, block_ids, block_pages=pages)
        if step.attn_tiles is None:
            self.plan(step)
        qsl, pos = step.query_start_loc_cpu, step.positions
        if iq is not None:
            block_ids = indexer_prefill(iq.contiguous(), c, bt, qsl, pos, sp.topk, sp.local_blocks,
                                        tiles=step.index_tiles)
        tiles = step.sparse_tiles if block_ids is not None and step.sparse_tiles is not None else step.attn_tiles
        return msa_prefill(q, c, bt, qsl, pos, sp.scale, block_ids, tiles=tiles, seq_lens_cpu=step.seq_lens_cpu)
