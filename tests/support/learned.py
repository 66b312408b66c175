"""The micro learned-model geometries the trainer's CPU tests share (learn.config.learned_config overrides), every layer
kind (full attention, MSA with its indexer, dense and MoE MLPs) at a few thousand parameters: `MICRO`, three layers
with two query heads per KV head (the fast paths' GQA), and `MICRO_2L`, two layers of single-KV-head attention (whole
training runs: the fastest model that still has every kind)."""
from m3serve.config import FULL, SPARSE

MICRO = dict(hidden_size=32, head_dim=16, index_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
             index_n_heads=2, intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32,
             num_hidden_layers=3, layer_types=[FULL, SPARSE, SPARSE], mlp_layer_types=["dense", "sparse", "sparse"],
             num_local_experts=4, index_block_size=8, index_topk_blocks=2)
MICRO_2L = dict(hidden_size=32, head_dim=16, index_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
                index_n_heads=1, intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32,
                num_hidden_layers=2, layer_types=[FULL, SPARSE], mlp_layer_types=["dense", "sparse"],
                num_local_experts=4, index_block_size=8, index_topk_blocks=2)
