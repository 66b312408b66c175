"""The MoE layer: sigmoid router with correction bias, top-k routed experts (SwiGLU-OAI), shared expert.

Its method is picked once at load (`SparseMoE.prepare`), by the experts' weight format and the device:
- `TorchMoE`: the reference (dequantize the routed experts' weights, per expert; loops on the host over the
  experts that got tokens, so it synchronises: CPU and tests).
- `KernelMoE`: the Triton MoE layer (kernels/moe.py: router with on-device grouping, grouped expert GEMMs that
  decode NVFP4 / MXFP8 / FP8 weights in registers, SwiGLU-OAI fused, the shared expert in the same launches or,
  when its width differs from the routed experts' (under EP), in two of its own, combine): CUDA, quantized experts
  or bf16/fp16 ones. With expert parallelism the router picks among every expert
  and the kernels run this rank's (the others' assignments masked), so the output is the rank's partial sum. The
  weights are laid out for it once and the checkpoint layout released. No host synchronisation (CUDA-graph safe).
- `DenseMoE`: every expert over every token, the routing weights (zero for experts not chosen) combining them: no
  host synchronisation either, exact, E times the work. On CUDA for fp32 dense experts only (the small test models,
  whose fp32 tests expect fp32 products, not the kernels' tf32 dots). Every quantized or bf16 expert / shared-expert
  format pair at any shape runs `KernelMoE` (tests/gpu/test_odd_shapes_gpu.py).
- `Fp8DotsReferenceMoE`: off CUDA with `Tuning.a8` on and quantized experts, the kernels' FP8-dot arithmetic in torch
  (the accuracy table of the a8 tiles on the CPU).

Tensor parallelism: the shared expert and the dense MLPs split their FFN over the ranks (gate_up by rows, down by
columns); the routed experts either split each expert's FFN the same way or, with expert parallelism, each rank
holds E/N whole experts (`Experts.first_expert`...) and runs the tokens routed to them (every rank has every token
after attention's all-reduce: that is the dispatch). Either way each rank's routed + shared output is a partial
sum, and `SparseMoE` sums them over the ranks with one all-reduce (the combine).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.config import ModelConfig
from m3serve.distributed.parallel import Parallel
from m3serve.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from m3serve.model.sharding import Shard
from m3serve.model.weights import QuantWeight

def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate|up (not interleaved): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class DenseMLP(nn.Module):
    """`reduce=False`: the output is this rank's partial sum (the MoE layer sums it with the routed experts')."""

    def __init__(self, cfg: ModelConfig, inter: int, dtype: torch.dtype, fmt: str = "dense",
                 parallel: Parallel | None = None, reduce: bool = True):
        super().__init__()
        parallel = parallel or Parallel()
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * inter, parallel, parts=2, fmt=fmt,
                                                 dtype=dtype)  # gate rows first
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, parallel, fmt=fmt, dtype=dtype, reduce=reduce)

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
    """This rank's routed experts' stacked weights: gate_up [E_r, 2I_r, H] (gate rows first), down [E_r, H, I_r].

    Router ids are global: local expert j is global expert `first_expert + j`, for j < `num_experts`; of
    `total_experts`. Tensor-parallel: every expert, I_r = I/N. Expert-parallel: E_r = E/N whole experts."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fmt: str = "dense", parallel: Parallel | None = None):
        super().__init__()
        parallel = parallel or Parallel()
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.total_experts, self.first_expert, self.num_experts = e, 0, e
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        gate_up = down = Shard()
        if parallel.size > 1 and parallel.expert_parallel:
            self.first_expert, stop = parallel.split(e, "num_local_experts")
            self.num_experts = stop - self.first_expert
            gate_up = down = Shard(experts=(self.first_expert, stop))
        elif parallel.size > 1:
            i0, i1 = parallel.split(i, "intermediate_size")
            i = i1 - i0
            gate_up, down = Shard(rows=(i0, i1), parts=2), Shard(cols=(i0, i1))
        self.gate_up_proj = QuantWeight(2 * i, h, fmt, dtype, lead=(self.num_experts,), shard=gate_up)
        self.down_proj = QuantWeight(h, i, fmt, dtype, lead=(self.num_experts,), shard=down)

    def local_ids(self, idx: torch.Tensor) -> list[int]:
        """The local indices of this rank's experts that some token was routed to (synchronises with the host)."""
        first, n = self.first_expert, self.num_experts
        return [e - first for e in torch.unique(idx).tolist() if first <= e < first + n]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e over the tokens x (weights dequantized: the reference math)."""
        h = F.linear(x, self.gate_up_proj.dequantize(e, x.dtype))
        return F.linear(swiglu_oai(h, self.alpha, self.limit), self.down_proj.dequantize(e, x.dtype))


class TorchMoE:
    """A method's `apply(layer, x)` computes the whole layer (router, routed experts, shared expert) of this rank, so
    a fused kernel can take all of it (the layer then sums the ranks' outputs); the torch methods differ only in how
    they run the routed experts."""

    name = "torch-reference"

    def apply(self, layer: "SparseMoE", x: torch.Tensor) -> torch.Tensor:
        weights, idx = layer.gate(x)
        return self.routed(layer.experts, x, weights, idx) * layer.scaling + layer.shared_experts(x)

    def routed(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in experts.local_ids(idx):
            tok, slot = torch.where(idx == e + experts.first_expert)
            h = experts.expert(e, x[tok])
            out.index_add_(0, tok, (h * weights[tok, slot, None].to(h.dtype)).float())
        return out.to(x.dtype)


class DenseMoE(TorchMoE):
    name = "dense-all-experts"

    def routed(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        combine = torch.zeros(x.shape[0], experts.total_experts, dtype=torch.float32, device=x.device)
        combine.scatter_(1, idx, weights.float())
        combine = combine[:, experts.first_expert:experts.first_expert + experts.num_experts]
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
                         top_k=layer.gate.top_k, routed_scaling=layer.scaling, alpha=e.alpha, limit=e.limit,
                         first_expert=e.first_expert)


class Fp8DotsReferenceMoE:
    """The arithmetic of the kernels' FP8 dots (`Tuning.a8`) in torch, where no GPU runs them (`kernels.moe.
    fused_moe_ref(..., a8=True)`: activations rounded to e4m3 per row, the quantized weights as the a8 tiles round
    them), so that the accuracy table can judge them on the CPU (`m3serve eval-tasks --paths nvfp4-a8`)."""

    name = "fp8-dots-reference"

    def __init__(self, layer: "SparseMoE"):
        from m3serve.kernels.moe import moe_prepare_module
        self.weights = moe_prepare_module(layer, layer.experts.gate_up_proj.dtype)

    def apply(self, layer: "SparseMoE", x: torch.Tensor) -> torch.Tensor:
        from m3serve.kernels.moe import fused_moe_ref
        e = layer.experts
        return fused_moe_ref(x, layer.gate.weight, layer.gate.e_score_correction_bias, self.weights,
                             top_k=layer.gate.top_k, routed_scaling=layer.scaling, alpha=e.alpha, limit=e.limit,
                             first_expert=e.first_expert, a8=True)


def select_moe_method(layer: "SparseMoE", device: torch.device):
    if device.type != "cuda":
        from m3serve.kernels.dispatch import tuning
        return Fp8DotsReferenceMoE(layer) if tuning().a8 and layer.experts.gate_up_proj.fmt != "dense" else TorchMoE()
    if isinstance(layer.method, KernelMoE):
        return layer.method
    e = layer.experts
    if e.gate_up_proj.fmt == "dense" and e.gate_up_proj.dtype == torch.float32:
        return DenseMoE()
    return KernelMoE(layer)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, expert_fmt: str = "dense", shared_fmt: str = "dense",
                 parallel: Parallel | None = None):
        super().__init__()
        self.parallel = parallel or Parallel()
        self.scaling = cfg.routed_scaling_factor
        self.gate = Router(cfg)  # replicated: every rank routes every token alike
        self.experts = Experts(cfg, dtype, expert_fmt, self.parallel)
        self.shared_experts = DenseMLP(cfg, cfg.shared_intermediate_size, dtype, shared_fmt, self.parallel,
                                       reduce=False)
        self.method = None

    def prepare(self, device: torch.device) -> None:
        self.method = select_moe_method(self, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce((self.method or TorchMoE()).apply(self, x))
