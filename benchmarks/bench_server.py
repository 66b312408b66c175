#!/usr/bin/env python3
"""The serving path's cost: engine-direct vs the real tritonserver (m3serve backend), and the Python
backend's per-response cost with an engine that costs nothing.

  python benchmarks/bench_server.py --device cuda --out OUT_DIR            # H200 (see docs/performance.md)
  python benchmarks/bench_server.py --device cpu --concurrency 1,4 --max-tokens 16 --out /tmp/b   # smoke

Three measurements at each concurrency C (C users, each sending --requests-per-user requests in a row,
every request --max-tokens tokens with ignore_eos, greedy; request i of a level its own prompt, --prompts):
  engine   AsyncLLMEngine in this process, C concurrent `generate` streams          (no server at all)
  server   the same engine behind tritonserver: model `m3`, gRPC streaming, clients/bench.py's client
  null     tritonserver with a zero-cost engine (model `m3null`, $M3SERVE_TEST_ENGINE_FACTORY=m3null=this file:null_engine):
           what the server path alone can carry -> responses/s and microseconds per response
  null ids the same engine behind the token-id contract (`m3null_ids`), twice: the client naming no output (all four
           tensors in each response) and naming `output_ids` alone (clients/bench.py's default): the cost of a tensor
With --geometry N: the M3.1-Flash geometry cut to N layers (random weights, benchmarks/geometry.py) engine-direct
and behind tritonserver's `m3_ids` (token ids in and out, the engine built by $M3SERVE_TEST_ENGINE_FACTORY), at
real speed on the GPU; no null engine. With --speculative K as well: the same again with DSpark speculation on
(K drafts, a random draft, controlled acceptance --spec-p: geometry.py's `control_acceptance`), engine-direct and
through a second model `m3_ids_spec` of the same server, and a table of speculation on vs off.
Writes OUT_DIR/bench_server.json and OUT_DIR/bench_server.md. The server runs through `build.sh serve`
(with $M3SERVE_PYTHON when there is no .venv), in its own process group, killed at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PROMPT = "Please write a short poem about the sea, the sky, and the stars at night."


# ---- the zero-cost engine (the m3serve backend builds it through $M3SERVE_TEST_ENGINE_FACTORY) ----------
class _NullEngine:
    """Streams one token per output from its own thread, as fast as it can hand them over: no model, no pages."""

    def __init__(self, config):
        from m3serve.text.tokenizer import Tokenizer

        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
        self._cv = threading.Condition()
        self._active: dict[str, list] = {}  # request id -> [sink, tokens left, tokens sent, prompt tokens]
        self._aborted: set[str] = set()
        self._tokens = 0
        self._stop = False
        threading.Thread(target=self._run, name="null-engine", daemon=True).start()

    async def prepare(self, prompt=None, prompt_token_ids=None, sampling_params=None, reasoning_parser=None,
                      chat_template_kwargs=None, text_options=None):
        n_prompt = len(prompt_token_ids) if prompt_token_ids else len(self.tokenizer.encode(prompt or ""))
        return n_prompt, sampling_params.max_tokens or 16

    def start(self, request_id, sink, prompt=None, prompt_token_ids=None, sampling_params=None, **_):
        """The token-id contract's one-message start (engine/client.py): prepared at once, nothing to wait for."""
        n_prompt = len(prompt_token_ids) if prompt_token_ids else len(self.tokenizer.encode(prompt or ""))
        self.submit(request_id, (n_prompt, sampling_params.max_tokens or 16), sink)

    def submit(self, request_id, prepared, sink):
        with self._cv:
            self._active[request_id] = [sink, prepared[1], 0, prepared[0]]
            self._cv.notify()

    def _run(self):
        from m3serve.engine.outputs import RequestOutput

        while True:
            with self._cv:
                while not self._active and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch = list(self._active.items())
            for rid, st in batch:
                sink, left, sent, n_prompt = st
                aborted = rid in self._aborted
                last = left <= 1 or aborted
                st[1], st[2] = left - 1, sent + 1
                self._tokens += 1
                sink(RequestOutput(rid, [65], text="x", finished=last,
                                   finish_reason=("abort" if aborted else "length") if last else None,
                                   num_prompt_tokens=n_prompt, num_output_tokens=sent + 1, cumulative_logprob=0.0))
                if last:
                    with self._cv:
                        self._active.pop(rid, None)
                        self._aborted.discard(rid)
            time.sleep(0)  # one round of tokens per "step"; the response thread gets the GIL in between

    def abort_sync(self, request_id):
        with self._cv:
            if request_id in self._active:
                self._aborted.add(request_id)

    async def abort(self, request_id):
        self.abort_sync(request_id)

    def stats(self):
        return {"num_running": len(self._active), "num_waiting": 0, "num_free_pages": 1, "num_total_pages": 1,
                "kv_cache_usage": 0.0, "num_preemptions": 0, "prefix_cache_hit_tokens": 0,
                "prompt_tokens_total": 0, "generation_tokens_total": self._tokens}

    def is_healthy(self):
        return True

    def shutdown(self):
        with self._cv:
            self._stop = True
            self._cv.notify()


