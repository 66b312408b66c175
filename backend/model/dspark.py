"""The DSpark draft model (design/dspark.md section 1): a block-parallel backbone conditioned on tapped
target features, plus the Markov and confidence heads (dspark_heads.py). The target's token embedding
and lm_head are shared: the draft holds references to the target's modules, never copies.

One backbone pass drafts a block for S sequences at once:
- context: the target's tapped hidden states F [N, m*H] of committed positions become C = hidden_norm(fc(F));
  every draft layer turns C into K/V rows (`context_kv`: k_norm + RoPE at the rows' own positions). These
  rows are what the draft cache holds.
- block: slot k of [x0, mask x (gamma-1)] at position t+k predicts the token at t+k+1 ("sample from
  anchor"). Block queries attend to the context rows at positions < t and to all gamma block rows
  (bidirectional); the block's own K/V rows are transient and never cached.
`block_hidden` takes the context through a callable `context(layer)`: either rows indexed by position (row j =
position j, [S, L, H_kv, D] K and V; the draft cache's `gather`, or a contiguous recompute from all committed
features: the tests compare them), or a `PagedContext`: the layer's pages, which a kernel reads in place up to each
anchor's position (split-K partials) and merges with the block's own rows (the draft cache's `paged_fn`, on CUDA).
With a reduced draft vocabulary (`use_draft_vocab`, model/dspark_vocab.py) the base logits and the Markov bias cover
the subset's N columns only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.distributed.parallel import Parallel
from m3serve.model.dspark_config import DSparkConfig
from m3serve.model.dspark_heads import ConfidenceHead, MarkovHead
from m3serve.model.dspark_vocab import DraftVocab
from m3serve.model.layers.moe import swiglu_oai
from m3serve.model.m3 import RMSNorm, Rotary, apply_rope

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PagedContext:
    """One draft layer's context as pages: the block queries attend to keys 0..lens[s]-1 of sequence s straight
    from the cache (`m3serve.kernels.msa_attention.context_partials`), nothing gathered."""

    cache: object  # the layer's pages with the kernels' LayerCache attributes (kernels/cache.py)
    block_tables: torch.Tensor  # int32 [S, W]
    lens: torch.Tensor | None = None  # int [S]: context rows per sequence (the anchors' positions; set per pass)


# layer -> (k, v) rows by position [S, L, H_kv, D] (the torch path), or the layer's pages (the kernel path)
ContextFn = Callable[[int], "tuple[torch.Tensor, torch.Tensor] | PagedContext"]


class DraftRMSNorm(RMSNorm):
    """Qwen3's `w * norm(x)` (weights stored as scales, default), or the target's Gemma-style (1 + w)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool):
        super().__init__(dim, eps)
        self.unit_offset = unit_offset
        if not unit_offset:
            self.weight.data.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return super().forward(x)
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * y).to(x.dtype)


