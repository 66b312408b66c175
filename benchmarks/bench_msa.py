"""MSA kernels on M3 shapes: decode (indexer scan + block-sparse attention, dense-mode attention for the
full-attention layers), prefill insert and prefill attention; torch references in the same run.

    python benchmarks/bench_msa.py --out /tmp/bench.json        (one device call; prints a table)
    python benchmarks/bench_msa.py --smoke                      (CPU: tiny shapes, checks the script runs;
                                                                 with --tune / --tune-decoders: their variants too)

Kernel variants (``--tune``, ``--tune-decoders``) are selected through the kernels' tuning table
(``m3serve.kernels.dispatch.tuned``), the same launch parameters the engine gets by default otherwise.

Per (context, batch, cache dtype): times (triton.testing.do_bench, median, L2 flushed between reps; also
CUDA-graph replays with the L2 flushed, which hide Python launch overhead), bytes the kernel must move
(each K/V/index byte it reads once) / time against the device-to-device copy bandwidth measured here.
References: dense SDPA bf16 decode over the whole context (the 16 query heads of a KV head as 16 query
rows, no mask); the unfused torch MSA decode (gather pages, scores, max-pool, top-k, gather blocks, SDPA).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.testing  # noqa: E402

from ceilings import copy_bandwidth  # noqa: E402
from m3serve.config import KV_BYTES_PER_ELEMENT  # noqa: E402
from m3serve.model.kv_cache import LayerKVCache  # noqa: E402
from m3serve.kernels.dispatch import tuned  # noqa: E402
from m3serve.kernels.indexer import indexer_block_scores, indexer_decode, indexer_prefill  # noqa: E402
from m3serve.kernels.kv_insert import kv_insert, kv_insert_ref  # noqa: E402
from m3serve.kernels.msa_attention import msa_decode, msa_prefill  # noqa: E402

H_Q, H_KV, D, H_IDX, D_IDX, B, TOPK = 64, 4, 128, 4, 128, 128, 16
SCALE = {"bfloat16": 1.0, "fp8": 2.0 / 448, "nvfp4": 2.0 / 2688}


# ----------------------------------------------------------------------------------------------- timing
_FLUSH = None


def _flush():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    _FLUSH.zero_()


def t_eager(fn, rep=30):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def t_graph(fn, n=10):
    """Median of CUDA-graph replays of fn (L2 flushed before each); None if fn cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        times = []
        for _ in range(n):
            _flush()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]
    except Exception as e:  # noqa: BLE001
        print(f"  (graph capture failed: {type(e).__name__}: {e})", flush=True)
        return None


def under(fn, **knobs):
    """``fn`` with the kernels' launch choices changed (`dispatch.Tuning` fields): one benchmark variant."""
    def run():
        with tuned(**knobs):
            return fn()
    return run


def t_cpu(fn, n=1):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


