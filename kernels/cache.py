"""One layer's paged cache as the kernels see it: the attributes they read, the layout, and the torch readers the
references use.

Every kernel and reference takes the layer's cache as one object with the attributes of `LayerCache` (the
engine's ``model.kv_cache.LayerKVCache`` has them; any object with these names will do: the kernels know
nothing of the engine). Layout (architecture.md, "Paged cache layout"), ``P`` pages of ``B`` tokens, page = MSA
block:

* K, V: ``[P, H_kv, B, D]`` (bf16 / fp32 or ``float8_e4m3fn``) or ``uint8 [P, H_kv, B, D/2]`` + block scales
  ``float8_e4m3fn [P, H_kv, B, D/16]`` (nvfp4, even element in the low nibble);
* index keys (sparse layers): the same without the head dim, ``[P, B, ...]``; ``None`` on full-attention layers;
* one fp32 per-layer scale per tensor, dequant side: x = q * scale, x = E2M1(q) * S * scale.

The format is told by the data dtype (`codecs.cache_format`). A token with slot ``page * B + offset`` lives at
``[page, :, offset]``; block tables are ``int32 [S, max_pages]`` (logical block -> page).
"""
from __future__ import annotations

from typing import Protocol

import torch

from . import fp8, nvfp4
from .codecs import FMT_FP8, FMT_NVFP4, cache_format


class LayerCache(Protocol):
    k: torch.Tensor
    v: torch.Tensor
    k_scale_blocks: torch.Tensor | None
    v_scale_blocks: torch.Tensor | None
    k_scale: float
    v_scale: float
    index: torch.Tensor | None
    index_scale_blocks: torch.Tensor | None
    index_scale: float


def cache_part(cache: LayerCache, part: str) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(data, block scales, per-layer scale) of ``part``: "k", "v" or "index"."""
    return getattr(cache, part), getattr(cache, f"{part}_scale_blocks"), getattr(cache, f"{part}_scale")


def dequant_pages_ref(data, scale_blocks, scale, dtype=torch.float32):
    """Dequantize whole cache tensors (any leading shape) to ``dtype``."""
    fmt = cache_format(data)
    if fmt == FMT_NVFP4:
        return nvfp4.dequantize_nvfp4(data, scale_blocks, scale, dtype)
    if fmt == FMT_FP8:
        return fp8.dequantize_fp8(data, scale, dtype)
    return data.to(dtype)


def gather_pages_ref(data, scale_blocks, scale, block_table_row: torch.Tensor, n_tokens: int,
                     dtype=torch.float32) -> torch.Tensor:
    """The first ``n_tokens`` of one sequence: ``[n, H, D]`` (K/V) or ``[n, D]`` (index keys), dequantized."""
    B = data.shape[-2]
    pages = block_table_row[: -(-n_tokens // B)].long()
    x = dequant_pages_ref(data[pages], None if scale_blocks is None else scale_blocks[pages], scale, dtype)
    if x.dim() == 4:  # [n_pages, H, B, D] -> [n_pages * B, H, D]
        x = x.permute(0, 2, 1, 3)
    return x.reshape(-1, *x.shape[2:])[:n_tokens]


def gather_part_ref(cache: LayerCache, part: str, block_table_row: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """`gather_pages_ref` of one part ("k", "v", "index") of a layer's cache, fp32."""
    return gather_pages_ref(*cache_part(cache, part), block_table_row, n_tokens)
