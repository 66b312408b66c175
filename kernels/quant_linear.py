"""Quantized dense linears ``y = x @ W^T`` (x [M, K] bf16) for whatever a checkpoint quantizes outside the experts:
NVFP4, MXFP8 and FP8 (E4M3 with a per-tensor or per-channel fp32 scale) weights, laid out once by
`quant_linear_prepare` (`weight_layout`). Unquantized weights stay as they are and go to cuBLAS (``F.linear``),
never converted per call.

Paths: the mma kernel of `grouped_gemm_mma` (sm_89 / sm_90, up to `MMA_MAX_ROWS` rows: weights as the mma's M side,
the activations converted once to its fp16 layout by one small launch) or the portable kernel of `grouped_gemm`
(interpreter, ROCm, larger M); both are the MoE kernels with one group and no routing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .grouped_gemm import MODE_LINEAR, grouped_gemm, mma_kernels
from .weight_layout import CHUNK_K, PackedWeight, pack_quant_weight, unpack

MMA_MAX_ROWS = 256
# rows (M) -> mma config (p 16-row tiles per program, nt rows per tile, unroll chunks in flight) / portable tiles
LINEAR_TUNING = ((16, dict(p=1, nt=8, unroll=2)), (MMA_MAX_ROWS, dict(p=1, nt=16, unroll=2)))
PORTABLE_SMALL = dict(bm=16, bn=64, num_warps=4, num_stages=2)
PORTABLE_LARGE = dict(bm=64, bn=128, num_warps=8, num_stages=3)


@dataclass
class QuantLinear:
    """A prepared linear: ``packed`` (quantized, kernel layout) or ``dense`` (kept for cuBLAS)."""
    n: int
    k: int
    packed: PackedWeight | None = None
    dense: torch.Tensor | None = None

    @property
    def fmt(self) -> str:
        return "dense" if self.dense is not None else self.packed.name


def quant_linear_prepare(qw) -> QuantLinear:
    """A `QuantWeight` (no leading axis) -> `QuantLinear`. Dense weights are referenced, not copied."""
    if qw.fmt == "dense":
        return QuantLinear(qw.n, qw.k, dense=qw.weight)
    return QuantLinear(qw.n, qw.k, packed=pack_quant_weight(qw))


def _mma_config(M: int, w: PackedWeight, device) -> dict | None:
    mma = mma_kernels()
    if mma is None or not mma.available(device) or not mma.supported(w):
        return None
    for limit, cfg in LINEAR_TUNING:
        if M <= limit and w.n_pad % (16 * cfg["p"]) == 0 and (w.k_pad // CHUNK_K) % (4 * cfg["unroll"]) == 0:
            return cfg
    return None


def quant_linear(x: torch.Tensor, w: QuantLinear, config: dict | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype."""
    if w.dense is not None:
        return F.linear(x, w.dense)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] != w.k:
        raise ValueError(f"x has K={x2.shape[1]}, the weight {w.k}")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, w.n, dtype=x.dtype, device=x.device)
    pw = w.packed
    cfg = config if config is not None else _mma_config(M, pw, x.device)
    if M == 0:
        return out.reshape(*lead, w.n)
    if cfg is not None and "p" in cfg:
        mma = mma_kernels()
        mma.grouped_gemm_mma(mma.to_x16(x2, pw.k_pad), out, MODE_LINEAR, plain=pw, T=M, **cfg)
    else:
        cfg = cfg or (PORTABLE_SMALL if M <= 64 or x.device.type != "cuda" else PORTABLE_LARGE)
        grouped_gemm(x2, out, MODE_LINEAR, plain=pw, T=M, **cfg)
    return out.reshape(*lead, w.n)


def quant_linear_ref(x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
    """fp32 torch reference."""
    if w.dense is not None:
        return F.linear(x.float(), w.dense.float())
    wd = unpack(w.packed, 0)[: w.n, : w.k]
    return F.linear(x.float(), wd)


__all__ = ["QuantLinear", "quant_linear_prepare", "quant_linear", "quant_linear_ref"]
