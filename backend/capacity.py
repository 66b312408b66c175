"""`m3serve capacity`: how many sequences of a given length fit, from the cache bytes per token.

With `gpus` = N tensor-parallel ranks, each rank holds 1/N of the sharded weights plus every replicated one (router,
the indexer's shared key projection), 1/N of the KV heads' cache (at least one head) and all of the indexer keys
(one head, replicated); the pool has the same number of pages on every rank, so the limits are those of one rank
(`per_rank`)."""
from __future__ import annotations

from m3serve.config import (ModelConfig, indexer_bytes_per_token, kv_bytes_per_token, normalize_kv_dtype,
                            page_count)

# what the driver holds per process outside PyTorch's allocator (the CUDA context, cuBLAS / Triton modules): 0.61 GiB
# measured by benchmarks/bench_rank.py on an H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130 (2026-12-06,
# docs/performance.md); the engine sizes its pool from the free memory it sees, so the planner leaves this out too
CUDA_CONTEXT_GB = 0.66

# bytes per parameter by format, scales included
_WEIGHT_BYTES = {"bfloat16": 2.0, "nvfp4": 0.5 + 1 / 16, "mxfp8": 1.0 + 1 / 32}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    indexer = h * cfg.index_head_dim * (cfg.index_n_heads + 1)
    expert = 3 * h * cfg.intermediate_size
    shared = 3 * h * cfg.shared_intermediate_size
    dense = 3 * h * cfg.dense_intermediate_size
    router = cfg.num_local_experts * h
    n = cfg.num_hidden_layers
    out = {
        "attention": attn * n, "indexer": indexer * cfg.num_sparse_layers,
        "routed_experts": expert * cfg.num_local_experts * cfg.num_moe_layers,
        "shared_experts": shared * cfg.num_moe_layers, "router": router * cfg.num_moe_layers,
        "dense_mlp": dense * (n - cfg.num_moe_layers),
        "embeddings": cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2),
    }
    out["total"] = sum(out.values())
    return out


def replicated_params(cfg: ModelConfig) -> int:
    """Parameters every tensor-parallel rank holds in full: the routers and the indexer's key projection."""
    return cfg.num_local_experts * cfg.hidden_size * cfg.num_moe_layers + \
        cfg.hidden_size * cfg.index_head_dim * cfg.num_sparse_layers


def row_scale_bytes(cfg: ModelConfig, fmt: str, intermediate: int, matrices: int, ranks: int = 1) -> int:
    """NVFP4 weights as laid out for the kernels keep one fp32 scale per output row of every matrix (the
    checkpoint's per-tensor `weight_scale_2` spread over the rows, kernels/weight_layout.py): `matrices` MLPs of
    `intermediate` width; a tensor-parallel rank holds its slice of gate_up's rows and all of down_proj's (hidden)
    rows. Other formats have none."""
    if fmt != "nvfp4":
        return 0
    return 4 * matrices * (2 * intermediate // ranks + cfg.hidden_size)


def weight_bytes(cfg: ModelConfig, experts: str = "bfloat16", shared: str = "bfloat16", ranks: int = 1) -> int:
    """Weight bytes in memory of the whole model (ranks=1) or of one of `ranks` tensor-parallel ranks."""
    p = param_counts(cfg)
    rest = p["total"] - p["routed_experts"] - p["shared_experts"]
    total = p["routed_experts"] * _WEIGHT_BYTES[experts] + p["shared_experts"] * _WEIGHT_BYTES[shared] + rest * 2
    replicated = replicated_params(cfg) * 2
    rows = row_scale_bytes(cfg, experts, cfg.intermediate_size, cfg.num_local_experts * cfg.num_moe_layers, ranks) \
        + row_scale_bytes(cfg, shared, cfg.shared_intermediate_size, cfg.num_moe_layers, ranks)
    fp32_router = p["router"] * 2  # the routers stay in fp32 (4 bytes, not the 2 counted above), on every rank
    return int((total - replicated) / ranks + replicated) + rows + fp32_router


def plan(cfg: ModelConfig, kv_cache_dtype: str, indexer_kv_dtype: str | None = None, gpus: int = 1,
         gpu_memory_gb: float = 141.0, seq_len: int = 262144, weights_gb: float | None = None,
         gpu_memory_utilization: float = 0.9, block_size: int | None = None,
         activation_reserve_gb: float = 4.0, cuda_context_gb: float = CUDA_CONTEXT_GB) -> dict:
    """The cache budget per rank: `gpu_memory_gb` x `gpu_memory_utilization`, less the activation reserve, the
    rank's weights and `cuda_context_gb` (what the driver holds for a process outside PyTorch's allocator)."""
    if not 0 <= cuda_context_gb < float("inf"):  # NaN too
        raise ValueError(f"cuda_context_gb: must be a finite number >= 0, got {cuda_context_gb!r}")
    kv = normalize_kv_dtype(kv_cache_dtype)
    idx = kv if indexer_kv_dtype in (None, "auto") else normalize_kv_dtype(indexer_kv_dtype)
    q = cfg.quantization_config or {}
    if weights_gb is None:
        experts = "nvfp4" if q.get("routed_experts") == "NVFP4" else "bfloat16"
        shared = {"MXFP8": "mxfp8", "NVFP4": "nvfp4"}.get(q.get("shared_experts"), "bfloat16")
        wbytes, rank_wbytes = weight_bytes(cfg, experts, shared), weight_bytes(cfg, experts, shared, gpus)
    else:
        wbytes = int(weights_gb * 1e9)
        rank_wbytes = wbytes // gpus  # given as a total: assumed evenly split
    kv_tok, idx_tok = kv_bytes_per_token(cfg, kv), indexer_bytes_per_token(cfg, idx)
    heads = max(cfg.num_key_value_heads // gpus, 1)  # fewer KV heads than ranks: one each, replicated
    rank_tok = kv_tok * heads / cfg.num_key_value_heads + idx_tok  # a rank caches its KV heads, every index key
    block = block_size or cfg.index_block_size
    per_seq = page_count(seq_len, block) * block * rank_tok
    reserve = (activation_reserve_gb + cuda_context_gb) * 1e9
    budget = gpu_memory_gb * 1e9 * gpu_memory_utilization - reserve - rank_wbytes
    return {
        "kv_cache_dtype": kv, "indexer_kv_dtype": idx,
        "kv_bytes_per_token": kv_tok, "indexer_bytes_per_token": idx_tok,
        "cache_bytes_per_token": kv_tok + idx_tok,
        "weight_bytes": wbytes, "gpus": gpus, "gpu_memory_gb": gpu_memory_gb, "seq_len": seq_len,
        "cache_budget_bytes": max(int(budget), 0) * gpus,
        "max_concurrent_sequences": max(int(budget // per_seq), 0) if per_seq else 0,
        "max_cached_tokens": max(int(budget // rank_tok), 0),
        "per_rank": {"weight_bytes": rank_wbytes, "cache_bytes_per_token": int(round(rank_tok)),
                     "cache_budget_bytes": max(int(budget), 0)},
    }
