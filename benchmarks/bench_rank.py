#!/usr/bin/env python3
"""One rank of a TP4 deployment of MiniMax-M3.1-Flash at full depth, on one GPU: the published geometry (60 layers,
3 full-attention + dense MLP, then 57 MSA + MoE), sharded as rank 0 of 4 (16 query heads, 1 KV head, 1 index head,
a quarter of every expert's FFN, or with --ep 32 whole experts), random weights made on the device in the real
formats (NVFP4 routed experts, MXFP8 shared expert, bf16 elsewhere: no checkpoint), NVFP4 KV and index keys, served
by the engine (`LLMEngine.step()`, decode CUDA graphs) as rank 0 would run it.

  python benchmarks/bench_rank.py --out OUT_DIR             # the H200 (about 5 minutes)
  python benchmarks/bench_rank.py --out OUT_DIR --ep        # the same rank under expert parallelism
  python benchmarks/bench_rank.py --smoke --out /tmp/r      # CPU, toy widths (tests/unit/test_bench_rank.py)
  python benchmarks/bench_rank.py --reproject OUT_DIR/bench_rank.json --allreduce TP.json --out DIR   # no GPU

The other three ranks are absent: every all-reduce (o_proj, dense MLP / MoE, embedding) leaves this rank's partial
sum in place and the logits gather tiles this rank's vocab rows to the full vocab (`StandIn`: the same shapes
downstream, no traffic). The stand-ins are also timed on their own (`standin_s`: the all-reduce's is nothing, the
logits' tiling copy stands for the concatenation the real gather does too).

Measured: the memory plan (weight bytes, the KV pool the engine sizes from free memory at 128K tokens per
sequence, the decode graphs' pool) against `m3serve.capacity.plan` for the same rank; the time to make the weights
and lay them out for the kernels (not a checkpoint load: no 60 GB file is read); CUDA graph capture time and memory;
the per-rank decode step at batch 1, 4, 16, 64 x context 4K, 32K, 128K (points whose pages do not fit the pool are
reported as such); the collectives each step calls (kind and bytes, recorded in one eager step per batch).
Estimated (labelled so): the TP4 step = rank step + every recorded collective at NCCL's own cost model
for 4 GPUs over NVLink, and the tokens/s per user against the goal of 300 at 4 users; with --allreduce (bench_tp.py's
JSON from a 4-GPU host) the all-reduces at their measured cost as well; `--reproject` redoes only that from a
saved bench_rank.json (its recorded collectives and step times) on any machine, so the one-GPU run and the 4-GPU
all-reduces need not share a call.
Writes OUT_DIR/bench_rank.json (after every measurement) and OUT_DIR/bench_rank.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import one_eager_step, randomize_cache, release, sync, time_decode  # noqa: E402
from geometry import SMOKE_TP4, _storage_bytes, flash_geometry, make_engine, random_model  # noqa: E402

from m3serve.capacity import plan  # noqa: E402
from m3serve.distributed.parallel import Parallel  # noqa: E402
from m3serve.executor.cuda_graph import graph_reserve_bytes  # noqa: E402
from m3serve.model.kv_cache import activation_reserve_bytes  # noqa: E402

TP = 4
GOAL_TOK_S_PER_USER, GOAL_USERS = 300.0, 4
# The collectives' cost until a 4-GPU run measures it (estimates, with their sources):
# NCCL's tuner model (NVIDIA/nccl src/graph/tuning.cc at 5067397, ncclTunerConstantsDefaults): Ring / LL base latency
# 6.6 us plus 0.6 us per NVLink step; a ring all-reduce takes 2 (N - 1) steps, an all-gather N - 1.
NCCL_BASE_US, NCCL_HOP_US = 6.6, 0.6
# bus bandwidth of a ring all-reduce on H100 SXM, 2 to 8 GPUs: 365-370 GB/s (NVIDIA/nccl#1455); the H200 has the same
# NVLink 4 (18 links, 900 GB/s)
NCCL_BUS_GBPS = 370.0
# a pessimistic floor: ~20-25 us per all-reduce of 4 B to 1 MiB measured with PyTorch on 8 x H100 (eager launches,
# marin-community/marin#6736)
PESSIMISTIC_US = 25.0


@dataclasses.dataclass
class StandIn(Parallel):
    """Rank `rank` of `size` alone: `all_reduce` leaves the partial sum in place, `gather_first` tiles this rank's
    vocab rows to the full width on rank 0. While `calls` is a list, each collective's kind and bytes are appended."""

    calls: list | None = None

    def _record(self, kind: str, nbytes: int) -> None:
        if self.calls is not None:
            self.calls.append((kind, nbytes))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._record("all_reduce", x.numel() * x.element_size())
        return x

    def gather_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        self._record("all_gather", x.numel() * x.element_size() * self.size)
        if not self.is_first:
            return None
        return x.repeat(*[self.size if d == dim % x.dim() else 1 for d in range(x.dim())])


