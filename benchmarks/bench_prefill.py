"""Prefill-sized steps on the GPU, in one run: the MoE layer and the quantized linears at large token counts on the
decode kernels (`grouped_gemm_mma` / `grouped_gemm`) and on the decode-once-then-cuBLAS path (`dequant_gemm`), beside
dense bf16 GEMMs of the same work; the crossover each measurement gives; TTFT on the M3.1-Flash geometry as a share
of the bf16 GEMM rate measured in the same run.

* ceilings: device-to-device copy bandwidth (read + write) and the bf16 GEMM rate (8192^3, ``torch.mm``).
* moe: M3's layer (hidden 6144, 128 experts top-4, FFN 3072, NVFP4 experts, MXFP8 shared expert) at --tokens:
  ``kernels_ms`` = `fused_moe` with the dispatch table minus its "dense" rows (CUDA-graph replay), ``dense_ms`` =
  `fused_moe` with only the "dense" row (eager: that path reads the routing's counts on the host), ``bf16_ms`` =
  the dense bf16 GEMMs of the same FLOPs ([T (k+1), H] x [H, 2I], [T (k+1), I] x [I, H]); ``err`` = relative
  difference of the two paths' outputs; ``decode`` = the decode launch alone on 16 experts' gate_up (TB/s read +
  written); from --variants-from tokens also bench_moe's larger portable tiles (``tl_variants``).
* linear: ``N x K`` = 6144 x 8192 for NVFP4 / MXFP8 / FP8 at --linear-rows: kernels vs dense path (both graph
  replay) vs ``F.linear`` bf16.
* crossover: the smallest count measured from which the dense path wins at every larger count measured; the
  dispatch constants `dispatch.MOE_DENSE_FROM` / `LINEAR_DENSE_FROM` are to be set from it.
* ttft: one prompt of --ttft tokens through `LLMEngine` on the 4-layer geometry (bench_engine's build, eager), with
  the dispatch tables minus their "dense" rows and then as they are; the prefill's FLOPs counted
  (`prefill_flops`) and their rate as a share of the measured bf16 GEMM rate.

    python benchmarks/bench_prefill.py --out /tmp/prefill.json     (one device call; tables last)
    python benchmarks/bench_prefill.py --smoke                      (CPU interpreter, tiny shapes: checks it runs)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/support: random layers

from bench_moe import linear_variants, swap_variants, timed, timed_variant, variants  # noqa: E402
from ceilings import copy_bandwidth  # noqa: E402
from m3serve.config import SPARSE  # noqa: E402
from m3serve.kernels import dispatch  # noqa: E402
from m3serve.kernels.dequant_gemm import dequant  # noqa: E402
from m3serve.kernels.dispatch import tuned  # noqa: E402
from m3serve.kernels.moe import fused_moe, moe_prepare_module  # noqa: E402
from m3serve.kernels.quant_linear import quant_linear, quant_linear_prepare  # noqa: E402
from m3serve.model.weights import QuantWeight  # noqa: E402
from support.moe import fill_random, m3_moe_config, random_moe, rel_err, tiny_moe_config  # noqa: E402


@contextlib.contextmanager
def recorded(row: dict):
    """The dense path's measurement: a failure is recorded in the row (``dense_error``, dense_ms = inf), the run goes
    on with the other measurements."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        row.update(dense_ms=float("inf"), err=float("nan"), dense_error=f"{type(exc).__name__}: {str(exc)[:300]}")
        print(f"dense path failed: {row['dense_error']}", flush=True)


def fused_moe_rows(bm: int = 256, bn: int = 128, stages: int = 2) -> dict:
    """The MoE table with its 128 x 128 gate_up tiles replaced by fused ones of ``bm`` token rows and ``bn`` weight
    rows (`grouped_gemm(..., fuse=True)`; their down tiles kept)."""
    fused = dict(dispatch._MOE_TL, bm=bm, bn=bn, num_stages=stages, fuse=True)
    return {"moe_table": tuple((lim, path, fused if gu is dispatch._MOE_TL else gu, *rest)
                               for lim, path, gu, *rest in dispatch.MOE_TABLE)}


