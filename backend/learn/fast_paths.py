"""What makes a training step of the learned model fast without changing its math (issue 27).

transformers' `MiniMaxM3VLForCausalLM` trains as it is, but its eager path spends a step on [B, H, S, S] tensors and
host syncs: on the H200 (2026-12-04, `--profile-steps`) a 64K-token step took 217 ms of wall time, 124 ms of device
time, mostly elementwise kernels over attention probabilities and masks, and the device idled while the MoE's expert
loop synced with the host. `install(model)` swaps four pieces for ones that compute the same values:

- **attention** (`ATTENTION`, registered with transformers' AttentionInterface): torch's scaled_dot_product_attention,
  causal, where every key block is visible (the full-attention layers, and MSA layers in the dense warm-up, where
  the flash kernel runs); on an MSA layer under its top-k mask, the same call with a boolean mask built from the
  indexer's block indices (the memory-efficient kernel). The rows are right-padded and causal, so no padding mask
  is needed (the model is called with `input_ids` only). Attention probabilities are not returned; the indexer's
  distillation asks for the teacher's (the module's `teacher_sink`) on the few rows it covers.
- **MoE experts** (`EXPERTS`, train-learned `--experts`): "all" runs every token through every expert as one batched
  matmul, weighted by its router weights (zero for experts it did not pick): the top-k sum without the per-expert
  loop and its host syncs, at 4x the MoE's FLOPs for 8 experts at top-2. "grouped" runs only the picked experts:
  rows sorted into aligned per-expert groups, torch's grouped GEMM, fixed shapes and no host sync. Counting a
  step's aten ops' bytes (CPU, 2026-12-05), the all-experts path's elementwise work on [T, 8, F] tensors was ~40%
  of a step's device time, and "grouped" cuts the estimate by a third (docs/quality.md).
- **RMSNorm** through torch's `rms_norm` (one fused kernel each way on CUDA).
- **the indexer's selection** runs without autograd (top-k indices carry no gradient; the indexer learns only from
  the distillation, which recomputes its scores with gradients on the distilled rows).

With the fast paths the step was still host-bound on the H200 (2026-12-04: ~274 ms of wall time, ~114 ms of device
time at 64K tokens; a CPU profile counts ~14,000 aten calls a step). `CompiledPieces` (train-learned `--compile`)
runs the pieces made of many small ops through torch.compile: the same math in fewer ops (on the CPU, 2026-12-04:
14,022 -> 8,724 aten calls a step, `benchmarks/bench_train_ops.py`). On the H200 (2026-12-04, run 6 of
docs/quality.md) it lost: 149 s to compile, then ~293 ms a 128K-token step against 217-260 ms eager (the device busy
59 ms instead of 158, but the host paid more in the guards of 50 compiled functions than it saved in ops); so it is
off by default.
"""
from __future__ import annotations

import functools
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


def swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """M3's clamped SwiGLU of a fused [gate | up] projection (transformers' `_apply_gate` and dense MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


GROUP_ALIGN = 16  # rows: each expert's group in experts_grouped starts at a multiple of this


def experts_all(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """MiniMaxM3VLExperts.forward computed for every expert, weighted by the router (0 where not picked)."""
    w = torch.zeros(hidden_states.shape[0], gate_up_proj.shape[0], dtype=top_k_weights.dtype,
                    device=hidden_states.device).scatter(1, top_k_index, top_k_weights)
    gate_up = torch.einsum("td,efd->tef", hidden_states, gate_up_proj.to(hidden_states.dtype))
    act = swiglu(gate_up, alpha, limit)
    out = torch.einsum("tef,edf->ted", act, down_proj.to(act.dtype))
    return (out * w[..., None].to(out.dtype)).sum(1).to(hidden_states.dtype)


def experts_grouped(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, alpha: float, limit: float,
                    align: int = GROUP_ALIGN) -> torch.Tensor:
    """What `experts_all` computes, from the experts each token picked only: its top-k rows sorted into one group per
    expert and two `torch._grouped_mm` calls, so the SwiGLU and the weighting run over top_k rows a token instead of
    num_experts (the all-experts path's elementwise work on [T, E, F] tensors was ~40% of a step's estimated device
    time, docs/quality.md). Each group is padded with zero rows to a multiple of `align` (every group starts 16-byte
    aligned, as the grouped GEMM's backward wants; zero rows add nothing to a gradient) and the last group takes the
    slack up to a fixed row count, so a token count has one shape and nothing waits on the host (capturable).
    Autocast's dtype is applied by hand: the grouped GEMM is not on autocast's list."""
    t, k = top_k_index.shape
    e, d = gate_up_proj.shape[0], hidden_states.shape[-1]
    dev = hidden_states.device
    dt = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else hidden_states.dtype
    flat = top_k_index.reshape(-1)
    n = flat.numel()
    counts = torch.zeros(e, dtype=flat.dtype, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    cap = -(-(n + e * (align - 1)) // align) * align  # the most rows the padded groups can need
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert]  # within its expert's group
    rows = torch.empty_like(flat).scatter_(0, order, (ends - padded)[expert] + rank)  # slot (token, j) -> its row
    offs = torch.where(torch.arange(e, device=dev) == e - 1, cap, ends).to(torch.int32)
    x = hidden_states.new_zeros(cap, d, dtype=dt).index_copy(
        0, rows, hidden_states.to(dt)[:, None, :].expand(t, k, d).reshape(n, d))
    act = swiglu(torch._grouped_mm(x, gate_up_proj.to(dt).transpose(1, 2), offs=offs), alpha, limit)
    out = torch._grouped_mm(act, down_proj.to(dt).transpose(1, 2), offs=offs).index_select(0, rows).view(t, k, d)
    return (out * top_k_weights[..., None].to(out.dtype)).sum(1).to(hidden_states.dtype)


# TrainConfig.experts: how the MoE experts run in training ("all": experts_all, "grouped": experts_grouped)
EXPERTS = {"all": experts_all, "grouped": experts_grouped}


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                     ) -> torch.Tensor:
    return EXPERTS[self.experts_path](hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                      self.swiglu_alpha, self.swiglu_limit)


def _rms_norm_fused(self, x: torch.Tensor) -> torch.Tensor:
    """MiniMaxM3VLRMSNorm.forward (normalised in fp32, scaled by `weight + 1`, back in x's dtype) through torch's
    rms_norm: on CUDA one fused kernel forward and one backward, where transformers' form runs 4 ops forward and 11
    backward over the whole activation (a one-pass stand-in cut a step's estimated device time by 15%,
    docs/quality.md)."""
    return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).type_as(x)


def _select_without_grad(self, *args, **kwargs):
    """MiniMaxM3VLIndexer.forward without autograd (bound per module: a deep copy of the model binds its own)."""
    with torch.no_grad():
        return type(self).forward(self, *args, **kwargs)


def _experts_modules(model) -> list:
    return [m for m in model.modules() if "forward" in vars(m) and vars(m)["forward"].__func__ is _experts_forward]


def check_experts(experts: str) -> None:
    """A ValueError naming the choices unless `experts` is a key of EXPERTS."""
    if experts not in EXPERTS:
        raise ValueError(f"experts must be one of {list(EXPERTS)}, got {experts!r}")


def set_experts(model, experts: str) -> None:
    """The fast experts of `model` (installed) run as EXPERTS[`experts`] from now on."""
    check_experts(experts)
    for m in _experts_modules(model):
        m.experts_path = experts


def experts_path(model) -> str:
    """How the fast experts of `model` run (a key of EXPERTS)."""
    return _experts_modules(model)[0].experts_path


def install(model, experts: str = "all") -> None:
    """Put the fast paths into `model` (a MiniMaxM3VLForCausalLM): attention, experts (`experts`: a key of EXPERTS),
    RMSNorm, indexer selection."""
    from transformers import AttentionInterface
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts, MiniMaxM3VLRMSNorm

    check_experts(experts)
    AttentionInterface.register(ATTENTION, attention)
    model.config._attn_implementation = ATTENTION
    for m in model.modules():
        if isinstance(m, MiniMaxM3VLExperts):
            m.forward = types.MethodType(_experts_forward, m)
        elif type(m) is MiniMaxM3VLRMSNorm:
            m.forward = types.MethodType(_rms_norm_fused, m)
    set_experts(model, experts)
    for layer in model.model.layers:
        ix = layer.self_attn.indexer
        if ix is not None:
            ix.forward = types.MethodType(_select_without_grad, ix)


# ---------------------------------------------------------------------------------------------- --compile

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """MiniMaxM3VLRMSNorm.forward: normalised in fp32, scaled by `weight + 1`, back in x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def dense_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """MiniMaxM3VLDenseMLP.forward from its two weights."""
    return F.linear(swiglu(F.linear(x, gate_up), alpha, limit), down)


def moe(hidden_states: torch.Tensor, router: tuple, experts: tuple, shared: tuple, scale: float, path: str = "all"
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMaxM3VLSparseMoeBlock.forward with the experts as EXPERTS[`path`] runs them, from its weights: `router`
    (weight, e_score_correction_bias, top_k), `experts` and `shared` (gate_up, down, alpha, limit). Returns the output
    and the router's top-k expert indices [T, top_k] (for RouterBalance)."""
    b, s, d = hidden_states.shape
    h = hidden_states.view(-1, d)
    weight, bias, top_k = router
    probs = torch.sigmoid(F.linear(h.to(weight.dtype), weight).float())
    _, index = torch.topk(probs + bias, top_k, dim=-1, sorted=False)
    picked = probs.gather(1, index)
    picked = picked / picked.sum(dim=-1, keepdim=True)
    out = EXPERTS[path](h, index, picked, *experts) * scale + dense_mlp(h, *shared)
    return out.reshape(b, s, d), index


def project_qk(hidden: torch.Tensor, q_proj: torch.Tensor, k_proj: torch.Tensor, q_norm: torch.Tensor,
               k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys [B, H, S, D] as MiniMaxM3VLAttention and MiniMaxM3VLIndexer make them: projected, per-head
    RMSNorm (QK-norm), partial RoPE on the first `cos.shape[-1]` dims (cos and sin cut to the head's width)."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb

    shape = (*hidden.shape[:-1], -1, head_dim)
    q = rms_norm(F.linear(hidden, q_proj).view(shape), q_norm, eps).transpose(1, 2)
    k = rms_norm(F.linear(hidden, k_proj).view(shape), k_norm, eps).transpose(1, 2)
    return apply_rotary_pos_emb(q, k, cos[..., :head_dim], sin[..., :head_dim])


def indexer_kl(q: torch.Tensor, k: torch.Tensor, teacher: torch.Tensor, block_indices: torch.Tensor,
               position_ids: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """The indexer's distillation loss per query, [B, H_idx, S]: KL(teacher || softmax(q . k * scale)), both over
    the keys the query may see (its selected blocks, causal); q [B, H_idx, S, D], k [B, 1, S, D], teacher
    [B, H_idx, S, S] (IndexerDistill)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    allowed = block_keep(block_indices, scores.shape[-1], block_size, position_ids)
    log_student = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return (torch.xlogy(teacher, teacher) - teacher * log_student.masked_fill(~allowed, 0.0)).sum(-1)


def rope(inv_freq: torch.Tensor, position_ids: torch.Tensor, scaling: float, dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMaxM3VLRotaryEmbedding.forward (default rope type): cos and sin per position."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


@functools.lru_cache(maxsize=None)
def compiled(backend: str) -> dict:
    """The pieces above through torch.compile with `backend`, dynamic shapes (token count and row length change
    every batch): compiled on their first call, once per input rank, dtype, autocast and grad mode."""
    return {f.__name__: torch.compile(f, backend=backend, dynamic=True)
            for f in (rms_norm, dense_mlp, moe, rope, project_qk, indexer_kl)}


def run(name: str, module, *args):
    """The piece `name` (a function above) on `args`: compiled where CompiledPieces marked `module`, else eager."""
    backend = getattr(module, "compile_backend", None)
    return globals()[name](*args) if backend is None else compiled(backend)[name](*args)


def qk_of(module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`project_qk` with an attention's or an indexer's weights."""
    return run("project_qk", module, hidden, module.q_proj.weight, module.k_proj.weight, module.q_norm.weight,
               module.k_norm.weight, module.q_norm.eps, cos, sin, module.head_dim)


def _rms_forward(self, x):
    return compiled(self.compile_backend)["rms_norm"](x, self.weight, self.eps)


def _mlp_forward(self, x):
    return compiled(self.compile_backend)["dense_mlp"](x, self.gate_up_proj.weight, self.down_proj.weight,
                                                       self.swiglu_alpha, self.swiglu_limit)


def _moe_forward(self, hidden_states):
    g, ex, sh = self.gate, self.experts, self.shared_experts
    out, index = compiled(self.compile_backend)["moe"](
        hidden_states, (g.weight, g.e_score_correction_bias, g.top_k),
        (ex.gate_up_proj, ex.down_proj, ex.swiglu_alpha, ex.swiglu_limit),
        (sh.gate_up_proj.weight, sh.down_proj.weight, sh.swiglu_alpha, sh.swiglu_limit), self.routed_scaling_factor,
        getattr(ex, "experts_path", "all"))
    sink = getattr(g, "load_sink", None)  # the router module is not called: RouterBalance reads its choice here
    if sink is not None:
        sink(index)
    return out


def _attention_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """MiniMaxM3VLAttention.forward without a cache, its projections compiled (`project_qk`); the indexer and the
    attention function (`attention`: IndexerDistill's teacher sink) run as they do eagerly, and the module's own
    hooks fire as before (it is still called as a module)."""
    if cache is not None or kwargs.get("past_key_values") is not None:  # decoding: transformers' own forward
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    input_shape = hidden_states.shape[:-1]
    q, k = qk_of(self, hidden_states, *position_embeddings)
    v = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
    block_indices = None
    if self.indexer is not None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(k.shape[2], device=q.device)
        position_ids = (position_ids if position_ids.ndim > 1 else position_ids.unsqueeze(0)).expand(q.shape[0], -1)
        block_indices = self.indexer(hidden_states, position_embeddings, None, position_ids)
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling, block_indices=block_indices, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _rope_forward(self, x, position_ids):
    return compiled(self.compile_backend)["rope"](self.inv_freq, position_ids, self.attention_scaling, x.dtype)


class CompiledPieces:
    """`--compile`: the training step's pieces made of many small ops and free of Python side effects run through
    torch.compile: every RMSNorm, the dense MLP, each MoE block (router, every expert, shared expert: one graph; the
    router's top-k choice goes to its `load_sink`), the rotary embedding, the attentions' projections with their
    QK-norm and RoPE (`project_qk`; with the fast attention only) and the same for the indexer's distillation
    (IndexerDistill). The attention modules stay modules (IndexerDistill's hooks on them and on the indexer fire as
    before); the indexer's selection and the attention function run eagerly. Same math as the eager modules
    (tests/unit/test_learn_fast_paths.py); `undo()` puts the eager forwards back (after training, or when compiling
    failed)."""

    def __init__(self, model, backend: str = "inductor"):
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf

        self.backend = backend
        swaps = {hf.MiniMaxM3VLRMSNorm: _rms_forward, hf.MiniMaxM3VLSparseMoeBlock: _moe_forward}
        self.modules = [(m, swaps[type(m)]) for m in model.modules() if type(m) in swaps]
        self.modules += [(layer.mlp, _mlp_forward) for layer in model.model.layers
                         if type(layer.mlp) is hf.MiniMaxM3VLDenseMLP]
        if model.model.rotary_emb.rope_type == "default":
            self.modules.append((model.model.rotary_emb, _rope_forward))
        if model.config._attn_implementation == ATTENTION:
            self.modules += [(layer.self_attn, _attention_forward) for layer in model.model.layers]
        self.modules += [(layer.self_attn.indexer, None) for layer in model.model.layers  # marked for `run` only
                         if layer.self_attn.indexer is not None]
        self.saved = [vars(m).get("forward") for m, _ in self.modules]
        for m, fn in self.modules:
            m.compile_backend = backend
            if fn is not None:
                m.forward = types.MethodType(fn, m)

    def undo(self) -> None:
        for (m, fn), prev in zip(self.modules, self.saved):
            del m.compile_backend
            if fn is not None:
                del m.forward
                if prev is not None:
                    m.forward = prev
        self.modules = []
