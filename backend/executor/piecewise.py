"""CUDA graphs for prefill and mixed steps, piece by piece: everything of a step but its attention, captured once per
token bucket; the attention runs eagerly between the pieces (its per-step metadata, tile maps and block tables,
changes every step).

A mixed step (decodes beside a prompt chunk) otherwise runs eagerly, every layer's kernels launched one by one from
Python; on the 4-layer geometry a step of 64 decodes and 64 prompt tokens took twice an idle decode step (H100,
2026-12-07, docs/performance.md), the hypothesis being the host's launches (`bench_itl.py --profile` tells).

A step of T tokens (T <= the largest bucket) pads to its bucket b; the L + 1 pieces of bucket b replay in turn:
  piece 0      embedding, rotary cos / sin, layer 0's input norm and fused QKV projection
  attention l  eager, the step's T real rows: layer l's `Attention.attend` (cache insert, indexer, MSA) into `attn`
  piece l + 1  layer l's o_proj, residual, post-attention norm, MLP / MoE, residual; then layer l + 1's input norm
               and QKV projection (the last piece: the final norm)
Persistent buffers (ids, positions, cos / sin, residual, QKV output, attention output, hidden states) carry the rows
between the pieces; every piece of every bucket shares one memory pool (the pieces run one after another and keep
nothing in it). Padding rows (token 0 at position 0) pass through the norms, projections and MoE and are dropped;
no attention sees them. Up to `EngineConfig.piecewise_graph_tokens` tokens (0: off); CUDA only. On the CPU a
`PiecewiseGraphs` never captured runs the same pieces eagerly: what tests check against the model's forward.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from m3serve.step_io import StepInput

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, then every 64 up to 512, every 256 beyond; `max_tokens` itself last."""
    sizes, t = [16, 32, 64], 64
    while t < max_tokens:
        t += 64 if t < 512 else 256
        sizes.append(t)
    return sorted({min(s, max_tokens) for s in sizes})


def piecewise_reserve_bytes(max_tokens: int, hidden_size: int) -> int:
    """What the pieces' pool and buffers are expected to hold at the largest bucket: a prefill layer's activations
    (the MoE's sorted copies and intermediates dominate), as `cuda_graph.graph_reserve_bytes` counts a decode row."""
    return max_tokens * hidden_size * 2 * 64


class PiecewiseGraphs:
    """The pieces of one `ModelRunner`'s model (its layers' fused QKV weights and bound attention), their buffers
    at the largest bucket and, once `capture` ran, their graphs."""

    def __init__(self, model, max_tokens: int, device: torch.device):
        self.model, self.device = model, torch.device(device)
        self.layers = list(model.model.layers)
        self.buckets = token_buckets(max_tokens)
        big = self.buckets[-1]
        emb = model.model.embed_tokens.weight
        z = dict(device=self.device)
        self.input_ids = torch.zeros(big, dtype=torch.int64, **z)
        self.positions = torch.zeros(big, dtype=torch.int64, **z)
        cos, _ = model.rotary(self.positions[:1], emb.dtype)
        self.cos = torch.zeros(big, *cos.shape[1:], dtype=cos.dtype, **z)
        self.sin = torch.zeros_like(self.cos)
        hidden = emb.shape[1]
        self.residual = torch.zeros(big, hidden, dtype=emb.dtype, **z)
        self.hidden = torch.zeros(big, hidden, dtype=emb.dtype, **z)
        qkv = [layer.self_attn.qkv_weight for layer in self.layers]
        self.ok = all(w is not None for w in qkv)  # every layer's projections fused (`Attention.fuse_projections`)
        width = max((w.shape[0] for w in qkv if w is not None), default=1)
        self.qkv = torch.zeros(big, width, dtype=emb.dtype, **z)
        heads = max(a.n_heads * a.head_dim for a in (layer.self_attn for layer in self.layers))
        self.attn = torch.zeros(big, heads, dtype=emb.dtype, **z)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self.capture_s = 0.0
        self.num_steps = 0  # steps run through the pieces (replayed once captured)
        self.padded_rows = 0  # rows those steps padded to their buckets

    def supports(self, step: StepInput) -> bool:
        """A step with prompt tokens (decode steps have their own graphs) of at most the largest bucket's tokens."""
        return self.ok and not step.is_decode and 0 < step.input_ids.shape[0] <= self.buckets[-1]

    def _piece(self, i: int, b: int) -> None:
        """Piece i of bucket b (the module docstring): reads and writes the leading b rows of the buffers."""
        inner = self.model.model
        if i == 0:
            x = inner.embed_tokens(self.input_ids[:b])
            cos, sin = self.model.rotary(self.positions[:b], x.dtype)
            self.cos[:b].copy_(cos)
            self.sin[:b].copy_(sin)
        else:
            prev = self.layers[i - 1]
            attn = prev.self_attn
            x = self.residual[:b] + attn.o_proj(self.attn[:b, : attn.n_heads * attn.head_dim])
            x = x + prev.mlp(prev.post_attention_layernorm(x))
        if i == len(self.layers):
            self.hidden[:b].copy_(inner.norm(x))
            return
        layer = self.layers[i]
        self.residual[:b].copy_(x)
        w = layer.self_attn.qkv_weight
        self.qkv[:b, : w.shape[0]].copy_(F.linear(layer.input_layernorm(x), w))

    def _run(self, i: int, b: int) -> None:
        graphs = self.graphs.get(b)
        if graphs is None:
            self._piece(i, b)
        else:
            graphs[i].replay()

    @torch.inference_mode()
    def capture(self) -> None:
        """Every piece of every bucket (largest first, one pool), each run once first (compiles, sizes the
        allocator's blocks)."""
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            graphs = []
            for i in range(len(self.layers) + 1):
                self._piece(i, b)
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self._piece(i, b)
                if self.pool is None:
                    self.pool = g.pool()
                graphs.append(g)
            self.graphs[b] = graphs
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d piecewise graphs (%d layers + 1, tokens %s) in %.1f s",
                 sum(len(g) for g in self.graphs.values()), len(self.layers), self.buckets, self.capture_s)

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Final hidden states [T, H] of a step already on the device (`supports`): its rows into the buffers, the
        pieces of its bucket replayed (run, before `capture`) around each layer's eager attention."""
        T = step.input_ids.shape[0]
        b = next(s for s in self.buckets if s >= T)
        self.model.plan(step)
        self.input_ids[:T].copy_(step.input_ids)
        self.positions[:T].copy_(step.positions)
        self.input_ids[T:b].zero_()
        self.positions[T:b].zero_()
        self._run(0, b)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            w = attn.qkv_weight.shape[0]
            out = attn.attend(self.qkv[:T, :w], self.cos[:T], self.sin[:T], step)
            self.attn[:T, : attn.n_heads * attn.head_dim].copy_(out.reshape(T, -1))
            self._run(i + 1, b)
        self.num_steps += 1
        self.padded_rows += b - T
        return self.hidden[:T]
