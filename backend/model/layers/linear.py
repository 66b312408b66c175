"""Linear layers and their methods: the weight's format and the device pick how `y = x W^T` runs, once at load.

- `DenseLinear`: bf16/fp32 weights straight to the BLAS (F.linear), never converted per call.
- `TorchQuantLinear`: the reference for NVFP4 / MXFP8 / FP8 weights: dequantize, then F.linear (CPU, tests).
- `KernelQuantLinear`: the Triton kernels (kernels/quant_linear.py) decode the packed weights in registers (CUDA);
  the weight is laid out for them once and the checkpoint layout released.

Tensor parallelism (nano-vllm's split): `ColumnParallelLinear` holds N/size output rows (of each of `parts` blocks,
e.g. gate | up), `RowParallelLinear` holds K/size input columns and sums the partial outputs over the ranks. Each
holds only its shard (`w.shard` tells the loader which slice to read) and still hands its local GEMM to its method.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.distributed.parallel import Parallel
from m3serve.model.sharding import Shard
from m3serve.model.weights import QuantWeight


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
    """Dense: cuBLAS; quantized on CUDA: the kernels, at any N and K (tests/gpu/test_odd_shapes_gpu.py); else the
    torch reference."""
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
        if self.w.released:
            return  # a fused kernel (the MoE layer's, for its shared expert) holds this weight in its own layout
        self.method = select_linear_method(self.w, device, self.method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        method = self.method or (DenseLinear() if self.w.fmt == "dense" else TorchQuantLinear())
        return method.apply(self.w, x)


class ColumnParallelLinear(Linear):
    """y[:, this rank's output rows] = x W_shard^T; the output stays split (the next layer takes it as it is).
    `head_dim`: the rows are heads of that size, split by `Parallel.split_heads` (replicated below one per rank)."""

    def __init__(self, k: int, n: int, parallel: Parallel, parts: int = 1, fmt: str = "dense",
                 dtype: torch.dtype = torch.float32, head_dim: int | None = None):
        if head_dim is None:
            start, stop = parallel.split(n // parts, f"output size {n // parts}")
        else:
            h0, h1 = parallel.split_heads(n // head_dim, f"{n // head_dim} heads")
            start, stop = h0 * head_dim, h1 * head_dim
        super().__init__(k, (stop - start) * parts, fmt, dtype)
        if parallel.size > 1:
            self.w.shard = Shard(rows=(start, stop), parts=parts)


class RowParallelLinear(Linear):
    """y = sum over ranks of x[:, this rank's K columns] W_shard^T (`reduce=False`: the caller sums once for
    several partial outputs, e.g. the routed and the shared experts)."""

    def __init__(self, k: int, n: int, parallel: Parallel, fmt: str = "dense", dtype: torch.dtype = torch.float32,
                 reduce: bool = True):
        start, stop = parallel.split(k, f"input size {k}")
        super().__init__(stop - start, n, fmt, dtype)
        self.parallel, self.reduce = parallel, reduce
        if parallel.size > 1:
            self.w.shard = Shard(cols=(start, stop))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.parallel.all_reduce(y) if self.reduce else y
