"""Linear weights as stored on the device: dense (bf16/fp32), NVFP4, MXFP8 or FP8 (per tensor / per channel).

One `QuantWeight` holds a weight of logical shape `[*lead, N, K]` (`lead` is the expert axis for
stacked experts). NVFP4 keeps its FP32 second-level scale per output row, so fused shards (gate|up)
with different `weight_scale_2` stay exact instead of taking the max. The torch path dequantizes on
use; kernels read the packed buffers directly.
"""
from __future__ import annotations

import torch
from torch import nn

from m3serve.kernels import mxfp8, nvfp4
from m3serve.model.sharding import Shard

FORMATS = ("dense", "nvfp4", "mxfp8", "fp8")


class QuantWeight(nn.Module):
    def __init__(self, n: int, k: int, fmt: str = "dense", dtype: torch.dtype = torch.float32,
                 lead: tuple[int, ...] = (), device: torch.device | str | None = None, shard: Shard | None = None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}")
        self.n, self.k, self.fmt, self.lead, self.dtype = n, k, fmt, tuple(lead), dtype  # this rank's shape
        self.released = False  # `release` ran: a kernel method holds the weight in its own layout
        self.shard = shard or Shard()  # which part of the checkpoint weight that is (tensor parallelism)
        shape = (*self.lead, n)
        if fmt == "dense":
            self.register_buffer("weight", torch.zeros(*shape, k, dtype=dtype, device=device))
        elif fmt == "nvfp4":
            if k % nvfp4.FP4_BLOCK:
                raise ValueError(f"NVFP4 needs K % 16 == 0, got K={k}")
            self.register_buffer("packed", torch.zeros(*shape, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer("block_scale", torch.zeros(*shape, k // 16, dtype=torch.float8_e4m3fn,
                                                            device=device))
            self.register_buffer("scale_2", torch.ones(*shape, dtype=torch.float32, device=device))
        elif fmt == "fp8":  # E4M3 with an fp32 scale per row (a per-tensor checkpoint scale is broadcast)
            self.register_buffer("qweight", torch.zeros(*shape, k, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("scale", torch.ones(*shape, dtype=torch.float32, device=device))
        else:
            if k % mxfp8.MX_BLOCK:
                raise ValueError(f"MXFP8 needs K % 32 == 0, got K={k}")
            self.register_buffer("qweight", torch.zeros(*shape, k, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("scale_e8m0", torch.full((*shape, k // 32), 127, dtype=torch.uint8,
                                                          device=device))

    # ---- the torch path ---------------------------------------------------------------------------
    def dequantize(self, index: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        if self.fmt == "dense":
            return pick(self.weight).to(dtype)
        if self.fmt == "nvfp4":
            w = nvfp4.dequantize_nvfp4(pick(self.packed), pick(self.block_scale), 1.0, torch.float32)
            return (w * pick(self.scale_2)[..., None]).to(dtype)
        if self.fmt == "fp8":
            return (pick(self.qweight).float() * pick(self.scale)[..., None]).to(dtype)
        return mxfp8.dequantize_mxfp8(pick(self.qweight), pick(self.scale_e8m0), torch.float32).to(dtype)

    def release(self) -> None:
        """Drop the stored tensors (a kernel method keeps them in its own layout); shapes and format stay known."""
        for name, buf in list(self._buffers.items()):
            self._buffers[name] = buf.new_empty(0)
        self.released = True

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # ---- loading ------------------------------------------------------------------------------
    def load(self, kind: str, t: torch.Tensor, index: int | None = None, rows: slice = slice(None),
             name: str = "") -> None:
        """Copy one checkpoint tensor into place. `kind` is the normalized tensor role:
        weight | weight_scale | weight_scale_2 (NVFP4, dequant side) | input_scale."""
        where = (index,) if index is not None else ()
        if kind == "input_scale":  # W4A4 activation scale; the W4A16 (Hopper) path does not use it
            return
        target = {
            ("dense", "weight"): "weight",
            ("nvfp4", "weight"): "packed",
            ("nvfp4", "weight_scale"): "block_scale",
            ("nvfp4", "weight_scale_2"): "scale_2",
            ("mxfp8", "weight"): "qweight",
            ("mxfp8", "weight_scale"): "scale_e8m0",
            ("fp8", "weight"): "qweight",
            ("fp8", "weight_scale"): "scale",
        }.get((self.fmt, kind))
        if target is None:
            raise ValueError(f"{name}: tensor role {kind!r} does not belong to a {self.fmt} weight")
        buf = getattr(self, target)
        dst = buf[where][rows] if where else buf[rows]
        if target == "scale_2":
            if t.numel() != 1:
                raise ValueError(f"{name}: expected a scalar weight_scale_2, found shape {tuple(t.shape)}")
            dst.fill_(float(t.reshape(())))
            return
        if target == "scale":  # fp8: per tensor (broadcast) or per output row
            if t.numel() not in (1, dst.numel()):
                raise ValueError(f"{name}: expected a scalar or {dst.numel()} weight scales, found {tuple(t.shape)}")
            dst.copy_(t.float().reshape(-1).expand(dst.numel()).reshape(dst.shape))
            return
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: expected shape {tuple(dst.shape)}, found {tuple(t.shape)}")
        if target in ("packed", "scale_e8m0") and t.dtype != torch.uint8:
            raise ValueError(f"{name}: expected dtype uint8, found {t.dtype}")
        if target in ("block_scale", "qweight") and t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: expected dtype float8_e4m3fn, found {t.dtype}")
        if target == "weight" and not t.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a floating-point weight, found {t.dtype}")
        dst.copy_(t)

    def extra_repr(self) -> str:
        return f"lead={self.lead}, n={self.n}, k={self.k}, fmt={self.fmt}"
