"""The learned model's shape: every layer kind of M3.1-Flash at about 12M parameters.

6 layers: full attention at layers 0 and 3, MSA (lightning indexer, 32-token blocks, top-4 + the local block) at the
other four; a dense MLP at layer 0 and MoE (8 experts, top-2, a shared expert) after it; QK-norm and partial RoPE (half
of each 64-dim head) as in every M3 config. MSA therefore attends to 4 x 32 = 128 selected tokens, and the retrieval
task's 619-token prompts (512 tokens of key-value pairs) are over 4x that span."""
from __future__ import annotations

from m3serve.config import FULL, SPARSE, ModelConfig
from m3serve.model import layout as L
from m3serve.model.tiny import tiny_config

INDEX_BLOCK_SIZE = 32
INDEX_TOPK_BLOCKS = 4


def learned_config(vocab_size: int, bos: int | None, eos: int | None, **over) -> ModelConfig:
    """The learned model's config (bf16 checkpoint); `over` changes fields."""
    d = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, dense_intermediate_size=512,
             shared_intermediate_size=256, layer_types=[FULL, SPARSE, SPARSE, FULL, SPARSE, SPARSE],
             mlp_layer_types=["dense"] + ["sparse"] * 5, index_n_heads=2, index_head_dim=64,
             index_block_size=INDEX_BLOCK_SIZE, index_topk_blocks=INDEX_TOPK_BLOCKS)
    d.update(over)
    return tiny_config(vocab_size, bos, eos, **d)


def selected_span(cfg: ModelConfig) -> int:
    """Tokens an MSA query attends to at most: the top-k blocks."""
    return cfg.index_block_size * cfg.index_topk_blocks


def make_learned(out_dir: str, state: dict | None = None, seed: int = 0, dtype: str = "bfloat16",
                 max_shard_bytes: int = 16 << 20, random_dspark: bool = False) -> ModelConfig:
    """Write the learned model's tokenizer (trained from the tasks with `seed`), config and weights to `out_dir` in
    the transformers layout (which transformers 5.25 loads as it is): `state` in transformers names (the trained
    weights), or seeded random weights when None (for tests). `random_dspark`: also a seeded random DSpark draft in
    `out_dir/dspark` (tapping layers 1, 3, 5; its mask token the unused video token), for tests."""
    from m3serve.learn.tokenizer import build_tokenizer
    from m3serve.model.tiny import random_state, write_model

    tok = build_tokenizer(out_dir, seed=seed)
    vocab = -(-tok["vocab_size"] // 64) * 64
    cfg = learned_config(vocab, tok["bos_token_id"], tok["eos_token_id"], dtype=dtype)
    write_model(out_dir, cfg, random_state(cfg, seed) if state is None else state, L.TRANSFORMERS, dtype,
                max_shard_bytes)
    if random_dspark:
        from m3serve.model.dspark_tiny import make_tiny_dspark
        from m3serve.text.tokenizer import Tokenizer

        mask = Tokenizer.from_pretrained(out_dir).token_id("]<]video[>[")
        make_tiny_dspark(out_dir, seed=seed, dtype=dtype, target_layer_ids=[1, 3, 5], mask_token_id=mask)
    return cfg
