"""The Triton kernel attention backend over the paged cache (the engine selects it on CUDA).

Same interface as `m3serve.model.attention.TorchAttention`: `forward(layer, q, k, v, iq, ik, batch)`, and
`forward_packed(layer, qkv, attn, cos, sin, batch)`, which the model calls instead once its projections are
fused (`packed_qkv`): from the one QKV GEMM's output, one launch norms and rotates q / k / index q / index key
and quantizes K, V and the index key into their pages (`qkv_insert`). `forward` does the insert alone
(`kv_insert`). Then on sparse layers the indexer (block scores + top-k), then block-sparse attention. Steps where every
sequence has exactly one new token use the decode kernels (split-K); any other step uses the prefill
kernels (query tiles, causal by position), which also cover decode sequences mixed into a prefill step.

Reads from `batch.extra`: `cache` (a PagedKVCache; falls back to `batch.cache`), `block_tables`,
`seq_lens`, `slot_mapping`. Per-step tile maps are built once and kept in `batch.extra`.
"""
from __future__ import annotations

import torch

from m3serve.kernels.indexer import indexer_block_t, indexer_decode, indexer_prefill
from m3serve.kernels.kv_insert import kv_insert
from m3serve.kernels.msa_attention import msa_decode, msa_prefill, prefill_block_t
from m3serve.kernels.qkv_insert import QKVLayout, qkv_insert
from m3serve.kernels.triton_utils import prefill_tiles

_META = "_triton_attention_meta"


class TritonAttention:
    packed_qkv = True  # takes the fused projection output (forward_packed)

    def __init__(self, block_size: int, topk: int, local_blocks: int, scale: float):
        self.block_size, self.topk, self.local_blocks, self.scale = block_size, topk, local_blocks, scale

    def _step_meta(self, batch, q: torch.Tensor, iq: torch.Tensor | None) -> dict:
        """Decode flag and prefill tile maps, computed once per step (every layer shares them)."""
        meta = batch.extra.get(_META)
        if meta is None:
            qsl = batch.query_start_loc
            meta = {"decode": all(qsl[i + 1] - qsl[i] == 1 for i in range(len(qsl) - 1))}
            batch.extra[_META] = meta
        if not meta["decode"]:
            if "attn_tiles" not in meta:
                g = q.shape[1] // self._cache(batch).k_data[0].shape[1]
                meta["attn_block_t"] = prefill_block_t(g)
                meta["attn_tiles"] = prefill_tiles(batch.query_start_loc, meta["attn_block_t"], q.device)
            if iq is not None and "idx_tiles" not in meta:
                meta["idx_block_t"] = indexer_block_t(iq.shape[1])
                meta["idx_tiles"] = prefill_tiles(batch.query_start_loc, meta["idx_block_t"], q.device)
        return meta

    @staticmethod
    def _cache(batch):
        return batch.extra.get("cache", batch.cache)

    def _check(self, cache, layer: int, sparse_model: bool) -> bool:
        if cache.block_size != self.block_size:
            raise ValueError(f"cache pages hold {cache.block_size} tokens, the indexer block is {self.block_size}")
        return sparse_model and cache.idx_data[layer] is not None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                iq: torch.Tensor | None, ik: torch.Tensor | None, batch) -> torch.Tensor:
        cache = self._cache(batch)
        sparse = self._check(cache, layer, iq is not None)
        kv_insert(k, v, batch.extra["slot_mapping"], cache.k_data[layer], cache.v_data[layer],
                  cache.k_scale_blocks[layer], cache.v_scale_blocks[layer], cache.k_scale[layer], cache.v_scale[layer],
                  ik=ik if sparse else None, idx_data=cache.idx_data[layer] if sparse else None,
                  idx_scale_blocks=cache.idx_scale_blocks[layer] if sparse else None,
                  idx_scale=cache.idx_scale[layer] if sparse else 1.0)
        return self._attend(layer, q, iq if sparse else None, batch)

    def forward_packed(self, layer: int, qkv: torch.Tensor, attn, cos: torch.Tensor, sin: torch.Tensor,
                       batch) -> torch.Tensor:
        """qkv: the fused projection output of `attn` (an `m3.Attention`); cos/sin ``[T, rotary_dim]``."""
        cache = self._cache(batch)
        sparse = self._check(cache, layer, attn.indexer is not None)
        ix = attn.indexer
        layout = QKVLayout(attn.n_heads, attn.n_kv, attn.head_dim, attn.rotary_dim,
                           ix.n_heads if sparse else 0, ix.head_dim if sparse else 0)
        if not sparse and ix is not None:
            qkv = qkv[:, :layout.width]  # a cache without index pages: the index columns go unused
        q, iq = qkv_insert(qkv, layout, attn.norm_weights, attn.eps, cos, sin, batch.extra["slot_mapping"],
                           cache.k_data[layer], cache.v_data[layer], cache.k_scale_blocks[layer],
                           cache.v_scale_blocks[layer], cache.k_scale[layer], cache.v_scale[layer],
                           idx_data=cache.idx_data[layer], idx_scale_blocks=cache.idx_scale_blocks[layer],
                           idx_scale=cache.idx_scale[layer])
        return self._attend(layer, q, iq, batch)

    def _attend(self, layer: int, q: torch.Tensor, iq: torch.Tensor | None, batch) -> torch.Tensor:
        """Indexer (when iq is given) and block-sparse attention over the pages the new tokens are already in."""
        cache, ex = self._cache(batch), batch.extra
        kd, vd = cache.k_data[layer], cache.v_data[layer]
        ksb, vsb = cache.k_scale_blocks[layer], cache.v_scale_blocks[layer]
        k_scale, v_scale = cache.k_scale[layer], cache.v_scale[layer]
        bt, seq_lens = ex["block_tables"], ex["seq_lens"]
        meta = self._step_meta(batch, q, iq)
        q = q.contiguous()
        block_ids = pages = None
        if meta["decode"]:
            if iq is not None:
                block_ids, pages = indexer_decode(iq.contiguous(), cache.idx_data[layer], cache.idx_scale_blocks[layer],
                                                  cache.idx_scale[layer], bt, seq_lens, self.topk, self.local_blocks,
                                                  return_pages=True)
            return msa_decode(q, kd, vd, ksb, vsb, k_scale, v_scale, bt, seq_lens, self.scale, block_ids,
                              block_pages=pages)
        qsl, pos = batch.query_start_loc, batch.positions
        if iq is not None:
            block_ids = indexer_prefill(iq.contiguous(), cache.idx_data[layer], cache.idx_scale_blocks[layer],
                                        cache.idx_scale[layer], bt, qsl, pos, self.topk, self.local_blocks,
                                        block_t=meta["idx_block_t"], tiles=meta["idx_tiles"])
        return msa_prefill(q, kd, vd, ksb, vsb, k_scale, v_scale, bt, qsl, pos, self.scale, block_ids,
                           block_t=meta["attn_block_t"], tiles=meta["attn_tiles"])
