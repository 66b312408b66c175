#!/usr/bin/env python3
"""Inter-token latency (ITL) of decoding streams while a long prompt is prefilled in chunks beside them, on the
M3.1-Flash geometry cut to a few layers (bench_engine's `build`: random weights in the real formats, NVFP4 KV and
index keys, CUDA graphs for decode steps, async scheduling).

  python benchmarks/bench_itl.py --out OUT_DIR                      # the H200
  python benchmarks/bench_itl.py --smoke --out /tmp/itl             # CPU, toy sizes (CI runs this)

Measured, in one run, through `LLMEngine.step()`; a token's arrival time is when the step that sampled it returns:
  idle      --streams sequences decode at --context tokens (their cache filled with random bytes up front), nothing
            else runs: ITL p50 / p99 over every stream's gaps between consecutive tokens
  chunks    the same streams, then one prompt of --long tokens is admitted; each step until its first token carries
            the 64 decodes and one chunk of the prompt (the scheduler gives decodes the token budget first: a chunk is
            max_num_batched_tokens - streams tokens). Per chunk size in --chunks (max_num_batched_tokens): ITL p50 /
            p99 / max of the streams' gaps that end in that window, p99 over idle p99, the prompt's TTFT (from its
            admission to the step that returns its first token), the steps that carried a chunk (the scheduler's
            mixed-step count) and, beside it, the TTFT of the same prompt with no streams decoding
  capped    the same at the largest chunk, with the scheduler's `max_prefill_tokens_with_decodes` set to each of
            --caps: a step that decodes takes at most that many prompt tokens, one with nothing decoding the whole
            chunk (so the prompt alone keeps the largest chunk's TTFT)
The trade-off: a bigger chunk means fewer, longer steps in the window: the prompt's TTFT falls and every decoding
stream waits longer for each token. One engine serves every row (built with the largest chunk, so its warm-up
compiles every token count up to it); each row sets the scheduler's token budget and runs its scenario once untimed
first (no kernel compiles in the timed window: the count seen there is reported).
Writes OUT_DIR/bench_itl.json and OUT_DIR/bench_itl.md.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import geometry  # noqa: E402
from bench_engine import (build, profile_decode, release, start_synthetic, stop_synthetic, sync,  # noqa: E402
                          time_ttft)

from m3serve.config import EngineConfig  # noqa: E402
from m3serve.engine.sampling_params import SamplingParams  # noqa: E402
from m3serve.kernels.dispatch import Tuning, tuned, tuning  # noqa: E402

LONG_ID = "itl-long"
WARM_STEPS = 3  # decode steps after the streams start, before anything is recorded (graph replays settle)
BEFORE_STEPS = 8  # recorded decode steps before the long prompt is admitted (each stream's last token before it)


def prompt_per_step(chunk: int, streams: int, cap: int = 0) -> int:
    """Prompt tokens of a step beside the streams' decodes, which take one token each of the budget first."""
    return min(chunk - streams, cap) if cap else chunk - streams


