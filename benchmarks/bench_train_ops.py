#!/usr/bin/env python3
"""Ops per training step of the learned model (train-learned's target step: answer + prompt loss, the indexer's KL,
router balancing, AdamW), eager and with `--compile` (learn/fast_paths.CompiledPieces): the host launches every op,
so their count is what a host-bound step costs. Random weights of the learned config, a synthetic batch.

    python benchmarks/bench_train_ops.py --rows 8 --len 512 --steps 3 [--backend inductor] [--out ops.json]

Prints per mode: aten ops per step (every aten call the profiler saw, nested ones included, and the top-level
ones), device kernels per step (CUDA), and ms per step (wall, this machine)."""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

os.environ.setdefault("USE_HUB_KERNELS", "0")


def count(model, batch, steps: int, device, args) -> dict:
    from m3serve.learn.train import IndexerDistill, RouterBalance, _param_groups, _target_step

    groups = _param_groups(model, 0.1)
    opt = torch.optim.AdamW(groups, lr=1e-3, fused=device.type == "cuda")
    distill, balance = IndexerDistill(model, args.distill_rows, 0), RouterBalance(model, 1e-2)
    distill.enabled = balance.enabled = True

    def step():
        _target_step(model, opt, groups, distill, balance, batch, 1e-3, args.dense, device, 0.25)
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    step()  # warm (compiles, when compiled)
    first = time.perf_counter() - t0
    step()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda"
                                                    else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
    wall = (time.perf_counter() - t0) / steps
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    distill.remove()
    balance.remove()
    return {"aten_ops_per_step": round(len(aten) / steps), "top_level_aten_ops_per_step": round(len(top) / steps),
            "device_kernels_per_step": round(len(kernels) / steps), "ms_per_step": round(wall * 1e3, 1),
            "first_step_s": round(first, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--distill-rows", type=int, default=16)
    p.add_argument("--dense", action="store_true", help="the dense warm-up's step (default: the sparse one)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--out")
    args = p.parse_args()
    from m3serve.learn.config import learned_config
    from m3serve.learn.fast_paths import CompiledPieces
    from m3serve.learn.train import build_target

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, args.vocab, (args.rows, args.len), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, -args.len // 8:] = True
    batch = (ids, mask, torch.ones_like(mask), torch.arange(args.rows) % 2)
    eager = build_target(learned_config(args.vocab, 0, 1), device, 0)
    compiled = copy.deepcopy(eager)
    CompiledPieces(compiled, args.backend)
    out = {"device": str(device), "torch": torch.__version__, "rows": args.rows, "len": args.len,
           "dense": args.dense, "eager": count(eager, batch, args.steps, device, args),
           "compiled": {"backend": args.backend, **count(compiled, batch, args.steps, device, args)}}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
