#!/usr/bin/env python3
"""DSpark through tritonserver on the learned model's own tasks: tokens/s with speculation vs plain decoding
(issue 28: "with the learned model's draft, tokens per second with speculation beat plain decoding on its tasks at
batch 1 and 8, on the engine and through tritonserver"; bench_learned_spec.py measures the engine).

    python benchmarks/bench_learned_server.py --model models/m3-tiny-learned --device cuda --dtype bfloat16 --out OUT
    python benchmarks/bench_learned_server.py --model M --device cpu --dtype float32 --n 2 --batches 1,2 --out OUT

One real tritonserver (`build.sh serve`, as bench_server.py starts it) serves the checkpoint twice through the `m3`
text contract: `m3` plain and `m3_spec` with DSpark (--k drafts, greedy drafts), each with eval-tasks' engine
options (learn/evaluate.py `engine_options`), prefix caching off (every prompt runs several times) and --num-pages
KV pages (two engines share the device). The workload is eval-tasks' `triton-m3` path: per task --n held-out
examples, messages and tools rendered by the server, greedy, the task's token budget. Per batch size C and model: a
warm-up pass over the first --warmup-n prompts of every task, then each task's prompts with C requests in flight on
one gRPC stream (the next sent as one finishes). tok/s = the tokens the model generated (the server's
vllm:generation_tokens_total for it) / the pass's wall time (prefill included); the mean accepted length
(tokens a speculative step emits) from its spec_decode counters. Greedy replies must be identical (`identical`;
`mismatches` shows the first that differ). The row "all" sums the tasks. Writes OUT/bench_learned_server.json.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("m3", "m3_spec")


def _script(name: str):
    """A sibling benchmark script as a module (bench_server.py's server start, bench_learned_spec.py's options)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_repo(a, repo: str) -> None:
    """`m3` and `m3_spec`: the text contract's config, each with its model.json."""
    from m3serve.learn.evaluate import MAX_MODEL_LEN, engine_options

    src = open(os.path.join(ROOT, "model_repository", "m3", "config.pbtxt")).read()
    for name in MODELS:
        opts = engine_options(a.device, a.dtype, MAX_MODEL_LEN, speculative=name == "m3_spec")
        if "speculative_config" in opts:
            opts["speculative_config"]["num_speculative_tokens"] = a.k
        opts.update(model=os.path.abspath(a.model), enable_prefix_caching=False, num_gpu_blocks_override=a.num_pages,
                    max_num_seqs=max(64, *a.batches))
        os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(re.sub(r'^name: "[^"]*"', f'name: "{name}"', src, count=1, flags=re.M))
        with open(os.path.join(repo, name, "1", "model.json"), "w") as f:
            json.dump(opts, f, indent=2)


def wait_ready(url: str, timeout: float = 600.0) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout
    while not all(client.is_model_ready(m) for m in MODELS):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{MODELS} not ready after {timeout:.0f} s")
        time.sleep(0.5)


def measure(bs, url: str, mport: int, model: str, sets, tok, budgets, batch: int, warmup_n: int) -> dict:
    """The warm-up pass, then per task: replies, generated tokens, seconds, speculative drafts and tokens accepted."""
    from m3serve.learn.evaluate import triton_replies

    for task, exs in sets.items():
        triton_replies(url, model, exs[:warmup_n], tok, budgets[task], window=batch)
    out = {}
    for task, exs in sets.items():
        time.sleep(0.6)  # the responder publishes its counters every 250 ms
        before, t0 = bs.server_counters(mport, model), time.perf_counter()
        texts = triton_replies(url, model, exs, tok, budgets[task], window=batch)
        seconds = time.perf_counter() - t0
        time.sleep(0.6)
        after = bs.server_counters(mport, model)
        gained = {k: after[k] - before[k] for k in after}
        out[task] = {"texts": texts, "seconds": seconds, "tokens": int(gained["vllm:generation_tokens_total"]),
                     "drafts": int(gained["vllm:spec_decode_num_drafts_total"]),
                     "accepted": int(gained["vllm:spec_decode_num_accepted_tokens_total"])}
    return out


