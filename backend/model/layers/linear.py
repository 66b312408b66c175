"""Linear layers and their methods: the weight's format and the device pick how `y = x W^T` runs, once at load.

- `DenseLinear`: bf16/fp32 weights straight to the BLAS (F.linear), never converted per call.
- `TorchQuantLinear`: the reference for NVFP4 / MXFP8 / FP8 weights: dequantize, then F.linear (CPU, tests).
- `KernelQuantLinear`: the Triton kernels (kernels/quant_linear.py) decode the packed weights in registers (CUDA);
  the weight is laid out for them once and the checkpoint layout released.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.model.weights import QuantWeight

log = logging.getLogger(__name__)


class DenseLinear:
    name = "dense"

    def apply(self, w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w.weight)


class TorchQuantLinear:
    name = "torch-dequant"

    def apply(self, w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w.dequantize(dtype=x.dtype))


class KernelQuantLinear:
    name = "triton-quant"

    def __init__(self, w: QuantWeight):
        from m3serve.kernels.quant_linear import quant_linear_prepare
        self.weight = quant_linear_prepare(w)
        w.release()

    def apply(self, w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
        from m3serve.kernels.quant_linear import quant_linear
        return quant_linear(x, self.weight)


def select_linear_method(w: QuantWeight, device: torch.device, current=None):
    if w.fmt == "dense":
        return DenseLinear()
    if device.type == "cuda":
        return current if isinstance(current, KernelQuantLinear) else KernelQuantLinear(w)
    return TorchQuantLinear()


class Linear(nn.Module):
    """y = x W^T with W a `QuantWeight` (no bias: M3 has none); `method` is set by `prepare(device)`."""

    def __init__(self, k: int, n: int, fmt: str = "dense", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.w = QuantWeight(n, k, fmt, dtype)
        self.method = None

    def prepare(self, device: torch.device) -> None:
        if getattr(self.w, "released", False):
            return  # a fused kernel (the MoE layer's, for its shared expert) holds this weight in its own layout
        self.method = select_linear_method(self.w, device, self.method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        method = self.method or (DenseLinear() if self.w.fmt == "dense" else TorchQuantLinear())
        return method.apply(self.w, x)
