"""Helpers for the paged-kernel tests (interpreter and GPU): layer caches (the engine's `LayerKVCache`, which the
kernels take) over random bytes, filled through shuffled page tables with fresh random data; the kernel attention
backend against the reference one over whole steps."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from m3serve.config import ModelConfig
from m3serve.step_io import StepInput
from m3serve.model.kv_cache import LayerKVCache, PagedKVCache
from m3serve.kernels.kv_insert import kv_insert_ref
from m3serve.model.layers.attention import AttentionGeometry, TorchAttention
from m3serve.model.layers.triton_attention import TritonAttention

KV_DTYPES = ("bfloat16", "fp8", "nvfp4")


def alloc(dtype: str, lead: tuple, dim: int, device="cpu"):
    """Cache tensors for `dtype`, filled with random (valid) bytes so unwritten slots are not zero."""
    if dtype == "nvfp4":
        data = torch.randint(0, 256, (*lead, dim // 2), dtype=torch.uint8, device=device)
        sb = (torch.rand(*lead, dim // 16, device=device) * 4 + 0.1).to(torch.float8_e4m3fn)
        return data, sb
    if dtype == "fp8":
        return torch.randn(*lead, dim, device=device).to(torch.float8_e4m3fn), None
    return torch.randn(*lead, dim, device=device).to(torch.bfloat16), None


def layer_cache(kv_dtype: str, P: int, H_kv: int, B: int, D: int, index_dtype: str | None = None, D_idx: int = 0,
                scales=(1.0, 1.0, 1.0), device="cpu") -> LayerKVCache:
    """One layer's pages over random (valid) bytes: K/V ``[P, H_kv, B, ...]``, index keys ``[P, B, ...]`` when
    ``index_dtype`` is given; ``scales`` = (k_scale, v_scale, index_scale)."""
    (kd, ksb), (vd, vsb) = (alloc(kv_dtype, (P, H_kv, B), D, device) for _ in range(2))
    idx, isb = alloc(index_dtype, (P, B), D_idx, device) if index_dtype else (None, None)
    return LayerKVCache(kv_dtype, kd, vd, ksb, vsb, scales[0], scales[1], index_dtype, idx, isb, scales[2])


def clone_cache(c: LayerKVCache) -> LayerKVCache:
    return dataclasses.replace(c, **{f.name: getattr(c, f.name).clone() for f in dataclasses.fields(c)
                                     if isinstance(getattr(c, f.name), torch.Tensor)})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN in the kernel output (unwritten or broken)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def page_tables(seq_lens, block_size: int, spare: int = 3, gen=None, device="cpu"):
    """Shuffled, disjoint page tables: int32 [S, max_pages] (padding entries point at pages too)."""
    S = len(seq_lens)
    max_pages = max(-(-int(n) // block_size) for n in seq_lens) + 1
    P = S * max_pages + spare
    perm = torch.randperm(P, generator=gen)[: S * max_pages].view(S, max_pages)
    return perm.to(torch.int32).to(device), P


def slots_of(block_table_row, positions, block_size):
    pos = positions.long()
    return block_table_row.long()[pos // block_size] * block_size + pos % block_size


@dataclass
class PagedSetup:
    bt: torch.Tensor
    seq_lens: torch.Tensor
    cache: LayerKVCache
    k_dense: list  # per sequence [L, H, D] inputs that were inserted (bf16)
    v_dense: list
    ik_dense: list


def build(seq_lens, H_kv, D, B, kv_dtype, index_dtype=None, D_idx=None, gen=None, scale=None, device="cpu"):
    """Insert random K/V/index keys of every sequence (all its positions) into shuffled pages (torch ref).
    Random values come from the CPU generator `gen`; caches and inserted tensors live on `device`."""
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    bt, P = page_tables(seq_lens.tolist(), B, gen=gen)
    if scale is None:  # a per-layer calibration-like scale for quantized caches, exercising the epilogue
        scale = {"bfloat16": 1.0, "fp8": 2.0 / 448, "nvfp4": 2.5 / 2688}[kv_dtype]
    i_scale = {"bfloat16": 1.0, "fp8": 3.0 / 448, "nvfp4": 3.0 / 2688, None: 1.0}[index_dtype]
    cache = layer_cache(kv_dtype, P, H_kv, B, D, index_dtype, D_idx, (scale, scale, i_scale), device)
    kl, vl, il = [], [], []
    for s, n in enumerate(seq_lens.tolist()):
        k = torch.randn(n, H_kv, D, generator=gen).to(device, torch.bfloat16)
        v = torch.randn(n, H_kv, D, generator=gen).to(device, torch.bfloat16)
        ik = torch.randn(n, D_idx, generator=gen).to(device, torch.bfloat16) if index_dtype is not None else None
        slots = slots_of(bt[s], torch.arange(n), B).to(device)
        kv_insert_ref(k, v, slots, cache, ik)
        kl.append(k), vl.append(v), il.append(ik)
    return PagedSetup(bt.to(device), seq_lens.to(device), cache, kl, vl, il)


def chunk_positions(seq_lens, chunk_lens):
    """query_start_loc and positions for a prefill step whose chunks are the last tokens of each sequence."""
    qsl = [0]
    pos = []
    for n, c in zip(seq_lens, chunk_lens):
        qsl.append(qsl[-1] + c)
        pos.append(torch.arange(n - c, n))
    return qsl, torch.cat(pos).to(torch.int64)


# (sequence -> new tokens) per step: A is chunk-prefilled, B and C join, then everyone decodes
ATTENTION_STEPS = [{0: 40, 1: 25}, {0: 35, 1: 1, 2: 9}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]


def run_attention_scenario(kv_dtype, index_dtype, device="cpu", h_q=8, h_kv=2, d=64, di=32, b=16, topk=4,
                           steps=None, seed=42, tol=1.5e-2):
    """TritonAttention (kernels) vs TorchAttention (references), each over its own PagedKVCache: drive both through
    `steps` ({sequence: new tokens} per step) on a full and a sparse layer; outputs close, the same bytes written."""
    steps = steps or ATTENTION_STEPS
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(num_hidden_layers=2, num_attention_heads=h_q, num_key_value_heads=h_kv, head_dim=d,
                      layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "dense"],
                      index_n_heads=h_kv, index_head_dim=di, index_block_size=b, index_topk_blocks=topk)
    seqs_all = sorted({s for st in steps for s in st})
    total = {s: sum(st.get(s, 0) for st in steps) for s in seqs_all}
    n_pages = sum(-(-n // b) for n in total.values()) + 3
    scales = {0: (0.004, 0.003), 1: (0.002, 0.005)} if kv_dtype != "bfloat16" else None
    iscales = {1: 0.003} if index_dtype != "bfloat16" else None
    caches = [PagedKVCache(cfg, n_pages, kv_dtype, index_dtype, device=device, kv_scales=scales,
                           index_scales=iscales) for _ in range(2)]
    geometry = AttentionGeometry(b, topk, 1, d ** -0.5)
    backends = [[TorchAttention(geometry, c) for c in caches[0].layers],  # per layer, each over its layer's pages
                [TritonAttention(geometry, c, h_q, h_kv) for c in caches[1].layers]]
    free = torch.randperm(n_pages, generator=g).tolist()
    pages = {s: [] for s in seqs_all}
    done = {s: 0 for s in seqs_all}
    for step in steps:
        seqs = sorted(step)
        pos, slots, qsl, lens = [], [], [0], []
        for s in seqs:
            start, end = done[s], done[s] + step[s]
            while len(pages[s]) * b < end:
                pages[s].append(free.pop())
            pos += range(start, end)
            slots += [pages[s][p // b] * b + p % b for p in range(start, end)]
            qsl.append(qsl[-1] + step[s])
            lens.append(end)
            done[s] = end
        T = qsl[-1]
        tables = torch.zeros(len(seqs), max(len(pages[s]) for s in seqs), dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(pages[s])] = torch.tensor(pages[s], dtype=torch.int32)
        step_in = StepInput(torch.zeros(T, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                            torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), qsl, lens,
                            all(step[s] == 1 for s in seqs), max(step.values()), max(lens), block_tables=tables,
                            slot_mapping=torch.tensor(slots, dtype=torch.int64)).to(device)
        backends[1][0].plan(step_in)  # once per step, for every layer
        for layer in range(2):
            rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, torch.bfloat16)  # noqa: E731
            q, k, v = rnd(T, h_q, d), rnd(T, h_kv, d), rnd(T, h_kv, d)
            iq = ik = None
            if cfg.is_sparse_attention(layer):
                iq, ik = rnd(T, h_kv, di), rnd(T, di)
            outs = [backend[layer].forward(q, k, v, iq, ik, step_in) for backend in backends]
            assert outs[1].shape == q.shape and outs[1].dtype == q.dtype
            err = rel_err(outs[1], outs[0])
            assert err < tol, (step, layer, err)
    assert max(done.values()) > topk * b  # the sparse layer's selection dropped blocks
    for a, c in zip(caches[0].layers, caches[1].layers):
        for x, y in zip(a.tensors(), c.tensors()):  # same bytes written by both paths
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
