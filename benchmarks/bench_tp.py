"""Tensor / expert parallelism on one multi-GPU host (issue #16), everything in one call:

1. parity: greedy tokens of TP 2 / 4 and EP 2 / 4 (NCCL) against TP 1 on a small model (the tiny geometry with 4 KV
   heads, fp32 weights, `make_tiny`): the first position where each prompt's tokens part, and the largest logprob
   difference before it (the kernels' dots take bf16 operands, so two runs may part at a near-tie late);
2. the all-reduce cost: NCCL all-reduce of [T, hidden] bf16 (M3: hidden 6144) for T tokens per step, timed with CUDA
   events over N GPUs, launched one by one and replayed from a CUDA graph that holds them (as the decode graphs
   do); an M3 layer does two (o_proj, MoE), so a decode step of 60 layers does 120, plus one for the embedding and
   a gather of the logits. `bench_rank.py --allreduce OUT.json` adds these to its one-GPU rank step.

    python benchmarks/bench_tp.py --out /tmp/tp.json        (prints a table; NCCL_NVLS_ENABLE=0 is the default)
    python benchmarks/bench_tp.py --smoke --out /tmp/tp.json (CPU, gloo, TP 2 only: checks the script runs)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m3serve import LLM, SamplingParams
from m3serve.model.tiny import make_tiny

PROMPTS = [list(range(3, 23)), [(7 * i) % 500 + 3 for i in range(90)], [(13 * i) % 480 + 5 for i in range(150)]]
NEW_TOKENS = 24
TOKENS = (1, 4, 16, 64, 256, 1024, 8192)


def _run(model: str, device: str, tp: int, ep: bool) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model=model, device=device, dtype="float32", max_model_len=512, num_gpu_blocks_override=64,
              tensor_parallel_size=tp, enable_expert_parallel=ep)
    t1 = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0))
    t2 = time.perf_counter()
    llm.shutdown()
    return {"tp": tp, "ep": ep, "startup_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 3),
            "tokens": [o.token_ids for o in outs],
            "logprobs": [[d[t] for d, t in zip(o.logprobs, o.token_ids)] for o in outs]}


def parity(device: str, configs: list[tuple[int, bool]]) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        make_tiny(d, seed=1, num_attention_heads=8, num_key_value_heads=4, index_n_heads=4)
        base = _run(d, device, 1, False)
        rows = [base]
        for tp, ep in configs:
            r = _run(d, device, tp, ep)
            parts, diffs = [], []
            for want, got, lw, lg in zip(base["tokens"], r["tokens"], base["logprobs"], r["logprobs"]):
                n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
                parts.append(n)
                diffs.append(max([abs(a - b) for a, b in zip(lw[:n], lg[:n])], default=0.0))
            r.update(first_difference=parts, equal=all(n == NEW_TOKENS for n in parts),
                     max_logprob_diff=round(max(diffs), 5))
            rows.append(r)
    return rows


def _allreduce_rank(rank: int, world: int, port: int, hidden: int, iters: int, out: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    res = {}
    for t in TOKENS:
        x = torch.randn(t, hidden, device=device, dtype=torch.bfloat16)
        for _ in range(10):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        res[t] = {"eager": start.elapsed_time(end) * 1e3 / iters}  # us per all-reduce
        try:
            res[t]["graph"] = _graph_allreduce_us(x, iters)
        except Exception as e:  # noqa: BLE001 - recorded: the eager figure and the parity runs still count
            res[t]["graph_error"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _graph_allreduce_us(x: torch.Tensor, iters: int) -> float:
    """us per all-reduce of `iters` all-reduces captured in one CUDA graph, replayed (every rank alike)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            dist.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (3 * iters)


def allreduce_cost(world: int, hidden: int, iters: int) -> list[dict]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ar.json")
        mp.spawn(_allreduce_rank, args=(world, port, hidden, iters, out), nprocs=world, join=True)
        with open(out) as f:
            res = {int(k): v for k, v in json.load(f).items()}
    rows = []
    for t, r in sorted(res.items()):
        nbytes, us = t * hidden * 2, r["eager"]
        rows.append({"gpus": world, "tokens": t, "bytes": nbytes, "us_per_allreduce": round(us, 2),
                     "us_per_allreduce_graph": round(r["graph"], 2) if "graph" in r else None,
                     "graph_error": r.get("graph_error"),
                     "us_per_layer": round(2 * us, 2), "ms_per_60_layer_step": round((120 + 1) * us / 1e3, 3),
                     "bus_GBps": round(2 * (world - 1) / world * nbytes / (us * 1e-6) / 1e9, 1)})
    return rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, TP 2 only")
    p.add_argument("--skip-allreduce", action="store_true")
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    gpus = 0 if a.smoke else torch.cuda.device_count()
    if not a.smoke and gpus < 2:
        print("needs 2 or more GPUs (or --smoke)", file=sys.stderr)
        return 2
    n = 2 if a.smoke else min(gpus, 4)
    configs = [(tp, ep) for tp in (2, 4) if tp <= n for ep in (False, True)]
    if a.smoke:
        configs = [(2, False)]
    result = {"date": datetime.date.today().isoformat(), "commit": _commit(),
              "device": "cpu (gloo)" if a.smoke else f"{gpus} x {torch.cuda.get_device_name(0)}",
              "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
              "parity": parity("cpu" if a.smoke else "cuda", configs)}
    print("| run | startup s | generate s | tokens equal TP 1 | first difference | max logprob diff |")
    print("|---|---|---|---|---|---|")
    for r in result["parity"]:
        name = f"{'EP' if r['ep'] else 'TP'} {r['tp']}"
        print(f"| {name} | {r['startup_s']} | {r['generate_s']} | {r.get('equal', '-')} | "
              f"{r.get('first_difference', '-')} | {r.get('max_logprob_diff', '-')} |")
    if not a.smoke and not a.skip_allreduce:
        result["allreduce"] = [row for w in (2, 4) if w <= gpus for row in allreduce_cost(w, a.hidden, a.iters)]
        print("\n| GPUs | tokens | us / all-reduce | in a graph | us / layer (2) | ms / 60-layer step | bus GB/s |")
        print("|---|---|---|---|---|---|---|")
        for r in result["allreduce"]:
            print(f"| {r['gpus']} | {r['tokens']} | {r['us_per_allreduce']} | "
                  f"{r['us_per_allreduce_graph'] or r['graph_error']} | {r['us_per_layer']} | "
                  f"{r['ms_per_60_layer_step']} | {r['bus_GBps']} |")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