def rows_of(batch: int, plain: dict, spec: dict, sets, diff: dict, acc: dict) -> list[dict]:
    rows = []
    for task in [*sets, "all"]:
        tasks = list(sets) if task == "all" else [task]
        p = {k: sum(plain[t][k] for t in tasks) for k in ("tokens", "seconds")}
        s = {k: sum(spec[t][k] for t in tasks) for k in ("tokens", "seconds", "drafts", "accepted")}
        mism = {"n": sum(diff[t]["n"] for t in tasks), "of": sum(diff[t]["of"] for t in tasks),
                "first": diff[task]["first"] if task != "all" else []}
        rows.append({"task": task, "batch": batch, "plain_tok_s": p["tokens"] / p["seconds"],
                     "spec_tok_s": s["tokens"] / s["seconds"],
                     "speedup": (s["tokens"] / s["seconds"]) / (p["tokens"] / p["seconds"]),
                     "mean_accepted_length": 1.0 + s["accepted"] / s["drafts"] if s["drafts"] else 0.0,
                     "num_drafts": s["drafts"], "plain_tokens": p["tokens"], "spec_tokens": s["tokens"],
                     "plain_seconds": p["seconds"], "spec_seconds": s["seconds"],
                     "plain_accuracy": sum(acc[t]["accuracy"] for t in tasks) / len(tasks),
                     "identical": mism["n"] == 0, "mismatches": mism})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| task | batch | plain tok/s | spec tok/s | speedup | mean accepted | plain accuracy | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "yes" if r["identical"] else f"NO ({r['mismatches']['n']} of {r['mismatches']['of']})"
        lines.append(f"| {r['task']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} "
                     f"| {r['speedup']:.2f} | {r['mean_accepted_length']:.2f} | {100 * r['plain_accuracy']:.1f}% "
                     f"| {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from m3serve.learn.evaluate import _commit, _device_name, eval_sets, score, token_budgets, unlike
    from m3serve.text.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _script("bench_learned_spec").learned_bench_args(ap)
    ap.add_argument("--num-pages", type=int, default=4096, help="KV pages of each engine")
    ap.add_argument("--out", required=True, help="a folder: bench_learned_server.json, the server's log")
    a = ap.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tok = Tokenizer.from_pretrained(a.model)
    sets = eval_sets(a.n, a.seed, tuple(a.tasks))
    budgets = token_budgets(sets, tok)
    warmup_n = min(a.warmup_n, a.n)
    bs = _script("bench_server")
    os.makedirs(a.out, exist_ok=True)
    repo = os.path.join(a.out, "repository")
    write_repo(a, repo)
    log_path = os.path.join(a.out, "server.log")
    proc, url, mport = bs.start_server(repo, log_path, ready_model="m3")
    try:
        wait_ready(url)
        results = {m: {b: measure(bs, url, mport, m, sets, tok, budgets, b, warmup_n) for b in a.batches}
                   for m in MODELS}
    finally:
        bs.stop_server(proc)
    rows = []
    for b in a.batches:
        plain, spec = results["m3"][b], results["m3_spec"][b]
        texts = {t: plain[t]["texts"] for t in sets}
        rows += rows_of(b, plain, spec, sets, unlike(texts, {t: spec[t]["texts"] for t in sets}), score(sets, texts))
    res = {"date": started, "device_name": _device_name(a.device),
           "command": "python benchmarks/bench_learned_server.py " + shlex.join(sys.argv[1:] if argv is None else argv),
           "commit": os.environ.get("COMMIT") or _commit(HERE), "model": a.model, "device": a.device,
           "dtype": a.dtype, "k": a.k, "n_per_task": a.n, "warmup_n": warmup_n, "seed": a.seed,
           "batches": a.batches, "tasks": list(sets), "budgets": budgets, "rows": rows,
           "identical": all(r["identical"] for r in rows)}
    print(f"\n{res['device_name']}, {a.dtype}, {a.model} through tritonserver (m3 vs m3_spec), K={a.k}, "
          f"{a.n} prompts per task, commit {res['commit']}\n")
    print(table(rows))
    with open(os.path.join(a.out, "bench_learned_server.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
