#!/usr/bin/env python3
"""Soak test of the real tritonserver: N concurrent streams for D seconds, mixed prompt lengths, random cancellation.

  python benchmarks/soak_server.py --geometry 4 --streams 64 --duration 300 --out OUT     # H200: M3.1-Flash geometry
  python benchmarks/soak_server.py --device cpu --streams 4 --duration 15 --out /tmp/soak  # the tiny model (CPU)

Serves `m3_ids` (token ids in and out) through `./build.sh serve`: with --geometry N the M3.1-Flash geometry cut to N
layers with random weights (benchmarks/geometry.py, built in the server by $M3SERVE_TEST_ENGINE_FACTORY), else the
tiny model. Each stream sends requests back to back until the time is up: a prompt of log-uniform random length in
--prompt-lens, a random output length in --max-tokens (ignore_eos), and with probability --cancel a cancellation (the
gRPC stream cancelled at a random moment: before the first token, or after a random number of tokens).
Fails (exit 1) on any error other than a cancellation, on a page not given back (the server's
m3serve:kv_cache_free_pages below its total once idle), on a request still running, and on a Triton kernel compiled
after the model reported ready (the engine's compile log, geometry.log_compiles: GPU geometry runs only).
Reports TTFT and inter-token latency p50 / p99 as a table (soak_server.md) and JSON (soak_server.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import sys
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients"))

MODEL = "m3_ids"


def write_repo(a, model_dir: str, repo: str) -> str:
    """m3_ids over the model (or the geometry factory); returns $M3SERVE_TEST_ENGINE_FACTORY for the server."""
    os.makedirs(os.path.join(repo, MODEL, "1"), exist_ok=True)
    shutil.copy(os.path.join(ROOT, "model_repository", MODEL, "config.pbtxt"), os.path.join(repo, MODEL))
    opts = {"model": model_dir, "device": a.device, "dtype": a.dtype, "max_model_len": a.max_model_len,
            "max_num_seqs": max(a.streams, 8), "max_num_batched_tokens": a.max_num_batched_tokens,
            "num_gpu_blocks_override": a.num_pages, "enable_prefix_caching": True}
    with open(os.path.join(repo, MODEL, "1", "model.json"), "w") as f:
        json.dump(opts, f, indent=2)
    return f"{MODEL}={os.path.join(ROOT, 'benchmarks', 'geometry.py')}:async_engine" if a.geometry else ""


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


async def one_request(client, rng: random.Random, a, rid: str) -> dict:
    """One streamed request, cancelled at a random moment with probability a.cancel."""
    from bench import build_inputs, random_ids

    n_prompt = int(round(math.exp(rng.uniform(math.log(a.prompt_lens[0]), math.log(a.prompt_lens[1])))))
    max_tokens = rng.randint(*a.max_tokens)
    cancel = rng.random() < a.cancel
    cancel_tokens = rng.randint(1, max(1, max_tokens // 2)) if cancel and rng.random() < 0.5 else None
    cancel_delay = rng.uniform(0.0, 0.05) if cancel and cancel_tokens is None else None
    inputs = build_inputs("ids", random_ids(n_prompt, seed=rng.randrange(1 << 30)), max_tokens, True, 0.0)

    async def requests():
        yield {"model_name": MODEL, "inputs": inputs, "request_id": rid, "enable_empty_final_response": True}

    t0 = time.perf_counter()
    stamps, error, cancelled = [], None, False
    it = client.stream_infer(requests(), stream_timeout=a.request_timeout)

    async def read():
        try:
            await read_responses()
        except asyncio.CancelledError:
            if not cancelled:  # grpc reports our own cancellation as CancelledError; anything else propagates
                raise

    async def read_responses():
        nonlocal error
        async for result, err in it:
            if err is not None:
                error = str(err)
                return
            ids = result.as_numpy("output_ids")
            k = int(ids.shape[-1]) if ids is not None else 0
            if k:
                stamps.append((time.perf_counter(), k))
            if cancel_tokens is not None and sum(n for _, n in stamps) >= cancel_tokens:
                return
            p = result.get_response().parameters
            if "triton_final_response" in p and p["triton_final_response"].bool_param:
                return

    reader = asyncio.ensure_future(read())
    if cancel_delay is not None:
        done, _ = await asyncio.wait([reader], timeout=cancel_delay)
        if not done:
            cancelled = True
            it.cancel()
    await reader
    if cancel_tokens is not None and error is None and sum(n for _, n in stamps) < max_tokens:
        cancelled = True
        it.cancel()
    if cancelled and error is not None and "cancel" in error.lower():
        error = None  # the cancellation's own echo
    itl = [(tb - ta) / k for (ta, _), (tb, k) in zip(stamps, stamps[1:]) for _ in range(k)]
    return {"ttft": stamps[0][0] - t0 if stamps else None, "itl": itl, "tokens": sum(n for _, n in stamps),
            "cancelled": cancelled, "error": error, "prompt": n_prompt, "max_tokens": max_tokens}


async def soak(a, url: str) -> list[dict]:
    import tritonclient.grpc.aio as grpcaio

    deadline = time.monotonic() + a.duration
    results: list[dict] = []

    async def stream(s: int):
        rng = random.Random(a.seed * 1000 + s)
        client = grpcaio.InferenceServerClient(url)
        try:
            i = 0
            while time.monotonic() < deadline:
                results.append(await one_request(client, rng, a, f"soak-{s}-{i}"))
                i += 1
        finally:
            await client.close()

    await asyncio.gather(*(stream(s) for s in range(a.streams)))
    return results


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def idle_pages(mport: int, timeout: float = 30.0) -> dict:
    """The server's page and request counters once no request runs (or when `timeout` passes)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://localhost:{mport}/metrics", timeout=10) as f:
            text = f.read().decode()
        got = {k: metric(text, k) for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                            "m3serve:kv_cache_free_pages", "m3serve:kv_cache_total_pages")}
        if (got["vllm:num_requests_running"] == 0 and got["vllm:num_requests_waiting"] == 0
                and got["m3serve:kv_cache_free_pages"] == got["m3serve:kv_cache_total_pages"]) \
                or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def summarize(res: dict) -> str:
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    s = res["summary"]
    rows = ["| streams | seconds | requests | cancelled | errors | output tokens/s | TTFT p50 ms | TTFT p99 ms "
            "| ITL p50 ms | ITL p99 ms | leaked pages | compiles after ready |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {res['args']['streams']} | {s['wall_s']:.0f} | {s['requests']} | {s['cancelled']} | {s['errors']} "
            f"| {s['tokens_per_s']:.0f} | {f(s['ttft_ms_p50'])} | {f(s['ttft_ms_p99'])} | {f(s['itl_ms_p50'])} "
            f"| {f(s['itl_ms_p99'])} | {s['leaked_pages']} | {s['compiles_after_ready']} |"]
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--geometry", type=int, default=0, metavar="LAYERS")
    p.add_argument("--model", default=None, help="a model directory (default: the tiny model, made here)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--cancel", type=float, default=0.25, help="share of requests cancelled at a random moment")
    p.add_argument("--prompt-lens", default="8,2000", help="min,max prompt length (log-uniform)")
    p.add_argument("--max-tokens", default="8,256", help="min,max output tokens (uniform)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.prompt_lens = tuple(int(x) for x in a.prompt_lens.split(","))
    a.max_tokens = tuple(int(x) for x in a.max_tokens.split(","))
    if a.prompt_lens[1] + a.max_tokens[1] > a.max_model_len:
        p.error("--prompt-lens max + --max-tokens max must fit in --max-model-len")
    from bench_server import server_compiles, start_server, stop_server, work_dir, write_report

    work, model_dir = work_dir(a)
    if a.geometry:
        os.environ["M3SERVE_GEOMETRY_LAYERS"] = str(a.geometry)
    repo = os.path.join(work, "repo")
    factories = write_repo(a, model_dir, repo)
    log_path = os.path.join(a.out, "tritonserver.log")
    t0 = time.time()
    proc, url, mport = start_server(repo, log_path, ready_model=MODEL, factories=factories)
    t_ready = time.time()
    res = {"args": vars(a), "server_start_s": t_ready - t0, "model": model_dir}
    try:
        t1 = time.perf_counter()
        results = asyncio.run(soak(a, url))
        wall = time.perf_counter() - t1
        counters = idle_pages(mport)
    finally:
        stop_server(proc)
    late = [(t, dt, name) for t, dt, name in server_compiles(log_path) if t > t_ready]
    errors = [r["error"] for r in results if r["error"]]
    ttft = [1000 * r["ttft"] for r in results if r["ttft"] is not None and not r["cancelled"]]
    itl = [1000 * x for r in results for x in r["itl"]]
    total, free = counters["m3serve:kv_cache_total_pages"], counters["m3serve:kv_cache_free_pages"]
    res["summary"] = {
        "wall_s": wall, "requests": len(results), "cancelled": sum(r["cancelled"] for r in results),
        "errors": len(errors), "error_examples": errors[:5], "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99), "leaked_pages": None if total is None or free is None else int(total - free),
        "running_after": counters["vllm:num_requests_running"], "compiles_after_ready": len(late),
        "compiled_after_ready": sorted({name.split()[0] for _, _, name in late})}
    res["table"] = summarize(res)
    write_report(a.out, "soak_server", res)
    s = res["summary"]
    failures = []
    if s["errors"]:
        failures.append(f"{s['errors']} requests failed, e.g. {s['error_examples']}")
    if s["leaked_pages"] != 0 or s["running_after"] != 0:
        failures.append(f"not idle after the run: {counters}")
    if s["compiles_after_ready"]:
        failures.append(f"{s['compiles_after_ready']} kernels compiled after ready: {s['compiled_after_ready']}")
    if not results or not ttft:
        failures.append("no request completed")
    for line in failures:
        print(f"[soak] FAIL: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