def null_engine(config):
    return _NullEngine(config)


# ---- engine-direct ---------------------------------------------------------------------------------------
def engine_options(a, speculative: bool = False) -> dict:
    out = {"device": a.device, "dtype": a.dtype, "max_model_len": a.max_model_len,
           "max_num_seqs": max(64, max(a.levels)), "max_num_batched_tokens": a.max_num_batched_tokens,
           "num_gpu_blocks_override": a.num_pages}
    out.update(a.engine_option)
    if speculative:  # the draft: written by geometry.py's factory
        out["speculative_config"] = {"method": "dspark", "num_speculative_tokens": a.speculative,
                                     "kv_cache_dtype": "fp8"}
    return out


def _option(text: str) -> tuple[str, object]:
    """KEY=JSON (a bare word is a string) -> (KEY, value)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--engine-option wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def spec_control(a) -> str:
    """$M3SERVE_GEOMETRY_CONTROL for geometry.py's factory: controlled acceptance of the bench's prompt."""
    return json.dumps({"p": a.spec_p, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens})


async def _engine_level(engine, c, n_per_user, max_tokens, prompts):
    """C users, each sending requests in a row until `c * n_per_user` are sent; request i sends
    prompts[i % len(prompts)] (token ids, or text)."""
    from m3serve.engine.sampling_params import SamplingParams

    ttfts, rates, total = [], [], 0
    counter = iter(range(c * n_per_user))

    async def user(u):
        nonlocal total
        for i in counter:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            first = last = None
            n = 0
            prompt = prompts[i % len(prompts)]
            ids = isinstance(prompt, list)
            async for out in engine.generate(f"e{u}-{i}", prompt=None if ids else prompt,
                                             prompt_token_ids=prompt if ids else None, sampling_params=sp):
                now = time.perf_counter()
                if out.new_token_ids:
                    if first is None:
                        first = now
                        n_first = len(out.new_token_ids)
                    last = now
                    n += len(out.new_token_ids)
            total += n
            ttfts.append(first - t0)
            if n > n_first and last > first:
                rates.append((n - n_first) / (last - first))

    st0, unix0 = engine.stats(), time.time()
    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(c)))
    wall = time.perf_counter() - t0
    st1, unix1 = engine.stats(), time.time()
    ttfts.sort()
    return {"concurrency": c, "requests": c * n_per_user, "output_tokens": total, "wall_s": wall,
            "tokens_per_s_total": total / wall, "tokens_per_s_per_user_mean": sum(rates) / len(rates),
            "ttft_ms_p50": 1000 * ttfts[len(ttfts) // 2], "t_start": unix0, "t_end": unix1,
            **engine_pace(st0, st1, wall)}


def compiles_in(levels: list[dict], compiles) -> None:
    """Count the kernel compiles (unix time, seconds, kernel) that fell inside each timed level: a stall the level's
    figures include (geometry.log_compiles)."""
    for lv in levels:
        inside = [(dt, name) for t, dt, name in compiles if lv["t_start"] <= t <= lv["t_end"]]
        lv["compiles"] = len(inside)
        lv["compile_s"] = sum(dt for dt, _ in inside)
        lv["compiled"] = sorted({name.split()[0] for _, name in inside})


def server_compiles(log_path: str) -> list[tuple[float, float, str]]:
    """The `[compile]` lines the server's engine (its own process, or the stub with --engine-process false) printed
    into the server's log."""
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith("[compile] "):
                _, t, dt, name = line.rstrip("\n").split(" ", 3)
                out.append((float(t), float(dt), name))
    return out


