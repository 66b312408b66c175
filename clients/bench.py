#!/usr/bin/env python3
"""Concurrency sweep against the m3serve Triton server (gRPC streaming, asyncio client).

  python clients/bench.py --concurrency 1,4,16 --requests 32 --max-tokens 128 --out bench.json

Each of C users sends its requests one after another over gRPC streams (the last token arrives with the
FINAL response). Per level: TTFT and inter-token latency percentiles (a response carrying k tokens counts
as k gaps of interval/k), tokens/s per user (decode rate after the first token) and in total (all output
tokens / wall time), requests/s, errors. Writes JSON (--out) and prints a table; a progress bar per level.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np
import tritonclient.grpc.aio as grpcaio
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

try:
    from tqdm import tqdm
except ImportError:  # the bar is a nicety
    tqdm = None

DEFAULT_PROMPT = "Please write a short poem about the sea, the sky, and the stars at night."


def _t(name, value, dtype=None, shape=None):
    arr = np.array([value], dtype=dtype if dtype is not None else object)
    if arr.dtype == object:
        arr = np.array([value.encode("utf-8")], dtype=object)
    if shape:
        arr = arr.reshape(shape)
    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def _ids_input(ids: list[int]):
    arr = np.array([ids], dtype=np.int32)
    t = grpcclient.InferInput("input_ids", list(arr.shape), "INT32")
    t.set_data_from_numpy(arr)
    return t


def build_inputs(model_kind: str, prompt, max_tokens: int, ignore_eos: bool, temperature: float):
    """The request tensors of one model kind: "text" (`m3`), "ensemble", or "ids" (`m3_ids`: `prompt` is a list of
    token ids; with `ignore_eos`, end_id -1: only the length ends the request)."""
    if model_kind == "ensemble":
        return [_t("text_input", prompt, shape=[1, 1]), _t("max_tokens", max_tokens, np.int32, [1, 1]),
                _t("stream", True, bool, [1, 1]), _t("temperature", temperature, np.float32, [1, 1])]
    if model_kind == "ids":
        ins = [_ids_input(prompt), _t("input_lengths", len(prompt), np.int32, [1, 1]),
               _t("request_output_len", max_tokens, np.int32, [1, 1]), _t("streaming", True, bool, [1, 1]),
               _t("temperature", temperature, np.float32, [1, 1])]
        return ins + ([_t("end_id", -1, np.int32, [1, 1])] if ignore_eos else [])
    sp = {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
    return [_t("text_input", prompt), _t("stream", True, bool), _t("exclude_input_in_output", True, bool),
            _t("return_num_output_tokens", True, bool), _t("sampling_parameters", json.dumps(sp))]


def requested_outputs(model_kind: str) -> list[str]:
    """The outputs this client reads, asked for by name (none named: every output). Each tensor of a response costs the
    server's Python backend a shared-memory block and a copy per response, in its one response thread (on the CPU
    at 16 streams: 112-143 us per response with the four tensors, 65-78 us with output_ids alone,
    docs/performance.md), so an `m3_ids` client that reads only the new ids asks for `output_ids` alone."""
    return ["output_ids"] if model_kind == "ids" else []


def random_ids(n: int, vocab: int = 500, seed: int = 0) -> list[int]:
    """A prompt of n token ids (ids < 500: valid for the tiny model and every M3 vocabulary)."""
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def pct(values, q):
    return float(np.percentile(values, q)) if len(values) else None


async def one_request(client, model, inputs, rid, timeout, outputs=None):
    async def requests():
        yield {"model_name": model, "inputs": inputs, "outputs": outputs, "request_id": rid,
               "enable_empty_final_response": True}

    t0 = time.perf_counter()
    ttft = None
    stamps = []  # (time, tokens in this response)
    tokens = 0
    error = None
    it = client.stream_infer(requests(), stream_timeout=timeout)
    async for result, err in it:
        if err is not None:
            error = str(err)
            break
        now = time.perf_counter()
        n, ids = result.as_numpy("num_output_tokens"), result.as_numpy("output_ids")
        if ids is not None:  # m3_ids: the new token ids of this response
            k = int(ids.shape[-1])
        else:
            k = int(n.sum()) if n is not None else (1 if result.as_numpy("text_output") is not None else 0)
        if k:
            if ttft is None:
                ttft = now - t0
            stamps.append((now, k))
            tokens += k
        p = result.get_response().parameters
        if "triton_final_response" in p and p["triton_final_response"].bool_param:
            break
    end = time.perf_counter()
    itl = []
    for (ta, _), (tb, k) in zip(stamps, stamps[1:]):
        itl += [(tb - ta) / k] * k
    rate = None
    if len(stamps) > 1 and tokens > 1 and stamps[-1][0] > stamps[0][0]:
        rate = (tokens - stamps[0][1]) / (stamps[-1][0] - stamps[0][0])
    return {"ttft": ttft, "itl": itl, "tokens": tokens, "e2e": end - t0, "rate": rate, "error": error,
            "responses": len(stamps)}


EVERY_OUTPUT = ()  # run_level(outputs=EVERY_OUTPUT): name no output, get each one the model returns


async def run_level(url, model, model_kind, concurrency, n_requests, prompt, max_tokens, ignore_eos,
                    temperature, timeout, show_bar, outputs=None, prompts=None):
    """`outputs`: the output names to ask for (default: `requested_outputs(model_kind)`; EVERY_OUTPUT: none named).
    `prompts`: request i sends prompts[i % len(prompts)] instead of `prompt` (requests that differ, as real traffic
    does: the same prompt greedy in every stream gives every step identical rows)."""
    inputs = build_inputs(model_kind, prompt, max_tokens, ignore_eos, temperature)
    if prompts:
        per_request = [build_inputs(model_kind, p, max_tokens, ignore_eos, temperature) for p in prompts]
    names = requested_outputs(model_kind) if outputs is None else outputs
    outputs = [grpcclient.InferRequestedOutput(name) for name in names] or None
    results = []
    counter = iter(range(n_requests))
    bar = tqdm(total=n_requests, desc=f"c={concurrency}", unit="req", leave=False, file=sys.stderr) \
        if (tqdm and show_bar) else None

    async def user(u):
        client = grpcaio.InferenceServerClient(url)
        try:
            for i in counter:
                results.append(await one_request(client, model, per_request[i % len(per_request)] if prompts
                                                 else inputs, f"u{u}-{i}", timeout, outputs))
                if bar:
                    bar.update(1)
        finally:
            await client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(concurrency)))
    wall = time.perf_counter() - t0
    if bar:
        bar.close()
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    rates = [r["rate"] for r in ok if r["rate"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if r["error"]), None),
        "wall_s": wall, "output_tokens": tokens, "tokens_per_s_total": tokens / wall if wall else None,
        "tokens_per_s_per_user_mean": float(np.mean(rates)) if rates else None,
        "requests_per_s": len(ok) / wall if wall else None,
        "responses_per_request_mean": float(np.mean([r["responses"] for r in ok])) if ok else None,
        "ttft_ms": {q: (pct(ttft, q) or 0) * 1000 for q in (50, 90, 99)},
        "itl_ms": {q: (pct(itl, q) or 0) * 1000 for q in (50, 90, 99)},
        "e2e_s_mean": float(np.mean([r["e2e"] for r in ok])) if ok else None,
    }


async def wait_ready(url, model, timeout):
    client = grpcaio.InferenceServerClient(url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if await client.is_server_ready() and await client.is_model_ready(model):
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"model {model!r} not ready at {url} after {timeout:.0f}s")
            await asyncio.sleep(0.5)
    finally:
        await client.close()


async def sweep(a) -> dict:
    if a.wait_ready:
        await wait_ready(a.url, a.model, a.wait_ready)
    prompt = a.prompt if a.prompt else DEFAULT_PROMPT
    if a.model_kind == "ids":
        prompt = random_ids(a.prompt_ids)
    levels = [int(c) for c in a.concurrency.split(",") if c]
    out = {"url": a.url, "model": a.model, "max_tokens": a.max_tokens, "ignore_eos": a.ignore_eos,
           "prompt_chars": len(prompt), "levels": []}
    if a.warmup:
        await run_level(a.url, a.model, a.model_kind, min(levels), a.warmup, prompt, a.max_tokens, a.ignore_eos,
                        a.temperature, a.timeout, False)
    for c in levels:
        n = a.requests if a.requests else c * a.requests_per_user
        out["levels"].append(await run_level(a.url, a.model, a.model_kind, c, n, prompt, a.max_tokens,
                                             a.ignore_eos, a.temperature, a.timeout, not a.no_progress))
    return out


def table(res: dict) -> str:
    rows = ["conc  reqs  err  tok/s total  tok/s/user  TTFT p50/p90/p99 ms   ITL p50/p90/p99 ms   resp/req"]
    for lv in res["levels"]:
        t, i = lv["ttft_ms"], lv["itl_ms"]
        rows.append(f"{lv['concurrency']:>4}  {lv['requests']:>4}  {lv['errors']:>3}  {lv['tokens_per_s_total'] or 0:>11.1f}"
                    f"  {lv['tokens_per_s_per_user_mean'] or 0:>10.1f}  {t[50]:>6.1f}/{t[90]:>6.1f}/{t[99]:>6.1f}"
                    f"   {i[50]:>6.2f}/{i[90]:>6.2f}/{i[99]:>6.2f}   {lv['responses_per_request_mean'] or 0:>6.1f}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="m3", help="m3 (text contract), ensemble, or m3_ids (random prompt ids)")
    p.add_argument("--prompt-ids", type=int, default=128, help="m3_ids: prompt length (random token ids)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: users x --requests-per-user)")
    p.add_argument("--requests-per-user", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens (default on)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before the sweep")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--wait-ready", type=float, default=0.0, metavar="S")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    a.model_kind = {"ensemble": "ensemble", "m3_ids": "ids"}.get(a.model, "text")
    res = asyncio.run(sweep(a))
    print(table(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if any(lv["errors"] for lv in res["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
