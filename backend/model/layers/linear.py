"""Linear layers and their methods: the weight's format and the device pick how `y = x W^T` runs, once at load.

- `DenseLinear`: bf16/fp32 weights straight to the BLAS (F.linear), never converted per call.
- `TorchQuantLinear`: the reference for NVFP4 / MXFP8 weights: dequantize, then F.linear.
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


def select_linear_method(w: QuantWeight, device: torch.device):
    return DenseLinear() if w.fmt == "dense" else TorchQuantLinear()


class Linear(nn.Module):
    """y = x W^T with W a `QuantWeight` (no bias: M3 has none); `method` is set by `prepare(device)`."""

    def __init__(self, k: int, n: int, fmt: str = "dense", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.w = QuantWeight(n, k, fmt, dtype)
        self.method = None

    def prepare(self, device: torch.device) -> None:
        self.method = select_linear_method(self.w, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        method = self.method or (DenseLinear() if self.w.fmt == "dense" else TorchQuantLinear())
        return method.apply(self.w, x)