def engine_pace(before: dict, after: dict, wall: float) -> dict:
    """Engine steps per second and the share of the wall time its thread waited for the device (near 0: host-bound)
    between two readings of the engine's counters (`stats()`, or the server's metrics under the same names)."""
    def delta(key, sub=None):
        a, b = after.get(key, 0), before.get(key, 0)
        return (a or {}).get(sub, 0) - (b or {}).get(sub, 0) if sub else a - b

    steps, decodes = delta("num_steps"), delta("steps_by_kind", "decode")
    return {"engine_steps_per_s": steps / wall, "engine_device_wait_share": delta("device_wait_seconds") / wall,
            "engine_prompt_steps": delta("num_prompt_steps"),
            "engine_steps_not_ahead": steps - delta("num_steps_ahead"),  # each waited for the step before it
            "engine_ms_per_decode_step": 1e3 * delta("step_seconds_by_kind", "decode") / decodes if decodes else None}


def timed_levels(a) -> list[tuple[int, int]]:
    """(repeat, concurrency) of each timed level: every level once per repeat, in the order given (--repeats: is the
    ratio steady from one pass to the next?)."""
    return [(r, c) for r in range(a.repeats) for c in a.levels]


def run_engine_direct(a, model_dir, speculative: bool = False) -> list[dict]:
    from m3serve.config import EngineConfig
    from m3serve.engine.async_engine import AsyncLLMEngine

    cfg = EngineConfig(model=model_dir, **engine_options(a, speculative))
    if a.geometry:
        from geometry import async_engine
        engine, prompts = async_engine(cfg), a.id_prompts
    else:
        engine, prompts = AsyncLLMEngine(cfg), a.text_prompts
    try:
        async def go():
            for c in a.levels:  # warm-up: the timed runs themselves, once (their prefill chunks and the mixed steps
                # of staggered arrivals compile kernels of new shapes: 2026-12-03 on the H200 a warm-up of one request
                # per user left C = 64 compiling inside the timed run)
                await _engine_level(engine, c, a.requests_per_user, a.max_tokens, prompts)
            out = []
            for r, c in timed_levels(a):
                out.append(dict(await _engine_level(engine, c, a.requests_per_user, a.max_tokens, prompts),
                                repeat=r))
                print(f"[engine{' spec' if speculative else ''}] c={c}: {out[-1]['tokens_per_s_total']:.0f} tok/s",
                      file=sys.stderr, flush=True)
            return out
        return asyncio.run(go())
    finally:
        engine.shutdown()
        engine = None
        gc.collect()
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the server's stub takes the GPU next


