"""What makes a training step of the learned model fast without changing its math (issue 27).

transformers' `MiniMaxM3VLForCausalLM` trains as it is, but its eager path spends a step on [B, H, S, S] tensors and
host syncs: on the H200 (2026-12-04, `--profile-steps`) a 64K-token step took 217 ms of wall time, 124 ms of device
time, mostly elementwise kernels over attention probabilities and masks, and the device idled while the MoE's expert
loop synced with the host. `install(model)` swaps three pieces for ones that compute the same values:

- **attention** (`ATTENTION`, registered with transformers' AttentionInterface): torch's scaled_dot_product_attention,
  causal, where every key block is visible (the full-attention layers, and MSA layers in the dense warm-up, where
  the flash kernel runs); on an MSA layer under its top-k mask, the same call with a boolean mask built from the
  indexer's block indices (the memory-efficient kernel). The rows are right-padded and causal, so no padding mask
  is needed (the model is called with `input_ids` only). Attention probabilities are not returned; the indexer's
  distillation asks for the teacher's (`TeacherSink`) on the few rows it covers.
- **MoE experts**: every token through every expert as one batched matmul, weighted by its router weights (zero
  for experts it did not pick): the top-k sum without the per-expert loop and its host syncs. 8 small experts at
  top-2 cost 4x the MoE's FLOPs, far below the time the loop lost.
- **the indexer's selection** runs without autograd (top-k indices carry no gradient; the indexer learns only from
  the distillation, which recomputes its scores with gradients on the distilled rows).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

ATTENTION = "m3serve_train"


def block_keep(block_indices: torch.Tensor, seq_len: int, block_size: int,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B, H_idx, S_q, S] keep-mask of an MSA layer: the query's selected key blocks (`block_indices`
    [B, H_idx, S_q, k], -1 = unused slot) and causal (queries at `position_ids`, default 0..S_q-1)."""
    b, h, sq, _ = block_indices.shape
    n_blocks = -(-seq_len // block_size)
    keep = torch.zeros(b, h, sq, n_blocks + 1, dtype=torch.bool, device=block_indices.device)
    keep.scatter_(-1, block_indices.masked_fill(block_indices < 0, n_blocks), True)
    keys = torch.arange(seq_len, device=block_indices.device)
    keep = keep[..., keys // block_size]
    pos = (torch.arange(sq, device=keys.device)[None] if position_ids is None else position_ids)
    return keep & (keys[None, None, None, :] <= pos[:, None, :, None])


def _selects_all(module, seq_len: int) -> bool:
    ix = module.indexer
    return ix is None or ix.topk_blocks * ix.block_size >= seq_len


def attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
              block_indices=None, **kwargs):
    """transformers' attention interface: query [B, H, S, D], key and value [B, H_kv, S, D] -> ([B, S, H, D], None)."""
    s = query.shape[2]
    g = query.shape[1] // key.shape[1]
    dense = block_indices is None or _selects_all(module, s)
    mask = None
    if not dense:
        keep = block_keep(block_indices, s, module.indexer.block_size, kwargs.get("position_ids"))
        mask = keep.repeat_interleave(g, dim=1)
    sink = getattr(module, "teacher_sink", None)
    if sink is not None:
        sink(module, query, key, None if dense else block_indices, scaling)
    if dense:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=g > 1,
                                             dropout_p=dropout)
    else:
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1),
                                             attn_mask=mask, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def teacher_probs(module, query, key, block_indices, scaling: float, rows: torch.Tensor | None) -> torch.Tensor:
    """The main attention's probabilities over keys for `rows` (all if None), averaged over each index head's group
    of query heads: fp32 [R, H_idx, S, S], detached (the indexer's distillation target)."""
    q, k = query.detach(), key.detach()
    if rows is not None:
        q, k = q[rows], k[rows]
        block_indices = None if block_indices is None else block_indices[rows]
    s, g = q.shape[2], q.shape[1] // k.shape[1]
    scores = torch.matmul(q.float(), k.float().repeat_interleave(g, 1).transpose(-1, -2)) * scaling
    if block_indices is None:
        keep = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
    else:
        keep = block_keep(block_indices, s, module.indexer.block_size).repeat_interleave(g, dim=1)
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    h_idx = module.indexer.num_heads
    return probs.unflatten(1, (h_idx, -1)).mean(2)


def _experts_all(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                 ) -> torch.Tensor:
    """MiniMaxM3VLExperts.forward computed for every expert, weighted by the router (0 where not picked)."""
    w = torch.zeros(hidden_states.shape[0], self.num_experts, dtype=top_k_weights.dtype,
                    device=hidden_states.device).scatter(1, top_k_index, top_k_weights)
    gate_up = torch.einsum("td,efd->tef", hidden_states, self.gate_up_proj.to(hidden_states.dtype))
    act = self._apply_gate(gate_up)
    out = torch.einsum("tef,edf->ted", act, self.down_proj.to(act.dtype))
    return (out * w[..., None].to(out.dtype)).sum(1).to(hidden_states.dtype)


def _select_without_grad(self, *args, **kwargs):
    """MiniMaxM3VLIndexer.forward without autograd (bound per module: a deep copy of the model binds its own)."""
    with torch.no_grad():
        return type(self).forward(self, *args, **kwargs)


def install(model) -> None:
    """Put the fast paths into `model` (a MiniMaxM3VLForCausalLM): attention, experts, indexer selection."""
    from transformers import AttentionInterface
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts

    AttentionInterface.register(ATTENTION, attention)
    model.config._attn_implementation = ATTENTION
    for m in model.modules():
        if isinstance(m, MiniMaxM3VLExperts):
            m.forward = types.MethodType(_experts_all, m)
    for layer in model.model.layers:
        ix = layer.self_attn.indexer
        if ix is not None:
            ix.forward = types.MethodType(_select_without_grad, ix)
