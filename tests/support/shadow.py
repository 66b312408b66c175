"""A shadow attention backend for engine tests: at every layer of every step it runs the Triton kernels
and the torch reference on the same inputs over the same paged cache, checks them against each other,
and hands the reference output on (teacher forcing), so one discrete flip cannot snowball.

Why not compare two free runs: the kernels' dots take fp16/bf16 operands, so hidden states differ by
~1e-3 from the reference; over layers a near-tie in a router's or the indexer's top-k flips, and from
there the two runs see different inputs (with an nvfp4 cache the flipped block moved one logprob by 0.5
on the tiny model, 2026-12-02; the kernels matched their references on that step's cache).

A (token, query head) whose output differs by more than `tol` must be explained by a block-selection
near-tie of that head's own indexer head: the blocks the kernel chose instead of the reference's score
within `tie_rtol` of them in fp32 on the cached keys. Anything else is an error (a flip on another head
excuses nothing). `flips` counts the tokens so excused: callers cap it (1 in 100 tokens).
"""
from __future__ import annotations

import torch

from m3serve.kernels.cache import gather_part_ref
from m3serve.kernels.indexer import indexer_decode, indexer_prefill, indexer_prefill_ref
from m3serve.model.layers.attention import TorchAttention


def _block_scores(iq_t, keys, pos, B):
    """fp32 block scores [H, n_blocks] of one query (causal) over keys [L, D]."""
    s = torch.einsum("hd,kd->hk", iq_t.float(), keys.float())
    s[:, pos + 1:] = float("-inf")
    n = keys.shape[0]
    nb = -(-n // B)
    s = torch.nn.functional.pad(s, (0, nb * B - n), value=float("-inf"))
    return s.view(s.shape[0], nb, B).amax(-1)


def shadow_of(runner, tol: float, kernels=None, references=None) -> "ShadowAttention":
    """Shadow every layer of `runner` (a `ModelRunner`, its graphs not captured) and bind the shadows to it: the
    kernels (default: the backends bound now) against the references (default: a `TorchAttention` of the same
    geometry over each layer's cache)."""
    kernels = list(kernels or runner.attention)
    references = list(references or [TorchAttention(k.geometry, k.cache) for k in kernels])
    shadow = ShadowAttention(kernels, references, tol)
    runner.bind_attention(shadow.layers)
    return shadow


class _LayerShadow:
    """One layer's backend: its kernel and its reference on the same inputs over the same layer cache."""

    def __init__(self, hub: "ShadowAttention", layer: int, kernel, reference):
        self.hub, self.layer, self.kernel, self.reference = hub, layer, kernel, reference
        self.cache = kernel.cache

    @property
    def packed_qkv(self) -> bool:
        return getattr(self.kernel, "packed_qkv", False)

    def plan(self, step):
        plan = getattr(self.kernel, "plan", None)
        if plan is not None:
            plan(step)

    def forward(self, q, k, v, iq, ik, step):
        out_k = self.kernel.forward(q, k, v, iq, ik, step)  # inserts the new K/V/index keys
        out_r = self.reference.forward(q, k, v, iq, ik, step)  # stores the same bytes, reads them back
        return self.hub._compare(self, q, out_k, out_r, iq, step)

    def forward_packed(self, qkv, attn, cos, sin, step):
        """The kernels from the fused projection output; the reference from the model's own unfused math on it
        (which rounds between norm and RoPE, so its stored bytes may differ on rare rounding ties)."""
        self.hub.packed_calls += 1
        out_k = self.kernel.forward_packed(qkv, attn, cos, sin, step)
        q, k, v, iq, ik = attn.finish(torch.split(qkv, attn.qkv_sizes, dim=-1), cos, sin)
        out_r = self.reference.forward(q, k, v, iq, ik, step)
        return self.hub._compare(self, q, out_k, out_r, iq, step)


class ShadowAttention:
    """The counters of every layer's check; `layers[l]` is layer l's backend (bound by `shadow_of`)."""

    def __init__(self, kernels, references, tol: float, tie_rtol: float = 1e-2):
        self.tol, self.tie_rtol = tol, tie_rtol
        self.layers = [_LayerShadow(self, i, k, r) for i, (k, r) in enumerate(zip(kernels, references, strict=True))]
        self.calls = self.tokens = self.flips = self.packed_calls = 0
        self.max_err = 0.0  # over tokens that needed no explanation

    def _compare(self, shadow: _LayerShadow, q, out_k, out_r, iq, step):
        ref = out_r.float()
        err = (out_k.float() - ref).abs().amax(dim=2) / ref.abs().amax().clamp_min(1e-6)  # [tokens, heads]
        bad = (err > self.tol).any(1).nonzero().flatten().tolist()
        self.calls += 1
        self.tokens += q.shape[0]
        ok = err.clone()
        ok[err > self.tol] = 0
        self.max_err = max(self.max_err, float(ok.max()) if ok.numel() else 0.0)
        if bad:
            self._explain(shadow, iq, step, bad, err)
        return out_r

    def _explain(self, shadow: _LayerShadow, iq, step, bad, err):
        layer, cache = shadow.layer, shadow.cache
        assert iq is not None and cache.has_index, (
            f"layer {layer} (dense) tokens {bad}: kernel vs reference error {err[bad].amax(1).tolist()} > {self.tol}")
        qsl, pos, sp = step.query_start_loc_cpu, step.positions, shadow.kernel.geometry
        bt, topk, local, B = step.block_tables, sp.topk, sp.local_blocks, sp.block_size
        if step.is_decode:  # what TritonAttention ran
            sel_k = indexer_decode(iq.contiguous(), cache, bt, step.seq_lens, topk, local)
        else:
            sel_k = indexer_prefill(iq.contiguous(), cache, bt, qsl, pos, topk, local)
        sel_r = indexer_prefill_ref(iq, cache, bt, qsl, pos, topk, local)
        group = err.shape[1] // iq.shape[1]  # query heads per indexer head
        for t in bad:
            s = max(i for i in range(len(qsl) - 1) if qsl[i] <= t)
            p = int(pos[t])
            keys = gather_part_ref(cache, "index", bt[s], int(step.seq_lens_cpu[s]))
            scores = _block_scores(iq[t], keys, p, B)
            for h in sorted({int(qh) // group for qh in (err[t] > self.tol).nonzero().flatten()}):
                a = {int(x) for x in sel_r[t, h] if x >= 0}
                b = {int(x) for x in sel_k[t, h] if x >= 0}
                assert a != b, (f"layer {layer} token {t} (pos {p}) indexer head {h}: kernel vs reference error "
                                f"{float(err[t, h * group:(h + 1) * group].max()):.4g} > {self.tol} with the same "
                                "block selection")
                lost, won = sorted(a - b), sorted(b - a)
                span = float(scores[h][torch.isfinite(scores[h])].abs().max())
                gap = max(abs(float(scores[h, i]) - float(scores[h, j])) for i in lost for j in won)
                assert gap <= self.tie_rtol * span, (
                    f"layer {layer} token {t} (pos {p}) head {h}: kernel chose blocks {won} over {lost}, "
                    f"score gap {gap:.4g} is not a near-tie (scores {scores[h].tolist()})")
            self.flips += 1