def picked(args, variant) -> bool:
    """Is ``variant`` timed: its repr matches one of --variant-filter's comma-separated regular expressions (all if
    none; "bn...256": a weight tile of 256 rows, the quotes and colon matched by dots, since `*_ARGS` of
    device_run.sh are word-split)."""
    return any(re.search(f, repr(variant)) for f in args.variant_filter.split(","))


def without_dense(table: tuple) -> tuple:
    return tuple(r for r in table if r[1] != "dense")


def crossover(rows: list[dict], key: str) -> int | None:
    """Smallest ``key`` value from which ``dense_ms`` < ``kernels_ms`` at every larger measured value (None if the
    dense path does not win at the largest)."""
    best = None
    for r in sorted(rows, key=lambda r: -r[key]):
        if r["dense_ms"] < r["kernels_ms"]:
            best = r[key]
        else:
            break
    return best


def gemm_rate(dev: str, n: int, rep: int) -> float:
    """FLOP/s of a bf16 n^3 ``torch.mm``."""
    a = torch.randn(n, n, device=dev).bfloat16() if dev == "cuda" else torch.randn(n, n)
    b = torch.randn(n, n, device=dev).bfloat16() if dev == "cuda" else torch.randn(n, n)
    return 2 * n ** 3 / (timed(lambda: a @ b, True, rep) * 1e-3)


