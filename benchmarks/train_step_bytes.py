#!/usr/bin/env python3
"""Where a training step of the learned model spends device time, estimated on any machine: one target step
(train-learned's: answer + prompt loss, the indexer's KL, router balancing, AdamW) runs once under a
TorchDispatchMode that records every aten op that is not a view, with the bytes it reads and writes and the FLOPs
torch's flop counter gives it. An op's estimated time is the larger of bytes / bandwidth and FLOPs / matmul rate
(a roofline; no launch cost: under CUDA graphs launches cost little). The bytes are those of this run's dtypes: on
the CPU every tensor is fp32, where the GPU's bf16 autocast halves the matmuls' operands, so the absolute times are
an upper bound and the shares are what to read.

    python benchmarks/train_step_bytes.py --rows 64 --len 512 [--experts grouped] [--out bytes.json]

Prints the estimate per 131,072 tokens, the share of ops on [tokens, experts, width] tensors (the all-experts path's
work, learn/fast_paths.py), and the top ops by estimated time."""
from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

os.environ.setdefault("USE_HUB_KERNELS", "0")


class OpBytes(TorchDispatchMode):
    """Every non-view aten op: (name, bytes read + written, FLOPs, whether a tensor is [tokens, experts, width])."""

    def __init__(self, tokens: int, experts: int):
        super().__init__()
        self.tokens, self.experts = tokens, experts
        self.ops: list[tuple[str, int, int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return out  # a view: no kernel
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        flops = 0
        if func._overloadpacket is torch.ops.aten._grouped_mm:  # not in torch's counter: [M, K] x [G, K, N] or
            a, b = args[0], args[1]  # [K, M] x [M, N] (a weight's gradient), each 2 M K N over its groups
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[-1]
        elif func._overloadpacket in flop_registry:
            try:
                flops = int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a counter that does not take these arguments: count no FLOPs
                flops = 0
        # [tokens, experts, width]: every expert's rows for every token (the router's [tokens, experts] is not)
        wide = any(t.dim() >= 3 and t.shape[0] == self.tokens and t.shape[1] == self.experts for t in tensors)
        self.ops.append((str(func._overloadpacket).removeprefix("aten."), nbytes, flops, wide))
        return out


def estimate(rows: int, length: int, experts: str, bandwidth: float, matmul_rate: float, dense: bool = False,
             seed: int = 0) -> dict:
    from bench_train_ops import step_parts, synthetic_batch

    from m3serve.learn.config import learned_config
    from m3serve.learn.step import target_step
    from m3serve.learn.train import build_target

    dev = torch.device("cpu")
    cfg = learned_config(2048, 0, 1)
    model = build_target(cfg, dev, seed, experts=experts)
    # foreach: the optimizer's ops over whole lists of tensors, as the GPU's fused AdamW reads them (not one by one)
    groups, opt, distill, balance = step_parts(model, dev, 16, seed=seed, foreach=True)
    batch = synthetic_batch(rows, length, 2000, seed)
    target_step(model, opt, groups, distill, balance, batch, 1e-3, dense, dev, 0.25)  # the optimizer's state
    mode = OpBytes(rows * length, cfg.num_local_experts)
    with mode:
        target_step(model, opt, groups, distill, balance, batch, 1e-3, dense, dev, 0.25)
    by_op: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0, 0.0])
    wide_s = total_s = 0.0
    for name, nbytes, flops, wide in mode.ops:
        s = max(nbytes / bandwidth, flops / matmul_rate)
        total_s += s
        wide_s += s * wide
        row = by_op[name]
        row[0] += 1
        row[1] += nbytes
        row[2] += flops
        row[3] += s
    scale = 131072 / (rows * length)
    top = sorted(by_op.items(), key=lambda kv: -kv[1][3])[:25]
    return {"rows": rows, "len": length, "experts": experts, "dense": dense, "bandwidth": bandwidth,
            "matmul_rate": matmul_rate, "ops": len(mode.ops), "estimate_ms": round(total_s * 1e3, 3),
            "estimate_ms_per_131072_tokens": round(total_s * 1e3 * scale, 1),
            "expert_wide_share": round(wide_s / total_s, 3),
            "top": [{"op": k, "calls": c, "gb": round(b / 1e9, 3), "gflop": round(f / 1e9, 1),
                     "ms": round(s * 1e3, 3), "share": round(s / total_s, 3)} for k, (c, b, f, s) in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--experts", default="all", help="learn/fast_paths.EXPERTS: all | grouped")
    p.add_argument("--dense", action="store_true", help="the dense warm-up's step (default: the sparse one)")
    p.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s (default: about an H100's HBM)")
    p.add_argument("--matmul-rate", type=float, default=4.0e14, help="FLOP/s of the matmuls")
    p.add_argument("--out")
    a = p.parse_args()
    r = estimate(a.rows, a.len, a.experts, a.bandwidth, a.matmul_rate, a.dense)
    print(f"{r['rows']} x {r['len']} tokens, experts {r['experts']!r}: {r['ops']} ops, estimated {r['estimate_ms']} ms "
          f"({r['estimate_ms_per_131072_tokens']} ms per 131,072 tokens); ops on [tokens, experts, width] tensors "
          f"{r['expert_wide_share']:.0%}")
    print("| op | calls | GB | GFLOP | est. ms | share |\n|---|---|---|---|---|---|")
    for t in r["top"]:
        print(f"| {t['op']} | {t['calls']} | {t['gb']} | {t['gflop']} | {t['ms']} | {t['share']:.1%} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
