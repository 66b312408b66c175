"""Helpers for the MoE / quantized-GEMM tests and benchmark: random but valid quantized weights of any format and
size (drawn on the weight's own device, so M3-sized layers are cheap on a GPU), and a small `SparseMoE`."""
from __future__ import annotations

import torch

from m3serve.config import ModelConfig
from m3serve.model.layers.moe import SparseMoE


def _uniform(shape, lo, hi, gen, device):
    return torch.rand(shape, generator=gen, device=device) * (hi - lo) + lo


def _matrices(t: torch.Tensor):
    """`t`'s matrices one by one (one expert's at a time): the fp32 draw of a whole M3-sized layer would be 18 GiB."""
    return t.view(-1, *t.shape[-2:])


@torch.no_grad()
def fill_random(qw, gen: torch.Generator, std: float = 0.02) -> None:
    """Random weights in qw's format with roughly ``std`` spread: every code / byte value occurs, block scales vary
    over a 8x range, per-row second-level scales differ (so gate / up halves do too)."""
    dev = qw.packed.device if qw.fmt == "nvfp4" else (qw.weight.device if qw.fmt == "dense" else qw.qweight.device)
    if qw.fmt == "dense":
        for part in _matrices(qw.weight):
            part.copy_(torch.randn(part.shape, generator=gen, device=dev) * std)
    elif qw.fmt == "nvfp4":
        qw.packed.copy_(torch.randint(0, 256, qw.packed.shape, generator=gen, device=dev, dtype=torch.uint8))
        qw.block_scale.copy_(_uniform(qw.block_scale.shape, 8.0, 64.0, gen, dev).to(torch.float8_e4m3fn))
        qw.scale_2.copy_(_uniform(qw.scale_2.shape, 0.5, 1.5, gen, dev) * std / (3.0 * 30.0))
    else:
        for part in _matrices(qw.qweight):
            q = (torch.randn(part.shape, generator=gen, device=dev) * 100.0).clamp(-448, 448)
            part.copy_(q.to(torch.float8_e4m3fn))
        if qw.fmt == "mxfp8":
            e = torch.randint(-2, 2, qw.scale_e8m0.shape, generator=gen, device=dev) + 127 - 13
            qw.scale_e8m0.copy_(e.to(torch.uint8))
        else:
            qw.scale.copy_(_uniform(qw.scale.shape, 0.5, 1.5, gen, dev) * std / 100.0)


def m3_moe_config() -> ModelConfig:
    """M3's MoE shapes: hidden 6144, expert FFN 3072, 128 experts top-4, shared FFN 3072."""
    return tiny_moe_config(6144, 3072, 128, 4, 3072)


def tiny_moe_config(hidden=128, inter=64, experts=8, top_k=2, shared_inter=None) -> ModelConfig:
    return ModelConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                       num_experts_per_tok=top_k, shared_intermediate_size=shared_inter or inter,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=1,
                       layer_types=["full_attention"], mlp_layer_types=["sparse"])


def random_moe(cfg: ModelConfig, expert_fmt: str, shared_fmt: str, gen: torch.Generator, device="cpu",
               dtype=torch.float32, bias_std: float = 0.05, router_std: float = 2.4) -> SparseMoE:
    """A `SparseMoE` with random weights (router fp32 as the model keeps it; logits of std ``router_std`` for
    unit activations: large values saturate the sigmoid and let the bias concentrate tokens on a few experts,
    ~1 with a small bias routes nearly uniformly)."""
    with torch.device(device):  # built in place (an M3-sized layer is GBs)
        moe = SparseMoE(cfg, dtype, expert_fmt, shared_fmt)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=gen, device=device) * router_std
                              / cfg.hidden_size ** 0.5)
        moe.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_local_experts, generator=gen, device=device)
                                               * bias_std)
    for qw in (moe.experts.gate_up_proj, moe.experts.down_proj, moe.shared_experts.gate_up_proj.w,
               moe.shared_experts.down_proj.w):
        fill_random(qw, gen)
    return moe


def expert_slice(qw, first: int, n: int):
    """A `QuantWeight` of experts [first, first + n) of the stacked ``qw`` (an expert-parallel rank's share)."""
    from m3serve.model.weights import QuantWeight

    out = QuantWeight(qw.n, qw.k, qw.fmt, qw.dtype, lead=(n,), device=next(qw.buffers()).device)
    for name, buf in qw.named_buffers():
        getattr(out, name).copy_(buf[first:first + n])
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
