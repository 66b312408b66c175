"""Lightning indexer: which 128-token KV blocks each query attends to (MSA sparse layers).

`indexer_topk_ref` is the readable reference (transformers 5.25 `MiniMaxM3VLIndexer.forward`, for one
sequence): score every cached index key with each index head (fp32, no softmax), mask future keys,
max-pool per block, force the query's own (local) blocks, keep the top-k blocks per head, -1 for
slots whose score is -inf. Output `int32 [H_idx, T_q, topk]`: valid block ids left-packed in
descending score order, -1 right-padded, no duplicates.
"""
from __future__ import annotations

import torch


def indexer_topk_ref(
    iq: torch.Tensor,  # [T_q, H_idx, D_idx]  index queries (normed, RoPE applied)
    ik: torch.Tensor,  # [L, D_idx]           every index key of the sequence so far (normed, RoPE)
    q_pos: torch.Tensor,  # [T_q]             absolute positions of the queries
    block_size: int,
    topk: int,
    local_blocks: int = 1,
) -> torch.Tensor:
    t_q, n_heads, _ = iq.shape
    k_len = ik.shape[0]
    n_blocks = -(-k_len // block_size)
    scores = torch.einsum("qhd,kd->hqk", iq.float(), ik.float())
    future = torch.arange(k_len, device=iq.device)[None, :] > q_pos[:, None]  # [T_q, L]
    scores = scores.masked_fill(future[None], float("-inf"))
    pad = n_blocks * block_size - k_len
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    block_scores = scores.view(n_heads, t_q, n_blocks, block_size).amax(-1)  # [H, T_q, n_blocks]
    if local_blocks > 0:
        own = q_pos // block_size
        local = (own[:, None] - torch.arange(local_blocks, device=iq.device)[None, :]).clamp(min=0)
        block_scores.scatter_(-1, local[None].expand(n_heads, -1, -1), float("inf"))
    k = min(topk, n_blocks)
    top_scores, top_idx = block_scores.topk(k, dim=-1)
    top_idx = top_idx.masked_fill(top_scores == float("-inf"), -1).to(torch.int32)
    if k < topk:
        top_idx = torch.nn.functional.pad(top_idx, (0, topk - k), value=-1)
    return top_idx
