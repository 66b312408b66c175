"""NVFP4 in plain torch: the reference the Triton kernels are checked against.

Conventions (docs: /work/shared/design/formats.md sections 1.1-1.6 and 3.1):

* Element: FP4 E2M1, codes 0..7 = {0, .5, 1, 1.5, 2, 3, 4, 6}, codes 8..15 the same magnitudes negated
  (bit 3 = sign, 0x8 = -0). No Inf/NaN (1.1).
* Packing along the last (K) dim: element 2i in the LOW nibble, element 2i+1 in the HIGH nibble (1.2).
* Scales: one float8_e4m3fn block scale S_j per 16 consecutive elements along K, plus one fp32 per-tensor
  ``scale_2`` on the *dequant side* (ModelOpt ``weight_scale_2`` = amax / 2688; vLLM KV ``k_scale``) (1.3, 3.1).
  compressed-tensors stores the quant-side reciprocal g = 1 / scale_2 (1.6).
* Quantize (1.4): S_j = e4m3_rn_sat(amax_j / (6 * scale_2)); q_i = e2m1_rne_sat(x_i / (S_j * scale_2)), q = 0 where
  S_j == 0. Dequantize: x_i ~= E2M1(q_i) * S_j * scale_2.

Exact division is used (vLLM uses rcp.approx, so its bytes can differ in rare ties; formats.md 1.4).
All arithmetic is float32 regardless of the input dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

__all__ = [
    "E2M1_VALUES",
    "FP4_BLOCK",
    "E2M1_MAX",
    "E4M3_MAX",
    "cast_to_e2m1_codes",
    "pack_fp4",
    "unpack_fp4",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "nvfp4_global_from_compressed_tensors",
]

FP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Index = 4-bit code. Code 8 is -0.0 so that dequantize(quantize(-0.0)) keeps the sign bit.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

ScaleLike = Union[float, torch.Tensor]


def cast_to_e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round ``y`` (already divided by its scale) to E2M1 codes, uint8 in [0, 15], same shape.

    Round-to-nearest, ties to the even mantissa (= even code), saturating at 6 (formats.md 1.4):
    [0,.25]->0, (.25,.75)->.5, [.75,1.25]->1, (1.25,1.75)->1.5, [1.75,2.5]->2, (2.5,3.5)->3, [3.5,5]->4, >5->6.
    The sign goes to bit 3 (negative values that round to 0 give code 8, i.e. -0). NaN maps to 0 / 8.
    """
    a = y.float().abs()
    # Each threshold passed adds one code; '>' where the tie goes down (lower code even), '>=' where it goes up.
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = torch.signbit(y.float()).to(torch.uint8) << 3
    return (mag.to(torch.uint8) | sign).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 [..., K/2]; element 2i in the low nibble, 2i+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (inverse of :func:`pack_fp4`)."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


_E2M1_ON: dict[torch.device, torch.Tensor] = {}


def _e2m1_on(device: torch.device) -> torch.Tensor:
    """`E2M1_VALUES` on ``device``, copied there once (the first call runs before any graph capture: warm-up)."""
    t = _E2M1_ON.get(device)
    if t is None:
        t = _E2M1_ON[device] = E2M1_VALUES.to(device)
    return t


def _as_scalar_scale(s: ScaleLike, device: torch.device, name: str) -> torch.Tensor:
    t = torch.as_tensor(s, dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must be a scalar (one per tensor), got shape {tuple(t.shape)}")
    return t.reshape(())


def quantize_nvfp4(
    x: torch.Tensor, scale_2: Optional[ScaleLike] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x[..., K]`` (K % 16 == 0) to NVFP4 along the last dim.

    ``scale_2`` is the dequant-side global scale (ModelOpt ``weight_scale_2``, vLLM ``k_scale``); when None it is
    amax(|x|) / 2688 over the whole tensor (1.0 if the tensor is all zero).
    Returns ``(packed uint8 [..., K/2], block_scale float8_e4m3fn [..., K/16], scale_2 float32 0-dim)``.
    """
    K = x.shape[-1]
    if K % FP4_BLOCK:
        raise ValueError(f"quantize_nvfp4: last dim K={K} must be a multiple of {FP4_BLOCK}")
    xf = x.float()
    if scale_2 is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
        s2 = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax)).float()
    else:
        s2 = _as_scalar_scale(scale_2, x.device, "scale_2")

    blocks = xf.reshape(*xf.shape[:-1], K // FP4_BLOCK, FP4_BLOCK)
    amax_j = blocks.abs().amax(dim=-1)
    block_scale = (amax_j / (E2M1_MAX * s2)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)

    denom = (block_scale.float() * s2).unsqueeze(-1)
    y = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(blocks))
    codes = cast_to_e2m1_codes(y).reshape(xf.shape)
    return pack_fp4(codes), block_scale, s2


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    scale_2: ScaleLike,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``packed uint8 [..., K/2]``, ``block_scale e4m3 [..., K/16]``, scalar ``scale_2`` -> ``[..., K]`` in ``dtype``.

    x = E2M1(q) * S_j * scale_2, computed in float32 then cast.
    """
    K = packed.shape[-1] * 2
    if block_scale.shape[-1] * FP4_BLOCK != K or block_scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(
            f"dequantize_nvfp4: block_scale shape {tuple(block_scale.shape)} does not match packed "
            f"{tuple(packed.shape)} (expected [..., {K // FP4_BLOCK}])")
    # a Python scale and the table already on the device: no host-to-device copy (capturable in a CUDA graph)
    s2 = float(scale_2) if isinstance(scale_2, (int, float)) else _as_scalar_scale(scale_2, packed.device, "scale_2")
    vals = _e2m1_on(packed.device)[unpack_fp4(packed).long()]
    vals = vals.reshape(*packed.shape[:-1], K // FP4_BLOCK, FP4_BLOCK)
    out = vals * block_scale.float().unsqueeze(-1) * s2
    return out.reshape(*packed.shape[:-1], K).to(dtype)


def nvfp4_global_from_compressed_tensors(weight_global_scale: ScaleLike) -> torch.Tensor:
    """compressed-tensors quant-side global scale g (``weight_global_scale``) -> dequant-side scale_2 = 1/g (1.6)."""
    g = torch.as_tensor(weight_global_scale, dtype=torch.float32)
    return (1.0 / g).reshape(()) if g.numel() == 1 else 1.0 / g