def bench_moe_layer(args, dev, res):
    cfg = m3_moe_config() if not args.smoke else tiny_moe_config(256, 128, 16, 4, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    moe = random_moe(cfg, "nvfp4", "mxfp8", g, device=dev, dtype=dtype, bias_std=0.01, router_std=1.0)
    w = moe_prepare_module(moe)
    kw = dict(top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha,
              limit=cfg.swiglu_limit)
    kernels = without_dense(dispatch.MOE_TABLE)
    dense = ((None, "dense", dict(scratch_mb=args.scratch_mb), dict(scratch_mb=args.scratch_mb)),)
    n_dec = min(16, w.n_experts)
    dec_ms = timed(lambda: dequant(w.gate_up, list(range(n_dec)), dtype), False, args.rep)
    dec_bytes = w.gate_up.bytes_per_group() * n_dec + n_dec * w.gate_up.n_pad * w.gate_up.k_pad * 2
    res["moe_decode"] = dict(experts=n_dec, ms=dec_ms, tb_s=dec_bytes / (dec_ms * 1e-3) / 1e12)
    print(json.dumps(res["moe_decode"]), flush=True)
    H, inter, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts_per_tok
    rows = []
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device=dev).to(dtype)
        layer = lambda: fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, **kw)
        row = dict(tokens=T, default=dispatch.moe_config(T, w, x.device)[0],
                   flops=2 * 3 * H * inter * T * (k + 1))
        with tuned(moe_table=kernels):
            row["kernels_path"] = dispatch.moe_config(T, w, x.device)[0]
            y_k = layer()
            row["kernels_ms"] = timed(layer, True, args.rep)
        with tuned(moe_table=dense, dense_prefill=True), recorded(row):
            assert dispatch.moe_config(T, w, x.device)[0] == "dense"
            y_d = layer()
            row["dense_ms"] = timed(layer, False, args.rep)
            row["err"] = rel_err(y_d, y_k)
        row["tl_variants"] = []  # larger portable tiles (more rows per decoded weight tile): bench_moe's sweep
        for v in (variants(T) if T >= args.variants_from and dev == "cuda" else []):
            if not picked(args, v):
                continue
            if tuple(v) != dispatch.moe_config(T, w, x.device):  # the default's own tiles are timed above
                row["tl_variants"].append(timed_variant("moe_table", v, lambda: dispatch.moe_config(T, w, x.device),
                                                        layer, args.rep, ref=y_k))
        a1 = torch.randn(T * (k + 1), H, device=dev, dtype=dtype)
        b1 = torch.randn(H, 2 * inter, device=dev, dtype=dtype)
        a2 = torch.randn(T * (k + 1), inter, device=dev, dtype=dtype)
        b2 = torch.randn(inter, H, device=dev, dtype=dtype)
        row["bf16_ms"] = timed(lambda: (a1 @ b1, a2 @ b2), True, args.rep)
        del a1, b1, a2, b2
        for p in ("kernels", "dense", "bf16"):
            row[p + "_tflops"] = row["flops"] / (row[p + "_ms"] * 1e-3) / 1e12
        row["best_vs_bf16"] = min(row["kernels_ms"], row["dense_ms"]) / row["bf16_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    res["moe"] = rows
    res["moe_crossover_tokens"] = crossover(rows, "tokens")
    del moe, w
    gc.collect()


FP8_LINEAR = [("dense8", dict())]  # dequant_gemm.fp8_linear: e4m3 per row, cuBLAS's FP8 GEMM (lossy; `err` says)


def bench_linears(args, dev, res):
    n, k = (6144, 8192) if not args.smoke else (96, 256)
    g = torch.Generator(device=dev).manual_seed(1)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    wd = torch.randn(n, k, generator=g, device=dev).to(dtype) * 0.02
    kernels = without_dense(dispatch.LINEAR_TABLE)
    dense = ((None, "dense", dict()),)
    rows, res["linear_crossover_rows"] = [], {}
    for fmt in ("nvfp4", "mxfp8", "fp8"):
        with torch.device(dev):
            qw = QuantWeight(n, k, fmt, dtype)
        fill_random(qw, g)
        ql = quant_linear_prepare(qw)
        mine = []
        for M in args.linear_rows:
            x = torch.randn(M, k, generator=g, device=dev).to(dtype)
            row = dict(fmt=fmt, M=M, N=n, K=k, weight_bytes=ql.packed.nbytes(),
                       default=dispatch.linear_config(M, ql.packed, x.device)[0])
            with tuned(linear_table=kernels):
                row["kernels_path"] = dispatch.linear_config(M, ql.packed, x.device)[0]
                y_k = quant_linear(x, ql)
                row["kernels_ms"] = timed(lambda: quant_linear(x, ql), True, args.rep)
            with tuned(linear_table=dense, dense_prefill=True), recorded(row):
                assert dispatch.linear_config(M, ql.packed, x.device)[0] == "dense"
                row["err"] = rel_err(quant_linear(x, ql), y_k)
                row["dense_ms"] = timed(lambda: quant_linear(x, ql), True, args.rep)
            row["bf16_ms"] = timed(lambda: F.linear(x, wd), True, args.rep)
            row["best_speedup_vs_bf16"] = row["bf16_ms"] / min(row["kernels_ms"], row["dense_ms"])
            row["tl_variants"] = [  # the other mma rows, the portable kernel's (swapped, wg16, split K) tiles
                timed_variant("linear_table", v, lambda: dispatch.linear_config(M, ql.packed, x.device),
                              lambda: quant_linear(x, ql), args.rep, ref=y_k)
                for v in (linear_variants(M) + (swap_variants(M) if M <= 64 else []) + FP8_LINEAR * (M >= 256)
                          if dev == "cuda" and M >= args.variants_from_rows else [])
                if picked(args, v)]
            mine.append(row)
            print(json.dumps(row), flush=True)
        res["linear_crossover_rows"][fmt] = crossover(mine, "M")
        rows += mine
    res["linear"] = rows


def prefill_flops(cfg, prompt: int) -> float:
    """FLOPs of prefilling ``prompt`` tokens through the layers of ``cfg`` (one sequence, causal): projections
    (q, k, v, o; on MSA layers the indexer's q and k), attention (QK^T and PV over the keys each query sees: all
    earlier ones on full layers, at most top-k blocks on MSA layers), the indexer's scores (all earlier keys), the
    MLP (dense, or the router + top-k experts + shared expert), the lm_head for the last token."""
    H, hd, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    pos = torch.arange(prompt, dtype=torch.float64) + 1  # keys each query sees (itself included)
    total = 2.0 * H * cfg.vocab_size
    for kind, mlp in zip(cfg.layer_types, cfg.mlp_layer_types):
        proj = H * hd * (2 * nq + 2 * nkv)
        if kind == SPARSE:
            proj += H * cfg.index_head_dim * (cfg.index_n_heads + 1)
            keys = pos.clamp(max=cfg.index_topk_blocks * cfg.index_block_size)
            total += 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(pos.sum())
        else:
            keys = pos
        total += 2.0 * proj * prompt + 4.0 * nq * hd * float(keys.sum())
        if mlp == "dense":
            total += 2.0 * 3 * H * cfg.dense_intermediate_size * prompt
        else:
            ffn = cfg.num_experts_per_tok * cfg.intermediate_size + cfg.shared_intermediate_size
            total += (2.0 * 3 * H * ffn + 2.0 * H * cfg.num_local_experts) * prompt
    return total


def tl_swap(table: tuple, swap: bool) -> tuple:
    """A dispatch table with its portable ("tl") rows' configs computing the transposed product (``swap``) or not."""
    return tuple((r[0], r[1], *(dict(c, swap=swap) for c in r[2:])) if r[1] == "tl" else r for r in table)


def profile_ttft(engine, device, prompt: int, g, top: int = 15) -> dict:
    """One more prefill of ``prompt`` tokens under torch.profiler (after the timed ones): its kernels by device
    time (the largest ``top``), each with its share of the step's kernel time."""
    from torch.profiler import ProfilerActivity, profile
    from bench_engine import kernel_rows, time_ttft

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = time_ttft(engine, device, prompt, g)
    rows, _, total = kernel_rows(prof, device)
    total = total or 1.0
    return dict(prompt_tokens=prompt, wall_ms=wall * 1e3, kernel_ms=total / 1e3,
                kernels=[dict(name=e.key[:90], ms=e.self_device_time_total / 1e3, calls=e.count,
                              share=e.self_device_time_total / total) for e in rows[:top]])


def bench_ttft(args, dev, res):
    from bench_engine import build, release, time_ttft
    from geometry import SMOKE

    # eager: the TTFT step is a prefill (graphs serve decode only), no start-up capture needed
    ns = SimpleNamespace(geometry_over=SMOKE if args.smoke else {}, batches=[1], enforce_eager=True,
                         no_async_scheduling=False, chunk=args.chunk)
    cfg, model, engine = build(args.layers, 1, torch.device(dev), ns, max(args.ttft))
    g = torch.Generator().manual_seed(0)
    kernels_only = dict(moe_table=without_dense(dispatch.MOE_TABLE), linear_table=without_dense(dispatch.LINEAR_TABLE))
    # the default tables' tl rows compute the transposed product (NOTES-moe, Version 4): the same rows without it
    unswapped = {k: tl_swap(getattr(dispatch.tuning(), k), False) for k in ("moe_table", "linear_table")}
    rows, profiles = [], []
    # the MSA prefill attention (45% of the 32K prefill's kernel time on the H100, 2026-12-07) with its byte decoder
    # (the default before the word decoder measured 11% faster, bench_msa), with 8-token tiles on 8 warps, and with the
    # full-attention layer's long chunks through torch's SDPA over pages dequantized once (`Tuning.prefill_sdpa_from`),
    # the sparse layers' tiles of 1 or 2 tokens (a tile visits the union of its tokens' blocks), their selections
    # walked sorted instead of a scan of every block of the context, and the long chunks over an fp16 copy of their
    # pages (`Tuning.prefill_plain_from`)
    variants = ((kernels_only, "decode kernels only"), ({}, "default dispatch"),
                (dict(dense_prefill=True), "dense rows on"), (unswapped, "tl rows unswapped"),
                (dict(prefill_words=False), "msa prefill bytes"),
                (dict(prefill_block_t=8, prefill_num_warps=8), "msa prefill 8-token tiles"),
                (dict(prefill_sdpa_from=1024), "msa prefill sdpa"),
                (dict(prefill_plain_from=1024), "msa prefill plain pages"),
                (dict(prefill_plain_from=1024, prefill_sdpa_from=1024), "msa prefill plain pages, sdpa"),
                (dict(prefill_sparse_block_t=1), "msa prefill sparse 1-token tiles"),
                (dict(prefill_sparse_block_t=2), "msa prefill sparse 2-token tiles"),
                (dict(prefill_sorted_blocks=True), "msa prefill sparse sorted walk"),
                (dict(prefill_sdpa_from=1024, prefill_sparse_block_t=1, prefill_sorted_blocks=True),
                 "msa prefill sdpa, sparse 1-token tiles sorted"),
                (dict(prefill_sparse_block_t=1, prefill_sorted_blocks=True), "msa prefill t1-sorted sparse tiles"),
                (fused_moe_rows(), "moe fused gate_up, 256-token tiles"),
                (fused_moe_rows(64, 256, 3), "moe fused gate_up, 64 x 256 tiles"),
                (dict(a8=True), "moe a8 tiles (fp8 dots)"),
                (dict(fused_norm=True), "norm in one launch"))
    for tables, name in (v for v in variants if any(f in v[1] for f in args.ttft_filter.split(","))):
        with tuned(**tables), recorded({}):
            for n in args.ttft:  # warm-up: compiles the prefill kernels of every chunk size
                time_ttft(engine, torch.device(dev), n, g)
            for n in args.ttft:
                t = time_ttft(engine, torch.device(dev), n, g)
                fl = prefill_flops(cfg, n)
                row = dict(dispatch=name, prompt_tokens=n, ttft_ms=t * 1e3, tokens_per_s=n / t,
                           gflop_per_token=fl / n / 1e9, tflops=fl / t / 1e12,
                           share_of_bf16_gemm=fl / t / res["bf16_gemm_flops"])
                rows.append(row)
                print(json.dumps(row), flush=True)
            if dev == "cuda" and name != "default dispatch":
                profiles.append(dict(dispatch=name, **profile_ttft(engine, torch.device(dev), max(args.ttft), g)))
    res["ttft"] = dict(layers=args.layers, chunk=args.chunk, rows=rows, profiles=profiles)
    del model, engine
    release()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--tokens", default="1,16,64,512,1024,2048,4096,8192")
    ap.add_argument("--linear-rows", default="16,64,256,1024,4096,8192")
    ap.add_argument("--ttft", default="1024,8192,32768", help="prompt lengths ('' to skip)")
    ap.add_argument("--layers", type=int, default=4, help="geometry layers of the TTFT engine (1 dense + MSA/MoE)")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk) of the engine")
    ap.add_argument("--scratch-mb", type=int, default=2048, help="decoded experts held at once (dense path)")
    ap.add_argument("--rep", type=int, default=25)
    ap.add_argument("--variants-from", type=int, default=4096, help="time bench_moe's tl tile variants from here")
    ap.add_argument("--variants-from-rows", type=int, default=16, help="time the linears' swap variants from here")
    ap.add_argument("--variant-filter", default="",
                    help="time only the variants whose repr matches one of these regular expressions (comma-separated)")
    ap.add_argument("--ttft-filter", default="",
                    help="run only the TTFT dispatch rows whose name contains one of these (comma-separated)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.linear_rows = [int(t) for t in args.linear_rows.split(",") if t]
    args.ttft = [int(t) for t in args.ttft.split(",") if t]
    if args.smoke:
        args.tokens, args.linear_rows, args.ttft, args.rep, args.chunk = [1, 9], [3, 17], [48], 1, 64
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = dict(device=torch.cuda.get_device_name() if dev == "cuda" else platform.processor(),
               torch=torch.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
               commit=os.environ.get("COMMIT") or subprocess.run(
                   ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                   cwd=Path(__file__).parent).stdout.strip())
    res["copy_tb_s"] = (copy_bandwidth(dev) if dev == "cuda" else copy_bandwidth(dev, 64 << 20)) / 1e12
    res["bf16_gemm_flops"] = gemm_rate(dev, 8192 if dev == "cuda" else 256, args.rep)
    print(f"copy {res['copy_tb_s']:.3f} TB/s, bf16 GEMM {res['bf16_gemm_flops'] / 1e12:.0f} TFLOP/s", flush=True)

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))

    bench_moe_layer(args, dev, res)
    save()
    bench_linears(args, dev, res)
    save()
    report(res)  # before the TTFT part: a run cut short there keeps these tables in its log
    if dev == "cuda":
        torch.cuda.empty_cache()
    if args.ttft:
        bench_ttft(args, dev, res)
        save()
        report_ttft(res)