def _linear(k: int, n: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(k, n, bias=False, dtype=dtype).requires_grad_(False)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype: torch.dtype):
        super().__init__()
        h, self.n_heads, self.n_kv, self.head_dim = (cfg.hidden_size, cfg.num_attention_heads,
                                                     cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = _linear(h, self.n_heads * self.head_dim, dtype)
        self.k_proj = _linear(h, self.n_kv * self.head_dim, dtype)
        self.v_proj = _linear(h, self.n_kv * self.head_dim, dtype)
        self.o_proj = _linear(self.n_heads * self.head_dim, h, dtype)
        self.q_norm = DraftRMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)
        self.k_norm = DraftRMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> k [N, H_kv, D] (k_norm + RoPE), v [N, H_kv, D]. The same projections serve the
        context features and the block rows."""
        n = x.shape[0]
        k = apply_rope(self.k_norm(self.k_proj(x).view(n, self.n_kv, self.head_dim)), cos, sin)
        return k, self.v_proj(x).view(n, self.n_kv, self.head_dim)

    def forward(self, x: torch.Tensor, cos, sin, ctx, mask: torch.Tensor) -> torch.Tensor:
        """x [S, G, H] block rows; ctx: (k, v) [S, L, H_kv, D] with mask bool [S, G, L + G], or a PagedContext
        with the block's own mask bool [G, G] -> [S, G, H]."""
        s, g, _ = x.shape
        flat = x.reshape(s * g, -1)
        q = apply_rope(self.q_norm(self.q_proj(flat).view(s * g, self.n_heads, self.head_dim)), cos, sin)
        k, v = self.kv(flat, cos, sin)
        if isinstance(ctx, PagedContext):
            return self.o_proj(self._paged(q.view(s, g, self.n_heads, -1), k.view(s, g, self.n_kv, -1),
                                           v.view(s, g, self.n_kv, -1), ctx, mask).to(x.dtype))
        ctx_k, ctx_v = ctx
        k = torch.cat([ctx_k.to(x.dtype), k.view(s, g, self.n_kv, -1)], 1)
        v = torch.cat([ctx_v.to(x.dtype), v.view(s, g, self.n_kv, -1)], 1)
        out = F.scaled_dot_product_attention(q.view(s, g, self.n_heads, -1).transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask[:, None], enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(s, g, -1))

    def _paged(self, q, k, v, ctx: PagedContext, mask: torch.Tensor) -> torch.Tensor:
        """Block queries q [S, G, H_q, D] over the paged context (each block row a query of the kernel, its
        sequence's table and length repeated: the decode kernel's own head grouping) and over the block's own rows
        k, v [S, G, H_kv, D] (torch: G x G), merged by their log-sum-exps -> [S, G, H_q * D] fp32."""
        from m3serve.kernels.msa_attention import context_partials

        s, g, _, d = q.shape
        grp = self.n_heads // self.n_kv
        scale = self.head_dim ** -0.5
        op, lse = context_partials(q.reshape(s * g, self.n_heads, d).contiguous(), ctx.cache,
                                   ctx.block_tables.repeat_interleave(g, 0), ctx.lens.repeat_interleave(g), scale)
        qg = q.view(s, g, self.n_kv, grp, d).float()
        sc = torch.einsum("sqhgd,skhd->sqhgk", qg, k.float()) * scale
        sc = sc.masked_fill(~mask[None, :, None, None, :], float("-inf"))
        own = torch.einsum("sqhgk,skhd->sqhgd", torch.softmax(sc, -1), v.float())
        lse_all = torch.cat([lse, (torch.logsumexp(sc, -1) * LOG2E).reshape(s * g, -1, 1)], -1)  # [S*G, H_q, n+1]
        parts = torch.cat([op, own.reshape(s * g, self.n_heads, 1, d)], 2)  # [S*G, H_q, n+1, D]
        w = torch.exp2(lse_all - lse_all.amax(-1, keepdim=True))  # the block's own part is never empty
        return ((parts * w[..., None]).sum(2) / w.sum(-1)[..., None]).reshape(s, g, -1)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype: torch.dtype):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.act, self.alpha, self.limit = cfg.hidden_act, cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, i, dtype), _linear(h, i, dtype), _linear(i, h, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.act == "swiglu_oai":
            return self.down_proj(swiglu_oai(torch.cat([g, u], -1), self.alpha, self.limit))
        return self.down_proj(F.silu(g) * u)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype: torch.dtype):
        super().__init__()
        self.self_attn = DraftAttention(cfg, dtype)
        self.mlp = DraftMLP(cfg, dtype)
        self.input_layernorm = DraftRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)
        self.post_attention_layernorm = DraftRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)

    def forward(self, x, cos, sin, ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class SharedTargetParts:
    """The target's frozen embedding and lm_head, held by reference (not registered as submodules, so
    they are neither copied, nor saved, nor counted twice)."""

    embed_tokens: nn.Module  # ids [...] -> [..., H]
    lm_head: nn.Module  # [..., H] -> [..., V] (this rank's vocabulary rows under tensor parallelism)
    parallel: Parallel | None = None  # the target's (None: one rank)


def block_mask(ctx_len: torch.Tensor, num_ctx_rows: int, gamma: int, window: int | None, causal: bool
               ) -> torch.Tensor:
    """bool [S, gamma, L + gamma]: block queries see context rows j < t (and j >= t - W with a window)
    and the block's rows (all of them, or rows <= their own with a causal block)."""
    j = torch.arange(num_ctx_rows, device=ctx_len.device)[None, :]
    ctx = j < ctx_len[:, None]
    if window is not None:
        ctx = ctx & (j >= ctx_len[:, None] - window)
    blk = torch.ones(gamma, gamma, dtype=torch.bool, device=ctx_len.device)
    if causal:
        blk = blk.tril()
    s = ctx_len.shape[0]
    return torch.cat([ctx[:, None, :].expand(s, gamma, -1), blk[None].expand(s, -1, -1)], -1)


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DSparkConfig, shared: SharedTargetParts, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype, self.shared = cfg, dtype, shared
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DraftLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = DraftRMSNorm(h, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)
        self.fc = _linear(cfg.num_taps * h, h, dtype)
        self.hidden_norm = DraftRMSNorm(h, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)
        r = cfg.markov_rank
        self.markov_head = MarkovHead(cfg.markov_head_type, cfg.vocab_size, r, h, dtype) if r else None
        self.confidence_head = None
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(h, r if cfg.confidence_head_with_markov else 0)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self.draft_vocab: DraftVocab | None = None  # a reduced draft vocabulary (`use_draft_vocab`)

    def use_draft_vocab(self, ids: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Draft from the sorted vocabulary ids [N] only: the lm_head rows of the subset (this rank's share) and the
        Markov head's W2 rows taken once (W1 stays indexed by the full-vocabulary previous token)."""
        self.draft_vocab = DraftVocab.build(ids, lm_head_weight, self.config.vocab_size, self.shared.parallel)
        if self.markov_head is not None:
            w2 = self.markov_head.markov_w2
            w2.weight = nn.Parameter(w2.weight.detach()[self.draft_vocab.ids].contiguous(), requires_grad=False)
            w2.out_features = self.draft_vocab.size

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """The draft vocabulary's ids [N] (column j of the draft's logits is id vocab_ids[j]); None: all of V."""
        return None if self.draft_vocab is None else self.draft_vocab.ids

    # ---- geometry the engine needs ---------------------------------------------------------------
    @property
    def tap_layers(self) -> list[int]:
        """Target layers whose outputs (HF convention; -1 = embedding) form a context row, in order."""
        return list(self.config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- context rows ------------------------------------------------------------------------------
    @torch.inference_mode()
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Tapped features [N, m*H] at `positions` [N] -> per draft layer (k, v) [N, H_kv, D]."""
        c = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self.rotary(positions, self.dtype)
        return [layer.self_attn.kv(c, cos, sin) for layer in self.layers]

    # ---- one backbone pass -------------------------------------------------------------------------
    @torch.inference_mode()
    def block_hidden(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, context: ContextFn
                     ) -> torch.Tensor:
        """anchor_ids, anchor_positions [S] (the anchor x0 at t; context rows < t are in `context`) ->
        the block's final hidden states h [S, gamma, H]."""
        cfg, g = self.config, self.config.block_size
        s = anchor_ids.shape[0]
        ids = torch.full((s, g), cfg.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        x = self.shared.embed_tokens(ids.flatten()).view(s, g, -1).to(self.dtype)
        positions = anchor_positions[:, None].long() + torch.arange(g, device=anchor_ids.device)[None]
        cos, sin = self.rotary(positions.flatten(), self.dtype)
        masks: dict[tuple, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            ctx, window = context(i), cfg.attention_window(i)
            if isinstance(ctx, PagedContext):
                if window[0] is not None:
                    raise ValueError(f"draft layer {i}: a sliding window needs the gathered context (context_fn)")
                ctx = dataclasses.replace(ctx, lens=anchor_positions)
                key = ("paged", window[1])
                if key not in masks:
                    masks[key] = block_mask(anchor_positions[:1], 0, g, None, window[1])[0]
            else:
                key = window + (ctx[0].shape[1],)
                if key not in masks:
                    masks[key] = block_mask(anchor_positions, ctx[0].shape[1], g, *window)
            x = layer(x, cos, sin, ctx, masks[key])
        return self.norm(x)

    @torch.inference_mode()
    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """U = lm_head(h) with the target's lm_head, fp32 [..., V]: under tensor parallelism each rank's vocabulary
        rows gathered on every rank (every rank drafts). With a draft vocabulary: [..., N], its columns only."""
        if self.draft_vocab is not None:
            return self.draft_vocab.logits(h, self.shared.parallel)
        u = self.shared.lm_head(h).float()
        return u if self.shared.parallel is None else self.shared.parallel.all_gather(u, -1)