# ---- the server ------------------------------------------------------------------------------------------
def write_repo(a, model_dir, repo) -> str:
    """The model repository; returns $M3SERVE_TEST_ENGINE_FACTORY for the server (engines of the test models)."""
    src = os.path.join(ROOT, "model_repository", "m3", "config.pbtxt")
    null = os.path.abspath(__file__) + ":null_engine"
    models = [("m3", None), ("m3null", null), ("m3null_ids", null)]
    if a.geometry:  # the token-id contract over the random M3.1-Flash geometry (no tokenizer: ids in, ids out)
        src = os.path.join(ROOT, "model_repository", "m3_ids", "config.pbtxt")
        factory = os.path.join(ROOT, "benchmarks", "geometry.py") + ":async_engine"
        models = [("m3_ids", factory)] + ([("m3_ids_spec", factory)] if a.speculative else [])
    factories = ";".join(f"{name}={factory}" for name, factory in models if factory)
    for name, factory in models:
        opts = dict(engine_options(a, name == "m3_ids_spec"), model=model_dir, enable_prefix_caching=True)
        os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
        contract = os.path.join(ROOT, "model_repository", "m3_ids", "config.pbtxt") if name == "m3null_ids" else src
        cfg = re.sub(r'^name: "[^"]*"', f'name: "{name}"', open(contract).read(), count=1, flags=re.M)
        if factory and not a.geometry:  # one response per token: measures the per-response cost, no coalescing
            cfg = cfg.replace("parameters [\n", 'parameters [\n  { key: "coalesce_responses" value: '
                                                '{ string_value: "false" } },\n')
        cfg = cfg.replace("parameters [\n", f'parameters [\n  {{ key: "engine_process" value: {{ string_value: '
                                            f'"{a.engine_process}" }} }},\n')
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(cfg)
        with open(os.path.join(repo, name, "1", "model.json"), "w") as f:
            json.dump(opts, f, indent=2)
    return factories


def work_dir(a) -> tuple[str, str]:
    """(a fresh work folder under a.out or $M3SERVE_BENCH_WORK, the model: a.model or the tiny model made there)."""
    os.makedirs(a.out, exist_ok=True)
    work = os.environ.get("M3SERVE_BENCH_WORK") or os.path.join(a.out, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    model_dir = a.model
    if not model_dir:
        from m3serve.model.tiny import make_tiny
        model_dir = os.path.join(work, "tiny-m3")
        make_tiny(model_dir)
    return work, model_dir


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(repo, log_path, timeout=600, ready_model="m3null", factories=""):
    import tritonclient.grpc as grpcclient

    ports = [free_port() for _ in range(3)]
    cmd = [os.path.join(ROOT, "build.sh"), "serve", "--model-repository", repo, "--grpc-port", str(ports[0]),
           "--http-port", str(ports[1]), "--metrics-port", str(ports[2]), "--exit-on-error=false"]
    key = os.environ.get("M3SERVE_REPOSITORY_KEY") or secrets.token_hex(16)  # build.sh restricts the repository API
    env = dict(os.environ, M3SERVE_MODEL_DIR=os.path.dirname(repo), M3SERVE_TEST_ENGINE_FACTORY=factories,
               M3SERVE_REPOSITORY_KEY=key)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    url = f"localhost:{ports[0]}"
    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited ({proc.returncode}); see {log_path}")
        try:
            if client.is_model_ready(ready_model):
                index = client.get_model_repository_index(
                    as_json=True, headers={"triton-grpc-protocol-m3serve-repository-key": key})
                states = {m["name"]: m.get("state") for m in index.get("models", [])}
                if ready_model != "m3null" or client.is_model_ready("m3") or states.get("m3") == "UNAVAILABLE":
                    return proc, url, ports[2]
        except Exception:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"tritonserver not ready after {timeout}s; see {log_path}")
        time.sleep(0.5)


