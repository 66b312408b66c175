"""The MiniMax-M3 text model in PyTorch: the reference path every kernel and the engine are checked
against (numerics of transformers 5.25 `MiniMaxM3VLForCausalLM`), written over an explicit cache.

Tokens of all sequences of a step are flattened to `[T, hidden]`; the `StepInput` says which belong to
which sequence. Each attention layer owns its cache: `bind_kv_cache` binds it, once when the cache is
allocated (again after any re-allocation), to an attention backend (model/layers/attention.py) over that
layer's pages, which the layer calls at every step. Module names follow the transformers layout so the
loader's map stays short.

Built with a `Parallel` of size N, each rank holds its shard (model/sharding.py has the rules): its
attention heads, its part of each FFN (or its experts), its vocab rows; the layers sum partial outputs over the
ranks where a split ends (o_proj, the MLP down projections, the MoE layer, the embedding).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.config import ModelConfig
from m3serve.distributed.parallel import Parallel
from m3serve.kernels import dispatch
from m3serve.kernels.rms_norm import rms_norm, rms_norm_ref
from m3serve.step_io import StepInput
from m3serve.model.layers.attention import AttentionGeometry, TorchAttention
from m3serve.model.layers.embedding import VocabParallelEmbedding
from m3serve.model.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from m3serve.model.layers.moe import DenseMLP, SparseMoE

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Gemma-style: normalize in fp32, scale by (1 + weight); weights are stored as offsets."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dispatch.fused_norm(x):  # one launch on a GPU where the tuning says so
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style RoPE on the first `cos.shape[-1]` channels of x [T, H, D]; the rest pass through."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class Rotary(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Indexer(nn.Module):
    """Index heads follow the KV heads across ranks (head h picks the blocks of KV head h); the one index key
    is shared by all heads, so every rank computes and caches it."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, parallel: Parallel):
        super().__init__()
        h0, h1 = parallel.split_heads(cfg.index_n_heads, "index_n_heads")
        self.n_heads, self.head_dim = h1 - h0, cfg.index_head_dim
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.index_n_heads * cfg.index_head_dim, parallel,
                                           dtype=dtype, head_dim=cfg.index_head_dim)
        self.k_proj = Linear(cfg.hidden_size, cfg.index_head_dim, dtype=dtype)
        self.q_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)

    def finish(self, iq, ik, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected iq [T, H_i * D_i], ik [T, D_i] -> normed and rotated iq [T, H_i, D_i], ik [T, D_i]."""
        t = iq.shape[0]
        iq = self.q_norm(iq.view(t, self.n_heads, self.head_dim))
        ik = self.k_norm(ik.view(t, 1, self.head_dim))
        cos, sin = cos[..., : self.head_dim], sin[..., : self.head_dim]
        return apply_rope(iq, cos, sin), apply_rope(ik, cos, sin)[:, 0]


class Attention(nn.Module):
    """This rank's attention heads (`n_heads`, `n_kv`: local counts; with more ranks than KV heads each KV head is
    replicated on size/H_kv ranks, whose q heads are its group); o_proj sums the heads' outputs over ranks."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, parallel: Parallel | None = None):
        super().__init__()
        parallel = parallel or Parallel()
        self.layer = layer
        self.n_heads = parallel.part(cfg.num_attention_heads, "num_attention_heads")
        kv0, kv1 = parallel.split_heads(cfg.num_key_value_heads, "num_key_value_heads")
        self.n_kv = kv1 - kv0
        self.head_dim, self.eps, self.rotary_dim = cfg.head_dim, cfg.rms_norm_eps, cfg.rotary_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = ColumnParallelLinear(h, cfg.num_attention_heads * d, parallel, dtype=dtype, head_dim=d)
        self.k_proj = ColumnParallelLinear(h, cfg.num_key_value_heads * d, parallel, dtype=dtype, head_dim=d)
        self.v_proj = ColumnParallelLinear(h, cfg.num_key_value_heads * d, parallel, dtype=dtype, head_dim=d)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, parallel, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg, dtype, parallel) if cfg.is_sparse_attention(layer) else None
        self.qkv_weight: torch.Tensor | None = None  # set by fuse_projections()
        self.backend = None  # the attention backend over this layer's cache (M3ForCausalLM.bind_kv_cache)

    @property
    def kv_cache(self):
        """This layer's cache (K/V pages and, on sparse layers, the indexer's key pages), as bound."""
        return None if self.backend is None else self.backend.cache

    def _projections(self) -> list[Linear]:
        ix = self.indexer
        return [self.q_proj, self.k_proj, self.v_proj] + ([ix.q_proj, ix.k_proj] if ix is not None else [])

    def fuse_projections(self) -> None:
        """One weight for every projection of the layer's input (q | k | v | index q | index k), so one GEMM
        computes them; the separate weights become views into it (no extra memory)."""
        if self.qkv_weight is not None:
            return
        lins = self._projections()
        if any(lin.w.fmt != "dense" for lin in lins):
            return
        self.qkv_weight = torch.cat([lin.w.weight for lin in lins])
        row = 0
        for lin in lins:
            lin.w.weight = self.qkv_weight[row: row + lin.w.n]
            row += lin.w.n

    @property
    def qkv_sizes(self) -> list[int]:
        return [lin.w.n for lin in self._projections()]

    @property
    def norm_weights(self) -> tuple:
        ix = self.indexer
        return (self.q_norm.weight, self.k_norm.weight) + (
            (ix.q_norm.weight, ix.k_norm.weight) if ix is not None else (None, None))

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The raw projections (q | k | v | index q | index k): one GEMM once fused."""
        if self.qkv_weight is not None:
            return list(torch.split(F.linear(x, self.qkv_weight), self.qkv_sizes, dim=-1))
        return [lin(x) for lin in self._projections()]

    def finish(self, parts, cos, sin):
        """Raw projections -> q [T, H, D], k [T, H_kv, D] (QK-normed, RoPE'd), v, and the index q / k (or None)."""
        t = parts[0].shape[0]
        q = self.q_norm(parts[0].reshape(t, self.n_heads, self.head_dim))
        k = self.k_norm(parts[1].reshape(t, self.n_kv, self.head_dim))
        v = parts[2].reshape(t, self.n_kv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        iq = ik = None
        if self.indexer is not None:
            iq, ik = self.indexer.finish(parts[3], parts[4], cos, sin)
        return q, k, v, iq, ik

    def _bound(self):
        if self.backend is None:
            raise RuntimeError(f"attention layer {self.layer} has no KV cache: bind_kv_cache() binds one")
        return self.backend

    def attend(self, qkv: torch.Tensor, cos, sin, step: StepInput) -> torch.Tensor:
        """The attention of the fused projection's output ``qkv`` [T, sum(qkv_sizes)] (`qkv_weight`), before
        o_proj: the backend norms, rotates and caches straight from it where it can (`packed_qkv`)."""
        backend = self._bound()
        if getattr(backend, "packed_qkv", False):
            return backend.forward_packed(qkv, self, cos, sin, step)
        return backend.forward(*self.finish(list(torch.split(qkv, self.qkv_sizes, dim=-1)), cos, sin), step)

    def forward(self, x: torch.Tensor, cos, sin, step: StepInput) -> torch.Tensor:
        if self.qkv_weight is not None:
            out = self.attend(F.linear(x, self.qkv_weight), cos, sin, step)
        else:
            out = self._bound().forward(*self.finish(self.project(x), cos, sin), step)
        return self.o_proj(out.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, formats: dict[str, str], parallel: Parallel):
        super().__init__()
        self.self_attn = Attention(cfg, layer, dtype, parallel)
        if cfg.is_moe(layer):
            self.mlp = SparseMoE(cfg, dtype, formats.get("experts", "dense"), formats.get("shared_experts", "dense"),
                                 parallel)
        else:
            self.mlp = DenseMLP(cfg, cfg.dense_intermediate_size, dtype, formats.get("dense_mlp", "dense"), parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, step: StepInput):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class M3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, formats: dict[int, dict[str, str]] | None = None,
                 parallel: Parallel | None = None):
        super().__init__()
        formats, parallel = formats or {}, parallel or Parallel()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, formats.get(i, {}), parallel) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class M3ForCausalLM(nn.Module):
    """bind_kv_cache(cache) once, then forward(step) -> final hidden states [T, H]; compute_logits(h) -> fp32
    [N, V] (on rank 0)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 formats: dict[int, dict[str, str]] | None = None, parallel: Parallel | None = None):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.parallel = parallel or Parallel()
        self.model = M3Model(cfg, dtype, formats, self.parallel)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, self.parallel, dtype=dtype)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self.attention_geometry = AttentionGeometry.of(cfg)
        self._attention: tuple = ()  # every layer's bound attention backend, in layer order (bind_attention)

    def bind_kv_cache(self, cache, attention: str = "auto") -> None:
        """Bind each attention layer to its cache: layer l to `cache.layers[l]` (a `PagedKVCache`'s
        `LayerKVCache`; or `cache` a list of per-layer `AttentionCache`s). Called once when the cache is
        allocated, and again after any re-allocation (CUDA graphs captured before read the old pages).
        `attention`: "triton" (the kernels over the paged cache), "torch" (the reference attention), "auto"
        (the kernels on CUDA when they import, else the reference)."""
        layers = list(getattr(cache, "layers", cache))
        if len(layers) != len(self.model.layers):
            raise ValueError(f"{len(layers)} layer caches for a model of {len(self.model.layers)} layers")
        if attention == "auto":
            attention = "torch"
            if self.model.embed_tokens.weight.device.type == "cuda":
                try:
                    import m3serve.model.layers.triton_attention  # noqa: F401
                    attention = "triton"
                except ImportError as e:
                    log.warning("Triton attention backend unavailable (%s); using the torch reference attention", e)
        if attention == "triton":
            from m3serve.model.layers.triton_attention import TritonAttention
            cfg, par = self.config, self.parallel  # this rank's heads
            h0, h1 = par.split_heads(cfg.index_n_heads, "index_n_heads")
            backends = [TritonAttention(self.attention_geometry, c, cfg.num_attention_heads // par.size, h1 - h0)
                        for c in layers]
            log.info("attention backend: Triton kernels (block-sparse MSA over the paged cache)")
        elif attention == "torch":
            backends = [TorchAttention(self.attention_geometry, c) for c in layers]
        else:
            raise ValueError(f"attention {attention!r} is not one of 'auto', 'triton', 'torch'")
        self.bind_attention(backends)

    def bind_attention(self, backends) -> None:
        """Bind layer l's attention to `backends[l]` (each over that layer's cache); `bind_kv_cache` builds them.
        The tuple `attention_backends()` returned may be bound again as it is (a caller restoring a binding)."""
        backends = backends if isinstance(backends, tuple) else tuple(backends)
        if len(backends) != len(self.model.layers):
            raise ValueError(f"{len(backends)} attention backends for a model of {len(self.model.layers)} layers")
        for layer, backend in zip(self.model.layers, backends):
            layer.self_attn.backend = backend
        self._attention = backends

    def attention_backends(self) -> tuple:
        """Every layer's bound attention backend, in layer order (empty before `bind_kv_cache`); the same tuple
        object until the next binding."""
        return self._attention

    def plan(self, step: StepInput) -> None:
        """The step's per-step attention metadata (prefill tile maps), made once for every layer, unless the
        step already carries it (a CUDA graph's static step, planned at capture)."""
        plan = getattr(self._attention[0], "plan", None) if self._attention else None
        if plan is not None and step.attn_tiles is None:
            plan(step)

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """The step's tokens go into each layer's bound cache; final hidden states [T, H]."""
        self.plan(step)
        x = self.model.embed_tokens(step.input_ids)
        cos, sin = self.rotary(step.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, step)
        return self.model.norm(x)

    def prepare_for_inference(self) -> None:
        """Once after loading: one QKV(+indexer) GEMM per layer (`Attention.fuse_projections`), and each linear and
        MoE layer's method for the device its weights are on."""
        device = self.model.embed_tokens.weight.device
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
        for mod in self.modules():  # a MoE layer before its shared expert's linears (it may take them over)
            if isinstance(mod, (Linear, SparseMoE)):
                mod.prepare(device)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits [N, V]: every rank computes its vocab rows, rank 0 gets them all (the others: None)."""
        return self.parallel.gather_first(self.lm_head(hidden).float(), dim=-1)