def window_steps(long: int, per_step: int) -> int:
    """Steps whose budget carries a piece of the prompt."""
    return -(-long // per_step)


def itl_stats(gaps: list[float]) -> dict:
    a = np.asarray(gaps, dtype=np.float64) * 1e3
    return {"itl_count": len(gaps), "itl_p50_ms": float(np.percentile(a, 50)),
            "itl_p99_ms": float(np.percentile(a, 99)), "itl_max_ms": float(a.max())}


def run_streams(engine, device, streams: int, context: int, steps: int, long: int, per_step: int, seed: int) -> dict:
    """`streams` sequences decode at `context` tokens: `steps` recorded steps, then (long > 0) a prompt of `long`
    tokens is admitted and the steps run until its first token. Returns the streams' ITL over the gaps that end
    after the admission (all recorded gaps without one), the prompt's TTFT, and the engine's counters over it."""
    g = torch.Generator().manual_seed(seed)
    budget = steps + (window_steps(long, per_step) + 8 if long else 0)
    rids = start_synthetic(engine, streams, context, WARM_STEPS + budget + 4, g)
    arrivals: dict[str, list[float]] = {rid: [] for rid in rids}
    sch = engine.scheduler
    t_admit = t_first = None
    counts = {}
    try:
        for _ in range(WARM_STEPS):
            engine.step()
        sync(device)

        def record(outs) -> bool:
            t = time.perf_counter()
            for o in outs:
                if o.request_id in arrivals:
                    arrivals[o.request_id] += [t] * len(o.new_token_ids)
            return any(o.request_id == LONG_ID and o.new_token_ids for o in outs)

        for _ in range(steps):
            record(engine.step())
        mixed0, chunked0, ahead0 = sch.num_mixed_steps, sch.num_chunked_prefills, engine.num_steps_ahead
        if long:
            vocab = engine.model_config.vocab_size
            t_admit = time.perf_counter()
            engine.add_request(LONG_ID, prompt_token_ids=torch.randint(0, vocab, (long,), generator=g).tolist(),
                               sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            for _ in range(budget - steps):
                if record(engine.step()):
                    t_first = time.perf_counter()
                    counts = dict(mixed_steps=sch.num_mixed_steps - mixed0,
                                  chunked_prefills=sch.num_chunked_prefills - chunked0,
                                  steps_ahead=engine.num_steps_ahead - ahead0)  # async scheduling
                    break
            else:
                raise RuntimeError(f"the {long}-token prompt got no token in {budget - steps} steps "
                                   f"({per_step} prompt tokens a step)")
    finally:
        stop_synthetic(engine, rids)
        sync(device)
    start = t_admit if long else float("-inf")
    gaps = [b - a for ts in arrivals.values() for a, b in zip(ts, ts[1:]) if b > start]
    row = itl_stats(gaps)
    if long:
        row.update(ttft_s=t_first - t_admit, **counts,
                   compiles=sum(1 for t, _, _ in geometry.COMPILES if t_admit <= t <= t_first))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--streams", type=int, default=64, help="decoding sequences")
    p.add_argument("--context", type=int, default=4096, help="the streams' context (tokens) when they start")
    p.add_argument("--long", type=int, default=32768, help="the admitted prompt's tokens")
    p.add_argument("--chunks", default="192,320,512,2048,8192",
                   help="max_num_batched_tokens per row (the 64 streams take 64 of each; 2026-12-07 on the H100: "
                        "512 kept ITL p99 at 3.5x idle)")
    p.add_argument("--caps", default="64,128,256",
                   help="max_prefill_tokens_with_decodes per capped row, at the largest chunk ('' for none)")
    p.add_argument("--idle-steps", type=int, default=256, help="recorded decode steps with nothing admitted")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true", help="one step at a time (no step queued ahead)")
    p.add_argument("--piecewise", type=int, default=EngineConfig.piecewise_graph_tokens,
                   help="piecewise_graph_tokens: prefill / mixed steps of up to N tokens replay piecewise CUDA graphs "
                        "(0: eagerly)")
    p.add_argument("--profile", action="store_true",
                   help="then torch.profiler over idle decode steps and mixed steps at each cap: wall vs kernel time "
                        "per step, the largest kernels, the host's operators and runtime calls")
    p.add_argument("--tuned", action="append", default=[], metavar="KEY=VALUE",
                   help="a `dispatch.Tuning` field for the whole run, graphs included (e.g. fused_norm=True); "
                        "repeatable")
    p.add_argument("--smoke", action="store_true", help="CPU, toy geometry (hidden 256, 8 experts, vocab 4K)")
    a = p.parse_args(argv)
    try:
        a.tuned = tuning_changes(a.tuned)
    except ValueError as e:
        p.error(f"--tuned: {e}")
    a.chunks = sorted(int(x) for x in a.chunks.split(","))
    a.caps = sorted(int(x) for x in a.caps.split(",") if x.strip())
    if a.smoke:
        a.streams, a.context, a.long, a.chunks, a.caps, a.idle_steps = 4, 40, 300, [36, 132], [16], 6
    if a.chunks[0] <= a.streams:
        p.error(f"--chunks: {a.chunks[0]} leaves no budget for the prompt beside {a.streams} decodes")
    if a.caps and a.caps[0] < 1:
        p.error(f"--caps: each must be >= 1, got {a.caps[0]}")
    with tuned(**a.tuned):
        return measure(a)


def tuning_changes(items: list[str]) -> dict:
    """``KEY=VALUE`` strings -> `dispatch.tuned` keyword arguments (values as Python literals)."""
    fields = {f.name for f in dataclasses.fields(Tuning)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"{item!r}: expected KEY=VALUE with KEY one of Tuning's fields")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{item!r}: the value is not a Python literal") from None
    return out


def measure(a) -> int:
    """The run `main` parsed: idle ITL, then each chunk / cap row, the profiles, the JSON and the table."""
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if device.type == "cuda":
        geometry.log_compiles()
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "commit": os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                                                capture_output=True, cwd=HERE).stdout.strip(),
           "layers": a.layers, "streams": a.streams, "context": a.context, "long_prompt": a.long,
           "cuda_graphs": device.type == "cuda" and not a.enforce_eager, "async_scheduling": not a.no_async_scheduling,
           "piecewise_graph_tokens": a.piecewise,
           "tuned": {k: repr(getattr(tuning(), k)) for k in a.tuned}}  # as in effect
    # the streams' room: every recorded step of the longest row, its untimed run, and slack
    smallest = min([prompt_per_step(a.chunks[0], a.streams)] + [prompt_per_step(a.chunks[-1], a.streams, c)
                                                                for c in a.caps])
    longest = max(a.idle_steps, BEFORE_STEPS + window_steps(a.long, smallest) + 8) + WARM_STEPS + 8
    ns = SimpleNamespace(geometry_over=geometry.SMOKE if a.smoke else {}, batches=[a.streams + 1],
                         enforce_eager=a.enforce_eager, no_async_scheduling=a.no_async_scheduling, chunk=a.chunks[-1],
                         piecewise=a.piecewise)
    _, model, engine = build(a.layers, 1, device, ns, max(a.context + longest, a.long + 1))
    run_streams(engine, device, a.streams, a.context, max(2, a.idle_steps // 4), 0, 1, 1)  # warm-up
    res["idle"] = run_streams(engine, device, a.streams, a.context, a.idle_steps, 0, 1, 2)
    print(f"idle: {a.streams} streams at {a.context} tokens: ITL p50 {res['idle']['itl_p50_ms']:.2f} ms, "
          f"p99 {res['idle']['itl_p99_ms']:.2f} ms", flush=True)
    res["chunks"], res["caps"] = [], []
    g = torch.Generator().manual_seed(3)
    sch = engine.scheduler
    for key, chunk, cap in [("chunks", c, 0) for c in a.chunks] + [("caps", a.chunks[-1], c) for c in a.caps]:
        sch.max_num_batched_tokens, sch.max_prefill_tokens_with_decodes = chunk, cap
        per_step = prompt_per_step(chunk, a.streams, cap)
        run_streams(engine, device, a.streams, a.context, BEFORE_STEPS, a.long, per_step, 4)  # untimed: compiles
        row = dict(chunk=chunk, cap=cap, prompt_chunk=per_step,
                   **run_streams(engine, device, a.streams, a.context, BEFORE_STEPS, a.long, per_step, 5))
        time_ttft(engine, device, a.long, g)  # untimed: the prompt's steps without decodes
        row["ttft_alone_s"] = time_ttft(engine, device, a.long, g)
        row["p99_over_idle"] = row["itl_p99_ms"] / res["idle"]["itl_p99_ms"]
        row["within_2x_idle"] = row["p99_over_idle"] <= 2.0
        res[key].append(row)
        print(f"chunk {chunk}{f', beside decodes {cap}' if cap else ''}: ITL p50 {row['itl_p50_ms']:.2f} ms p99 "
              f"{row['itl_p99_ms']:.2f} ms ({row['p99_over_idle']:.2f}x idle), TTFT {row['ttft_s'] * 1e3:.1f} ms "
              f"(alone {row['ttft_alone_s'] * 1e3:.1f} ms), {row['mixed_steps']} mixed steps "
              f"({row['steps_ahead']} steps queued ahead), {row['compiles']} compiles", flush=True)
        save(res, a.out)
    if a.profile:
        res["profiles"] = profiles(engine, device, a)
        save(res, a.out)
    sch.max_prefill_tokens_with_decodes = 0
    res["trade_off"] = trade_off(res)
    save(res, a.out)
    with open(os.path.join(a.out, "bench_itl.md"), "w") as f:
        f.write(table(res))
    print(table(res))
    del engine, model
    release()
    return 0


def profiles(engine, device, a, steps: int = 8) -> list[dict]:
    """torch.profiler over idle decode steps (graphs on CUDA), then over mixed steps at the largest chunk with each
    cap (the first chunk's if no cap): is the step's wall its kernels' time, or does it wait on the host?"""
    sch = engine.scheduler
    out = [dict(kind="idle", prompt_tokens=0, **profile_decode(engine, device, a.streams, a.context, steps=steps))]
    for cap in a.caps or [0]:
        sch.max_num_batched_tokens, sch.max_prefill_tokens_with_decodes = (a.chunks[-1], cap) if cap else (
            a.chunks[0], 0)
        per = prompt_per_step(sch.max_num_batched_tokens, a.streams, cap)
        out.append(dict(kind="mixed", prompt_tokens=per, **profile_decode(engine, device, a.streams, a.context,
                                                                            prompt=a.long, steps=steps)))
    for p in out:
        print(f"profile, {p['kind']} steps ({p['prompt_tokens']} prompt tokens): wall {p['wall_us_per_step']:.0f} "
              f"us/step, kernels {p['kernel_us_per_step']:.0f} us/step; largest: "
              + ", ".join(f"{k['name'][:40]} {k['us_per_step']:.0f}" for k in p["kernels"][:4]), flush=True)
        print("  host, us/step (calls): "
              + ", ".join(f"{k['name'][:40]} {k['us_per_step']:.0f} ({k['calls_per_step']:.0f})"
                          for k in p["host_ops"][:6])
              + "; runtime: " + (", ".join(f"{n} {r['calls_per_step']:.0f} x, {r['us_per_step']:.0f} us"
                                           for n, r in p["runtime"].items()) or "none recorded"), flush=True)
    return out


def save(res: dict, out: str) -> None:
    """The results so far (a run cut short by its time limit keeps what it measured)."""
    with open(os.path.join(out, "bench_itl.json"), "w") as f:
        json.dump(res, f, indent=1)


def trade_off(res) -> str:
    """The chunk size trade-off, from this run's smallest and largest chunk."""
    rows = res["chunks"]
    lo, hi = rows[0], rows[-1]
    fits = [r["chunk"] for r in rows if r["within_2x_idle"]]
    capped = [f"{r['cap']}" for r in res.get("caps", []) if r["within_2x_idle"]]
    return (f"bigger chunks: fewer, longer steps while the prompt is prefilled. From chunk {lo['chunk']} to "
            f"{hi['chunk']} the {res['long_prompt']}-token prompt's TTFT went {lo['ttft_s'] * 1e3:.0f} -> "
            f"{hi['ttft_s'] * 1e3:.0f} ms and the decoding streams' ITL p99 {lo['itl_p99_ms']:.1f} -> "
            f"{hi['itl_p99_ms']:.1f} ms (idle {res['idle']['itl_p99_ms']:.1f} ms). ITL p99 within 2x of idle at "
            + (f"chunk {', '.join(map(str, fits))}" if fits else "no chunk measured")
            + (f"; with the prompt capped beside decodes at {', '.join(capped)} tokens a step" if capped else "")
            + ".")


def table(res) -> str:
    i = res["idle"]
    lines = [f"{res['device']}, {res['date']}, {res['layers']} layers, {res['streams']} streams decoding at "
             f"{res['context']} tokens, a {res['long_prompt']}-token prompt admitted, CUDA graphs "
             f"{res['cuda_graphs']}, async scheduling {res['async_scheduling']}", "",
             "| chunk (max_num_batched_tokens) | prompt tokens/step beside decodes | ITL p50 ms | ITL p99 ms | "
             "ITL max ms | p99 / idle | TTFT ms | TTFT alone ms | mixed steps | steps queued ahead | compiles |",
             "|---|---|---|---|---|---|---|---|---|---|---|",
             f"| idle (no prompt) | - | {i['itl_p50_ms']:.2f} | {i['itl_p99_ms']:.2f} | {i['itl_max_ms']:.2f} | 1.00 | "
             "- | - | - | - | - |"]
    for r in res["chunks"] + res.get("caps", []):
        capped = " (capped)" if r.get("cap") else ""
        lines.append(f"| {r['chunk']} | {r['prompt_chunk']}{capped} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | "
                     f"{r['itl_max_ms']:.2f} | {r['p99_over_idle']:.2f} | {r['ttft_s'] * 1e3:.1f} | "
                     f"{r['ttft_alone_s'] * 1e3:.1f} | {r['mixed_steps']} | {r['steps_ahead']} | {r['compiles']} |")
    if "trade_off" in res:
        lines += ["", res["trade_off"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
