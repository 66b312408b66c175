#!/usr/bin/env python3
"""The OpenAI gateway's cost: the same tritonserver (`m3`, the text contract) measured by gRPC streaming direct
(clients/bench.py's client) and through `m3serve openai` (streamed POST /v1/completions, SSE), at each concurrency.

  python benchmarks/bench_gateway.py --out OUT_DIR                                    # CPU: the tiny model
  python benchmarks/bench_gateway.py --device cuda --geometry 4 --out OUT_DIR         # H200: M3.1-Flash geometry

C users each send --requests-per-user requests in a row (default 2 on the CPU, 8 on a GPU; greedy, ignore_eos,
--max-tokens tokens, request i of a run the same prompt both ways: with --prompts distinct, the default, the prompt
ends "(request i)", so the streams' tokens differ as real traffic's do); per level, both paths in turn after one
warm-up level each, --repeats times: output tokens/s (all tokens / wall), TTFT p50/p90 (request sent -> first text),
ITL p50/p90 (per request: first text -> last text over tokens - 1, the same definition both ways), the server's
response thread's time in send() per response (its m3serve:response_send_seconds_total over m3serve:responses_total)
on each path, and the gateway/direct ratios and overheads. --geometry N: the M3.1-Flash geometry cut to N layers
with random weights (benchmarks/geometry.py), its vocabulary cut to the tiny tokenizer's 512 ids so that every token
decodes to text for the m3 contract. Writes OUT_DIR/bench_gateway.json and OUT_DIR/bench_gateway.md; the server
(build.sh serve) and the gateway run as child processes, stopped at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROMPT = "Please write a short poem about the sea, the sky, and the stars at night."


def geometry_text_engine(config):
    """The engine factory of --geometry ($M3SERVE_TEST_ENGINE_FACTORY): the M3.1-Flash geometry, random weights, with the tiny model's tokenizer."""
    import torch

    sys.path.insert(0, HERE)
    import geometry as g
    from m3serve.engine.async_engine import AsyncLLMEngine
    from m3serve.text.tokenizer import Tokenizer

    smoke = not torch.cuda.is_available()
    over = dict(g.SMOKE if smoke else {})
    over["vocab_size"] = Tokenizer.from_pretrained(config.model).vocab_size
    model = g.random_model(g.flash_geometry(int(os.environ.get("M3SERVE_GEOMETRY_LAYERS", "4")), **over),
                           "cpu" if smoke else "cuda")
    engine = g.make_engine(model, device="cpu" if smoke else "cuda", dtype="bfloat16", tokenizer=config.model,
                           max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                           num_gpu_blocks_override=config.num_gpu_blocks_override,
                           max_num_batched_tokens=config.max_num_batched_tokens)
    return AsyncLLMEngine(engine.config, engine=engine)


def write_repo(a, model_dir: str, repo: str) -> None:
    os.makedirs(os.path.join(repo, "m3", "1"))
    cfg = open(os.path.join(ROOT, "model_repository", "m3", "config.pbtxt")).read()
    if a.geometry:  # a test hook: from the server's environment only (backend/triton/parameters.py)
        os.environ["M3SERVE_TEST_ENGINE_FACTORY"] = f"m3={os.path.abspath(__file__)}:geometry_text_engine"
    with open(os.path.join(repo, "m3", "config.pbtxt"), "w") as f:
        f.write(cfg)
    opts = {"model": model_dir, "device": a.device, "dtype": "float32" if a.device == "cpu" else "bfloat16",
            "max_model_len": a.max_model_len, "max_num_seqs": max(64, max(a.levels)),
            "num_gpu_blocks_override": a.num_pages, "max_num_batched_tokens": a.max_num_batched_tokens}
    with open(os.path.join(repo, "m3", "1", "model.json"), "w") as f:
        json.dump(opts, f, indent=2)


