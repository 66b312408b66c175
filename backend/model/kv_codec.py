"""How K, V and index keys are stored in the cache: bf16/fp32, FP8 E4M3 (per-layer scale) or NVFP4
(E2M1 packed, E4M3 per 16, per-layer FP32 scale; formats.md 3.1). The torch path; kernels read
the same bytes."""
from __future__ import annotations

import torch

from m3serve.config import CACHE_DTYPES
from m3serve.kernels import fp8, nvfp4


class KVCodec:
    def __init__(self, dtype: str, scale: float = 1.0):
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"cache dtype {dtype!r} is not one of {CACHE_DTYPES}")
        self.dtype, self.scale = dtype, float(scale)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.dtype == "nvfp4":
            packed, block_scale, _ = nvfp4.quantize_nvfp4(x, self.scale)
            return packed, block_scale
        if self.dtype == "fp8":
            return (fp8.quantize_fp8(x, self.scale)[0],)
        return (x.to(getattr(torch, self.dtype)),)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dtype == "nvfp4":
            return nvfp4.dequantize_nvfp4(parts[0], parts[1], self.scale, dtype)
        if self.dtype == "fp8":
            return fp8.dequantize_fp8(parts[0], self.scale, dtype)
        return parts[0].to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x), x.dtype)
