"""Per-tensor FP8 E4M3 in plain torch: reference for the Triton kernels (formats.md 1.3 for the E4M3 format).

E4M3 "fn": bias 7, max 448, no Inf. The scale is dequant-side (x ~= fp8(q) * scale), as ModelOpt FP8
``weight_scale`` / ``k_scale``; default scale = amax / 448 (1.0 for an all-zero tensor). Values are RNE-cast and
saturate at +-448.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

__all__ = ["FP8_MAX", "quantize_fp8", "dequantize_fp8"]

FP8_MAX = 448.0


def _scalar(s: Union[float, torch.Tensor], device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(s, dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise ValueError(f"scale must be a scalar (per tensor), got shape {tuple(t.shape)}")
    return t.reshape(())


def quantize_fp8(
    x: torch.Tensor, scale: Optional[Union[float, torch.Tensor]] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> ``(q float8_e4m3fn, scale float32 0-dim)`` with q = sat(x / scale)."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    else:
        s = _scalar(scale, x.device)
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def dequantize_fp8(
    q: torch.Tensor, scale: Union[float, torch.Tensor], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """fp8(q) * scale in ``dtype`` (computed in float32)."""
    return (q.float() * _scalar(scale, q.device)).to(dtype)
