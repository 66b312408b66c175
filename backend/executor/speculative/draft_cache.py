"""The DSpark draft's paged KV cache: per draft layer, K (k_norm + RoPE applied) and V of the projected
context features C of the target's computed positions (design/dspark.md section 2).

It is indexed exactly like the target's page pool (model/kv_cache.py): the same page size B, the same page
ids, so the engine passes the target's block tables and slot mapping unchanged. A row of position p of a
sequence lives at slot `page_table[p // B] * B + p % B`. Layout per layer (what a paged kernel reads):
  k[l], v[l]   fp8 e4m3 (per-layer fp32 scale) | bf16 | fp16 | fp32   [P + 1, H_kv, B, D]
Page P (one past the pool) is a scratch page: rows written with slot -1 (padding) land there, so a write never
needs the host to filter its rows; no block table points at it.

Block rows (the drafted block) are transient and never written. The speculative step writes the rows of every
verified draft, accepted or not (executor/speculative/decoder.py, so the cache does not wait for verification): a rejected
draft's row lies past its sequence's accepted length, like its target KV row; no draft reads it (a block reads the
rows before its anchor) and the step that commits that position writes it again, so the cache needs no rollback.
`commit_slots` keeps only the accepted rows instead (slot -1 for the others), for callers that want exactly them.
On CUDA the draft reads a layer's pages in place (`paged_fn`); `gather` is the torch path.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from m3serve.config import ConfigError, normalize_kv_dtype
from m3serve.kernels import fp8
from m3serve.model.dspark import PagedContext
from m3serve.model.dspark_config import DSparkConfig
from m3serve.model.kv_codec import KVCodec

DRAFT_KV_DTYPES = ("fp8", "bfloat16", "float16", "float32")
_STORAGE = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}


def draft_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The storage name of a speculative config's `kv_cache_dtype` ("auto" = the draft's dtype, "fp8_e4m3")."""
    if kv_cache_dtype in DRAFT_KV_DTYPES:
        return kv_cache_dtype
    model_dtype = {torch.float32: "float32", torch.float16: "float16"}.get(dtype, "bfloat16")
    return normalize_kv_dtype(kv_cache_dtype, model_dtype)


class _Codec(KVCodec):
    """The KV codec with its FP8 scale held on the cache's device."""

    def __init__(self, dtype: str, scale: float, device: torch.device):
        super().__init__(dtype, scale)
        self.scale_t = torch.tensor(self.scale, dtype=torch.float32, device=device)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (fp8.quantize_fp8(x, self.scale_t)[0],) if self.dtype == "fp8" else super().encode(x)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp8.dequantize_fp8(parts[0], self.scale_t, dtype) if self.dtype == "fp8" else super().decode(parts, dtype)


