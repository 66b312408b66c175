"""Quantized dense linears ``y = x @ W^T`` (x [M, K] bf16) for whatever a checkpoint quantizes outside the experts:
NVFP4, MXFP8 and FP8 (E4M3 with a per-tensor or per-channel fp32 scale) weights, laid out once by
`quant_linear_prepare` (`weight_layout`). Unquantized weights stay as they are and go to cuBLAS (``F.linear``),
never converted per call.

Paths: the mma kernel of `grouped_gemm_mma` (sm_89 / sm_90, up to `dispatch.LINEAR_MMA_MAX_ROWS` rows: weights as
the mma's M side, the activations converted once to its fp16 layout by one small launch) or the portable kernel of
`grouped_gemm` (interpreter, ROCm, larger M); both are the MoE kernels with one group and no routing. At large M
`dequant_gemm` decodes the weight once per call into a bf16 scratch and calls cuBLAS (or, path "dense8", decodes it
straight to e4m3 and x to e4m3 per row for cuBLAS's FP8 GEMM: lossy, in no default row; or the portable kernel's
``a8`` tiles: x in e4m3 per row, the weights rounded to e4m3 as they are decoded, FP8 dots: lossy, in no default
row). The path and tiles by M: `dispatch.linear_config` (its table: `dispatch.LINEAR_TABLE`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import dispatch
from .dequant_gemm import dense_linear, fp8_linear
from .grouped_gemm import MODE_LINEAR, grouped_gemm
from .moe_router import to_x8, to_x16
from .weight_layout import PackedWeight, pack_quant_weight, unpack


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


def quant_linear(x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (path and tiles: `dispatch.linear_config`)."""
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
    if M == 0:
        return out.reshape(*lead, w.n)
    path, cfg = dispatch.linear_config(M, pw, x.device)
    if path == "dense":
        dense_linear(x2, pw, out)
    elif path == "dense8":
        fp8_linear(x2, pw, out)
    elif path == "mma":
        dispatch.gemm_mma_kernels().grouped_gemm_mma(to_x16(x2, pw.k_pad), out, MODE_LINEAR, plain=pw, T=M, **cfg)
    elif cfg.get("a8"):
        x8, xs = to_x8(x2, pw.k_pad, wg16=bool(cfg.get("wg16")))
        grouped_gemm(x8, out, MODE_LINEAR, plain=pw, T=M, xs=xs, **cfg)
    else:
        grouped_gemm(to_x16(x2, pw.k_pad, wg16=True) if cfg.get("wg16") else x2, out, MODE_LINEAR, plain=pw, T=M,
                     **cfg)
    return out.reshape(*lead, w.n)


def quant_linear_ref(x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
    """fp32 torch reference."""
    if w.dense is not None:
        return F.linear(x.float(), w.dense.float())
    wd = unpack(w.packed, 0)[: w.n, : w.k]
    return F.linear(x.float(), wd)


__all__ = ["QuantLinear", "quant_linear_prepare", "quant_linear", "quant_linear_ref"]
