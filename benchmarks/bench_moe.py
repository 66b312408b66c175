"""The MoE layer of M3 on the GPU (hidden 6144, 128 experts top-4, expert FFN 3072, MXFP8 shared expert FFN 3072):
`kernels.moe.fused_moe` (router + experts + shared + combine) against the torch bf16 reference of the same layer
(``torch._grouped_mm``, and a per-expert loop; the faster counts), all in one run, plus the quantized dense
linears against ``F.linear`` bf16.

* Time: median CUDA-graph replay with the L2 flushed before each (``triton.testing.do_bench``); the per-expert
  loop needs host syncs, so it is timed eagerly.
* Bytes the layer must read: the distinct routed experts the step touches (from its routing) x the bytes of one
  expert, + the shared expert + the fp32 router weight; "% copy" = bytes / time over the device-to-device copy
  bandwidth measured in the same run (read + write counted).
* 4096 tokens: the dense bf16 GEMMs of the same FLOPs ([T (k+1), H] x [H, 2I] and [T (k+1), I] x [I, H]).

    python benchmarks/bench_moe.py --out /tmp/moe.json          (one device call; prints tables last)
    python benchmarks/bench_moe.py --smoke                        (CPU interpreter, tiny shapes: checks it runs)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/support: random layers

from ceilings import copy_bandwidth  # noqa: E402
from m3serve.kernels import dispatch  # noqa: E402
from m3serve.kernels.dispatch import tuned  # noqa: E402
from m3serve.kernels.moe import MoEStep, fused_moe, moe_prepare_module  # noqa: E402
from m3serve.kernels.quant_linear import quant_linear, quant_linear_prepare  # noqa: E402
from m3serve.model.weights import QuantWeight  # noqa: E402
from support.moe import fill_random, m3_moe_config, random_moe, rel_err, tiny_moe_config  # noqa: E402


def timed(fn, graph: bool, rep: int) -> float:
    """Median ms of fn (CUDA graph replay when ``graph``), L2 flushed before each run."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()  # compiles and warms up (cuBLAS handles too) before the capture
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    return float(triton.testing.do_bench(run, warmup=max(5, rep // 5), rep=rep, return_mode="median"))


def timed_variant(table: str, v: tuple, chosen, fn, rep: int, ref: torch.Tensor | None = None) -> dict:
    """fn timed with ``v`` = (path, configs...) as the only row of the dispatch table ``table`` (a `Tuning` field);
    ``chosen()`` = what dispatch picks then: a variant it does not pick (shapes, device) is recorded, not timed.
    With ``ref`` (the default dispatch's output) the variant's output is compared with it (``err``)."""
    with tuned(**{table: ((None, *v),)}):
        got = chosen()
        if got != v:
            return dict(config=repr(v), error=f"not selectable here: dispatch picks {got!r}")
        try:
            err = {} if ref is None else dict(err=rel_err(fn(), ref))
            return dict(config=repr(v), ms=timed(fn, True, rep), **err)
        except Exception as exc:  # noqa: BLE001  (a variant the kernels refuse: recorded, not fatal)
            return dict(config=repr(v), error=str(exc)[:200])


class TorchLayer:
    """The same layer on bf16 weights (the dequantized experts): torch routing, then ``torch._grouped_mm`` or a
    per-expert loop; shared expert by F.linear."""

    def __init__(self, moe, cfg):
        e, i, h = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
        dev = moe.gate.weight.device
        self.gu = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=dev)
        self.dn = torch.empty(e, h, i, dtype=torch.bfloat16, device=dev)
        for x in range(e):
            self.gu[x] = moe.experts.gate_up_proj.dequantize(x, torch.bfloat16)
            self.dn[x] = moe.experts.down_proj.dequantize(x, torch.bfloat16)
        self.sgu = moe.shared_experts.gate_up_proj.w.dequantize(dtype=torch.bfloat16)
        self.sdn = moe.shared_experts.down_proj.w.dequantize(dtype=torch.bfloat16)
        self.rw, self.bias = moe.gate.weight, moe.gate.e_score_correction_bias
        self.k, self.e, self.scaling = cfg.num_experts_per_tok, e, cfg.routed_scaling_factor
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def _route(self, x):
        p = torch.sigmoid(F.linear(x.float(), self.rw))
        _, idx = torch.topk(p + self.bias, self.k, dim=-1)
        w = p.gather(1, idx)
        return w / w.sum(-1, keepdim=True), idx

    def _swiglu(self, h):
        g, u = h.chunk(2, dim=-1)
        g = g.clamp(max=self.limit)
        return (u.clamp(-self.limit, self.limit) + 1.0) * (g * torch.sigmoid(g * self.alpha))

    def _shared(self, x):
        return F.linear(self._swiglu(F.linear(x, self.sgu)), self.sdn)

    def grouped(self, x):
        w, idx = self._route(x)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tok = order // self.k
        h = torch._grouped_mm(x[tok], self.gu.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(self._swiglu(h), self.dn.transpose(1, 2), offs=offs)
        y = y * w.flatten()[order, None].to(y.dtype)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tok, y.float())
        return (out * self.scaling).to(x.dtype) + self._shared(x)

    def loop(self, x):
        w, idx = self._route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            h = F.linear(self._swiglu(F.linear(x[tok], self.gu[e])), self.dn[e])
            out.index_add_(0, tok, (h * w[tok, slot, None].to(h.dtype)).float())
        return (out * self.scaling).to(x.dtype) + self._shared(x)


def variants(T: int) -> list[tuple]:
    """Configs timed besides the default (the sweep that sets `dispatch.MOE_TABLE`): (path, gate_up, down)."""
    m = lambda g, d: ("mma", dict(p=g[0], nt=g[1], unroll=g[2]), dict(p=d[0], nt=d[1], unroll=d[2]))
    t = lambda g, d, swap=False, wg16=False: (
        "tl", dict(bm=g[0], bn=g[1], num_warps=g[2], num_stages=3, swap=swap, wg16=wg16),
        dict(bm=d[0], bn=d[1], num_warps=d[2], num_stages=3, swap=swap, wg16=wg16))
    sw = lambda g, d: t(g, d, True)  # the transposed product: decoded weights as the wgmma's register operand
    sw16 = lambda g, d: t(g, d, True, True)  # and fp16 activations in the wg16 order, the words decoders
    if T <= 4:
        return [m((1, 8, 2), (2, 8, 2)), m((1, 8, 2), (4, 8, 1)), m((1, 8, 3), (2, 8, 3)), m((2, 8, 2), (2, 8, 2))]
    if T <= 64:
        return [m((1, 8, 2), (2, 8, 2)), m((1, 8, 2), (4, 8, 1)), m((1, 16, 2), (2, 16, 2)),
                sw16((16, 64, 4), (16, 64, 4))]
    if T <= 512:
        return [m((1, 16, 2), (2, 16, 2)), m((1, 32, 2), (2, 32, 2)), t((64, 64, 4), (64, 128, 8)),
                t((32, 64, 4), (32, 128, 4)), sw((64, 128, 8), (64, 128, 8)), sw((32, 64, 4), (32, 64, 4)),
                sw16((16, 64, 4), (16, 64, 4)), sw16((32, 64, 4), (32, 64, 4)), sw16((32, 128, 8), (32, 128, 8)),
                sw16((64, 128, 8), (64, 128, 8))]
    # gate_up's two accumulators at 128 x 128 on 8 warps spill (sm_90 SASS, 2026-12-07: 255 registers, a 328-byte
    # stack): the same tiles on 16 warps, or 64 gate / up rows; the wg16 tiles (their 64-row weight tiles on 8 warps
    # would decode each tile twice, once per warp group: 128 rows)
    few = [sw16((32, 64, 4), (32, 64, 4)), sw16((32, 128, 8), (32, 128, 8))] if T <= 2048 else []
    # fused gate_up (`grouped_gemm(..., fuse=True)`): a tile's 128 weight rows are the gate and up rows of 64 columns,
    # one accumulator: 197 registers and no spill at 128 x 128 (sm_90 SASS, 2026-12-07), 254 and none with 256 token
    # rows in 2 stages (each decoded weight tile then serves twice the rows; in 3 stages a 64-byte stack), 128 and
    # none with 256 rows on 16 warps in 3 stages; the down tiles the table's 128 x 128. 64 token rows against 256
    # weight rows (128 columns): fewer rows of a tile left empty (4096 tokens give each expert 128 +- 11 rows, which
    # fill 1.5 tiles of 128 on average but 2.5 of 64), 232 registers and no spill on 8 warps (16 warps spill at their
    # 128-register cap); its down tiles 128 x 128 or 64 x 128 (153 registers; 64 x 256 spills)
    down = sw16((128, 128, 8), (128, 128, 8))[2]
    down64 = sw16((64, 128, 8), (64, 128, 8))[2]
    fused = [("tl", dict(sw16((bm, bn, w), (128, 128, 8))[1], fuse=True, num_stages=st), d)
             for bm, bn, w, st, d in ((128, 128, 8, 3, down), (256, 128, 8, 2, down), (256, 128, 16, 3, down),
                                      (64, 256, 8, 3, down), (64, 256, 8, 3, down64))]
    # a8: FP8 dots (e4m3 activations with a scale per row, the decoded weights rounded to e4m3; lossy, `err` says).
    # Each x tile is re-read from L2 by every program of its rows: bytes per multiply-add 2 / bn (fp16) against the
    # weights' 0.5625 / bm (NVFP4), so at 128 x 128 x is 3.6x the weight traffic; a8 halves it, 256 weight rows halve
    # it again (64 x 256 a8 down: 234 registers, no spill where fp16 spills; 128 x 256 spills 56-176 bytes, sm_90)
    down64w = dict(sw16((64, 256, 8), (64, 256, 8))[2], a8=True)
    fused128w = ("tl", dict(sw16((128, 256, 8), (128, 128, 8))[1], fuse=True, num_stages=2), down)
    a8 = [("tl", dict(gu, a8=True), dict(dn, a8=True)) for _, gu, dn in
          (sw16((128, 128, 8), (128, 128, 8)), fused[0], fused[4], fused128w, *few[:1])]
    a8.append(("tl", dict(fused[4][1], a8=True), down64w))
    return [sw((128, 128, 8), (128, 128, 8)), sw((64, 128, 8), (64, 128, 8)), sw((128, 64, 8), (128, 128, 8)),
            sw((128, 128, 16), (128, 128, 16)), sw16((128, 128, 8), (128, 128, 8)), sw16((64, 128, 8), (64, 128, 8)),
            sw16((64, 128, 8), (128, 128, 8)), sw16((128, 128, 16), (128, 128, 16)), *fused, *few, *a8]


STAGES = ("route", "gate_up", "down", "shared_expert", "combine")


def linear_variants(M: int) -> list[tuple]:
    """Configs timed besides the default (the sweep that sets `dispatch.LINEAR_TABLE`): (path, config)."""
    if M <= 16:
        return [("mma", dict(p=1, nt=8, unroll=2)), ("mma", dict(p=1, nt=16, unroll=2))]
    if M <= 64:
        return [("mma", dict(p=1, nt=64, unroll=2)), ("mma", dict(p=1, nt=32, unroll=2))]
    return [("tl", dict(bm=128, bn=128, num_warps=8, num_stages=3)), ("mma", dict(p=1, nt=64, unroll=2)),
            *swap_variants(M)]


def swap_variants(M: int) -> list[tuple]:
    """Portable-kernel configs with ``swap`` for a linear of M rows: (path, config); bm = rows per tile (the
    wgmma's N side), bn = weight rows (its M side: 64 per warp group); wg16 tiles, and split K for few rows; wg16
    tiles of 256 weight rows on 16 warps (each x tile, re-read from L2 by every program of its rows, read by half as
    many: at 64 rows x [64, 8192] is 1 MB, 96 MB read by 96 tiles of 64 weight rows, as many bytes as the bf16
    weight; 106 registers, no spill, sm_90 SASS, 2026-12-07); and the wg16 tiles of 128 and 256 rows with FP8 dots
    (a8: half the activation bytes; lossy, `err` says)."""
    bms = sorted({min(max(16, triton.next_power_of_2(M)), 128), min(max(16, triton.next_power_of_2(M)), 256)})
    splits = (1, 4) if M <= 256 else (1,)  # few rows: 6144 / bn tiles alone leave most of the SMs idle
    tile = lambda bm, bn, wg16, k, **kw: ("tl", dict(bm=bm, bn=bn, num_warps=bn // 16, num_stages=3, swap=True,
                                                     wg16=wg16, split=k, **kw))
    return ([tile(bm, bn, wg16, k) for bm in bms for bn in (64, 128) for wg16 in (False, True) for k in splits]
            + [tile(bm, 256, True, k) for bm in bms for k in splits]
            + [tile(bm, bn, True, k, a8=True) for bm in bms for bn in (128, 256) for k in splits])


def bench_layer(args, dev, bw, res):
    cfg = m3_moe_config() if not args.smoke else tiny_moe_config(256, 128, 16, 4, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    moe = random_moe(cfg, "nvfp4", "mxfp8", g, device=dev, dtype=dtype, bias_std=0.01, router_std=1.0)
    w = moe_prepare_module(moe)
    ref = TorchLayer(moe, cfg) if dev == "cuda" else None
    kw = dict(top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha,
              limit=cfg.swiglu_limit)
    e_bytes, s_bytes, r_bytes = w.expert_bytes(), w.shared_bytes(), moe.gate.weight.numel() * 4
    rows = []
    for T in args.tokens:
        x = torch.randn(T, cfg.hidden_size, generator=g, device=dev).to(dtype)
        rl = []
        y = fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, routing_out=rl, **kw)
        touched = int((rl[0].counts > 0).sum())
        nbytes = touched * e_bytes + s_bytes + r_bytes
        flops = 2 * 3 * cfg.hidden_size * cfg.intermediate_size * T * (cfg.num_experts_per_tok + 1)
        default = dispatch.moe_config(T, w, x.device)
        row = dict(tokens=T, experts_touched=touched, bytes=nbytes, flops=flops, default=repr(default))
        layer = lambda: fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, **kw)
        row["ms"] = timed(layer, True, args.rep)
        step = MoEStep(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, **kw)
        step.run()
        for name in STAGES:  # each launch (the shared expert: its two) alone, on the step's own buffers
            row[name + "_ms"] = timed(getattr(step, name), True, args.rep)
        row["variants"] = []
        if dev == "cuda":
            with tuned(moe_overlap=False):
                row["variants"].append(dict(config="shared expert in the routed launches (no side stream)",
                                            ms=timed(layer, True, args.rep)))
        if args.variants and dev == "cuda":
            for v in variants(T):
                row["variants"].append(timed_variant("moe_table", v, lambda: dispatch.moe_config(T, w, x.device),
                                                     layer, args.rep))
        if ref is not None:
            row["err_vs_torch_bf16"] = rel_err(y, ref.grouped(x))
            row["torch_grouped_ms"] = timed(lambda: ref.grouped(x), True, args.rep)
            row["torch_loop_ms"] = timed(lambda: ref.loop(x), False, args.rep) if T <= 512 else None
            best = min(v for v in (row["torch_grouped_ms"], row["torch_loop_ms"]) if v is not None)
            row["torch_best_ms"] = best
            row["speedup_vs_torch"] = best / row["ms"]
            row["pct_copy"] = nbytes / (row["ms"] * 1e-3) / bw * 100
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            if T >= 2048:
                a1 = torch.randn(T * (cfg.num_experts_per_tok + 1), cfg.hidden_size, device=dev, dtype=dtype)
                b1 = torch.randn(cfg.hidden_size, 2 * cfg.intermediate_size, device=dev, dtype=dtype)
                a2 = torch.randn(T * (cfg.num_experts_per_tok + 1), cfg.intermediate_size, device=dev, dtype=dtype)
                b2 = torch.randn(cfg.intermediate_size, cfg.hidden_size, device=dev, dtype=dtype)
                row["dense_bf16_ms"] = timed(lambda: (a1 @ b1, a2 @ b2), True, args.rep)
                row["dense_bf16_tflops"] = flops / (row["dense_bf16_ms"] * 1e-3) / 1e12
                row["vs_dense"] = row["ms"] / row["dense_bf16_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    res["layer"] = rows


def bench_linear(args, dev, res):
    n, k = (6144, 8192) if not args.smoke else (96, 256)
    g = torch.Generator(device=dev).manual_seed(1)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    rows = []
    wd = torch.randn(n, k, generator=g, device=dev).to(dtype) * 0.02
    for fmt in ("nvfp4", "mxfp8", "fp8"):
        with torch.device(dev):
            qw = QuantWeight(n, k, fmt, dtype)
        fill_random(qw, g)
        ql = quant_linear_prepare(qw)
        for M in args.linear_rows:
            x = torch.randn(M, k, generator=g, device=dev).to(dtype)
            row = dict(fmt=fmt, M=M, N=n, K=k, ms=timed(lambda: quant_linear(x, ql), True, args.rep),
                       bf16_ms=timed(lambda: F.linear(x, wd), True, args.rep), weight_bytes=ql.packed.nbytes())
            row["speedup_vs_bf16"] = row["bf16_ms"] / row["ms"]
            row["variants"] = []
            for v in (linear_variants(M) if args.variants and dev == "cuda" else []):
                row["variants"].append(timed_variant("linear_table", v, lambda: dispatch.linear_config(
                    M, ql.packed, x.device), lambda: quant_linear(x, ql), args.rep))
            rows.append(row)
            print(json.dumps(row), flush=True)
    res["linear"] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--tokens", default="1,4,16,64,512,4096")
    ap.add_argument("--linear-rows", default="1,16,64,512")
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--variants", action="store_true", help="also time the config sweep of `variants`")
    ap.add_argument("--no-linear", dest="linear", action="store_false")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.linear_rows = [int(t) for t in args.linear_rows.split(",") if t]
    if args.smoke:
        args.tokens, args.linear_rows, args.variants = [1, 5], [1, 3], False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = dict(device=torch.cuda.get_device_name() if dev == "cuda" else platform.processor(),
               torch=torch.__version__, triton=triton.__version__,
               commit=os.environ.get("COMMIT") or subprocess.run(
                   ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                   cwd=Path(__file__).parent).stdout.strip())
    bw = copy_bandwidth(dev) if dev == "cuda" else 1.0
    res["copy_tb_s"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    bench_layer(args, dev, bw, res)
    if args.linear:
        bench_linear(args, dev, res)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"\nMoE layer, {res['device']}, copy {res['copy_tb_s']:.2f} TB/s (graph ms, L2 flushed)")
    print("| tokens | experts | ms | route / gate_up / down / shared / combine ms alone | MB read | % copy | "
          "torch bf16 best ms | speedup | TFLOP/s | err |")
    for r in res["layer"]:
        parts = " / ".join(f"{r[n + '_ms']:.4f}" for n in STAGES)
        print(f"| {r['tokens']} | {r['experts_touched']} | {r['ms']:.4f} | {parts} | "
              f"{r['bytes'] / 1e6:.0f} | {r.get('pct_copy', 0):.0f}% | {r.get('torch_best_ms', 0):.4f} | "
              f"{r.get('speedup_vs_torch', 0):.2f}x | {r.get('tflops', 0):.0f} | {r.get('err_vs_torch_bf16', 0):.1e} |")
        for v in r["variants"]:
            print(f"|   variant {v['config']} | {v.get('ms', v.get('error'))} |")
        if "dense_bf16_ms" in r:
            print(f"|   dense bf16 same FLOPs: {r['dense_bf16_ms']:.3f} ms ({r['dense_bf16_tflops']:.0f} TFLOP/s); "
                  f"layer / dense = {r['vs_dense']:.2f} |")
    for r in res.get("linear", []):
        print(f"| linear {r['fmt']} M={r['M']} {r['N']}x{r['K']} | {r['ms']:.4f} ms | bf16 {r['bf16_ms']:.4f} ms | "
              f"{r['speedup_vs_bf16']:.2f}x | " + " ".join(f"{v['config']}: {v['ms']:.4f}" for v in r["variants"]))


if __name__ == "__main__":
    main()
