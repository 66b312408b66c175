"""The reference model's tiny random configs and weights (transformers 5.25 `MiniMaxM3VLForCausalLM`), shared by
the parity tests (tests/reference)."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("USE_HUB_KERNELS", "0")
from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig  # noqa: E402

BLOCK, TOPK = 4, 2


def hf_config(seed: int, **over) -> MiniMaxM3VLTextConfig:
    g = torch.Generator().manual_seed(seed)
    n_kv = [1, 2][int(torch.randint(0, 2, (1,), generator=g))]
    d = dict(vocab_size=128, hidden_size=48, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4 * n_kv,
             num_key_value_heads=n_kv, head_dim=16, dense_intermediate_size=64, shared_intermediate_size=32,
             num_local_experts=6, num_experts_per_tok=2, index_n_heads=n_kv, index_head_dim=16,
             index_block_size=BLOCK, index_topk_blocks=TOPK, rotary_dim=8, bos_token_id=1, eos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
             layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "minimax_m3_sparse"],
             mlp_layer_types=["dense", "sparse", "dense", "sparse"], routed_scaling_factor=2.0)
    d.update(over)
    return MiniMaxM3VLTextConfig(**d)


def hf_model(cfg, seed: int) -> MiniMaxM3VLForCausalLM:
    torch.manual_seed(seed)
    m = MiniMaxM3VLForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.2)  # Gemma offsets: non-zero so that (1 + w) matters
            elif "gate.weight" in name:
                p.normal_(0, 1.0)  # a router with real preferences
            else:
                p.normal_(0, 0.15)
        for name, b in m.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.3)
    return m
