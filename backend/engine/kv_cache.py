"""The page pool: per layer K/V pages (and indexer-key pages on sparse layers) in the cache dtype.

Layout (the kernels depend on it; architecture.md "Paged cache layout"), P pages of B tokens:
  k_data[l], v_data[l]    bf16 / fp32 / fp8 e4m3 [P, H_kv, B, D]  |  nvfp4: uint8 [P, H_kv, B, D/2]
  k_scale_blocks[l], ...  nvfp4: e4m3 [P, H_kv, B, D/16], else None
  k_scale[l], v_scale[l]  per-layer fp32 scale (checkpoint k_scale / v_scale, else 1.0)
  idx_data[l]             [P, B, D_idx] | uint8 [P, B, D_idx/2]; idx_scale_blocks[l], idx_scale[l]
                          (None on full-attention layers)
A token at position p of a sequence lives at slot `page_table[p // B] * B + p % B`.
`PagedKVCache` is also an `AttentionCache`: `store` writes through `batch.extra["slot_mapping"]`,
`load` gathers the sequence's pages through `batch.extra["block_tables"]` and dequantizes.
"""
from __future__ import annotations

import logging
import math

import torch

from m3serve.config import ConfigError, ModelConfig
from m3serve.model.kv_codec import KVCodec

log = logging.getLogger(__name__)

KV_DTYPES = ("float32", "bfloat16", "float16", "fp8", "nvfp4")
_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}
_ELEM_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1.0 / 16}
CPU_DEFAULT_CACHE_BYTES = 256 << 20


def page_bytes(cfg: ModelConfig, kv_dtype: str, index_dtype: str) -> int:
    """Bytes of one page over all layers (K, V, indexer keys, block scales)."""
    b = cfg.index_block_size
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * b * cfg.head_dim * _ELEM_BYTES[kv_dtype]
    idx = cfg.num_sparse_layers * b * cfg.index_head_dim * _ELEM_BYTES[index_dtype]
    return int(math.ceil(kv + idx))


