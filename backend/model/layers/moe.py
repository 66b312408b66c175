"""The MoE layer: sigmoid router with correction bias, top-k routed experts (SwiGLU-OAI), shared expert.

Its method is picked once at load (`SparseMoE.prepare`), by the experts' weight format and the device:
- `TorchMoE`: the reference (dequantize the routed experts' weights, per expert; loops on the host over the
  experts that got tokens, so it synchronises: CPU and tests).
- `KernelMoE`: the Triton MoE layer (kernels/moe.py: router with on-device grouping, grouped expert GEMMs that
  decode NVFP4 / MXFP8 / FP8 weights in registers, SwiGLU-OAI fused, the shared expert in the same launches,
  combine): CUDA, quantized experts or bf16/fp16 ones. The weights are laid out for it once and the checkpoint
  layout released. No host synchronisation (CUDA-graph safe).
- `DenseMoE`: fp32 dense experts on CUDA (the small test models), no host synchronisation either: every expert
  runs over every token and the routing weights (zero for experts not chosen) combine them. Exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.config import ModelConfig
from m3serve.model.layers.linear import Linear
from m3serve.model.weights import QuantWeight


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate|up (not interleaved): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, inter: int, dtype: torch.dtype, fmt: str = "dense"):
        super().__init__()
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, fmt=fmt, dtype=dtype)  # gate rows first
        self.down_proj = Linear(inter, cfg.hidden_size, fmt=fmt, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))


class Router(nn.Module):
    """Sigmoid router with correction bias (bias chooses, does not weigh); fp32 throughout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.num_local_experts, cfg.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_local_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Renormalised routing weights [T, k] (fp32) and expert ids [T, k]."""
        probs = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        _, idx = torch.topk(probs + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False)
        w = probs.gather(1, idx)
        return w / w.sum(-1, keepdim=True), idx


class Experts(nn.Module):
    """The routed experts' stacked weights: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fmt: str = "dense"):
        super().__init__()
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.num_experts = e
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = QuantWeight(2 * i, h, fmt, dtype, lead=(e,))
        self.down_proj = QuantWeight(h, i, fmt, dtype, lead=(e,))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e over the tokens x (weights dequantized: the reference math)."""
        h = F.linear(x, self.gate_up_proj.dequantize(e, x.dtype))
        return F.linear(swiglu_oai(h, self.alpha, self.limit), self.down_proj.dequantize(e, x.dtype))


class TorchMoE:
    """A method's `apply(layer, x)` computes the whole layer (router, routed experts, shared expert), so a fused
    kernel can take all of it; the torch methods differ only in how they run the routed experts."""

    name = "torch-reference"

    def apply(self, layer: "SparseMoE", x: torch.Tensor) -> torch.Tensor:
        weights, idx = layer.gate(x)
        return self.routed(layer.experts, x, weights, idx) * layer.scaling + layer.shared_experts(x)

    def routed(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            h = experts.expert(e, x[tok])
            out.index_add_(0, tok, (h * weights[tok, slot, None].to(h.dtype)).float())
        return out.to(x.dtype)


class DenseMoE(TorchMoE):
    name = "dense-all-experts"

    def routed(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        combine = torch.zeros(x.shape[0], experts.num_experts, dtype=torch.float32, device=x.device)
        combine.scatter_(1, idx, weights.float())
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(experts.num_experts):
            out += combine[:, e:e + 1] * experts.expert(e, x).float()
        return out.to(x.dtype)


class KernelMoE:
    name = "triton-fused"

    def __init__(self, layer: "SparseMoE"):
        from m3serve.kernels.moe import moe_prepare_module
        self.weights = moe_prepare_module(layer, layer.experts.gate_up_proj.dtype)
        for w in (layer.experts.gate_up_proj, layer.experts.down_proj, layer.shared_experts.gate_up_proj.w,
                  layer.shared_experts.down_proj.w):
            w.release()

    def apply(self, layer: "SparseMoE", x: torch.Tensor) -> torch.Tensor:
        from m3serve.kernels.moe import fused_moe
        e = layer.experts
        return fused_moe(x, layer.gate.weight, layer.gate.e_score_correction_bias, self.weights,
                         top_k=layer.gate.top_k, routed_scaling=layer.scaling, alpha=e.alpha, limit=e.limit)


def select_moe_method(layer: "SparseMoE", device: torch.device):
    if device.type != "cuda":
        return TorchMoE()
    if isinstance(layer.method, KernelMoE):
        return layer.method
    if layer.experts.gate_up_proj.fmt == "dense" and layer.experts.gate_up_proj.dtype == torch.float32:
        return DenseMoE()
    return KernelMoE(layer)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, expert_fmt: str = "dense", shared_fmt: str = "dense"):
        super().__init__()
        self.scaling = cfg.routed_scaling_factor
        self.gate = Router(cfg)
        self.experts = Experts(cfg, dtype, expert_fmt)
        self.shared_experts = DenseMLP(cfg, cfg.shared_intermediate_size, dtype, shared_fmt)
        self.method = None

    def prepare(self, device: torch.device) -> None:
        self.method = select_moe_method(self, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.method or TorchMoE()).apply(self, x)
