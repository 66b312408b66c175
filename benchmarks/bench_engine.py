#!/usr/bin/env python3
"""End-to-end decode and prefill of the engine on the M3.1-Flash geometry cut to a few layers (one H200 cannot hold
all 60), random weights in the real formats (NVFP4 routed experts, MXFP8 shared expert, bf16 attention / lm_head),
NVFP4 KV and index keys, through `LLMEngine.step()` (CUDA graphs for decode unless --enforce-eager).

  python benchmarks/bench_engine.py --out OUT_DIR                  # the H200 (docs/performance.md)
  python benchmarks/bench_engine.py --smoke --out /tmp/e           # CPU, toy sizes (CI runs this)

Measured, in one run:
  copy       device-to-device copy bandwidth (read + write), the ceiling every roofline uses
  ttft       time to the first token of one prompt of 1K / 8K / 32K tokens (chunked prefill)
  decode     step time and tokens/s per user at batch 1, 4, 16, 64 x context 1K, 32K, 128K: the sequences' cache is
             filled with random bytes up front (the decode reads real-sized pages; prefilling 64 x 128K tokens
             for real would take minutes), the byte roofline of the step from the geometry (weights read once,
             the routed experts actually touched, the cache the step must read) over the copy bandwidth, and the
             ratio measured / roofline
  scaling    the same decode step on 2 and 3 layers, to split a step into head, dense layer and MoE layer, and
             the figure scaled to 60 layers (3 dense + 57 MoE, as M3)
  profile    the largest GPU kernels of a few decode steps (torch.profiler)
Writes OUT_DIR/bench_engine.json and OUT_DIR/bench_engine.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceilings import copy_bandwidth  # noqa: E402
from geometry import SMOKE, flash_geometry, make_engine, random_model, step_bytes, weight_bytes  # noqa: E402

from m3serve.config import EngineConfig  # noqa: E402
from m3serve.engine.sampling_params import SamplingParams  # noqa: E402
from m3serve.engine.sequence import SequenceStatus  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def randomize_cache(engine, seed=0) -> None:
    """Random bytes in every page (NVFP4 codes, positive block scales): what a synthetic context reads."""
    g = torch.Generator(device=engine.executor.worker.device).manual_seed(seed)
    for layer in engine.executor.worker.cache.layers:
        for t in layer.tensors():
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device, generator=g))
            else:
                t.copy_((torch.rand(t.shape, device=t.device, generator=g) + 0.25).to(t.dtype))


def start_synthetic(engine, batch: int, context: int, max_tokens: int, g: torch.Generator) -> list[str]:
    """`batch` sequences whose first `context - 1` tokens count as already in the cache (pages allocated, their
    bytes whatever the pool holds): the next steps are decodes at `context` tokens."""
    vocab = engine.model_config.vocab_size
    rids = []
    sch = engine.scheduler
    for i in range(batch):
        rid = f"syn-{context}-{batch}-{i}"
        seq = engine.add_request(rid, prompt_token_ids=torch.randint(0, vocab, (context,), generator=g).tolist(),
                                 sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))
        engine.block_manager.allocate(seq)
        sch.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = context - 1
        sch.running.append(seq)
        rids.append(rid)
    return rids


def stop_synthetic(engine, rids: list[str]) -> None:
    """Abort the synthetic sequences and drain the step queued ahead for them (async scheduling)."""
    for rid in rids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def decode_tokens(steps: int, warmup: int = 3, runs: int = 3) -> int:
    """Tokens each sequence of `time_decode` asks for (its timed runs, the warm-up and a margin): the room above
    the context that `max_model_len` must leave."""
    return runs * steps + warmup + 4


def time_decode(engine, device, batch, context, steps, warmup=3, runs=3) -> tuple[float, float]:
    """Seconds per engine step as served: `steps` consecutive `step()` calls timed together, no synchronisation in
    between (with async scheduling the next step is queued while this one runs, and the host's work overlaps the
    device's; each call still waits for its step's tokens), the median of `runs` such runs; and the share of that
    run the host spent waiting for sampled tokens (near 0: the host's per-step work, not the GPU, sets the pace)."""
    g = torch.Generator().manual_seed(context + batch)
    rids = start_synthetic(engine, batch, context, decode_tokens(steps, warmup, runs), g)
    times = []
    try:
        for _ in range(warmup):
            assert len(engine.step()) == batch
        for _ in range(runs):
            t0, w0 = time.perf_counter(), engine.device_wait_s
            for _ in range(steps):
                outs = engine.step()
                assert len(outs) == batch, (len(outs), batch)
            wall = time.perf_counter() - t0
            times.append((wall / steps, (engine.device_wait_s - w0) / wall))
    finally:
        stop_synthetic(engine, rids)
        sync(device)
    return sorted(times)[len(times) // 2]


def experts_touched(engine, batch, context) -> list[float]:
    """Distinct routed experts per MoE layer in one decode step (eager; the router's choice recomputed from each MoE
    layer's input, which a fused kernel method routes without calling the router module)."""
    seen: dict[int, set] = {}
    model = engine.executor.worker.model
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.register_forward_pre_hook(
                lambda mod, inp, i=i: seen.setdefault(i, set()).update(mod.gate(inp[0])[1].flatten().tolist())))
    try:
        one_eager_step(engine, batch, context)
    finally:
        for h in hooks:
            h.remove()
    return [float(len(seen[i])) for i in sorted(seen)]


def one_eager_step(engine, batch, context) -> None:
    """Exactly one decode step of `batch` sequences at `context` tokens, eager (the model's Python runs: hooks and
    recorders see it), no step queued ahead."""
    runner, cfg = engine.executor.worker.runner, engine.config
    graphs, runner.graphs = runner.graphs, None
    queue, cfg.async_scheduling = cfg.async_scheduling, False
    try:
        time_decode(engine, engine.executor.worker.device, batch, context, steps=1, warmup=0, runs=1)
    finally:
        runner.graphs, cfg.async_scheduling = graphs, queue


def time_ttft(engine, device, prompt_len, g) -> float:
    vocab = engine.model_config.vocab_size
    sync(device)
    t0 = time.perf_counter()
    engine.add_request(f"ttft-{prompt_len}", prompt_token_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while True:
        outs = engine.step()
        if any(o.new_token_ids for o in outs):
            break
    sync(device)
    return time.perf_counter() - t0


def kernel_rows(prof, device) -> tuple[list, str, float]:
    """The profiled kernels, largest first, the time attribute read ("self_device_time_total"; on the CPU the ops'
    own "self_cpu_time_total") and their total in us. On CUDA the kernels alone: an operator (aten::mm) carries its
    kernels' device time too, so counting both counted the time of every torch op twice (2026-12-07: 731 ms "of
    kernels" in a 644 ms prefill)."""
    from torch.autograd import DeviceType
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = [e for e in prof.key_averages()
            if getattr(e, key, 0) > 0 and (device.type != "cuda" or e.device_type != DeviceType.CPU)]
    rows.sort(key=lambda e: -getattr(e, key))
    return rows, key, sum(getattr(e, key) for e in rows)


def profile_decode(engine, device, batch, context, top=12, prompt: int = 0, steps: int = 5) -> dict:
    """``steps`` engine steps of ``batch`` sequences decoding at ``context`` tokens under torch.profiler: the wall
    time per step against the kernel time per step (a step whose kernels take much less than its wall waits on the
    host), and its largest kernels. ``prompt`` > 0: a prompt of that many tokens is admitted first (one step
    outside the window), so the profiled steps are mixed ones (decodes beside a chunk of it, eager)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(1)
    rids = start_synthetic(engine, batch, context, steps + 12, g)
    try:
        for _ in range(3):
            engine.step()
        if prompt:
            rids.append("profile-prompt")
            engine.add_request(rids[-1], prompt_token_ids=torch.randint(
                0, engine.model_config.vocab_size, (prompt,), generator=g).tolist(),
                sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            engine.step()
        sync(device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        mixed0 = engine.scheduler.num_mixed_steps
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(device)
            wall = time.perf_counter() - t0
        mixed = engine.scheduler.num_mixed_steps - mixed0
    finally:
        stop_synthetic(engine, rids)
    rows, key, total = kernel_rows(prof, device)
    if not rows:  # seen once on the H200 (2026-12-03, a profile of the fourth engine built in the process)
        print(f"profile b={batch} ctx={context}: the profiler recorded no {key}", flush=True)
    total = total or 1.0
    return {"steps": steps, "mixed_steps": mixed,  # steps scheduled in the window with decodes and prompt tokens
            "wall_us_per_step": 1e6 * wall / steps, "kernel_us_per_step": total / steps,  # under the profiler
            "kernels": [{"name": e.key[:90], "us_per_step": getattr(e, key) / steps, "share": getattr(e, key) / total}
                        for e in rows[:top]],
            **host_rows(prof, steps, top)}


# CUDA runtime / driver calls that say where a step's host time goes: launches (eager work), graph replays, and
# the calls that wait for the device
RUNTIME_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
                 "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def host_rows(prof, steps: int, top: int) -> dict:
    """The host's side of a profile: the operators and runtime calls with the most CPU time of their own, per step
    ("host_ops"), and per step the count and CPU time of each of `RUNTIME_CALLS` seen ("runtime")."""
    from torch.autograd import DeviceType
    cpu = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0]
    cpu.sort(key=lambda e: -e.self_cpu_time_total)
    return {"host_ops": [{"name": e.key[:90], "us_per_step": e.self_cpu_time_total / steps,
                          "calls_per_step": e.count / steps} for e in cpu[:top]],
            "runtime": {e.key: {"calls_per_step": e.count / steps, "us_per_step": e.self_cpu_time_total / steps}
                        for e in cpu if e.key in RUNTIME_CALLS}}


def build(num_layers, dense_layers, device, args, max_context, room: int = 64):
    """The geometry's engine; `max_model_len` leaves `room` tokens above `max_context` for what its callers'
    sequences generate there (`decode_tokens` for `time_decode`'s rows)."""
    cfg = flash_geometry(num_layers, dense_layers, **args.geometry_over)
    model = random_model(cfg, device)
    max_batch = max(args.batches)
    max_len = max_context + room
    pages = max_batch * (-(-max_len // cfg.index_block_size)) + 16
    engine = make_engine(model, device=str(device), dtype="bfloat16", max_model_len=max_len,
                         max_num_seqs=max_batch, num_gpu_blocks_override=pages, enforce_eager=args.enforce_eager,
                         async_scheduling=not args.no_async_scheduling,
                         max_num_batched_tokens=args.chunk,
                         piecewise_graph_tokens=getattr(args, "piecewise", EngineConfig.piecewise_graph_tokens))
    randomize_cache(engine)
    return cfg, model, engine


def save(res: dict, out: str) -> None:
    """The results so far (a run cut short by its time limit keeps what it measured)."""
    with open(os.path.join(out, "bench_engine.json"), "w") as f:
        json.dump(res, f, indent=1)


def release() -> None:
    """Give the device memory of dropped engines back (their graphs' pools, caches, weights)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="1024,4096,32768,131072")
    p.add_argument("--ttft", default="1024,8192,32768")
    p.add_argument("--steps", type=int, default=None, help="decode steps per timed run (3 runs; 20, --smoke 2)")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    p.add_argument("--scaling-context", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true", help="one step at a time (no step queued ahead)")
    p.add_argument("--smoke", action="store_true", help="CPU, toy geometry (hidden 256, 8 experts, vocab 4K)")
    a = p.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.ttft = [int(x) for x in a.ttft.split(",")]
    a.geometry_over = {}
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if a.smoke:
        a.geometry_over = SMOKE
        a.batches, a.contexts, a.ttft, a.chunk, a.scaling_context = [1, 2], [48], [48], 64, 40
    a.steps = a.steps or (2 if a.smoke else 20)
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "layers": a.layers, "cuda_graphs": device.type == "cuda" and not a.enforce_eager,
           "async_scheduling": not a.no_async_scheduling}
    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    res["copy_bytes_per_s"] = bw
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    max_context = max(a.contexts + a.ttft + [a.scaling_context])
    room = max(64, decode_tokens(a.steps))  # a decode row at the largest context fits

    cfg, model, engine = build(a.layers, 1, device, a, max_context, room)
    wb = weight_bytes(model)
    g = torch.Generator().manual_seed(0)
    res["ttft"] = []
    for n in a.ttft:  # warm-up: compiles the prefill kernels of every chunk size
        time_ttft(engine, device, n, g)
    for n in a.ttft:
        t = time_ttft(engine, device, n, g)
        res["ttft"].append({"prompt_tokens": n, "ttft_s": t})
        print(f"TTFT {n:6d} tokens: {t * 1e3:8.1f} ms", flush=True)
        save(res, a.out)
    res["decode"] = []
    for ctx in a.contexts:
        for batch in a.batches:
            touched = experts_touched(engine, batch, ctx)
            t, wait = time_decode(engine, device, batch, ctx, a.steps)
            floor = step_bytes(wb, cfg, batch, ctx, touched)
            row = {"batch": batch, "context": ctx, "step_s": t, "tokens_per_s_per_user": 1 / t,
                   "experts_touched": touched, "roofline_bytes": floor, "roofline_s": floor / bw,
                   "share_of_roofline": floor / bw / t, "host_wait_share": wait}
            res["decode"].append(row)
            print(f"decode b={batch:3d} ctx={ctx:7d}: {t * 1e3:8.3f} ms  {1 / t:7.1f} tok/s/user  experts "
                  f"{sum(touched) / len(touched):5.1f}/layer  roofline {floor / bw * 1e3:7.3f} ms  "
                  f"{100 * floor / bw / t:5.1f}%  host waits {100 * wait:4.1f}%", flush=True)
            save(res, a.out)
    res["profile"] = {f"b{b}_ctx{c}": profile_decode(engine, device, b, c)
                      for b, c in ((1, a.scaling_context), (max(a.batches), a.scaling_context),
                                   (max(a.batches), max(a.contexts)))}
    save(res, a.out)
    del engine, model
    release()

    # scaling: the same step on [dense, moe] and [dense, dense, moe] splits head / dense layer / MoE layer
    scale = {}
    for name, (n, dense) in {"D+M": (2, 1), "D+D+M": (3, 2)}.items():
        eng_s = build(n, dense, device, a, a.scaling_context, room)[2]
        scale[name] = {b: time_decode(eng_s, device, b, a.scaling_context, a.steps) for b in (1, max(a.batches))}
        del eng_s
        release()
    eng4 = build(a.layers, 1, device, a, a.scaling_context, room)[2]  # the full model at the scaling context
    scale[f"D+{a.layers - 1}M"] = {b: time_decode(eng4, device, b, a.scaling_context, a.steps)
                                   for b in (1, max(a.batches))}
    del eng4
    release()
    res["scaling"] = []
    for b in (1, max(a.batches)):
        t = {name: v[b][0] for name, v in scale.items()}
        moe = (t[f"D+{a.layers - 1}M"] - t["D+M"]) / (a.layers - 2)
        dense = t["D+D+M"] - t["D+M"]
        head = t["D+M"] - moe - dense
        est60 = head + 3 * dense + 57 * moe
        waits = {name: v[b][1] for name, v in scale.items()}
        res["scaling"].append({"batch": b, "context": a.scaling_context, "moe_layer_s": moe, "dense_layer_s": dense,
                               "head_s": head, "estimated_60_layer_step_s": est60,
                               "estimated_60_layer_tokens_per_s_per_user": 1 / est60, "host_wait_shares": waits})
        bound = [name for name, w in waits.items() if w < 0.05]  # the host, not the GPU, set these steps' pace
        print(f"scaling b={b}: MoE layer {moe * 1e3:.3f} ms, dense layer {dense * 1e3:.3f} ms, head {head * 1e3:.3f} "
              f"ms -> 60 layers {est60 * 1e3:.2f} ms/step, {1 / est60:.1f} tok/s/user"
              + (f" (host-bound: {', '.join(bound)}; the split is not the GPU's)" if bound else ""), flush=True)
    save(res, a.out)
    with open(os.path.join(a.out, "bench_engine.md"), "w") as f:
        f.write(table(res))
    print(table(res))
    return 0


def table(res) -> str:
    lines = [f"copy {res['copy_bytes_per_s'] / 1e12:.3f} TB/s, {res['layers']} layers, CUDA graphs {res['cuda_graphs']}",
             "", "| prompt | TTFT ms |", "|---|---|"]
    lines += [f"| {r['prompt_tokens']} | {r['ttft_s'] * 1e3:.1f} |" for r in res["ttft"]]
    lines += ["", "| batch | context | step ms | tok/s/user | experts/layer | roofline ms | share | host waits |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        e = sum(r["experts_touched"]) / max(1, len(r["experts_touched"]))
        lines.append(f"| {r['batch']} | {r['context']} | {r['step_s'] * 1e3:.3f} | {r['tokens_per_s_per_user']:.1f} | "
                     f"{e:.1f} | {r['roofline_s'] * 1e3:.3f} | {100 * r['share_of_roofline']:.1f}% | "
                     f"{100 * r['host_wait_share']:.0f}% |")
    lines += ["", "| batch | MoE layer ms | dense layer ms | head ms | 60 layers ms/step | tok/s/user |",
              "|---|---|---|---|---|---|"]
    for r in res.get("scaling", []):
        lines.append(f"| {r['batch']} | {r['moe_layer_s'] * 1e3:.3f} | {r['dense_layer_s'] * 1e3:.3f} | "
                     f"{r['head_s'] * 1e3:.3f} | {r['estimated_60_layer_step_s'] * 1e3:.2f} | "
                     f"{r['estimated_60_layer_tokens_per_s_per_user']:.1f} |")
    for name, p in res.get("profile", {}).items():
        lines += ["", f"profile {name}: {p['kernel_us_per_step']:.1f} us of kernels per step, "
                      f"{p['wall_us_per_step']:.1f} us wall per step (profiled)"]
        lines += [f"  {100 * r['share']:5.1f}%  {r['us_per_step']:9.1f} us/step  {r['name']}" for r in p["kernels"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