class DraftKVCache:
    def __init__(self, num_layers: int, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: str = "fp8", dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 scales: dict[int, tuple[float, float]] | None = None):
        if kv_dtype not in DRAFT_KV_DTYPES:
            raise ConfigError(f"draft kv_cache_dtype {kv_dtype!r} is not one of {list(DRAFT_KV_DTYPES)}")
        self.num_layers, self.num_pages, self.block_size = num_layers, num_pages, block_size
        self.kv_dtype, self.dtype, self.device = kv_dtype, dtype, torch.device(device)
        scales = scales or {}
        shape = (num_pages + 1, num_kv_heads, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=_STORAGE[kv_dtype], device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=_STORAGE[kv_dtype], device=self.device) for _ in range(num_layers)]
        self.k_scale = [float(scales.get(i, (1.0, 1.0))[0]) for i in range(num_layers)]
        self.v_scale = [float(scales.get(i, (1.0, 1.0))[1]) for i in range(num_layers)]
        # FP8 scales as device tensors made once: a Python-float scale would be copied to the device (a host
        # synchronisation, and not allowed inside a CUDA graph) by every write and every read
        self._k_codec = [_Codec(kv_dtype, s, self.device) for s in self.k_scale]
        self._v_codec = [_Codec(kv_dtype, s, self.device) for s in self.v_scale]

    @classmethod
    def for_draft(cls, cfg: DSparkConfig, num_pages: int, block_size: int, kv_cache_dtype: str = "fp8",
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  scales: dict[int, tuple[float, float]] | None = None) -> "DraftKVCache":
        """A cache for draft `cfg` over the target's pool geometry (`num_pages` pages of `block_size`).
        `kv_cache_dtype`: one of DRAFT_KV_DTYPES or the speculative config's names ("auto" = the model
        dtype, "fp8_e4m3")."""
        return cls(cfg.num_hidden_layers, num_pages, block_size, cfg.num_key_value_heads, cfg.head_dim,
                   draft_kv_dtype(kv_cache_dtype, dtype), dtype, device, scales)

    @staticmethod
    def page_bytes(cfg: DSparkConfig, block_size: int, kv_cache_dtype: str, dtype: torch.dtype) -> int:
        """Bytes one page of the pool costs in the draft cache (every draft layer's K and V)."""
        elem = torch.empty(0, dtype=_STORAGE[draft_kv_dtype(kv_cache_dtype, dtype)]).element_size()
        return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * block_size * cfg.head_dim * elem

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # ---- writes ------------------------------------------------------------------------------------
    def _page_offset(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.long()
        scratch = slots < 0
        page = torch.where(scratch, self.num_pages, slots // self.block_size)
        return page, torch.where(scratch, 0, slots % self.block_size)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and write K, V [N, H_kv, D] of N context rows at `slots` (int [N]; -1 = drop)."""
        page, off = self._page_offset(slots)
        self.k[layer][page, :, off] = self._k_codec[layer].encode(k)[0]
        self.v[layer][page, :, off] = self._v_codec[layer].encode(v)[0]

    def write_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor) -> None:
        """Every layer's (k, v) of the same N rows (what `DSparkDraft.context_kv` returns)."""
        for layer, (k, v) in enumerate(rows):
            self.write(layer, slots, k, v)

    # ---- reads -------------------------------------------------------------------------------------
    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of S sequences through their block tables (int [S, max_pages]): K, V
        [S, max_pages * B, H_kv, D] dequantized to `dtype`, row j = position j. Rows past a sequence's
        context hold whatever its pages hold: the caller masks them (`block_mask`)."""
        tables = block_tables.long().clamp(min=0)
        s, p = tables.shape

        def rows(data: list[torch.Tensor], codec: list[KVCodec]) -> torch.Tensor:
            x = data[layer][tables].transpose(2, 3).reshape(s, p * self.block_size, *data[layer].shape[1::2])
            return codec[layer].decode((x,), self.dtype)

        return rows(self.k, self._k_codec), rows(self.v, self._v_codec)

    def context_fn(self, block_tables: torch.Tensor) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """`layer -> (k, v)` for `DSparkDraft.block_hidden` (every page of the tables gathered: the torch path)."""
        return lambda layer: self.gather(layer, block_tables)

    def paged_fn(self, block_tables: torch.Tensor) -> Callable[[int], PagedContext]:
        """`layer -> PagedContext` for `DSparkDraft.block_hidden`: the pages read in place by the kernel."""
        tables = block_tables.to(torch.int32)
        return lambda layer: PagedContext(_LayerPages(self, layer), tables)


class _LayerPages:
    """One draft layer's pages with the attributes the attention kernels read (kernels/cache.py `LayerCache`)."""

    k_scale_blocks = v_scale_blocks = index = index_scale_blocks = None
    index_scale = 1.0

    def __init__(self, cache: DraftKVCache, layer: int):
        self.k, self.v = cache.k[layer], cache.v[layer]
        fp8 = cache.kv_dtype == "fp8"
        self.k_scale, self.v_scale = (cache.k_scale[layer], cache.v_scale[layer]) if fp8 else (1.0, 1.0)


def commit_slots(slots: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Slots of the verify rows [S, K+1] (positions t..t+K) with the rows past the anchor + n accepted
    tokens set to -1: inserting the verify rows' features through these slots commits exactly the
    accepted ones (no host sync, no compaction)."""
    row = torch.arange(slots.shape[1], device=slots.device)[None, :]
    return torch.where(row <= num_accepted[:, None], slots.long(), -1)
