"""A tiny random DSpark draft for the tiny MiniMax-M3 (`make-tiny` writes it to `<tiny>/dspark/` by default):
seeded, a few hundred KB, in the DeepSeek checkpoint format, so tests and the demo go through the real
loading code. It taps three of the tiny target's four layers, drafts blocks of 7 (the launch line's
num_speculative_tokens), and has a vanilla Markov head and a confidence head with Markov features. Its
`embed_tokens` / `lm_head` are copies of the target's (as DeepSeek's checkpoints carry them).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from m3serve.config import ModelConfig
from m3serve.model import layout as L
from m3serve.model.dspark_config import DSparkConfig
from m3serve.model.dspark_vocab import DRAFT_VOCAB_TENSOR, select_draft_vocab
from m3serve.model.loader import list_tensors

TINY_MASK_TOKEN = 511  # "]<]video[>[" in the tiny tokenizer: never produced by text


def tiny_dspark_config(target: ModelConfig, **over) -> DSparkConfig:
    d = dict(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_hidden_layers=2,
             num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
             head_dim=target.head_dim, intermediate_size=target.dense_intermediate_size, block_size=7,
             target_layer_ids=[0, 1, 2], num_target_layers=target.num_hidden_layers,
             mask_token_id=min(TINY_MASK_TOKEN, target.vocab_size - 1), markov_rank=16,
             markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
             rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
             partial_rotary_factor=target.partial_rotary_factor)
    d.update(over)
    return DSparkConfig(**d)


def random_dspark_state(cfg: DSparkConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random draft weights under the checkpoint names (fp32), without embed_tokens / lm_head."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.05, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    h, hd, i, r = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.markov_rank
    norm_mean = 0.0 if cfg.rms_norm_unit_offset else 1.0
    sd = {"fc.weight": rnd(h, cfg.num_taps * h, std=0.1), "hidden_norm.weight": rnd(h, std=0.1, mean=norm_mean),
          "norm.weight": rnd(h, std=0.1, mean=norm_mean)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        sd[p + "self_attn.q_proj.weight"] = rnd(cfg.num_attention_heads * hd, h, std=0.15)
        sd[p + "self_attn.k_proj.weight"] = rnd(cfg.num_key_value_heads * hd, h, std=0.15)
        sd[p + "self_attn.v_proj.weight"] = rnd(cfg.num_key_value_heads * hd, h, std=0.15)
        sd[p + "self_attn.o_proj.weight"] = rnd(h, cfg.num_attention_heads * hd, std=0.1)
        sd[p + "self_attn.q_norm.weight"] = rnd(hd, std=0.1, mean=norm_mean)
        sd[p + "self_attn.k_norm.weight"] = rnd(hd, std=0.1, mean=norm_mean)
        sd[p + "mlp.gate_proj.weight"] = rnd(i, h, std=0.15)
        sd[p + "mlp.up_proj.weight"] = rnd(i, h, std=0.15)
        sd[p + "mlp.down_proj.weight"] = rnd(h, i, std=0.1)
        sd[p + "input_layernorm.weight"] = rnd(h, std=0.1, mean=norm_mean)
        sd[p + "post_attention_layernorm.weight"] = rnd(h, std=0.1, mean=norm_mean)
    if r:
        sd["markov_head.markov_w1.weight"] = rnd(cfg.vocab_size, r, std=0.5)
        sd["markov_head.markov_w2.weight"] = rnd(cfg.vocab_size, r, std=0.3)
        if cfg.markov_head_type == "gated":
            sd["markov_head.gate_proj.weight"] = rnd(r, h + r, std=0.1)
            sd["markov_head.gate_proj.bias"] = rnd(r, std=0.1)
        elif cfg.markov_head_type == "rnn":
            sd["markov_head.joint_proj.weight"] = rnd(3 * r, 2 * r + h, std=0.1)
            sd["markov_head.joint_proj.bias"] = rnd(3 * r, std=0.1)
    if cfg.enable_confidence_head:
        sd["confidence_head.proj.weight"] = rnd(1, h + (r if cfg.confidence_head_with_markov else 0), std=0.1)
        sd["confidence_head.proj.bias"] = rnd(1, std=0.1)
    return sd


def _target_tensor(target_dir: str, path: str) -> torch.Tensor | None:
    """The target checkpoint's tensor at internal module path `path` (embedding or lm_head), or None."""
    weight_map = list_tensors(target_dir)
    name = L.checkpoint_name(L.detect_layout(weight_map), None, path, None, None, "weight")
    if name not in weight_map:
        return None
    with safe_open(os.path.join(target_dir, weight_map[name]), "pt") as s:
        return s.get_tensor(name)


def write_dspark(out_dir: str, cfg: DSparkConfig, state: dict[str, torch.Tensor],
                 draft_vocab_ids: Sequence[int] | torch.Tensor | None = None) -> None:
    """A draft checkpoint: `config.json` + one `model.safetensors` holding `state` (checkpoint names), and with
    `draft_vocab_ids` (vocabulary ids, most frequent first: model/dspark_vocab.py) the subset a draft may propose
    from (checked as the loader checks it)."""
    state = dict(state)
    if draft_vocab_ids is not None:
        ids = torch.as_tensor(draft_vocab_ids, dtype=torch.int64).reshape(-1)
        select_draft_vocab(ids, ids.numel(), cfg.vocab_size)
        state[DRAFT_VOCAB_TENSOR] = ids
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)


def make_tiny_dspark(target_dir: str, out_dir: str | None = None, seed: int = 0, dtype: str = "bfloat16",
                     draft_vocab_ids: Sequence[int] | None = None, **over) -> DSparkConfig:
    """Write a seeded random draft for the model in `target_dir` to `out_dir` (default `<target>/dspark`), with a
    draft vocabulary `draft_vocab_ids` if given."""
    target = ModelConfig.from_pretrained(target_dir)
    cfg = tiny_dspark_config(target, **over)
    state = {k: v.to(getattr(torch, dtype)) for k, v in random_dspark_state(cfg, seed).items()}
    embed = _target_tensor(target_dir, "model.embed_tokens.weight")
    head = _target_tensor(target_dir, "lm_head.w")
    state["embed_tokens.weight"] = embed
    state["lm_head.weight"] = embed.clone() if head is None else head
    write_dspark(out_dir or os.path.join(target_dir, "dspark"), cfg, state, draft_vocab_ids)
    return cfg