def stop_server(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def load_bench_client():
    spec = importlib.util.spec_from_file_location("m3bench_client", os.path.join(ROOT, "clients", "bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def server_counters(mport, model) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"http://localhost:{mport}/metrics", timeout=10) as f:
        text = f.read().decode()
    def value(name, kind=None):
        m = re.search(re.escape(name) + r'\{' + (f'(?=[^}}]*kind="{kind}")' if kind else "")
                      + r'[^}]*model="' + re.escape(model) + r'"[^}]*\}\s+(\S+)', text)
        return float(m.group(1)) if m else 0.0

    out = {name: value(name) for name in (
        "m3serve:responses_total", "m3serve:response_send_seconds_total", "vllm:generation_tokens_total",
        "m3serve:engine_steps_total", "m3serve:engine_device_wait_seconds_total", "m3serve:engine_prompt_steps_total",
        "m3serve:engine_steps_ahead_total", "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_drafts_total")}
    out["decode_steps"] = value("m3serve:engine_steps_by_kind_total", "decode")
    out["decode_seconds"] = value("m3serve:engine_step_seconds_total", "decode")
    return out


def send_cost(before: dict, after: dict) -> tuple[float, float | None]:
    """Between two `server_counters` readings: (responses sent, microseconds in send() per response)."""
    n = after["m3serve:responses_total"] - before["m3serve:responses_total"]
    sec = after["m3serve:response_send_seconds_total"] - before["m3serve:response_send_seconds_total"]
    return n, (1e6 * sec / n if n else None)


def run_server_levels(bench, url, mport, model, a, max_tokens, outputs=None) -> list[dict]:
    """`outputs`: as clients/bench.py's run_level (None: what its client asks for by default)."""
    kind, prompts = ("ids", a.id_prompts) if "_ids" in model else ("text", a.text_prompts)

    async def go():
        for c in a.levels:  # warm-up, as engine-direct's
            await bench.run_level(url, model, kind, c, c * a.requests_per_user, prompts[0], max_tokens, True, 0.0,
                                  600, False, outputs, prompts)
        out = []
        for r, c in timed_levels(a):
            await asyncio.sleep(0.4)
            before, t_start = server_counters(mport, model), time.time()
            lv = await bench.run_level(url, model, kind, c, c * a.requests_per_user, prompts[0], max_tokens, True,
                                       0.0, 600, False, outputs, prompts)
            lv["t_start"], lv["t_end"], lv["repeat"] = t_start, time.time(), r
            await asyncio.sleep(0.6)  # the responder publishes its counters every 250 ms
            after = server_counters(mport, model)
            lv.update(engine_pace(*({"num_steps": x["m3serve:engine_steps_total"],
                                     "device_wait_seconds": x["m3serve:engine_device_wait_seconds_total"],
                                     "num_prompt_steps": x["m3serve:engine_prompt_steps_total"],
                                     "num_steps_ahead": x["m3serve:engine_steps_ahead_total"],
                                     "steps_by_kind": {"decode": x["decode_steps"]},
                                     "step_seconds_by_kind": {"decode": x["decode_seconds"]}}
                                    for x in (before, after)), lv["wall_s"]))
            lv["server_responses"], lv["server_send_us_per_response"] = send_cost(before, after)
            steps = after["vllm:spec_decode_num_drafts_total"] - before["vllm:spec_decode_num_drafts_total"]
            if steps:  # speculation on: drafts accepted per speculative step of a sequence
                lv["accepted_per_draft"] = (after["vllm:spec_decode_num_accepted_tokens_total"]
                                            - before["vllm:spec_decode_num_accepted_tokens_total"]) / steps
            out.append(lv)
            print(f"[{model}] c={c}: {lv['tokens_per_s_total']:.0f} tok/s, {lv['errors']} errors, "
                  f"{lv['server_send_us_per_response'] or 0:.0f} us/response in send", file=sys.stderr, flush=True)
        return out
    return asyncio.run(go())


# ---- report ------------------------------------------------------------------------------------------------
def summarize_spec(res) -> str:
    """Speculation on vs off (--speculative): tokens/s and the ratio, engine-direct and through the server."""
    nan = float("nan")
    lines = ["| C | engine tok/s off | engine tok/s on | on / off | server tok/s off | server tok/s on | on / off | "
             "server ITL p50 ms off / on | accepted drafts per step (server) |", "|---" * 9 + "|"]

    def ratio(off, on):
        return on["tokens_per_s_total"] / off["tokens_per_s_total"] if off.get("tokens_per_s_total") else nan

    for e, es, s, ss in zip(res["engine"], res["engine_spec"], res["server"], res["server_spec"]):
        lines.append(f"| {e['concurrency']} | {e['tokens_per_s_total']:.0f} | {es['tokens_per_s_total']:.0f} | "
                     f"{ratio(e, es):.2f} | {s['tokens_per_s_total']:.0f} | {ss['tokens_per_s_total']:.0f} | "
                     f"{ratio(s, ss):.2f} | {s['itl_ms'][50]:.2f} / {ss['itl_ms'][50]:.2f} | "
                     f"{ss.get('accepted_per_draft', nan):.2f} |")
    return "\n".join(lines)


def summarize(res) -> str:
    lines = ["| C | engine-direct tok/s | server tok/s | server / engine | server TTFT p50 ms | server ITL p50 ms | "
             "server resp/req | null-engine resp/s (1 token each) | us per response (end to end) | "
             "us per response in send() |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")  # a side that failed (its placeholders carry no counters)
    if not res["null"]:  # --geometry: engine-direct vs the server only
        lines = lines[:1] + ["|---|---|---|---|---|---|---|---|---|---|"]
        lines[0] = ("| C | run | engine-direct tok/s | server tok/s | server / engine | TTFT p50 ms (direct / server) | "
                    "server ITL p50 ms | server resp/req | engine steps/s (direct / server) | "
                    "engine waits for the GPU (direct / server) | steps with prompt tokens (direct / server) | "
                    "steps not queued ahead (direct / server) | ms per decode step (direct / server) | "
                    "kernel compiles in the timed run (direct / server) |")
        lines[1] = "|---" * 14 + "|"
        for e, s in zip(res["engine"], res["server"]):
            lines.append(f"| {e['concurrency']} | {s.get('repeat', 0) + 1} | {e['tokens_per_s_total']:.0f} | "
                         f"{s['tokens_per_s_total']:.0f} | {s['tokens_per_s_total'] / e['tokens_per_s_total']:.2f} | "
                         f"{e.get('ttft_ms_p50', nan):.1f} / {s['ttft_ms'][50]:.1f} | "
                         f"{s['itl_ms'][50]:.2f} | {s['responses_per_request_mean'] or 0:.0f} | "
                         f"{e.get('engine_steps_per_s', nan):.0f} / {s.get('engine_steps_per_s', nan):.0f} | "
                         f"{100 * e.get('engine_device_wait_share', nan):.0f}% / "
                         f"{100 * s.get('engine_device_wait_share', nan):.0f}% | "
                         f"{e.get('engine_prompt_steps', nan):.0f} / {s.get('engine_prompt_steps', nan):.0f} | "
                         f"{e.get('engine_steps_not_ahead', nan):.0f} / {s.get('engine_steps_not_ahead', nan):.0f} | "
                         f"{e.get('engine_ms_per_decode_step') or nan:.2f} / "
                         f"{s.get('engine_ms_per_decode_step') or nan:.2f} | "
                         f"{e.get('compiles', '-')} / {s.get('compiles', '-')} |")
        return "\n".join(lines)
    for e, s, n in zip(res["engine"], res["server"], res["null"]):
        resp = n["requests"] * (n["responses_per_request_mean"] or 0)
        rps = resp / n["wall_s"] if n["wall_s"] else 0
        lines.append(
            f"| {e['concurrency']} | {e['tokens_per_s_total']:.0f} | {s['tokens_per_s_total']:.0f} | "
            f"{s['tokens_per_s_total'] / e['tokens_per_s_total']:.2f} | {s['ttft_ms'][50]:.1f} | {s['itl_ms'][50]:.2f} | "
            f"{s['responses_per_request_mean'] or 0:.0f} | {rps:.0f} | {1e6 / rps if rps else 0:.0f} | "
            f"{n['server_send_us_per_response'] or 0:.0f} |")
    if res.get("null_ids"):
        lines += ["", "The null engine behind the token-id contract (`m3null_ids`), by the outputs the client names:",
                  "", "| C | outputs named | tok/s (1 token per response) | us per response in send() |",
                  "|---|---|---|---|"]
        for label, levels in res["null_ids"].items():
            lines += [f"| {lv['concurrency']} | {label} | {lv['tokens_per_s_total']:.0f} | "
                      f"{lv['server_send_us_per_response'] or 0:.0f} |" for lv in levels]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", help="model directory (default: a fresh tiny model)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--repeats", type=int, default=1, help="timed passes over the levels, each side (after one warm-up)")
    p.add_argument("--requests-per-user", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--null-max-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=JSON",
                   help="an engine option for both sides (model.json and engine-direct), e.g. max_waiting_steps=4")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--geometry", type=int, default=0, metavar="LAYERS",
                   help="the M3.1-Flash geometry cut to LAYERS layers, random weights (benchmarks/geometry.py), "
                        "served through m3_ids with random prompt ids; no null engine")
    p.add_argument("--prompt-len", type=int, default=128, help="--geometry: prompt length in token ids")
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="--geometry: also DSpark with K drafts (random draft, controlled acceptance), on vs off")
    p.add_argument("--spec-p", type=float, default=0.8,
                   help="--speculative: the chance a drafted token is the target's (controlled acceptance)")
    p.add_argument("--prompts", choices=("distinct", "same"),
                   help="distinct (the default without --speculative): request i of a level sends prompt i, so the "
                        "streams' tokens differ as real traffic's do (the same prompt greedy in every stream makes "
                        "every row of a step the same token once the streams run in step: one MoE route for the whole "
                        "batch); same: one prompt for all (--speculative: its controlled acceptance knows one prompt)")
    p.add_argument("--engine-process", choices=("true", "false"), default="true",
                   help="the server's engine in a process of its own (the model's default) or on threads of the stub")
    a = p.parse_args(argv)
    a.levels = [int(c) for c in a.concurrency.split(",")]
    a.engine_option = dict(_option(o) for o in a.engine_option)
    if a.speculative and not a.geometry:
        p.error("--speculative needs --geometry")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from geometry import bench_prompt_ids
    a.prompts = a.prompts or ("same" if a.speculative else "distinct")
    if a.speculative and a.prompts == "distinct":
        p.error("--speculative: --prompts same (the controlled acceptance knows one prompt)")
    a.prompt_ids = bench_prompt_ids(a.prompt_len)
    n = min(max(a.levels) * a.requests_per_user, 497) if a.prompts == "distinct" else 1  # 497 variants of the ids
    a.id_prompts = [bench_prompt_ids(a.prompt_len, v) for v in range(n)]
    a.text_prompts = [PROMPT] if n == 1 else [f"{PROMPT} (request {v})" for v in range(n)]
    if a.speculative:  # geometry.py's factory (engine-direct here, the server's model) reads it
        os.environ["M3SERVE_GEOMETRY_CONTROL"] = spec_control(a)
    work, model_dir = work_dir(a)
    import torch
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "python": platform.python_version(),
           "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "args": {k: v for k, v in vars(a).items() if not k.endswith("_prompts")}, "model": model_dir}
    t0 = time.time()
    try:
        res["engine"] = [] if a.skip_engine else run_engine_direct(a, model_dir)
    except Exception as e:  # keep going: the null-engine numbers need no engine
        import traceback
        traceback.print_exc()
        res["engine_error"] = f"{type(e).__name__}: {e}"
        res["engine"] = []
    if a.speculative:
        try:
            res["engine_spec"] = [] if a.skip_engine else run_engine_direct(a, model_dir, speculative=True)
        except Exception as e:
            import traceback
            traceback.print_exc()
            res["engine_spec_error"] = f"{type(e).__name__}: {e}"
            res["engine_spec"] = []
    res["engine_s"] = time.time() - t0
    repo = os.path.join(work, "repo")
    factories = write_repo(a, model_dir, repo)
    log_path = os.path.join(a.out, "tritonserver.log")
    t0 = time.time()
    proc, url, mport = start_server(repo, log_path, ready_model="m3_ids" if a.geometry else "m3null",
                                     factories=factories)
    res["server_start_s"] = time.time() - t0
    try:
        import tritonclient.grpc as grpcclient
        bench = load_bench_client()
        served = "m3_ids" if a.geometry else "m3"
        for key, name in [("server", served)] + ([("server_spec", "m3_ids_spec")] if a.speculative else []):
            if grpcclient.InferenceServerClient(url).is_model_ready(name):
                res[key] = run_server_levels(bench, url, mport, name, a, a.max_tokens)
            else:
                res[f"{key}_error"] = f"model {name} failed to load (see tritonserver.log)"
        res["null"] = [] if a.geometry else run_server_levels(bench, url, mport, "m3null", a, a.null_max_tokens)
        if not a.geometry:  # the token-id contract: every output in each response, then output_ids alone
            named = (("every output", bench.EVERY_OUTPUT), ("output_ids", ["output_ids"]))
            res["null_ids"] = {label: run_server_levels(bench, url, mport, "m3null_ids", a, a.null_max_tokens, names)
                               for label, names in named}
        import urllib.request
        with urllib.request.urlopen(f"http://localhost:{mport}/metrics", timeout=10) as f:
            res["metrics_tail"] = [ln for ln in f.read().decode().splitlines()
                                   if ln.startswith(("vllm:generation_tokens_total", "vllm:num_requests_running",
                                                     "m3serve:kv_cache_free_pages"))]
    finally:
        stop_server(proc)
    if a.geometry:  # kernel compiles inside timed levels (geometry.log_compiles: engine-direct here, the server's log)
        from geometry import COMPILES
        for side in ("engine", "engine_spec"):
            compiles_in(res.get(side, []), COMPILES)
        for side in ("server", "server_spec"):
            compiles_in(res.get(side, []), server_compiles(log_path))
        for side in ("engine", "engine_spec", "server", "server_spec"):
            for lv in res.get(side, []):
                if lv.get("compiles"):
                    print(f"[{side}] c={lv['concurrency']}: {lv['compiles']} kernel compiles in the timed run "
                          f"({lv['compile_s']:.2f} s): {', '.join(lv['compiled'])}", file=sys.stderr, flush=True)
    nan = float("nan")
    for side in ("engine", "engine_spec") if a.speculative else ("engine",):
        if not res.get(side):
            res[side] = [{"concurrency": c, "tokens_per_s_total": nan} for _, c in timed_levels(a)]
    for side in ("server", "server_spec") if a.speculative else ("server",):
        if not res.get(side):
            res[side] = [{"concurrency": c, "tokens_per_s_total": nan, "ttft_ms": {50: nan}, "itl_ms": {50: nan},
                          "responses_per_request_mean": nan} for _, c in timed_levels(a)]
    res["table"] = summarize(res)
    if a.speculative:
        res["table"] += (f"\n\nDSpark K = {a.speculative} (random draft, controlled acceptance p = {a.spec_p}), "
                         f"on vs off:\n\n" + summarize_spec(res))
    write_report(a.out, "bench_server", res)
    return 0


def write_report(out: str, name: str, res: dict) -> None:
    """OUT/<name>.json (everything) and OUT/<name>.md (res["table"]); the table to stdout."""
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(res["table"] + "\n")
    print(res["table"])


if __name__ == "__main__":
    sys.exit(main())