def report(res):
    print(f"\n{res['device']}, {res['date']}, commit {res['commit']}: copy {res['copy_tb_s']:.2f} TB/s, bf16 GEMM "
          f"{res['bf16_gemm_flops'] / 1e12:.0f} TFLOP/s")
    d = res["moe_decode"]
    print(f"decode launch alone: {d['experts']} experts' gate_up in {d['ms']:.3f} ms = {d['tb_s']:.2f} TB/s "
          f"(packed read + bf16 written)")
    print("\nMoE layer (kernels: graph replay; dense path: eager)")
    print("| tokens | default | kernels path | kernels ms | dense path ms | bf16 GEMMs ms | best / bf16 | "
          "TFLOP/s kernels / dense | err |")
    for r in res["moe"]:
        print(f"| {r['tokens']} | {r['default']} | {r['kernels_path']} | {r['kernels_ms']:.3f} | {r['dense_ms']:.3f} | "
              f"{r['bf16_ms']:.3f} | {r['best_vs_bf16']:.2f}x | {r['kernels_tflops']:.0f} / {r['dense_tflops']:.0f} | "
              f"{r['err']:.1e} |")
        if "dense_error" in r:
            print(f"|   dense path failed: {r['dense_error']} |")
        for v in r["tl_variants"]:
            print(f"|   tl variant {v['config']} | {v.get('ms', v.get('error'))} | err {v.get('err')} |")
    print(f"MoE crossover (dense path wins from): {res['moe_crossover_tokens']} tokens "
          f"(dispatch.MOE_DENSE_FROM = {dispatch.MOE_DENSE_FROM})")
    print("\nQuantized linears (graph replay)")
    print("| fmt | M | default | kernels path | kernels ms | dense path ms | bf16 ms | best speedup vs bf16 | err |")
    for r in res["linear"]:
        print(f"| {r['fmt']} | {r['M']} | {r['default']} | {r['kernels_path']} | {r['kernels_ms']:.4f} | "
              f"{r['dense_ms']:.4f} | {r['bf16_ms']:.4f} | {r['best_speedup_vs_bf16']:.2f}x | {r['err']:.1e} |")
        for v in r.get("tl_variants", []):
            print(f"|   tl variant {v['config']} | {v.get('ms', v.get('error'))} | err {v.get('err')} |")
    print(f"linear crossover rows (dense path wins from): {res['linear_crossover_rows']} "
          f"(dispatch.LINEAR_DENSE_FROM = {dispatch.LINEAR_DENSE_FROM})")


def report_ttft(res):
    if "ttft" in res:
        t = res["ttft"]
        print(f"\nTTFT, {t['layers']}-layer geometry, chunk {t['chunk']}")
        print("| dispatch | prompt | TTFT ms | tokens/s | GFLOP/token | TFLOP/s | share of bf16 GEMM |")
        for r in t["rows"]:
            print(f"| {r['dispatch']} | {r['prompt_tokens']} | {r['ttft_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                  f"{r['gflop_per_token']:.2f} | {r['tflops']:.0f} | {r['share_of_bf16_gemm'] * 100:.0f}% |")
        for p in t.get("profiles", []):
            print(f"\nprofile, {p['dispatch']}, {p['prompt_tokens']} tokens: {p['kernel_ms']:.1f} ms of kernels "
                  f"(wall {p['wall_ms']:.1f} ms under the profiler)")
            print("| kernel | ms | calls | share |")
            for k in p["kernels"]:
                print(f"| {k['name']} | {k['ms']:.2f} | {k['calls']} | {k['share'] * 100:.1f}% |")


if __name__ == "__main__":
    main()
