"""`m3serve make-tiny`: a tiny random MiniMax-M3 (seeded, a few MB) with every layer kind: full and
sparse (MSA) attention, dense and MoE MLPs, plus the tiny tokenizer and chat template. It is written
as a real checkpoint (sharded safetensors + index, original Hub or transformers layout), so the
demo and the tests go through the real loading code."""
from __future__ import annotations

import json
import os

import torch

from m3serve.config import FULL, SPARSE, ModelConfig
from m3serve.model import layout as L
from m3serve.model.checkpoint_writer import write_checkpoint


def tiny_config(vocab_size: int, bos: int | None, eos: int | None, **over) -> ModelConfig:
    d = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        bos_token_id=bos, eos_token_id=[eos] if eos is not None else [], num_local_experts=8,
        num_experts_per_tok=2, rope_theta=10000.0, partial_rotary_factor=0.5, dense_intermediate_size=128,
        shared_intermediate_size=64, layer_types=[FULL, SPARSE, SPARSE, FULL],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], index_n_heads=2, index_head_dim=32,
        index_block_size=16, index_topk_blocks=4, index_local_blocks=1, dtype="bfloat16",
    )
    d.update(over)
    return ModelConfig(**d)


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights in the internal (transformers-like) naming, fp32."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    h, hd, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h, std=0.5), "model.norm.weight": rnd(h, std=0.1),
          "lm_head.weight": rnd(cfg.vocab_size, h, std=0.2)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = rnd(h, std=0.1)
        sd[p + "post_attention_layernorm.weight"] = rnd(h, std=0.1)
        sd[p + "self_attn.q_proj.weight"] = rnd(cfg.num_attention_heads * hd, h, std=0.15)
        sd[p + "self_attn.k_proj.weight"] = rnd(cfg.num_key_value_heads * hd, h, std=0.15)
        sd[p + "self_attn.v_proj.weight"] = rnd(cfg.num_key_value_heads * hd, h, std=0.15)
        sd[p + "self_attn.o_proj.weight"] = rnd(h, cfg.num_attention_heads * hd, std=0.1)
        sd[p + "self_attn.q_norm.weight"] = rnd(hd, std=0.1)
        sd[p + "self_attn.k_norm.weight"] = rnd(hd, std=0.1)
        if cfg.is_sparse_attention(layer):
            di = cfg.index_head_dim
            sd[p + "self_attn.indexer.q_proj.weight"] = rnd(cfg.index_n_heads * di, h, std=0.3)
            sd[p + "self_attn.indexer.k_proj.weight"] = rnd(di, h, std=0.3)
            sd[p + "self_attn.indexer.q_norm.weight"] = rnd(di, std=0.1)
            sd[p + "self_attn.indexer.k_norm.weight"] = rnd(di, std=0.1)
        if cfg.is_moe(layer):
            sd[p + "mlp.gate.weight"] = rnd(e, h, std=0.3)
            sd[p + "mlp.gate.e_score_correction_bias"] = rnd(e, std=0.05)
            sd[p + "mlp.experts.gate_up_proj"] = rnd(e, 2 * i, h, std=0.15)
            sd[p + "mlp.experts.down_proj"] = rnd(e, h, i, std=0.1)
            s = cfg.shared_intermediate_size
            sd[p + "mlp.shared_experts.gate_up_proj.weight"] = rnd(2 * s, h, std=0.15)
            sd[p + "mlp.shared_experts.down_proj.weight"] = rnd(h, s, std=0.1)
        else:
            d = cfg.dense_intermediate_size
            sd[p + "mlp.gate_up_proj.weight"] = rnd(2 * d, h, std=0.15)
            sd[p + "mlp.down_proj.weight"] = rnd(h, d, std=0.1)
    return sd


def write_model(out_dir: str, cfg: ModelConfig, state: dict[str, torch.Tensor], layout: str = L.ORIGINAL,
                dtype: str = "bfloat16", max_shard_bytes: int = 1 << 20) -> None:
    """The checkpoint (`state` in transformers names), config.json and generation_config.json in `out_dir`."""
    write_checkpoint(out_dir, cfg, state, layout=layout, dtype=getattr(torch, dtype), max_shard_bytes=max_shard_bytes)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id[0],
                   "temperature": 1.0, "top_p": 0.95}, f, indent=2)


def make_tiny(out_dir: str, seed: int = 0, layout: str = L.ORIGINAL, dtype: str = "bfloat16",
              dspark: bool = True, **over) -> ModelConfig:
    """The tiny model in `out_dir` and (unless `dspark` is False) its tiny DSpark draft in `out_dir/dspark`, which
    `speculative_config` {"method": "dspark", ...} finds by default. `over`: config fields to change (e.g. 4 KV
    heads, so that 4 tensor-parallel ranks divide the model)."""
    from m3serve.text.tiny_tokenizer import build_tiny_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    tok = build_tiny_tokenizer(out_dir)
    vocab = -(-tok["vocab_size"] // 64) * 64  # embedding rows padded to a multiple of 64, as real models do
    cfg = tiny_config(vocab, tok["bos_token_id"], tok["eos_token_id"], dtype=dtype, **over)
    write_model(out_dir, cfg, random_state(cfg, seed), layout, dtype)
    if dspark:
        from m3serve.model.dspark_tiny import make_tiny_dspark

        make_tiny_dspark(out_dir, seed=seed, dtype=dtype)
    return cfg
