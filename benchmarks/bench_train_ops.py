#!/usr/bin/env python3
"""Ops per training step of the learned model (train-learned's target step: answer + prompt loss, the indexer's KL,
router balancing, AdamW), eager, with `--compile` (learn/fast_paths.CompiledPieces; `--no-compiled` skips it) and,
on CUDA with `--graphs`, captured as a CUDA graph (train-learned `--cuda-graphs`, learn/graphed_step.py), and with
both (`--compile --cuda-graphs`): the host launches every op, so their count is what a host-bound step costs. Random
weights of the learned config, a synthetic batch.

    python benchmarks/bench_train_ops.py --rows 8 --len 512 --steps 3 [--backend inductor] [--graphs] [--out ops.json]
    python benchmarks/bench_train_ops.py --rows 256 --len 512 --modes eager,graphed+grouped,compiled_graphed+grouped

Prints per mode: aten ops per step (every aten call the profiler saw, nested ones included, and the top-level
ones), device kernels per step (CUDA), ms per step (wall, this machine) under the profiler and without it, and with
`--graphs` the graphed steps' speedups over the eager one (unprofiled ms). `--modes` picks the steps, each with the
experts path train-learned `--experts` picks ("+grouped": only the picked experts, through the grouped GEMM)."""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

os.environ.setdefault("USE_HUB_KERNELS", "0")


def synthetic_batch(rows: int, length: int, vocab: int, seed: int = 0) -> tuple:
    """A training batch (ids, loss mask, real-token mask, task) of random ids: the loss on each row's last eighth,
    every token real, tasks 0 and 1 in turn."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, length), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, -length // 8:] = True
    return ids, mask, torch.ones_like(mask), torch.arange(rows) % 2


def step_parts(model, device, distill_rows: int, graphed: bool = False, seed: int = 0,
               foreach: bool | None = None) -> tuple:
    """What train-learned's target step takes besides the batch: parameter groups, AdamW (fused on CUDA, else
    `foreach` as torch takes it; capturable, its lr a device tensor, when `graphed`), the indexer's distillation on
    `distill_rows` rows and the routers' balance, both on."""
    from m3serve.learn.step import IndexerDistill, RouterBalance, param_groups

    groups = param_groups(model, 0.1)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(groups, lr=torch.tensor(1e-3, device=device) if graphed else 1e-3, fused=fused,
                            foreach=None if fused else foreach, capturable=graphed)
    distill, balance = IndexerDistill(model, distill_rows, seed), RouterBalance(model, 1e-2)
    distill.enabled = balance.enabled = True
    return groups, opt, distill, balance


def count(model, batch, steps: int, device, args, graphed: bool = False) -> dict:
    """Ops and time per step; `graphed`: the step captured as a CUDA graph (learn/graphed_step.py; its first step runs
    eagerly, the second captures, the timed ones replay)."""
    from m3serve.learn.graphed_step import GraphedSteps
    from m3serve.learn.step import target_step

    groups, opt, distill, balance = step_parts(model, device, args.distill_rows, graphed)
    graphs = GraphedSteps(model, opt, groups, distill, balance, device, 0.25, print) if graphed else None

    def step():
        if graphs is not None:
            graphs.step(batch, 1e-3, args.dense)
        else:
            target_step(model, opt, groups, distill, balance, batch, 1e-3, args.dense, device, 0.25)
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    step()  # warm (compiles, when compiled)
    first = time.perf_counter() - t0
    step()  # captures, when graphed
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    unprofiled = (time.perf_counter() - t0) / steps
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
            "ms_per_step_unprofiled": round(unprofiled * 1e3, 1), "first_step_s": round(first, 1),
            **({"graphs": graphs.summary()} if graphs is not None else {})}


MODES = ("eager", "graphed", "compiled", "compiled_graphed")


def modes_of(text: str) -> list[tuple[str, str, str]]:
    """`--modes`: "MODE[+EXPERTS],..." -> [(label, mode, experts path)]; MODE one of MODES, EXPERTS a key of
    learn/fast_paths.EXPERTS (default "all")."""
    from m3serve.learn.fast_paths import EXPERTS

    out = []
    for label in text.split(","):
        mode, _, experts = label.partition("+")
        if mode not in MODES or (experts or "all") not in EXPERTS:
            raise argparse.ArgumentTypeError(f"mode {label!r}: MODE[+EXPERTS], MODE one of {list(MODES)}, "
                                             f"EXPERTS one of {list(EXPERTS)}")
        out.append((label, mode, experts or "all"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--distill-rows", type=int, default=16)
    p.add_argument("--dense", action="store_true", help="the dense warm-up's step (default: the sparse one)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--graphs", action="store_true", help="also the step captured as a CUDA graph (CUDA only)")
    p.add_argument("--no-compiled", dest="compiled", action="store_false", help="skip the compiled step")
    p.add_argument("--modes", type=modes_of, help="the steps to time, e.g. 'eager,graphed+grouped' (MODE[+EXPERTS]: "
                   f"{', '.join(MODES)}; +grouped: the experts as train-learned --experts grouped runs them); "
                   "default: eager, graphed with --graphs on CUDA, compiled unless --no-compiled, and both")
    p.add_argument("--out")
    args = p.parse_args()
    from m3serve.learn.config import learned_config
    from m3serve.learn.fast_paths import CompiledPieces, install
    from m3serve.learn.train import build_target

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    graphs = args.graphs and device.type == "cuda"
    modes = args.modes or [(m, m, "all") for m in ["eager"] + ["graphed"] * graphs + ["compiled"] * args.compiled
                           + ["compiled_graphed"] * (graphs and args.compiled)]
    if device.type != "cuda" and any("graphed" in m for _, m, _ in modes):
        p.error("graphed modes need CUDA")
    batch = synthetic_batch(args.rows, args.len, args.vocab)
    base = build_target(learned_config(args.vocab, 0, 1), device, 0)
    out = {"device": str(device), "torch": torch.__version__, "rows": args.rows, "len": args.len,
           "dense": args.dense}
    for label, mode, experts in modes:
        model = copy.deepcopy(base)
        install(model, experts)
        if "compiled" in mode:  # the compiled pieces' kernels; inside graphs, no guards are left to run per step
            CompiledPieces(model, args.backend)
        out[label] = {"experts": experts, **({"backend": args.backend} if "compiled" in mode else {}),
                      **count(model, batch, args.steps, device, args, graphed="graphed" in mode)}
        del model
    if "eager" in out:
        for label, _, _ in modes:
            if label != "eager":
                out[label + "_speedup"] = round(out["eager"]["ms_per_step_unprofiled"]
                                                / out[label]["ms_per_step_unprofiled"], 2)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
