"""MXFP8 (OCP Microscaling) in plain torch: reference for the Triton kernels (formats.md section 2).

* Elements float8_e4m3fn; one E8M0 scale (uint8 b, value 2^(b-127), b = 255 is NaN, no zero) per 32 consecutive
  elements along the last (K) dim. Checkpoint tensors: ``weight`` e4m3 [N, K], ``weight_scale_inv`` uint8 [N, K/32]
  (a multiplier despite the name).
* Dequant: x = fp8(q) * 2^(b - 127).
* Quantize uses the "no-clip" rule (vLLM #53110): b = ceil(log2(amax / 448)) + 127, clamped to [0, 254], i.e. the
  smallest power of two with amax / 2^(b-127) <= 448 (computed exactly, not with float log2). amax == 0 -> b = 127.
  Elements are RNE-cast to E4M3, saturating at +-448.
"""
from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["MX_BLOCK", "FP8_E4M3_MAX", "e8m0_to_float", "quantize_mxfp8", "dequantize_mxfp8"]

MX_BLOCK = 32
FP8_E4M3_MAX = 448.0


def e8m0_to_float(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 -> float32 2^(b-127), exact (b=0 -> 2^-127 subnormal, b=255 -> NaN)."""
    b = scale_e8m0.to(torch.int32)
    # Float32 with biased exponent b and zero mantissa is exactly 2^(b-127) for b in [1, 254].
    out = (b << 23).view(torch.float32)
    out = torch.where(b == 0, torch.full_like(out, 2.0 ** -127), out)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def _no_clip_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest integer e with amax <= 448 * 2^e (= ceil(log2(amax/448))), for amax > 0."""
    _, e = torch.frexp(amax / FP8_E4M3_MAX)  # amax/448 = m * 2^e, m in [0.5, 1) -> ceil(log2) is e or e-1
    e = e.to(torch.int32)
    lim = lambda k: torch.ldexp(torch.full_like(amax, FP8_E4M3_MAX), k.float())  # 448 * 2^k, exact
    e = torch.where(amax <= lim(e - 1), e - 1, e)
    return torch.where(amax > lim(e), e + 1, e)  # guards the rounding of amax/448


def quantize_mxfp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x[..., K]`` (K % 32 == 0) -> ``(q float8_e4m3fn [..., K], scale uint8 E8M0 [..., K/32])``."""
    K = x.shape[-1]
    if K % MX_BLOCK:
        raise ValueError(f"quantize_mxfp8: last dim K={K} must be a multiple of {MX_BLOCK}")
    blocks = x.float().reshape(*x.shape[:-1], K // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    pos = amax > 0
    e = _no_clip_exponent(torch.where(pos, amax, torch.ones_like(amax)))
    b = torch.where(pos, e + 127, torch.full_like(e, 127)).clamp(0, 254)
    scale = b.to(torch.uint8)
    y = blocks / e8m0_to_float(scale).unsqueeze(-1)
    q = y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale


def dequantize_mxfp8(
    q: torch.Tensor, scale_e8m0: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q e4m3 [..., K]``, ``scale_e8m0 uint8 [..., K/32]`` -> fp8(q) * 2^(b-127) in ``dtype``."""
    K = q.shape[-1]
    if scale_e8m0.shape[-1] * MX_BLOCK != K or scale_e8m0.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"dequantize_mxfp8: scale shape {tuple(scale_e8m0.shape)} does not match q {tuple(q.shape)} "
            f"(expected [..., {K // MX_BLOCK}])")
    blocks = q.float().reshape(*q.shape[:-1], K // MX_BLOCK, MX_BLOCK)
    return (blocks * e8m0_to_float(scale_e8m0).unsqueeze(-1)).reshape(q.shape).to(dtype)
