"""MSA block-sparse attention: each query attends only to the keys of its KV head's selected blocks.

`msa_attention_ref` is the readable reference for one sequence: GQA (query head h uses KV head
h // (H_q / H_kv)), causal inside blocks, blocks given by the indexer's `[H_kv, T_q, topk]` contract
(-1 = unused slot). `block_ids=None` is dense causal attention (the `full_attention` layers).
Softmax in fp32.
"""
from __future__ import annotations

import torch


def msa_attention_ref(
    q: torch.Tensor,  # [T_q, H_q, D]
    k: torch.Tensor,  # [L, H_kv, D]
    v: torch.Tensor,  # [L, H_kv, D]
    q_pos: torch.Tensor,  # [T_q]
    scale: float,
    block_ids: torch.Tensor | None = None,  # [H_kv, T_q, topk] int, -1 padded
    block_size: int = 128,
) -> torch.Tensor:
    t_q, h_q, d = q.shape
    k_len, h_kv, _ = k.shape
    group = h_q // h_kv
    keep = torch.arange(k_len, device=q.device)[None, :] <= q_pos[:, None]  # [T_q, L]
    keep = keep[None].expand(h_kv, -1, -1)  # [H_kv, T_q, L]
    if block_ids is not None:
        n_blocks = -(-k_len // block_size)
        safe = block_ids.long().masked_fill(block_ids < 0, n_blocks)
        chosen = torch.zeros(h_kv, t_q, n_blocks + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, safe, True)
        chosen = chosen[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :k_len]
        keep = keep & chosen
    keep = keep.repeat_interleave(group, dim=0)  # [H_q, T_q, L]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, H_q, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out.to(q.dtype)