def activation_reserve_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Heuristic headroom for one step's activations (not profiled): ~64 hidden-sized bf16 buffers per
    batched token, plus fp32 logits and sampling work space per sequence, at least 1 GiB."""
    act = max_num_batched_tokens * cfg.hidden_size * 2 * 64
    logits = max_num_seqs * cfg.vocab_size * 4 * 4
    return max(1 << 30, act + logits)


def determine_num_pages(cfg: ModelConfig, kv_dtype: str, index_dtype: str, device: torch.device, *,
                        gpu_memory_utilization: float, num_gpu_blocks_override: int | None,
                        max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    per_page = page_bytes(cfg, kv_dtype, index_dtype)
    per_seq = math.ceil(max_model_len / cfg.index_block_size)
    if num_gpu_blocks_override is not None:
        pages, how = int(num_gpu_blocks_override), "num_gpu_blocks_override"
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights, this process's allocations, other processes
        budget = total * gpu_memory_utilization - used - activation_reserve_bytes(
            cfg, max_num_batched_tokens, max_num_seqs)
        pages = max(int(budget // per_page), 0)
        how = (f"{total / 2**30:.1f} GiB x {gpu_memory_utilization} - {used / 2**30:.1f} GiB in use "
               f"- activation reserve")
        cap = 4 * per_seq * max_num_seqs  # more could never be used, even as prefix cache (small models)
        if pages > cap:
            pages, how = cap, how + f", capped at 4 x max_num_seqs x pages per sequence"
    else:
        pages = max(per_seq, min(CPU_DEFAULT_CACHE_BYTES // per_page, per_seq * max_num_seqs))
        how = "CPU default"
    if pages < per_seq:
        raise ConfigError(
            f"the KV cache has room for {pages} pages ({pages * cfg.index_block_size} tokens, {how}), fewer than "
            f"one sequence of max_model_len={max_model_len} needs ({per_seq} pages): lower max_model_len, "
            f"raise gpu_memory_utilization or num_gpu_blocks_override, or use a smaller kv_cache_dtype")
    log.info("KV cache: %d pages of %d tokens (%s, %.1f MiB; kv %s, indexer %s); max concurrency at "
             "max_model_len=%d: %.2f sequences", pages, cfg.index_block_size, how, pages * per_page / 2**20,
             kv_dtype, index_dtype, max_model_len, pages / per_seq)
    return pages


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, kv_dtype: str, index_dtype: str,
                 device: torch.device | str = "cpu", kv_scales: dict[int, tuple[float, float]] | None = None,
                 index_scales: dict[int, float] | None = None):
        for name, dt in (("kv_cache_dtype", kv_dtype), ("indexer_kv_dtype", index_dtype)):
            if dt not in KV_DTYPES:
                raise ConfigError(f"{name} {dt!r} is not one of {KV_DTYPES}")
        self.kv_dtype, self.index_dtype = kv_dtype, index_dtype
        self.block_size, self.num_pages = cfg.index_block_size, num_pages
        self.num_layers = cfg.num_hidden_layers
        self.device = torch.device(device)
        kv_scales, index_scales = kv_scales or {}, index_scales or {}
        P, H, B, D, Di = num_pages, cfg.num_key_value_heads, self.block_size, cfg.head_dim, cfg.index_head_dim
        self.k_data, self.v_data, self.k_scale_blocks, self.v_scale_blocks = [], [], [], []
        self.k_scale, self.v_scale = [], []
        self.idx_data, self.idx_scale_blocks, self.idx_scale = [], [], []
        self._k_codec, self._v_codec, self._idx_codec = [], [], []
        for layer in range(self.num_layers):
            ks, vs = kv_scales.get(layer, (1.0, 1.0))
            for data, blocks, scales, codecs, s in ((self.k_data, self.k_scale_blocks, self.k_scale, self._k_codec, ks),
                                                    (self.v_data, self.v_scale_blocks, self.v_scale, self._v_codec, vs)):
                d, sb = self._alloc(kv_dtype, (P, H, B), D)
                data.append(d), blocks.append(sb), scales.append(float(s)), codecs.append(KVCodec(kv_dtype, s))
            if cfg.is_sparse_attention(layer):
                s = float(index_scales.get(layer, 1.0))
                d, sb = self._alloc(index_dtype, (P, B), Di)
                self.idx_data.append(d), self.idx_scale_blocks.append(sb), self.idx_scale.append(s)
                self._idx_codec.append(KVCodec(index_dtype, s))
            else:
                self.idx_data.append(None), self.idx_scale_blocks.append(None), self.idx_scale.append(None)
                self._idx_codec.append(None)

    def _alloc(self, dtype: str, lead: tuple[int, ...], dim: int):
        if dtype == "nvfp4":
            return (torch.zeros(*lead, dim // 2, dtype=torch.uint8, device=self.device),
                    torch.zeros(*lead, dim // 16, dtype=torch.float8_e4m3fn, device=self.device))
        return torch.zeros(*lead, dim, dtype=_STORAGE[dtype], device=self.device), None

    @property
    def nbytes(self) -> int:
        ts = self.k_data + self.v_data + self.k_scale_blocks + self.v_scale_blocks + self.idx_data + self.idx_scale_blocks
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    # ---- writes ------------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              ik: torch.Tensor | None) -> None:
        """Quantize and write K/V [t, H_kv, D] and index keys [t, D_idx] at `slots` (int64 [t])."""
        page, off = slots // self.block_size, slots % self.block_size
        for data, blocks, codec, x in ((self.k_data, self.k_scale_blocks, self._k_codec, k),
                                       (self.v_data, self.v_scale_blocks, self._v_codec, v)):
            parts = codec[layer].encode(x)
            data[layer][page, :, off] = parts[0]
            if len(parts) > 1:
                blocks[layer][page, :, off] = parts[1]
        if ik is not None and self.idx_data[layer] is not None:
            parts = self._idx_codec[layer].encode(ik)
            self.idx_data[layer][page, off] = parts[0]
            if len(parts) > 1:
                self.idx_scale_blocks[layer][page, off] = parts[1]

    # ---- reads -------------------------------------------------------------------------------------
    def gather(self, layer: int, pages: torch.Tensor, length: int):
        """Dequantized K, V [length, H_kv, D] (fp32) and IK [length, D_idx] of the tokens in `pages`."""

        def kv(data, blocks, codec):
            parts = [t[pages].transpose(1, 2).flatten(0, 1)[:length] for t in (data, blocks) if t is not None]
            return codec.decode(tuple(parts))

        k = kv(self.k_data[layer], self.k_scale_blocks[layer], self._k_codec[layer])
        v = kv(self.v_data[layer], self.v_scale_blocks[layer], self._v_codec[layer])
        ik = None
        if self.idx_data[layer] is not None:
            parts = [t[pages].flatten(0, 1)[:length] for t in (self.idx_data[layer], self.idx_scale_blocks[layer])
                     if t is not None]
            ik = self._idx_codec[layer].decode(tuple(parts))
        return k, v, ik

    # ---- the AttentionCache protocol ---------------------------------------------------------------
    def store(self, layer, seq, batch, k, v, ik) -> None:
        qsl = batch.query_start_loc
        self.write(layer, batch.extra["slot_mapping"][qsl[seq]:qsl[seq + 1]], k, v, ik)

    def load(self, layer, seq, batch):
        length = batch.extra["seq_lens_cpu"][seq]
        pages = batch.extra["block_tables"][seq, :-(-length // self.block_size)].long()
        return self.gather(layer, pages, length)
