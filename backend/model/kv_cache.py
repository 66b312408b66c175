"""The page pool: one `LayerKVCache` per layer (K/V pages, and indexer-key pages on sparse layers).

Layout (the kernels depend on it; architecture.md "Paged cache layout"), P pages of B tokens:
  k, v                  bf16 / fp32 / fp8 e4m3 [P, H_kv, B, D]  |  nvfp4: uint8 [P, H_kv, B, D/2]
  k_scale_blocks, ...   nvfp4: e4m3 [P, H_kv, B, D/16], else None
  k_scale, v_scale      per-layer fp32 scale (checkpoint k_scale / v_scale, else 1.0)
  index                 [P, B, D_idx] | uint8 [P, B, D_idx/2]; index_scale_blocks, index_scale
                        (None on full-attention layers)
A token at position p of a sequence lives at slot `page_table[p // B] * B + p % B`.
Each `LayerKVCache` is bound to its layer's attention once, when the pool is allocated
(`M3ForCausalLM.bind_kv_cache`); it is also an `AttentionCache` (the reference attention's): `store` writes
through the step's slot mapping, `load` gathers the sequence's pages through its block table and dequantizes.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from m3serve.config import CACHE_DTYPES, KV_BYTES_PER_ELEMENT, ConfigError, ModelConfig
from m3serve.step_io import StepInput
from m3serve.model.kv_codec import KVCodec

log = logging.getLogger(__name__)

_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}
CPU_DEFAULT_CACHE_BYTES = 256 << 20


def page_bytes(cfg: ModelConfig, kv_dtype: str, index_dtype: str, num_kv_heads: int | None = None) -> int:
    """Bytes of one page over all layers (K, V, indexer keys, block scales) for `num_kv_heads` KV heads (a
    tensor-parallel rank's; default all); the indexer keys are one head, on every rank."""
    b = cfg.index_block_size
    heads = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
    kv = cfg.num_hidden_layers * 2 * heads * b * cfg.head_dim * KV_BYTES_PER_ELEMENT[kv_dtype]
    idx = cfg.num_sparse_layers * b * cfg.index_head_dim * KV_BYTES_PER_ELEMENT[index_dtype]
    return int(math.ceil(kv + idx))


def activation_reserve_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Heuristic headroom for one step's activations (not profiled): ~64 hidden-sized bf16 buffers per
    batched token, plus fp32 logits and sampling work space per sequence, at least 1 GiB."""
    act = max_num_batched_tokens * cfg.hidden_size * 2 * 64
    logits = max_num_seqs * cfg.vocab_size * 4 * 4
    return max(1 << 30, act + logits)


def determine_num_pages(cfg: ModelConfig, kv_dtype: str, index_dtype: str, device: torch.device, *,
                        gpu_memory_utilization: float, num_gpu_blocks_override: int | None,
                        max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                        reserved_bytes: int = 0, num_kv_heads: int | None = None, extra_page_bytes: int = 0) -> int:
    """Pages the pool gets: what the device's memory allows under `gpu_memory_utilization` after the weights,
    the activation reserve and `reserved_bytes` (e.g. CUDA graph memory), or the override. `extra_page_bytes`:
    what else each page costs (the draft's cache rows of its tokens)."""
    per_page = page_bytes(cfg, kv_dtype, index_dtype, num_kv_heads) + extra_page_bytes
    per_seq = math.ceil(max_model_len / cfg.index_block_size)
    if num_gpu_blocks_override is not None:
        pages, how = int(num_gpu_blocks_override), "num_gpu_blocks_override"
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # blocks the allocator caches but nothing holds (loading's temporaries) are free
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights, this process's allocations, the CUDA context, other processes
        budget = total * gpu_memory_utilization - used - reserved_bytes - activation_reserve_bytes(
            cfg, max_num_batched_tokens, max_num_seqs)
        pages = max(int(budget // per_page), 0)
        how = (f"{total / 2**30:.1f} GiB x {gpu_memory_utilization} - {used / 2**30:.1f} GiB in use "
               f"- {reserved_bytes / 2**30:.2f} GiB reserved - activation reserve")
        cap = 4 * per_seq * max_num_seqs  # more could never be used, even as prefix cache (small models)
        if pages > cap:
            pages, how = cap, how + ", capped at 4 x max_num_seqs x pages per sequence"
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


def _alloc(dtype: str, lead: tuple[int, ...], dim: int, device: torch.device):
    """(data, block scales or None) for `dtype`."""
    if dtype == "nvfp4":
        return (torch.zeros(*lead, dim // 2, dtype=torch.uint8, device=device),
                torch.zeros(*lead, dim // 16, dtype=torch.float8_e4m3fn, device=device))
    return torch.zeros(*lead, dim, dtype=_STORAGE[dtype], device=device), None


@dataclass
class LayerKVCache:
    """One layer's pages (K/V, and the MSA indexer's keys on sparse layers). Kernels take this object (or its named
    tensors); the torch path goes through `write` / `gather` (`store` / `load` per step sequence)."""

    kv_dtype: str
    k: torch.Tensor
    v: torch.Tensor
    k_scale_blocks: torch.Tensor | None = None
    v_scale_blocks: torch.Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    index_dtype: str | None = None  # None: a full-attention layer (no indexer keys)
    index: torch.Tensor | None = None
    index_scale_blocks: torch.Tensor | None = None
    index_scale: float = 1.0

    @classmethod
    def allocate(cls, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                 device: torch.device, k_scale: float = 1.0, v_scale: float = 1.0, index_head_dim: int = 0,
                 index_dtype: str | None = None, index_scale: float = 1.0) -> "LayerKVCache":
        for name, dt in (("kv_cache_dtype", kv_dtype), ("indexer_kv_dtype", index_dtype or kv_dtype)):
            if dt not in CACHE_DTYPES:
                raise ConfigError(f"{name} {dt!r} is not one of {CACHE_DTYPES}")
        lead = (num_pages, num_kv_heads, block_size)
        k, ksb = _alloc(kv_dtype, lead, head_dim, device)
        v, vsb = _alloc(kv_dtype, lead, head_dim, device)
        index = isb = None
        if index_dtype is not None:
            index, isb = _alloc(index_dtype, (num_pages, block_size), index_head_dim, device)
        return cls(kv_dtype, k, v, ksb, vsb, float(k_scale), float(v_scale), index_dtype, index, isb,
                   float(index_scale))

    @property
    def block_size(self) -> int:
        return int(self.k.shape[2])

    @property
    def has_index(self) -> bool:
        return self.index is not None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale_blocks, self.v_scale_blocks, self.index,
                            self.index_scale_blocks) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def codecs(self) -> tuple[KVCodec, KVCodec, KVCodec | None]:
        idx = KVCodec(self.index_dtype, self.index_scale) if self.index_dtype is not None else None
        return KVCodec(self.kv_dtype, self.k_scale), KVCodec(self.kv_dtype, self.v_scale), idx

    # ---- the torch path ----------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ik: torch.Tensor | None) -> None:
        """Quantize and write K/V [t, H_kv, D] and index keys [t, D_idx] at `slots` (int64 [t])."""
        page, off = slots // self.block_size, slots % self.block_size
        kc, vc, ic = self.codecs()
        for data, blocks, codec, x in ((self.k, self.k_scale_blocks, kc, k), (self.v, self.v_scale_blocks, vc, v)):
            parts = codec.encode(x)
            data[page, :, off] = parts[0]
            if blocks is not None:
                blocks[page, :, off] = parts[1]
        if ik is not None and ic is not None:
            parts = ic.encode(ik)
            self.index[page, off] = parts[0]
            if self.index_scale_blocks is not None:
                self.index_scale_blocks[page, off] = parts[1]

    def gather(self, pages: torch.Tensor, length: int):
        """Dequantized K, V [length, H_kv, D] (fp32) and IK [length, D_idx] (or None) of the tokens in `pages`."""
        kc, vc, ic = self.codecs()

        def kv(data, blocks, codec):
            parts = [t[pages].transpose(1, 2).flatten(0, 1)[:length] for t in (data, blocks) if t is not None]
            return codec.decode(tuple(parts))

        ik = None
        if ic is not None:
            parts = [t[pages].flatten(0, 1)[:length] for t in (self.index, self.index_scale_blocks) if t is not None]
            ik = ic.decode(tuple(parts))
        return kv(self.k, self.k_scale_blocks, kc), kv(self.v, self.v_scale_blocks, vc), ik

    # ---- the AttentionCache protocol (the reference attention) -------------------------------------
    def store(self, seq: int, step: StepInput, k, v, ik) -> None:
        qsl = step.query_start_loc_cpu
        self.write(step.slot_mapping[qsl[seq]:qsl[seq + 1]], k, v, ik)

    def load(self, seq: int, step: StepInput):
        length = int(step.seq_lens[seq])  # not seq_lens_cpu: a step launched ahead completes it on the device
        pages = step.block_tables[seq, :-(-length // self.block_size)].long()
        return self.gather(pages, length)


class PagedKVCache:
    """The pool: `layers[l]` is layer l's `LayerKVCache`; all layers share the page ids."""

    def __init__(self, cfg: ModelConfig, num_pages: int, kv_dtype: str, index_dtype: str,
                 device: torch.device | str = "cpu", kv_scales: dict[int, tuple[float, float]] | None = None,
                 index_scales: dict[int, float] | None = None, num_kv_heads: int | None = None):
        self.kv_dtype, self.index_dtype = kv_dtype, index_dtype
        self.block_size, self.num_pages = cfg.index_block_size, num_pages
        self.device = torch.device(device)
        kv_scales, index_scales = kv_scales or {}, index_scales or {}
        heads = num_kv_heads or cfg.num_key_value_heads  # a tensor-parallel rank holds its KV heads only
        self.layers = [
            LayerKVCache.allocate(num_pages, self.block_size, heads, cfg.head_dim, kv_dtype,
                                  self.device, *kv_scales.get(layer, (1.0, 1.0)), index_head_dim=cfg.index_head_dim,
                                  index_dtype=index_dtype if cfg.is_sparse_attention(layer) else None,
                                  index_scale=index_scales.get(layer, 1.0))
            for layer in range(cfg.num_hidden_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