def nccl_us(kind: str, nbytes: int, n: int = TP) -> float:
    """NCCL's cost model for one collective over n GPUs on NVLink (see the constants): latency + bus bytes."""
    steps, bus = (2 * (n - 1), nbytes * 2 * (n - 1) / n) if kind == "all_reduce" else (n - 1, nbytes * (n - 1) / n)
    return NCCL_BASE_US + steps * NCCL_HOP_US + bus / (NCCL_BUS_GBPS * 1e3)


def standin_s(par: StandIn, batch: int, vocab: int, device, reps: int = 20) -> float:
    """Seconds of the logits stand-in (the all-reduce stand-in does nothing) at `batch` rows."""
    x = torch.randn(batch, vocab // par.size, device=device)
    par.gather_first(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        par.gather_first(x)
    sync(device)
    return (time.perf_counter() - t0) / reps


def pages_per_seq(context: int, block: int) -> int:
    return math.ceil(context / block)


def memory_plan(cfg, engine, weights: int, device, max_context: int, chunk: int, max_seqs: int,
                outside_pytorch: int = 0) -> dict:
    """The engine's memory on this rank against the planner's prediction for rank 0 of TP 4: once as
    `m3serve capacity` runs it (141 GB, a flat 4 GB activation reserve), once with this device's total and the
    engine's own reserves (activations and the graph pool) and the memory measured outside PyTorch before the engine
    (`outside_pytorch`: the CUDA context): the comparison that isolates the planner's arithmetic."""
    w = engine.executor.worker
    pool = sum(t.numel() * t.element_size() for layer in w.cache.layers for t in layer.tensors())
    per_seq = pages_per_seq(max_context, cfg.index_block_size)
    graphs = w.runner.graphs
    res = {"weights_bytes": weights, "kv_pages": w.cache.num_pages, "kv_pool_bytes": pool,
           "pages_per_sequence": per_seq, "sequences_at_max_context": w.cache.num_pages // per_seq,
           "max_context": max_context,
           "graph_pool_bytes": graphs.pool_bytes if graphs is not None else 0,
           "graph_reserve_bytes": graph_reserve_bytes(max_seqs, cfg.hidden_size, cfg.vocab_size)}
    default = plan(cfg, "nvfp4", "nvfp4", gpus=TP, seq_len=max_context)
    res["planner_default"] = default
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        reserve = activation_reserve_bytes(cfg, chunk, max_seqs) + res["graph_reserve_bytes"]
        matched = plan(cfg, "nvfp4", "nvfp4", gpus=TP, seq_len=max_context, gpu_memory_gb=total / 1e9,
                       activation_reserve_gb=reserve / 1e9, gpu_memory_utilization=engine.config.gpu_memory_utilization,
                       cuda_context_gb=outside_pytorch / 1e9)
        res.update(device_total_bytes=total, engine_reserve_bytes=reserve, planner_matched=matched,
                   peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                   kv_pool_over_planner=pool / max(1, matched["per_rank"]["cache_budget_bytes"]),
                   sequences_over_planner=res["sequences_at_max_context"] / max(1, matched["max_concurrent_sequences"]))
    res["weights_over_planner"] = weights / default["per_rank"]["weight_bytes"]
    res["graph_pool_over_reserve"] = res["graph_pool_bytes"] / max(1, res["graph_reserve_bytes"])
    return res


def measured_allreduce(path: str) -> dict[int, float]:
    """bytes -> us per all-reduce over 4 GPUs from `bench_tp.py`'s JSON (replayed from a CUDA graph where it got
    that figure, else launched one by one)."""
    with open(path) as f:
        rows = json.load(f).get("allreduce", [])
    return {r["bytes"]: r.get("us_per_allreduce_graph") or r["us_per_allreduce"] for r in rows if r["gpus"] == TP}


def projection(step_s: float, calls: list, batch: int, measured: dict[int, float] | None = None) -> dict:
    """The TP4 step: this rank's step plus each collective at NCCL's model (an estimate), at a pessimistic floor,
    and (with `measured`: bench_tp's 4-GPU all-reduces by bytes) with the all-reduces measured. The stand-ins stay
    in the rank's step: the all-reduce's costs nothing, the logits' tiling copy is the concatenation the real
    gather also does after its transfer."""
    est = sum(nccl_us(k, b) for k, b in calls) * 1e-6
    pess = sum(max(PESSIMISTIC_US, nccl_us(k, b)) for k, b in calls) * 1e-6
    tp4 = step_s + est
    out = {"estimate": True, "collectives": len(calls), "collective_bytes": sum(b for _, b in calls),
           "nccl_model_s": est, "pessimistic_s": pess, "tp4_step_s": tp4, "tp4_tokens_per_s_per_user": 1 / tp4,
           "tp4_pessimistic_tokens_per_s_per_user": 1 / (step_s + pess),
           "meets_goal": (1 / tp4 >= GOAL_TOK_S_PER_USER) if batch == GOAL_USERS else None}
    if measured:
        known = [(k, b) for k, b in calls if k == "all_reduce" and b in measured]
        coll = (sum(measured[b] for _, b in known) + sum(nccl_us(k, b) for k, b in calls if (k, b) not in known)) * 1e-6
        out.update(measured_allreduces=len(known), tp4_measured_step_s=step_s + coll,
                   tp4_measured_tokens_per_s_per_user=1 / (step_s + coll))
    return out


def save(res: dict, out: str) -> None:
    with open(os.path.join(out, "bench_rank.json"), "w") as f:
        json.dump(res, f, indent=1)


def write_report(res: dict, out: str) -> None:
    save(res, out)
    with open(os.path.join(out, "bench_rank.md"), "w") as f:
        f.write(table(res))
    print(table(res))


def compact_calls(calls: list) -> list:
    """[(kind, bytes)] in order -> [[kind, bytes, repeats]] runs (the JSON's `sequence`)."""
    runs: list = []
    for kind, nbytes in calls:
        if runs and runs[-1][:2] == [kind, nbytes]:
            runs[-1][2] += 1
        else:
            runs.append([kind, nbytes, 1])
    return runs


def reproject(path: str, allreduce: str, out: str) -> int:
    """The TP4 projection of a saved run again, with bench_tp's measured all-reduces (no device needed)."""
    with open(path) as f:
        res = json.load(f)
    measured = measured_allreduce(allreduce)
    for row in res.get("decode", []):
        if row.get("fits") and "step_s" in row:
            runs = res["collectives"][str(row["batch"])].get("sequence")
            if runs is None:
                raise SystemExit(f"{path}: no recorded collective sequence (a run older than --reproject)")
            calls = [(kind, nbytes) for kind, nbytes, n in runs for _ in range(n)]
            row["projection"] = projection(row["step_s"], calls, row["batch"], measured)
    res["reprojected"] = {"from": os.path.abspath(path), "allreduce": os.path.abspath(allreduce)}
    os.makedirs(out, exist_ok=True)
    write_report(res, out)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--dense-layers", type=int, default=3)
    p.add_argument("--ep", action="store_true", help="expert parallel: whole experts on the rank")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--steps", type=int, default=10, help="decode steps per timed run (3 runs)")
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--budget-s", type=float, default=360.0, help="skip the decode points left after this long")
    p.add_argument("--smoke", action="store_true", help="CPU, toy widths with M3's head ratios (SMOKE_TP4)")
    p.add_argument("--allreduce", help="bench_tp.py's JSON from a 4-GPU host: its all-reduces replace the model's")
    p.add_argument("--reproject", metavar="BENCH_RANK_JSON",
                   help="no run: redo the projection of this saved run with --allreduce's measured all-reduces")
    a = p.parse_args(argv)
    if a.reproject:
        if not a.allreduce:
            p.error("--reproject needs --allreduce")
        return reproject(a.reproject, a.allreduce, a.out)
    measured = measured_allreduce(a.allreduce) if a.allreduce else None
    t_start = time.perf_counter()
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    over = {}
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if a.smoke:
        a.layers, a.dense_layers, over = 4, 1, SMOKE_TP4
        batches, contexts, a.steps, a.chunk = [1, 2], [40, 80], 2, 64
    os.makedirs(a.out, exist_ok=True)
    cfg = flash_geometry(a.layers, a.dense_layers, **over)
    par = StandIn(0, TP, a.ep)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "layers": a.layers, "dense_layers": a.dense_layers, "rank": "0 of 4",
           "expert_parallel": a.ep, "kv_cache_dtype": "nvfp4", "nccl_model": {
               "base_us": NCCL_BASE_US, "hop_us": NCCL_HOP_US, "bus_GBps": NCCL_BUS_GBPS,
               "pessimistic_us": PESSIMISTIC_US}}

    # weights: made on the device, laid out for the kernels
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    model = random_model(cfg, device, parallel=par)
    model.prepare_for_inference()
    sync(device)
    res["build_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        weights = torch.cuda.memory_allocated(device) - base
    else:
        weights = _storage_bytes(list(model.parameters()) + list(model.buffers()))
    print(f"rank weights {weights / 2**30:.2f} GiB made and laid out in {res['build_s']:.1f} s", flush=True)

    # the engine: KV pool from free memory (CUDA), decode graphs captured
    max_context = max(contexts)
    max_seqs = max(batches)
    opts = dict(device=str(device), dtype="bfloat16", max_model_len=max_context + 64, max_num_seqs=max_seqs,
                max_num_batched_tokens=a.chunk)
    if device.type != "cuda":
        opts["num_gpu_blocks_override"] = max_seqs * pages_per_seq(max_context + 64, cfg.index_block_size) + 16
    if device.type == "cuda":  # what holds the device's memory as the engine starts sizing its pool
        free, total = torch.cuda.mem_get_info(device)
        res["before_engine"] = {"in_use_bytes": total - free, "allocated_bytes": torch.cuda.memory_allocated(device),
                                "reserved_bytes": torch.cuda.memory_reserved(device),
                                "outside_pytorch_bytes": total - free - torch.cuda.memory_reserved(device)}
    t0 = time.perf_counter()
    engine = make_engine(model, **opts)
    res["engine_s"] = time.perf_counter() - t0
    graphs = engine.executor.worker.runner.graphs
    res["graph_capture_s"] = graphs.capture_s if graphs is not None else None
    res["memory"] = memory_plan(cfg, engine, weights, device, max_context, a.chunk, max_seqs,
                                res.get("before_engine", {}).get("outside_pytorch_bytes", 0))
    m = res["memory"]
    print(f"KV pool {m['kv_pages']} pages, {m['kv_pool_bytes'] / 2**30:.2f} GiB: {m['sequences_at_max_context']} "
          f"sequences of {max_context}; graphs {m['graph_pool_bytes'] / 2**30:.2f} GiB captured in "
          f"{res['graph_capture_s'] or 0:.1f} s; weights / planner {m['weights_over_planner']:.3f}", flush=True)
    save(res, a.out)
    randomize_cache(engine)

    # the collectives of one step per batch (eager, recorded), and the stand-ins' own time
    res["collectives"], calls = {}, {}
    for b in batches:
        par.calls = []
        one_eager_step(engine, b, min(contexts))
        calls[b], par.calls = par.calls, None
        res["collectives"][b] = {"calls": len(calls[b]), "bytes": sum(n for _, n in calls[b]),
                                 "kinds": sorted({k for k, _ in calls[b]}), "sequence": compact_calls(calls[b]),
                                 "standin_s": standin_s(par, b, cfg.vocab_size, device)}
    save(res, a.out)

    res["decode"] = []
    for ctx in contexts:
        for b in batches:
            row = {"batch": b, "context": ctx}
            need = b * pages_per_seq(ctx + a.steps * 4 + 16, cfg.index_block_size)
            if need > engine.executor.worker.cache.num_pages:
                row["fits"] = False
            elif time.perf_counter() - t_start > a.budget_s:
                row["skipped"] = "time budget"
            else:
                t, wait = time_decode(engine, device, b, ctx, a.steps)
                row.update(fits=True, step_s=t, tokens_per_s_per_user=1 / t, host_wait_share=wait,
                           projection=projection(t, calls[b], b, measured))
                pr = row["projection"]
                print(f"b={b:3d} ctx={ctx:7d}: rank step {t * 1e3:8.3f} ms; TP4 estimate {pr['tp4_step_s'] * 1e3:8.3f} "
                      f"ms = {pr['tp4_tokens_per_s_per_user']:6.1f} tok/s/user", flush=True)
            res["decode"].append(row)
            save(res, a.out)
    res["total_s"] = time.perf_counter() - t_start
    write_report(res, a.out)
    del engine, model
    release()
    return 0


def table(res) -> str:
    m = res["memory"]
    gib = 2 ** 30
    lines = [f"{res['device']}: rank 0 of TP 4{' (EP)' if res['expert_parallel'] else ''}, {res['layers']} layers, "
             f"NVFP4 KV; weights made and laid out in {res['build_s']:.1f} s (no checkpoint read), engine built in "
             f"{res['engine_s']:.1f} s, decode graphs captured in {res['graph_capture_s'] or 0:.1f} s", "",
             "| memory | measured GiB | planner GiB | ratio |", "|---|---|---|---|",
             f"| weights | {m['weights_bytes'] / gib:.2f} | {m['planner_default']['per_rank']['weight_bytes'] / gib:.2f} "
             f"| {m['weights_over_planner']:.3f} |"]
    if "planner_matched" in m:
        pm = m["planner_matched"]
        lines.append(f"| KV pool ({m['kv_pages']} pages) | {m['kv_pool_bytes'] / gib:.2f} | "
                     f"{pm['per_rank']['cache_budget_bytes'] / gib:.2f} | {m['kv_pool_over_planner']:.3f} |")
        lines.append(f"| sequences of {m['max_context']} | {m['sequences_at_max_context']} | "
                     f"{pm['max_concurrent_sequences']} | {m['sequences_over_planner']:.3f} |")
    lines.append(f"| graph pool | {m['graph_pool_bytes'] / gib:.2f} | {m['graph_reserve_bytes'] / gib:.2f} (reserve) "
                 f"| {m['graph_pool_over_reserve']:.3f} |")
    if "before_engine" in res:
        b = res["before_engine"]
        lines += ["", f"Before the engine sized its pool: {b['in_use_bytes'] / gib:.2f} GiB in use on the device, "
                  f"{b['allocated_bytes'] / gib:.2f} GiB in PyTorch's tensors, {b['reserved_bytes'] / gib:.2f} GiB "
                  f"held by its allocator, {b['outside_pytorch_bytes'] / gib:.2f} GiB outside it (CUDA context, "
                  "libraries)."]
    lines += ["", "TP4 estimate: this rank's step (the other ranks assumed as fast) plus every collective it calls at "
              f"NCCL's tuner model for 4 GPUs on NVLink ({NCCL_BASE_US} us + {NCCL_HOP_US} us per step, "
              f"{NCCL_BUS_GBPS:.0f} GB/s bus); pessimistic: at least {PESSIMISTIC_US:.0f} us each. Goal: "
              f"{GOAL_TOK_S_PER_USER:.0f} tok/s/user at {GOAL_USERS} users.",
              "", "| batch | context | rank step ms | rank tok/s/user | collectives | TP4 step ms (estimate) | "
              "TP4 tok/s/user (estimate) | pessimistic | goal |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        if not r.get("fits", False):
            why = "does not fit the pool" if r.get("fits") is False else r.get("skipped", "")
            lines.append(f"| {r['batch']} | {r['context']} | {why} | | | | | | |")
            continue
        pr = r["projection"]
        goal = "" if pr["meets_goal"] is None else ("meets" if pr["meets_goal"] else "misses")
        if "tp4_measured_tokens_per_s_per_user" in pr:
            goal += f" (measured all-reduces: {pr['tp4_measured_tokens_per_s_per_user']:.1f} tok/s/user)"
        lines.append(f"| {r['batch']} | {r['context']} | {r['step_s'] * 1e3:.3f} | {r['tokens_per_s_per_user']:.1f} | "
                     f"{pr['collectives']} | {pr['tp4_step_s'] * 1e3:.3f} | {pr['tp4_tokens_per_s_per_user']:.1f} | "
                     f"{pr['tp4_pessimistic_tokens_per_s_per_user']:.1f} | {goal} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