def start_gateway(triton_url: str, port: int, log_path: str, workers: int = 1) -> subprocess.Popen:
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "-m", "m3serve.cli", "openai", "--triton-url", triton_url, "--port",
                             str(port), "--log-level", "warning", "--workers", str(workers)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited ({proc.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as f:
                if f.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the gateway was not ready after 120 s; see {log_path}")


async def _gateway_request(client, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, last, tokens, error, events = None, None, 0, None, 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return {"ttft": None, "tokens": 0, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter() - t0
                ttft = last if ttft is None else ttft
                events += 1
    return {"ttft": ttft, "tokens": tokens, "error": error, "itl": itl(ttft, last, tokens), "events": events}


def itl(first: float | None, last: float | None, tokens: int) -> float | None:
    """Mean inter-token latency of one request: first text -> last text over the tokens after the first."""
    return (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None


async def level(c: int, n: int, one) -> dict:
    """C users, n requests in all, each user's one after another; `one()` sends one and returns its record."""
    results, counter = [], iter(range(n))

    async def user():
        for _ in counter:
            results.append(await one())
    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(c)))
    return summary(c, results, time.perf_counter() - t0)


def summary(c: int, results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itls = [r["itl"] for r in ok if r["itl"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": c, "requests": len(results), "errors": len(results) - len(ok),
            "first_error": next((r["error"] for r in results if r["error"]), None), "wall_s": wall,
            "output_tokens": tokens, "tokens_per_s_total": tokens / wall if wall else None,
            "ttft_ms": {q: float(np.percentile(ttft, q)) * 1000 if ttft else None for q in (50, 90)},
            "itl_ms": {q: float(np.percentile(itls, q)) * 1000 if itls else None for q in (50, 90)},
            "text_events_per_request": (sum(r.get("events", 0) for r in ok) / len(ok)) if ok else None}


def load_bench_client():
    import importlib.util
    spec = importlib.util.spec_from_file_location("m3bench_client", os.path.join(ROOT, "clients", "bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def level_sends(mport: int | None, c: int, n: int, one) -> dict:
    """`level(c, n, one)` with the server's send() time and responses per request over it (from its metrics port;
    the responder publishes its counters every 250 ms, so they are read 0.6 s after the level)."""
    from bench_server import send_cost, server_counters
    before = server_counters(mport, "m3") if mport else None
    lv = await level(c, n, one)
    if before is not None:
        await asyncio.sleep(0.6)
        sent, lv["server_send_us_per_response"] = send_cost(before, server_counters(mport, "m3"))
        lv["server_responses_per_request"] = sent / lv["requests"] if lv["requests"] else None
    return lv


def run_levels(a, triton_url: str, gateway_url: str, gateway_pid: int | None = None,
               mport: int | None = None) -> tuple[list, list]:
    """Both paths hold one connection pool for the whole run (the gateway holds one gRPC channel): a gRPC client
    (clients/bench.py's request, one stream each) and an HTTP client; each level is warmed up first. With
    ``gateway_pid``, each gateway level also reports the gateway processes' CPU time per streamed token, and
    --start-cost adds the gateway's CPU per request started (one-token requests in bursts of each C); with the
    server's metrics port ``mport``, each level the server's send() time per response: (levels, start-cost rows)."""
    import httpx2
    import tritonclient.grpc.aio as grpcaio

    bench = load_bench_client()
    inputs = bench.build_inputs("text", PROMPT, a.max_tokens, True, 0.0)
    body = {"model": "m3", "prompt": PROMPT, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    rids = iter(range(1 << 30))

    direct_seq, gateway_seq = iter(range(1 << 30)), iter(range(1 << 30))  # both paths send the same prompts in turn

    def prompt(i: int) -> str:
        return PROMPT if a.prompts == "same" else f"{PROMPT} (request {i})"

    async def go():
        grpc_client = grpcaio.InferenceServerClient(triton_url)
        limits = httpx2.Limits(max_connections=max(a.levels), max_keepalive_connections=max(a.levels))
        http = httpx2.AsyncClient(timeout=600, limits=limits)

        async def direct():
            r = await bench.one_request(grpc_client, "m3", inputs if a.prompts == "same" else bench.build_inputs(
                "text", prompt(next(direct_seq)), a.max_tokens, True, 0.0), f"b{next(rids)}", 600)
            last = r["ttft"] + sum(r["itl"]) if r["ttft"] is not None else None  # its ITLs span first -> last
            return {"ttft": r["ttft"], "tokens": r["tokens"], "error": r["error"], "itl": itl(r["ttft"], last,
                                                                                           r["tokens"])}

        def gateway():
            return _gateway_request(http, gateway_url + "/v1/completions", dict(body, prompt=prompt(next(gateway_seq))))

        one_token = dict(body, max_tokens=1)

        async def start_cost(c: int) -> dict:
            """--start-cost bursts of C one-token requests through the gateway: its CPU per request started."""
            cpu0, t0 = tree_cpu_seconds(gateway_pid), time.perf_counter()
            for _ in range(a.start_cost):
                await asyncio.gather(*(_gateway_request(http, gateway_url + "/v1/completions", one_token)
                                       for _ in range(c)))
            n = a.start_cost * c
            return {"concurrency": c, "requests": n, "wall_s": time.perf_counter() - t0,
                    "cpu_ms_per_request": cpu_per(cpu0, tree_cpu_seconds(gateway_pid), n, 1e3)}
        out, starts = [], []
        try:
            for c in a.levels:
                n = c * a.requests_per_user
                await level(c, c, direct)  # warm-up of this batch size, both paths
                await level(c, c, gateway)
                for run in range(a.repeats):
                    d = await level_sends(mport, c, n, direct)
                    cpu0 = tree_cpu_seconds(gateway_pid)
                    g = await level_sends(mport, c, n, gateway)
                    g["cpu_us_per_token"] = cpu_per(cpu0, tree_cpu_seconds(gateway_pid), g["output_tokens"], 1e6)
                    out.append({"concurrency": c, "run": run + 1, "direct": d, "gateway": g,
                                "tokens_per_s_ratio": g["tokens_per_s_total"] / d["tokens_per_s_total"]
                                if d["tokens_per_s_total"] else None,
                                "ttft_p50_overhead_ms": _minus(g["ttft_ms"][50], d["ttft_ms"][50]),
                                "itl_p50_overhead_ms": _minus(g["itl_ms"][50], d["itl_ms"][50])})
                    print(f"c={c} run {run + 1}: direct {d['tokens_per_s_total']:.1f} tok/s, gateway "
                          f"{g['tokens_per_s_total']:.1f} tok/s, errors {d['errors']}/{g['errors']}",
                          file=sys.stderr, flush=True)
            for c in (a.levels if a.start_cost and gateway_pid else []):
                starts.append(await start_cost(c))
        finally:
            await http.aclose()
            await grpc_client.close()
        return out, starts
    return asyncio.run(go())


def tree_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` and its descendants (the gateway and, with --workers, its
    worker processes), from /proc; None without a pid or where /proc cannot be read."""
    if pid is None:
        return None
    try:
        tick = os.sysconf("SC_CLK_TCK")
        parent, cpu = {}, {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                parent[int(d)] = int(fields[1])
                cpu[int(d)] = (int(fields[11]) + int(fields[12])) / tick
        mine, grew = {pid}, True
        while grew:
            more = {p for p, pp in parent.items() if pp in mine} - mine
            grew = bool(more)
            mine |= more
        return sum(cpu.get(p, 0.0) for p in mine)
    except (OSError, ValueError):
        return None


def cpu_per(cpu0: float | None, cpu1: float | None, n: int, scale: float) -> float | None:
    """CPU seconds between two `tree_cpu_seconds` readings per item, times ``scale``; None if a reading is missing
    or there were no items."""
    return (cpu1 - cpu0) * scale / n if cpu0 is not None and cpu1 is not None and n else None


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def table(rows: list[dict]) -> str:
    cols = ["C", "run", "gateway workers", "direct tok/s", "gateway tok/s", "gateway/direct", "TTFT p50 direct ms",
            "TTFT p50 gateway ms", "TTFT p50 overhead ms", "ITL p50 direct ms", "ITL p50 gateway ms",
            "ITL p50 overhead ms", "gateway CPU us/token", "gateway text events/request",
            "server send us/response (direct / gateway)", "server responses/request (direct / gateway)",
            "errors (direct/gateway)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)
    for r in rows:
        d, g = r["direct"], r["gateway"]
        cells = [str(r["concurrency"]), str(r["run"]), str(r.get("gateway_workers", 1)),
                 num(d["tokens_per_s_total"], ".1f"),
                 num(g["tokens_per_s_total"], ".1f"), num(r["tokens_per_s_ratio"], ".3f"), num(d["ttft_ms"][50], ".1f"),
                 num(g["ttft_ms"][50], ".1f"), num(r["ttft_p50_overhead_ms"], "+.1f"), num(d["itl_ms"][50], ".2f"),
                 num(g["itl_ms"][50], ".2f"), num(r["itl_p50_overhead_ms"], "+.2f"), num(g.get("cpu_us_per_token"), ".0f"),
                 num(g.get("text_events_per_request"), ".0f"),
                 f"{num(d.get('server_send_us_per_response'), '.0f')} / {num(g.get('server_send_us_per_response'), '.0f')}",
                 f"{num(d.get('server_responses_per_request'), '.0f')} / "
                 f"{num(g.get('server_responses_per_request'), '.0f')}", f"{d['errors']}/{g['errors']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    for flag, kind, default in (("--device", str, "cpu"), ("--concurrency", str, "1,16,64"),
                                ("--requests-per-user", int, None), ("--max-tokens", int, 128), ("--repeats", int, 1),
                                ("--max-model-len", int, 1024), ("--max-num-batched-tokens", int, 4096),
                                ("--num-pages", int, 4096)):
        p.add_argument(flag, type=kind, default=default)
    p.add_argument("--prompts", choices=("distinct", "same"), default="distinct",
                   help="distinct: request i of a run ends its prompt with (request i), both paths alike; same: one "
                        "prompt for all (greedy, every stream the same tokens: steps of identical rows)")
    p.add_argument("--start-cost", type=int, default=0, metavar="BURSTS",
                   help="after the levels, BURSTS bursts of C one-token requests per level: the gateway's CPU per start")
    p.add_argument("--gateway-workers", default="1",
                   help="comma-separated `m3serve openai --workers` counts, each measured against direct in turn")
    p.add_argument("--geometry", type=int, default=0, metavar="LAYERS",
                   help="the M3.1-Flash geometry cut to LAYERS layers (random weights) instead of the tiny model")
    a = p.parse_args(argv)
    if a.start_cost < 0:
        p.error(f"--start-cost: must be >= 0, got {a.start_cost}")
    a.levels = [int(c) for c in a.concurrency.split(",")]
    a.gateway_workers = [int(w) for w in a.gateway_workers.split(",")]
    # on a GPU two requests per user end a level in well under a second: too short to compare (2026-12-06)
    a.requests_per_user = a.requests_per_user or (8 if a.device == "cuda" else 2)
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(a.out, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    from m3serve.model.tiny import make_tiny
    model_dir = os.path.join(work, "tiny-m3")
    make_tiny(model_dir)
    repo = os.path.join(work, "repo")
    write_repo(a, model_dir, repo)
    sys.path.insert(0, HERE)
    from bench_server import free_port, start_server, stop_server

    if a.geometry:
        os.environ["M3SERVE_GEOMETRY_LAYERS"] = str(a.geometry)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpus": os.cpu_count(),
           "args": {k: v for k, v in vars(a).items()}}
    proc, url, mport = start_server(repo, os.path.join(a.out, "tritonserver.log"), ready_model="m3")
    res["levels"], res["start_cost"] = [], []
    try:
        for workers in a.gateway_workers:  # one gateway after the other in front of the same server
            port = free_port()
            gw = start_gateway(url, port, os.path.join(a.out, "gateway.log"), workers)
            try:
                levels, starts = run_levels(a, url, f"http://127.0.0.1:{port}", gw.pid, mport)
            finally:
                gw.terminate()
                gw.wait(10)
            res["levels"] += [{**lv, "gateway_workers": workers} for lv in levels]
            res["start_cost"] += [{**st, "gateway_workers": workers} for st in starts]
    finally:
        stop_server(proc)
    res["table"] = table(res["levels"])
    if res["start_cost"]:
        res["table"] += ("\n\nThe gateway's CPU per request started (one-token requests, --start-cost bursts of C):\n\n"
                         "| C | gateway workers | requests | gateway CPU ms/request | wall s |\n|---|---|---|---|---|\n")
        res["table"] += "\n".join(f"| {r['concurrency']} | {r['gateway_workers']} | {r['requests']} | "
                                   f"{'n/a' if r['cpu_ms_per_request'] is None else format(r['cpu_ms_per_request'], '.2f')}"
                                   f" | {r['wall_s']:.1f} |" for r in res["start_cost"])
    for name, text in (("bench_gateway.json", json.dumps(res, indent=2)), ("bench_gateway.md", res["table"] + "\n")):
        with open(os.path.join(a.out, name), "w") as f:
            f.write(text)
    print(res["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
