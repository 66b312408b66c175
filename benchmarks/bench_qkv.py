"""The attention layer's input side on M3 shapes: hidden states -> q (and index q) + K / V / index key in
their cache pages. Three paths, timed side by side in one run:

* ``unfused``: the model's torch path: five projection GEMMs, RMSNorm and RoPE in torch (each a few
  kernels), then the torch quantize + index_put insert (``kv_insert_ref``);
* ``gemm+insert``: one fused QKV GEMM, torch norm/RoPE, then the Triton ``kv_insert`` (the engine before
  ``qkv_insert``);
* ``fused``: one fused QKV GEMM, then ``qkv_insert`` (norm + partial RoPE + quantize + paged store, one launch).

Also the ``qkv_insert`` launch alone against the copy bandwidth: it reads the GEMM output once and writes
q / index q and the cache bytes once.

    python benchmarks/bench_qkv.py --out /tmp/qkv.json     (one device call; prints a table)
    python benchmarks/bench_qkv.py --smoke                 (CPU interpreter: tiny shapes, checks it runs)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.testing  # noqa: E402

from m3serve.config import KV_BYTES_PER_ELEMENT, ModelConfig, preset  # noqa: E402
from m3serve.model.kv_cache import PagedKVCache  # noqa: E402
from m3serve.kernels.kv_insert import kv_insert, kv_insert_ref  # noqa: E402
from m3serve.kernels.qkv_insert import QKVLayout, qkv_insert  # noqa: E402
from m3serve.model.m3 import Attention, Rotary  # noqa: E402



def layer_config(tp: int, smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           partial_rotary_factor=0.5, num_hidden_layers=2, index_n_heads=2, index_head_dim=32,
                           index_block_size=16, layer_types=["full_attention", "minimax_m3_sparse"],
                           mlp_layer_types=["dense", "dense"])
    c = preset("minimax-m3")
    d = {k: getattr(c, k) for k in c.__dataclass_fields__}
    d.update(num_attention_heads=c.num_attention_heads // tp, num_key_value_heads=c.num_key_value_heads // tp,
             index_n_heads=c.index_n_heads // tp)
    return ModelConfig(**d)


def bench_one(cfg, layer, kv, T, device, timer):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    attn = Attention(cfg, layer, dtype).to(device)
    for b in attn.buffers():
        b.copy_((torch.randn(b.shape, generator=g) * 0.02).to(b.dtype))
    n_pages = T // cfg.index_block_size + 2
    cache = PagedKVCache(cfg, n_pages, kv, kv, device=device)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(device, dtype)
    pos = torch.arange(T, device=device) + 1000
    cos, sin = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)(pos, dtype)
    slots = torch.randperm(n_pages * cfg.index_block_size, device=device)[:T]
    sparse = attn.indexer is not None
    lc = cache.layers[layer]  # this layer's pages (index keys on sparse layers only)

    def unfused():
        q, k, v, iq, ik = attn.finish(attn.project(x), cos, sin)
        kv_insert_ref(k, v, slots, lc, ik=ik)
        return q, iq

    ix = attn.indexer
    layout = QKVLayout(attn.n_heads, attn.n_kv, attn.head_dim, attn.rotary_dim,
                       ix.n_heads if sparse else 0, ix.head_dim if sparse else 0)
    t_unfused = timer(unfused)  # before fusing: five GEMMs
    attn.fuse_projections()
    qkv = torch.nn.functional.linear(x, attn.qkv_weight)

    def gemm_insert():
        q, k, v, iq, ik = attn.finish(attn.project(x), cos, sin)
        kv_insert(k, v, slots, lc, ik=ik)
        return q, iq

    def fused():
        return qkv_insert(torch.nn.functional.linear(x, attn.qkv_weight), layout, attn.norm_weights, attn.eps,
                          cos, sin, slots, lc)

    def kernel_alone():
        return qkv_insert(qkv, layout, attn.norm_weights, attn.eps, cos, sin, slots, lc)

    t_gi, t_fused, t_kernel = timer(gemm_insert), timer(fused), timer(kernel_alone)
    t_gemm = timer(lambda: torch.nn.functional.linear(x, attn.qkv_weight))
    e = 2 if dtype == torch.bfloat16 else 4
    out_cols = layout.n_q * layout.head_dim + layout.n_idx * layout.index_dim
    cache_cols = 2 * layout.n_kv * layout.head_dim + (layout.index_dim if sparse else 0)
    nbytes = T * (layout.width * e + out_cols * e + cache_cols * KV_BYTES_PER_ELEMENT[kv])
    return {"heads": f"{layout.n_q}/{layout.n_kv}/{layout.n_idx}", "layer": "sparse" if sparse else "full",
            "kv_dtype": kv, "tokens": T, "unfused_ms": t_unfused, "gemm_insert_ms": t_gi, "fused_ms": t_fused,
            "gemm_ms": t_gemm, "qkv_insert_ms": t_kernel, "speedup_vs_unfused": t_unfused / t_fused,
            "speedup_vs_gemm_insert": t_gi / t_fused, "qkv_insert_bytes": nbytes,
            "qkv_insert_TBps": nbytes / (t_kernel * 1e-3) / 1e12}


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_msa import fmt_table, t_cpu, t_eager
    from ceilings import copy_bandwidth

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="64,512,2048,8192")
    ap.add_argument("--dtypes", default="nvfp4,fp8,bfloat16")
    ap.add_argument("--tp", default="1,4", help="per-rank head counts of these tensor-parallel sizes")
    ap.add_argument("--layers", default="both", choices=["both", "full", "sparse"])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    timer = t_cpu if args.smoke else t_eager
    tokens = [40] if args.smoke else [int(t) for t in args.tokens.split(",")]
    tps = [1] if args.smoke else [int(t) for t in args.tp.split(",")]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    copy_bw = None if args.smoke else copy_bandwidth(device)
    meta["copy_bw_TBps"] = copy_bw and copy_bw / 1e12
    print(json.dumps(meta), flush=True)
    rows = []
    for tp in tps:
        cfg = layer_config(tp, args.smoke)
        kinds = [i for i in range(cfg.num_hidden_layers) if not cfg.is_sparse_attention(i)][:1] + \
            [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_attention(i)][:1]
        for layer in kinds:  # the first full-attention and the first sparse layer
            if args.layers != "both" and (args.layers == "sparse") != cfg.is_sparse_attention(layer):
                continue
            for kv in args.dtypes.split(","):
                for T in tokens:
                    r = bench_one(cfg, layer, kv, T, device, timer)
                    r["tp"] = tp
                    if copy_bw:
                        r["qkv_insert_frac_copy"] = r["qkv_insert_TBps"] * 1e12 / copy_bw
                    rows.append(r)
                    print(r, flush=True)
                    if device == "cuda":
                        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(fmt_table(rows, [("tp", "{}"), ("heads", "{}"), ("layer", "{}"), ("kv_dtype", "{}"), ("tokens", "{}"),
                           ("unfused_ms", "{:.4f}"), ("gemm_insert_ms", "{:.4f}"), ("fused_ms", "{:.4f}"),
                           ("speedup_vs_unfused", "{:.2f}x"), ("speedup_vs_gemm_insert", "{:.2f}x"),
                           ("gemm_ms", "{:.4f}"), ("qkv_insert_ms", "{:.4f}"), ("qkv_insert_TBps", "{:.2f}"),
                           ("qkv_insert_frac_copy", "{:.0%}")]))


if __name__ == "__main__":
    main()