# ----------------------------------------------------------------------------------------------- data
def alloc_pool(dtype, lead, dim, device):
    """Random valid cache bytes (no NaN codes), generated in chunks to bound temporary memory."""
    if dtype == "nvfp4":
        data = torch.randint(0, 256, (*lead, dim // 2), dtype=torch.uint8, device=device)
        sb = torch.empty(*lead, dim // 16, dtype=torch.float8_e4m3fn, device=device)
        sbf = sb.view(-1, dim // 16)
        for i in range(0, sbf.shape[0], 1 << 22):
            blk = torch.rand(sbf[i:i + (1 << 22)].shape, device=device)
            sbf[i:i + (1 << 22)] = (blk * 200 + 10).to(torch.float8_e4m3fn)
        return data, sb
    data = torch.empty(*lead, dim, dtype=torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16, device=device)
    flat = data.view(-1, dim)
    for i in range(0, flat.shape[0], 1 << 22):
        blk = torch.randn(flat[i:i + (1 << 22)].shape, device=device)
        flat[i:i + (1 << 22)] = (blk * 100).to(data.dtype) if dtype == "fp8" else blk.to(data.dtype)
    return data, None


class Pool:
    """One layer's pages (K, V, index keys) of ``dtype``, random valid bytes: ``cache`` is what the kernels take."""

    def __init__(self, dtype, n_pages, device):
        self.dtype, self.P = dtype, n_pages
        (kd, ksb), (vd, vsb) = (alloc_pool(dtype, (n_pages, H_KV, B), D, device) for _ in range(2))
        idx, isb = alloc_pool(dtype, (n_pages, B), D_IDX, device)
        s = SCALE[dtype]
        self.cache = LayerKVCache(dtype, kd, vd, ksb, vsb, s, s, dtype, idx, isb, s)


def unfused_torch_msa_decode(q, iq, pool, bt, ctx, scale):
    """The plain-torch MSA decode over a bf16 pool (every sequence at length ctx, a multiple of B)."""
    S = q.shape[0]
    nb = ctx // B
    pages = bt[:, :nb].long()
    c = pool.cache
    keys = c.index[pages].view(S, nb * B, D_IDX)  # gather
    sc = torch.einsum("shd,skd->shk", iq, keys).float()  # [S, H, L]
    bs = sc.view(S, H_IDX, nb, B).amax(-1)
    bs[:, :, nb - 1] = float("inf")  # local block
    top = bs.topk(min(TOPK, nb), dim=-1).indices  # [S, H, k]
    sel = pages.gather(1, top.flatten(1)).view(S, H_KV, -1)  # page ids [S, H, k]
    hh = torch.arange(H_KV, device=q.device)[None, :, None]
    ksel = c.k[sel, hh].flatten(2, 3)  # [S, H, k*B, D]
    vsel = c.v[sel, hh].flatten(2, 3)
    return F.scaled_dot_product_attention(q.view(S, H_KV, H_Q // H_KV, D), ksel, vsel, scale=scale)


# ----------------------------------------------------------------------------------------------- benches
def bench_decode(pool, ctx, batch, device, copy_bw, timer, graph, refs):
    S = batch
    nb = ctx // B
    perm = torch.randperm(pool.P, device=device)[: S * nb]
    bt = perm.view(S, nb).to(torch.int32)
    seq_lens = torch.full((S,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(S, H_Q, D, device=device, dtype=torch.bfloat16)
    iq = torch.randn(S, H_IDX, D_IDX, device=device, dtype=torch.bfloat16)
    scale = D ** -0.5
    be = KV_BYTES_PER_ELEMENT[pool.dtype]
    idx_bytes = S * ctx * D_IDX * be
    row = {"kv_dtype": pool.dtype, "index_dtype": pool.dtype, "context": ctx, "batch": S}

    c = pool.cache
    scan = lambda: indexer_block_scores(iq, c, bt, seq_lens=seq_lens)  # noqa: E731
    idx_fn = lambda: indexer_decode(iq, c, bt, seq_lens, TOPK)  # noqa: E731
    bids, pages = indexer_decode(iq, c, bt, seq_lens, TOPK, return_pages=True)
    n_sel = int((bids >= 0).sum())
    attn_fn = lambda: msa_decode(q, c, bt, seq_lens, scale, bids, block_pages=pages)  # noqa: E731
    dense_fn = lambda: msa_decode(q, c, bt, seq_lens, scale, None)  # noqa: E731

    def both():
        ids, pages = indexer_decode(iq, c, bt, seq_lens, TOPK, return_pages=True)
        return msa_decode(q, c, bt, seq_lens, scale, ids, block_pages=pages)
    attn_bytes = n_sel * B * 2 * D * be
    dense_bytes = S * ctx * H_KV * 2 * D * be
    for name, fn, nbytes in (("indexer_scan", scan, idx_bytes), ("indexer_topk", idx_fn, idx_bytes),
                             ("msa_sparse", attn_fn, attn_bytes), ("msa_dense", dense_fn, dense_bytes),
                             ("msa_decode_total", both, idx_bytes + attn_bytes)):
        ms = timer(fn)
        row[f"{name}_ms"] = ms
        row[f"{name}_bytes"] = nbytes
        row[f"{name}_TBps"] = nbytes / (ms * 1e-3) / 1e12
        row[f"{name}_frac_copy"] = nbytes / (ms * 1e-3) / copy_bw
        if graph is not None:
            gm = graph(fn)
            row[f"{name}_graph_ms"] = gm
            if gm:
                row[f"{name}_graph_frac_copy"] = nbytes / (gm * 1e-3) / copy_bw
    if refs is not None:
        row.update(refs(q, iq, bt, ctx, scale))
    return row


def make_refs(pool_bf16, device, timer, graph):
    def refs(q, iq, bt, ctx, scale):
        S = q.shape[0]
        out = {}
        try:
            k = torch.randn(S, H_KV, ctx, D, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            qq = q.view(S, H_KV, H_Q // H_KV, D)
            fn = lambda: F.scaled_dot_product_attention(qq, k, v, scale=scale)  # noqa: E731
            out["sdpa_dense_bf16_ms"] = timer(fn)
            out["sdpa_dense_bf16_graph_ms"] = graph(fn) if graph else None
            out["sdpa_dense_bf16_TBps"] = 2 * k.numel() * 2 / (out["sdpa_dense_bf16_ms"] * 1e-3) / 1e12
            del k, v
        except torch.OutOfMemoryError:
            out["sdpa_dense_bf16_ms"] = None
        torch.cuda.empty_cache()
        if pool_bf16 is not None:
            try:
                fn = lambda: unfused_torch_msa_decode(q, iq, pool_bf16, bt, ctx, scale)  # noqa: E731
                out["torch_msa_unfused_bf16_ms"] = timer(fn)
            except torch.OutOfMemoryError:
                out["torch_msa_unfused_bf16_ms"] = None
            torch.cuda.empty_cache()
        return out
    return refs


def bench_insert(dtype, T, device, timer):
    P = T // B + 2
    g = lambda: alloc_pool(dtype, (P, H_KV, B), D, device)  # noqa: E731
    (kd, ksb), (vd, vsb) = g(), g()
    idd, isb = alloc_pool(dtype, (P, B), D_IDX, device)
    k = torch.randn(T, H_KV, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ik = torch.randn(T, D_IDX, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(P * B, device=device)[:T]
    s = SCALE[dtype]
    cache = LayerKVCache(dtype, kd, vd, ksb, vsb, s, s, dtype, idd, isb, s)
    fused = timer(lambda: kv_insert(k, v, slots, cache, ik))
    unfused = timer(lambda: kv_insert_ref(k, v, slots, cache, ik))
    nbytes = T * (2 * H_KV * D + D_IDX) * (2 + KV_BYTES_PER_ELEMENT[dtype])
    return {"kv_dtype": dtype, "tokens": T, "fused_ms": fused, "unfused_torch_ms": unfused,
            "speedup": unfused / fused, "bytes": nbytes, "fused_TBps": nbytes / (fused * 1e-3) / 1e12}


# prefill attention variants (`--prefill-variants`): 8-token tiles (128 rows of 16 heads) on 8 warps (2.549 ms against
# 2.183 with the byte decoder, sparse, H100, 2026-12-07), the byte decoder (the default before that run), the word one;
# 1- and 2-token tiles (16 / 32 rows): a sparse tile visits the union of its tokens' blocks for all its rows, so 4-token
# tiles compute 2-4x the attention their tokens need (their tokens' selections overlap little, in this bench's random
# queries as in the learned model's, docs/performance.md) but decode each block once for 4 tokens;
# sorted: sparse tiles walk their selections sorted instead of scanning the context's blocks; sdpa: dense-mode only
PREFILL_VARIANTS = {"t8w8": dict(prefill_block_t=8, prefill_num_warps=8), "bytes": dict(prefill_words=False),
                    "words": dict(prefill_words=True), "t1": dict(prefill_block_t=1), "t2": dict(prefill_block_t=2),
                    "sorted": dict(prefill_sorted_blocks=True), "t1_sorted": dict(prefill_block_t=1,
                                                                                    prefill_sorted_blocks=True),
                    "sdpa": dict(prefill_sdpa_from=128), "plain": dict(prefill_plain_from=128),
                    "plain_t1_sorted": dict(prefill_plain_from=128, prefill_block_t=1, prefill_sorted_blocks=True)}


def bench_prefill(pool, ctx, chunk, device, timer, variants=()):
    """One sequence: a `chunk`-token prefill chunk at the end of a `ctx`-token context (keys in pages); ``variants``:
    names of `PREFILL_VARIANTS` timed beside the default, each output compared with the default's."""
    nb = ctx // B
    bt = torch.randperm(pool.P, device=device)[:nb].view(1, nb).to(torch.int32)
    qsl = [0, chunk]
    pos = torch.arange(ctx - chunk, ctx, device=device)
    q = torch.randn(chunk, H_Q, D, device=device, dtype=torch.bfloat16)
    iq = torch.randn(chunk, H_IDX, D_IDX, device=device, dtype=torch.bfloat16)
    scale = D ** -0.5
    c = pool.cache
    idx_fn = lambda: indexer_prefill(iq, c, bt, qsl, pos, TOPK)  # noqa: E731
    bids = idx_fn()
    row = {"kv_dtype": pool.dtype, "context": ctx, "chunk": chunk}
    row["indexer_prefill_ms"] = timer(idx_fn)
    attend = lambda b: msa_prefill(q, c, bt, qsl, pos, scale, b, seq_lens_cpu=[ctx])  # noqa: E731
    row["msa_prefill_sparse_ms"] = timer(lambda: attend(bids))
    row["msa_prefill_dense_ms"] = timer(lambda: attend(None))
    if device == "cuda" and pool.dtype == "bfloat16":
        k = torch.randn(1, H_Q, ctx, D, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qq = q.transpose(0, 1)[None]
        mask = torch.arange(ctx, device=device)[None, :] <= pos[:, None]
        row["sdpa_dense_prefill_bf16_ms"] = timer(
            lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale))
    flops = 4 * chunk * H_Q * D * (ctx - chunk / 2)
    row["msa_prefill_dense_TFLOPs"] = flops / (row["msa_prefill_dense_ms"] * 1e-3) / 1e12
    base = {m: attend(b).float() for m, b in (("sparse", bids), ("dense", None))} if variants else {}
    for name in variants:
        with tuned(**PREFILL_VARIANTS[name]):
            for mode, b in (("sparse", bids), ("dense", None)):
                got = attend(b).float()
                row[f"{name}_{mode}_err"] = float((got - base[mode]).norm() / base[mode].norm())
                row[f"{name}_{mode}_ms"] = timer(lambda b=b: attend(b))
    return row


def bench_tune(pool, device, copy_bw, timer, shapes=((131072, 64), (32768, 8))):
    """Variants of the decode kernels at the large shapes (block sizes, warps, stages, decoders, splits)."""
    rows = []
    c = pool.cache
    be = KV_BYTES_PER_ELEMENT[pool.dtype]
    scale = D ** -0.5

    def setup(ctx, S):
        nb = ctx // B
        bt = torch.randperm(pool.P, device=device)[: S * nb].view(S, nb).to(torch.int32)
        sl = torch.full((S,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(S, H_Q, D, device=device, dtype=torch.bfloat16)
        iq = torch.randn(S, H_IDX, D_IDX, device=device, dtype=torch.bfloat16)
        return bt, sl, q, iq

    def rec(kind, ctx, S, params, fn, nbytes):
        try:
            ms = timer(fn)
        except Exception as e:  # noqa: BLE001
            print(f"  tune {kind} {params} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        rows.append({"kind": kind, "kv_dtype": pool.dtype, "context": ctx, "batch": S, "params": params,
                     "ms": ms, "frac_copy": nbytes / (ms * 1e-3) / copy_bw})

    for si, (ctx, S) in enumerate(shapes):
        if ctx // B * S > pool.P:
            continue
        bt, sl, q, iq = setup(ctx, S)
        idx_bytes = S * ctx * D_IDX * be
        scan = lambda: indexer_block_scores(iq, c, bt, seq_lens=sl)  # noqa: E731
        for nw, ns in ((4, 3), (8, 3), (4, 4), (8, 2)):
            rec("indexer_scan", ctx, S, f"warps={nw} stages={ns}",
                under(scan, index_num_warps=nw, index_num_stages=ns), idx_bytes)
        ids, pages = indexer_decode(iq, c, bt, sl, TOPK, return_pages=True)
        sparse = lambda: msa_decode(q, c, bt, sl, scale, ids, block_pages=pages)  # noqa: E731
        attn_bytes = int((ids >= 0).sum()) * B * 2 * D * be
        words_opts = {"nvfp4": (True, False), "fp8": (True, False), "bfloat16": (True,)}[pool.dtype]
        if si == 0:
            for words in words_opts:
                for bn in (64, 128):
                    for nw in (4, 8):
                        rec("msa_sparse", ctx, S, f"words={words} block_n={bn} warps={nw}",
                            under(sparse, decode_words=words, decode_block_n=bn, decode_num_warps=nw), attn_bytes)
        for st in (1, 2, 4, 8):
            rec("msa_sparse", ctx, S, f"split_target={st}", under(sparse, decode_split_target=st), attn_bytes)
        if si == 1 and pool.dtype != "bfloat16":
            dense_bytes = S * ctx * H_KV * 2 * D * be
            for bn in (64, 128):
                for nw in (4, 8):
                    rec("msa_dense", ctx, S, f"block_n={bn} warps={nw}",
                        under(lambda: msa_decode(q, c, bt, sl, scale, None), decode_block_n=bn, decode_num_warps=nw),
                        dense_bytes)
        for r in rows:
            if "printed" not in r:
                r["printed"] = True
                print(f"  tune {r['kind']} {r['kv_dtype']} ctx={r['context']} b={r['batch']} {r['params']}: "
                      f"{r['ms']:.4f} ms {r['frac_copy']:.0%}", flush=True)
    for r in rows:
        r.pop("printed", None)
    return rows


def bench_decoders(pool, device, copy_bw, timer, ctx=131072, S=64):
    """NVFP4: the mma.sync kernels' variants vs the portable kernels; FP8: V from words vs native cast.
    Timed with CUDA-graph replays (the caller's timer)."""
    rows = []
    if ctx // B * S > pool.P:
        return rows
    be = KV_BYTES_PER_ELEMENT[pool.dtype]
    nb = ctx // B
    bt = torch.randperm(pool.P, device=device)[: S * nb].view(S, nb).to(torch.int32)
    sl = torch.full((S,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(S, H_Q, D, device=device, dtype=torch.bfloat16)
    iq = torch.randn(S, H_IDX, D_IDX, device=device, dtype=torch.bfloat16)
    scale = D ** -0.5
    c = pool.cache
    ids, pages = indexer_decode(iq, c, bt, sl, TOPK, return_pages=True)
    attn_bytes = int((ids >= 0).sum()) * B * 2 * D * be
    dense_s = 8
    dense_bytes = dense_s * ctx * H_KV * 2 * D * be
    scan = lambda: indexer_block_scores(iq, c, bt, seq_lens=sl)  # noqa: E731
    sparse = lambda: msa_decode(q, c, bt, sl, scale, ids, block_pages=pages)  # noqa: E731
    dense = lambda: msa_decode(q[:dense_s], c, bt[:dense_s], sl[:dense_s], scale, None)  # noqa: E731
    variants = []
    if pool.dtype == "nvfp4":  # the mma.sync kernels (nvfp4_mma: decoder mode, pages in flight) vs the portable ones
        for params, kw in [("portable", {"mma": False})] + [
                (f"mma mode={m} unroll={u}", {"index_mma_mode": m, "index_mma_unroll": u})
                for m, u in ((0, 1), (0, 2), (1, 1), (1, 2), (1, 3), (1, 4))]:
            variants.append(("indexer_scan", params, S * ctx * D_IDX * be, under(scan, **kw)))
        for params, kw in (("portable", {"mma": False}), ("mma kmode=0", {"decode_mma_kmode": 0}),
                           ("mma kmode=1", {"decode_mma_kmode": 1}), ("mma split_target=1", {"decode_split_target": 1}),
                           ("mma split_target=4", {"decode_split_target": 4}),
                           ("mma split_target=8", {"decode_split_target": 8})):
            variants.append(("msa_sparse", params, attn_bytes, under(sparse, **kw)))
            variants.append(("msa_dense", f"b={dense_s} {params}", dense_bytes, under(dense, **kw)))
    else:
        for words in (True, False):
            variants.append(("msa_sparse", f"words={words}", attn_bytes, under(sparse, decode_words=words)))
            variants.append(("msa_dense", f"b={dense_s} words={words}", dense_bytes, under(dense, decode_words=words)))
    for kind, params, nbytes, fn in variants:
        try:
            ms = timer(fn)
        except Exception as e:  # noqa: BLE001
            print(f"  decoder {kind} {params} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rows.append({"kind": kind, "kv_dtype": pool.dtype, "context": ctx, "batch": S, "params": params, "ms": ms,
                     "frac_copy": nbytes / (ms * 1e-3) / copy_bw})
        print(f"  decoder {kind} {pool.dtype} {params}: {ms:.4f} ms {rows[-1]['frac_copy']:.0%}", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- main
def fmt_table(rows, cols):
    head = " | ".join(c for c, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for c, f in cols:
            val = r.get(c)
            cells.append("-" if val is None else (f.format(val) if isinstance(val, (int, float)) else str(val)))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dtypes", default="nvfp4,fp8,bfloat16")
    ap.add_argument("--insert-tokens", default="512,2048,8192")
    ap.add_argument("--prefill", default="8192:2048,32768:2048")
    ap.add_argument("--prefill-variants", default="", help=f"of {','.join(PREFILL_VARIANTS)}: timed beside the default")
    ap.add_argument("--mem-gb", type=float, default=100.0, help="skip combos whose pool exceeds this")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tune", action="store_true", help="also time kernel variants at the large shapes")
    ap.add_argument("--tune-decoders", action="store_true", help="time the NVFP4/FP8 decoder variants only")
    args = ap.parse_args()
    prefill_variants = [v for v in args.prefill_variants.split(",") if v]
    if set(prefill_variants) - set(PREFILL_VARIANTS):
        ap.error(f"--prefill-variants: {sorted(set(prefill_variants) - set(PREFILL_VARIANTS))} not among "
                 f"{list(PREFILL_VARIANTS)}")
    if args.smoke:  # CPU interpreter: tiny everything, only checks that the script runs end to end
        device = "cpu"
        contexts, batches = [512], [1, 2]
        ins, prefill = [256], [(512, 64)]
        timer, graph = t_cpu, None
        copy_bw = 1e10
    else:
        device = "cuda"
        contexts = [int(x) for x in args.contexts.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        ins = [int(x) for x in args.insert_tokens.split(",") if x]
        prefill = [tuple(int(y) for y in x.split(":")) for x in args.prefill.split(",") if x]
        timer, graph = t_eager, t_graph
        copy_bw = copy_bandwidth(device)
    dtypes = args.dtypes.split(",")

    def dump(res):
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "copy_bw_TBps": copy_bw / 1e12, "shapes": dict(H_Q=H_Q, H_KV=H_KV, D=D, H_IDX=H_IDX, D_IDX=D_IDX, B=B,
                                                           TOPK=TOPK)}
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        meta["commit"] = None
    print(json.dumps(meta), flush=True)
    decode_rows, insert_rows, prefill_rows, tune_rows = [], [], [], []
    max_pages = max(c // B * b for c in contexts for b in batches)
    for dtype in dtypes:
        page_bytes = B * (2 * H_KV * D + D_IDX) * KV_BYTES_PER_ELEMENT[dtype]
        n_pages = int(min(max_pages, args.mem_gb * 1e9 / page_bytes)) + 1
        pool = Pool(dtype, n_pages, device)
        refs = make_refs(pool if dtype == "bfloat16" else None, device, timer, graph) \
            if device == "cuda" and dtype == "bfloat16" else None
        for ctx in contexts:
            for batch in batches:
                if ctx // B * batch > pool.P:
                    print(f"skip {dtype} ctx={ctx} batch={batch}: pool too small", flush=True)
                    continue
                t0 = time.time()
                try:
                    row = bench_decode(pool, ctx, batch, device, copy_bw, timer, graph, refs)
                except Exception as e:  # noqa: BLE001  (keep the rest of the run)
                    print(f"FAILED decode {dtype} ctx={ctx} b={batch}: {type(e).__name__}: {e}", flush=True)
                    continue
                decode_rows.append(row)
                dump({"meta": meta, "decode": decode_rows, "insert": insert_rows, "prefill": prefill_rows,
                      "tune": tune_rows})
                print(f"decode {dtype} ctx={ctx} b={batch}: total {row['msa_decode_total_ms']:.4f} ms "
                      f"(scan {row['indexer_scan_frac_copy']:.0%}, sparse {row['msa_sparse_frac_copy']:.0%}, "
                      f"dense {row['msa_dense_frac_copy']:.0%} of copy bw) [{time.time() - t0:.1f}s]", flush=True)
        if args.tune:
            tune_rows += bench_tune(pool, device, copy_bw, timer, **({"shapes": ((512, 2), (512, 1))} if args.smoke
                                                                      else {}))
        if args.tune_decoders and dtype != "bfloat16":
            tune_rows += bench_decoders(pool, device, copy_bw, (lambda fn: graph(fn) or timer(fn)) if graph else timer,
                                        **({"ctx": 512, "S": 2} if args.smoke else {}))
        for ctx, chunk in prefill:
            if ctx // B <= pool.P:
                try:
                    prefill_rows.append(bench_prefill(pool, ctx, chunk, device, timer, prefill_variants))
                    print("prefill", prefill_rows[-1], flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"FAILED prefill {dtype} ctx={ctx}: {type(e).__name__}: {e}", flush=True)
        del pool
        if device == "cuda":
            torch.cuda.empty_cache()
        for T in ins:
            try:
                insert_rows.append(bench_insert(dtype, T, device, timer))
                print("insert", insert_rows[-1], flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"FAILED insert {dtype} T={T}: {type(e).__name__}: {e}", flush=True)
    # speedups vs dense SDPA at the same (context, batch)
    sdpa = {(r["context"], r["batch"]): r.get("sdpa_dense_bf16_ms") for r in decode_rows if "sdpa_dense_bf16_ms" in r}
    sdpa_g = {(r["context"], r["batch"]): r.get("sdpa_dense_bf16_graph_ms") for r in decode_rows
              if r.get("sdpa_dense_bf16_graph_ms")}
    unf = {(r["context"], r["batch"]): r.get("torch_msa_unfused_bf16_ms") for r in decode_rows
           if "torch_msa_unfused_bf16_ms" in r}
    for r in decode_rows:
        key = (r["context"], r["batch"])
        if sdpa.get(key):
            r["speedup_vs_sdpa_bf16"] = sdpa[key] / r["msa_decode_total_ms"]
        if r.get("msa_decode_total_graph_ms") and sdpa_g.get(key):
            r["speedup_vs_sdpa_bf16_graph"] = sdpa_g[key] / r["msa_decode_total_graph_ms"]
        if unf.get(key):
            r["speedup_vs_torch_msa_bf16"] = unf[key] / r["msa_decode_total_ms"]
    dump({"meta": meta, "decode": decode_rows, "insert": insert_rows, "prefill": prefill_rows, "tune": tune_rows})
    cols = [("kv_dtype", "{}"), ("context", "{}"), ("batch", "{}"),
            ("indexer_scan_ms", "{:.4f}"), ("indexer_scan_frac_copy", "{:.0%}"),
            ("msa_sparse_ms", "{:.4f}"), ("msa_sparse_frac_copy", "{:.0%}"),
            ("msa_dense_ms", "{:.4f}"), ("msa_dense_frac_copy", "{:.0%}"),
            ("msa_decode_total_ms", "{:.4f}"), ("msa_decode_total_graph_ms", "{:.4f}"),
            ("speedup_vs_sdpa_bf16", "{:.1f}x"), ("speedup_vs_sdpa_bf16_graph", "{:.1f}x"),
            ("speedup_vs_torch_msa_bf16", "{:.1f}x")]
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(fmt_table(decode_rows, cols))
    ref_cols = [("context", "{}"), ("batch", "{}"), ("sdpa_dense_bf16_ms", "{:.4f}"),
                ("sdpa_dense_bf16_graph_ms", "{:.4f}"), ("torch_msa_unfused_bf16_ms", "{:.4f}")]
    print(fmt_table([r for r in decode_rows if r["kv_dtype"] == "bfloat16"], ref_cols))
    print(fmt_table(insert_rows, [("kv_dtype", "{}"), ("tokens", "{}"), ("fused_ms", "{:.4f}"),
                                  ("unfused_torch_ms", "{:.4f}"), ("speedup", "{:.2f}x"), ("fused_TBps", "{:.2f}")]))
    print(fmt_table(prefill_rows, [("kv_dtype", "{}"), ("context", "{}"), ("chunk", "{}"),
                                   ("indexer_prefill_ms", "{:.3f}"), ("msa_prefill_sparse_ms", "{:.3f}"),
                                   ("msa_prefill_dense_ms", "{:.3f}"), ("msa_prefill_dense_TFLOPs", "{:.0f}"),
                                   ("sdpa_dense_prefill_bf16_ms", "{:.3f}")]))
    if prefill_variants:
        print(fmt_table(prefill_rows, [("kv_dtype", "{}"), ("context", "{}")] + [
            (f"{v}_{m}_{x}", "{:.3f}" if x == "ms" else "{:.1e}")
            for v in prefill_variants for m in ("sparse", "dense") for x in ("ms", "err")]))


if __name__ == "__main__":
    main()
