#!/usr/bin/env python3
"""DSpark speculation with a draft that has learned: tokens/s with speculation vs plain decoding on the learned tiny
model's own eval tasks (m3serve.learn.tasks), on the engine, at each batch size (issue 28: "with the learned model's
draft, tokens per second with speculation beat plain decoding on its tasks at batch 1 and 8").

    python benchmarks/bench_learned_spec.py --model /tmp/m3-tiny-learned --out /tmp/lspec.json        (H200)
    python benchmarks/bench_learned_spec.py --model M --device cpu --dtype float32 --n 2 --batches 1,2  (CPU check)

The workload is `m3serve eval-tasks`' (learn/evaluate.py, whose helpers this script calls): per task --n held-out
eval examples (seed --seed), each prompt rendered by the chat template as the engine path renders it, greedy, the
task's token budget (its longest answer + eos + 16 tokens), stopping at eos. Two engines, each built once and used
for every task and batch size, as eval-tasks builds its `engine` and `dspark-greedy` paths (`engine_options`:
max_model_len 2048, seed 0; CUDA graphs where the engine takes them by default, on CUDA; the speculative one with
DSpark, --k drafts, greedy drafts), except that prefix caching is off: each prompt runs several times per engine
(a warm-up and a measured pass per batch size), and reusing an earlier pass's KV would leave the prefill out of the
measured time.

Per batch size B: the engine keeps B requests in flight (a new one is added as soon as one finishes; the engine's
own in-flight batching runs them); first a warm-up pass over the first --warmup-n prompts of every task (compiles,
captures the speculative graphs of the buckets the pass reaches), then each task's prompts, timed: tok/s = output
tokens (eos included) / the wall time from the first request added to the last one finished (prefill included).
Per task and B: plain and speculative tok/s, the speedup, the mean accepted length (tokens a speculative step
emits, the bonus token included) and acceptance rate from the engine's spec_decode counters over that task's pass
(as eval-tasks reads them), the steps each engine ran and its mixed steps (a prefill beside decodes: run eagerly),
the steps and their wall time per kind (decode, speculative, prefill, and the mixed kinds: the engine's
`steps_by_kind` / `step_seconds_by_kind`, printed as a second table for the "all" rows), the most requests its
scheduler ran at once (max_running: B when the task has B prompts or more), the exact-match accuracy of the plain
replies, and whether the greedy replies are identical (they must be: `mismatches` shows the
first ones that differ). The row "all" sums the tasks.

`--variants` measures several speculative settings against the one plain engine in one run: each a JSON object of
speculative_config keys over the default (`'{}' '{"num_speculative_tokens": 3}' '{"confidence_threshold": 0.5}'`);
each row names its variant.

The plain engine is measured twice, before the speculative ones and again after them, and each task's plain figure
is the faster of its two passes (`plain_seconds_passes` keeps both): on the H100 (2026-12-06) a plain decode step
took 0.45 ms on one lent machine and 0.76 ms on another, so the figures move with the host, and one plain pass always
measured first could favour either side.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import shlex
import sys
import time

import torch

from m3serve import LLM, SamplingParams
from m3serve.learn.evaluate import (_commit, _device_name, engine_options, eval_sets, reply_text, score,
                                    spec_acceptance, spec_counters, token_budgets, unlike)
from m3serve.learn.render import prompt_ids
from m3serve.learn.tasks import TASKS
from m3serve.text.tokenizer import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
_ids = itertools.count()  # request ids, unique over every pass


def run_pass(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int
             ) -> tuple[list[list[int]], float, int]:
    """Greedy replies (token ids) of `prompts`, at most `batch` requests in flight; the pass's wall time; the most
    requests the engine's scheduler ran at once."""
    eng, out = llm.engine, [[] for _ in prompts]
    live: dict[str, int] = {}
    most = 0
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    nxt = 0

    def add() -> None:
        nonlocal nxt
        rid = f"lspec-{next(_ids)}"
        eng.add_request(rid, prompt_token_ids=prompts[nxt], sampling_params=sp)
        live[rid], nxt = nxt, nxt + 1

    t0 = time.perf_counter()
    while nxt < min(batch, len(prompts)):
        add()
    while eng.has_unfinished_requests():
        most = max(most, len(eng.scheduler.running))
        for o in eng.step():
            out[live[o.request_id]] += o.new_token_ids
            if o.finished:
                if o.finish_reason == "error":
                    raise RuntimeError(f"request {o.request_id} failed: {getattr(o, 'error', '')}")
                del live[o.request_id]
                if nxt < len(prompts):
                    add()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, most


def measure(llm: LLM, prompts: dict[str, list[list[int]]], budgets: dict[str, int], batch: int, warmup_n: int,
            tok) -> dict[str, dict]:
    """The warm-up pass, then per task: replies (text), output tokens, seconds, steps, acceptance."""
    for task, ps in prompts.items():
        run_pass(llm, ps[:warmup_n], budgets[task], batch)
    res = {}
    for task, ps in prompts.items():
        st, before = llm.engine.stats(), spec_counters(llm)
        ids, seconds, most = run_pass(llm, ps, budgets[task], batch)
        after = llm.engine.stats()
        res[task] = {"texts": [reply_text(tok, r) for r in ids], "tokens": sum(map(len, ids)), "seconds": seconds,
                     "steps": after["num_steps"] - st["num_steps"],
                     "mixed_steps": after["num_mixed_steps"] - st["num_mixed_steps"], "max_running": most,
                     "step_kinds": step_kinds(st, after), **spec_acceptance(before, spec_counters(llm))}
    return res


def profile_pass(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int, device: str) -> str:
    """One more pass over `prompts` (after the timed ones, so the profiler's cost is in no figure) under
    torch.profiler: the ops by their own device time (CUDA) or host time, and the kernels launched."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run_pass(llm, prompts, max_tokens, batch)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    head = (f"{len(prompts)} prompts, batch {batch}, engine steps {llm.engine.stats()['num_steps']} (cumulative), "
            f"kernel launches {launches}")
    return head + "\n" + events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                      row_limit=30)


PLAIN_AGAIN = "plain, again"  # the plain engine's second measurement, after the speculative ones


def faster_plain(first: dict[int, dict], again: dict[int, dict]) -> dict[int, dict]:
    """Per batch size and task, the faster of the plain engine's two passes (the same greedy tokens), with both
    passes' seconds as `seconds_passes`."""
    return {b: {t: dict(min(first[b][t], again[b][t], key=lambda m: m["seconds"]),
                        seconds_passes=[first[b][t]["seconds"], again[b][t]["seconds"]]) for t in first[b]}
            for b in first}


def step_kinds(before: dict, after: dict) -> dict[str, dict]:
    """Steps and their wall seconds per kind (ScheduledBatch.kind) between two engine stats readings."""
    return {k: {"steps": after["steps_by_kind"][k] - before["steps_by_kind"].get(k, 0),
                "seconds": after["step_seconds_by_kind"][k] - before["step_seconds_by_kind"].get(k, 0.0)}
            for k in after["steps_by_kind"]}


def add_kinds(parts: list[dict]) -> dict[str, dict]:
    """`step_kinds` of several passes, summed."""
    return {k: {f: sum(p[k][f] for p in parts) for f in ("steps", "seconds")} for k in parts[0]}


def row(task: str, batch: int, plain: dict, spec: dict, accuracy: float | None, mismatches: dict,
        variant: str = "{}") -> dict:
    p_tok_s, s_tok_s = plain["tokens"] / plain["seconds"], spec["tokens"] / spec["seconds"]
    return {"variant": variant, "task": task, "batch": batch, "plain_tok_s": p_tok_s, "spec_tok_s": s_tok_s,
            "speedup": s_tok_s / p_tok_s,
            "mean_accepted_length": spec["mean_accepted_length"], "acceptance_rate": spec["acceptance_rate"],
            "num_drafts": spec["num_drafts"], "verified_per_draft": spec["verified_per_draft"],
            "plain_tokens": plain["tokens"], "spec_tokens": spec["tokens"],
            "plain_seconds": plain["seconds"], "spec_seconds": spec["seconds"],
            "plain_seconds_passes": plain.get("seconds_passes"), "plain_steps": plain["steps"],
            "spec_steps": spec["steps"], "plain_mixed_steps": plain["mixed_steps"],
            "spec_mixed_steps": spec["mixed_steps"], "max_running": max(plain["max_running"], spec["max_running"]),
            "plain_step_kinds": plain["step_kinds"], "spec_step_kinds": spec["step_kinds"],
            "plain_accuracy": accuracy,
            "identical": mismatches["n"] == 0, "mismatches": mismatches}


def total(task_rows: list[dict]) -> dict:
    """The "all" row of one batch size: tokens, seconds, steps and drafts summed; acceptance weighted by drafts."""
    s = {k: sum(r[k] for r in task_rows) for k in ("plain_tokens", "spec_tokens", "plain_seconds", "spec_seconds",
                                                    "plain_steps", "spec_steps", "num_drafts", "plain_mixed_steps",
                                                    "spec_mixed_steps")}
    drafts = max(s["num_drafts"], 1)
    most = max(r["max_running"] for r in task_rows)
    passes = [r["plain_seconds_passes"] for r in task_rows]
    plain = {"tokens": s["plain_tokens"], "seconds": s["plain_seconds"], "steps": s["plain_steps"],
             "seconds_passes": [sum(p) for p in zip(*passes)] if all(passes) else None,
             "mixed_steps": s["plain_mixed_steps"], "max_running": most,
             "step_kinds": add_kinds([r["plain_step_kinds"] for r in task_rows])}
    spec = {"tokens": s["spec_tokens"], "seconds": s["spec_seconds"], "steps": s["spec_steps"],
            "mixed_steps": s["spec_mixed_steps"], "max_running": most,
            "step_kinds": add_kinds([r["spec_step_kinds"] for r in task_rows]),
            "num_drafts": s["num_drafts"],
            "verified_per_draft": sum(r["verified_per_draft"] * r["num_drafts"] for r in task_rows) / drafts,
            "mean_accepted_length": sum(r["mean_accepted_length"] * r["num_drafts"] for r in task_rows) / drafts,
            "acceptance_rate": sum(r["acceptance_rate"] * r["num_drafts"] for r in task_rows) / drafts}
    mism = {"n": sum(r["mismatches"]["n"] for r in task_rows), "of": sum(r["mismatches"]["of"] for r in task_rows),
            "first": []}
    acc = [r["plain_accuracy"] for r in task_rows]
    return row("all", task_rows[0]["batch"], plain, spec, sum(acc) / len(acc), mism, task_rows[0]["variant"])


def table(rows: list[dict]) -> str:
    head = ("| speculative_config over the default | task | batch | plain tok/s | spec tok/s | speedup | mean accepted "
            "| acceptance | plain steps | spec steps | plain accuracy | identical |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = []
    for r in rows:
        same = "yes" if r["identical"] else f"NO ({r['mismatches']['n']} of {r['mismatches']['of']})"
        lines.append(f"| `{r['variant']}` | {r['task']} | {r['batch']} | {r['plain_tok_s']:.1f} "
                     f"| {r['spec_tok_s']:.1f} "
                     f"| {r['speedup']:.2f} | {r['mean_accepted_length']:.2f} | {r['acceptance_rate']:.3f} "
                     f"| {r['plain_steps']} | {r['spec_steps']} | {100 * r['plain_accuracy']:.1f}% | {same} |")
    return "\n".join([head] + lines)


def kinds_table(rows: list[dict]) -> str:
    """The "all" rows' steps by kind: count, mean ms and share of the engine's busy time, plain and speculative."""
    head = ("| speculative_config over the default | batch | engine | step kind | steps | ms per step | share of step "
            "time |\n|---|---|---|---|---|---|---|")
    lines = []
    for r in (r for r in rows if r["task"] == "all"):
        for engine in ("plain", "spec"):
            kinds = r[f"{engine}_step_kinds"]
            busy = sum(v["seconds"] for v in kinds.values()) or 1.0
            lines += [f"| `{r['variant']}` | {r['batch']} | {engine} | {k} | {v['steps']} "
                      f"| {1e3 * v['seconds'] / v['steps']:.2f} | {100 * v['seconds'] / busy:.0f}% |"
                      for k, v in kinds.items() if v["steps"]]
    return "\n".join([head] + lines)


def learned_bench_args(ap: argparse.ArgumentParser) -> None:
    """The options of this script that bench_learned_server.py shares: checkpoint, device, batch sizes, prompts, K."""
    ap.add_argument("--model", required=True, help="a learned checkpoint (transformers layout, DSpark in dspark/)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batches", default="1,8", help="requests in flight at once")
    ap.add_argument("--n", type=int, default=50, help="eval prompts per task")
    ap.add_argument("--warmup-n", type=int, default=16, help="prompts per task of the warm-up pass (at most --n)")
    ap.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--seed", type=int, default=0, help="eval set seed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    learned_bench_args(ap)
    ap.add_argument("--variants", nargs="+", default=["{}"],
                    help="speculative settings to measure, each a JSON object of speculative_config keys over the "
                    "default (K = --k, greedy drafts); default: the default alone")
    ap.add_argument("--out", default=None, help="JSON results (a markdown table is printed)")
    ap.add_argument("--profile", default=None, choices=TASKS,
                    help="after the timed passes, one more pass over this task's warm-up prompts per engine and batch "
                    "size under torch.profiler; the tables go to OUT's name with .profile.txt (with --out)")
    a = ap.parse_args(argv)
    if a.profile and (not a.out or a.profile not in a.tasks):
        ap.error("--profile needs --out and one of --tasks")
    variants = {v: json.loads(v) for v in a.variants}
    if not all(isinstance(o, dict) for o in variants.values()):
        ap.error(f"--variants: each must be a JSON object, got {a.variants}")
    batches = [int(b) for b in a.batches.split(",")]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tok = Tokenizer.from_pretrained(a.model)
    sets = eval_sets(a.n, a.seed, tuple(a.tasks))
    budgets = token_budgets(sets, tok)
    prompts = {t: [prompt_ids(ex, tok) for ex in exs] for t, exs in sets.items()}
    warmup_n = min(a.warmup_n, a.n)

    results: dict[str, dict[int, dict]] = {}
    profiles: list[str] = []
    for mode in ["plain", *variants, PLAIN_AGAIN]:
        plain_mode = mode in ("plain", PLAIN_AGAIN)
        opts = engine_options(a.device, a.dtype, speculative=not plain_mode)
        if not plain_mode:
            opts["speculative_config"].update({"num_speculative_tokens": a.k, **variants[mode]})
        t0 = time.perf_counter()
        with LLM(model=a.model, enable_prefix_caching=False, **opts) as llm:
            print(f"{mode}: engine built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            results[mode] = {}
            for b in batches:
                results[mode][b] = measure(llm, prompts, budgets, b, warmup_n, tok)
                if a.profile:
                    profiles.append(f"## {mode}, {a.profile}, batch {b}\n" + profile_pass(
                        llm, prompts[a.profile][:warmup_n], budgets[a.profile], b, a.device))
                print(f"{mode}: batch {b} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        del llm  # its weights and KV pool go before the next engine sizes its pool from the free memory
        gc.collect()
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(f"{mode}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    results["plain"] = faster_plain(results.pop("plain"), results.pop(PLAIN_AGAIN))
    rows = []
    for v, b in itertools.product(variants, batches):
        plain, spec = results["plain"][b], results[v][b]
        texts = {t: plain[t]["texts"] for t in sets}
        acc = score(sets, texts)
        diff = unlike(texts, {t: spec[t]["texts"] for t in sets})
        task_rows = [row(t, b, plain[t], spec[t], acc[t]["accuracy"], diff[t], v) for t in sets]
        rows += task_rows + [total(task_rows)]

    res = {"date": started, "device_name": _device_name(a.device), "torch": torch.__version__,
           "command": "python benchmarks/bench_learned_spec.py " + shlex.join(sys.argv[1:] if argv is None else argv),
           "commit": os.environ.get("COMMIT") or _commit(HERE), "model": a.model, "device": a.device,
           "dtype": a.dtype, "k": a.k, "variants": list(variants), "n_per_task": a.n, "warmup_n": warmup_n,
           "seed": a.seed, "batches": batches,
           "tasks": list(sets), "budgets": budgets, "rows": rows,
           "identical": all(r["identical"] for r in rows)}
    print(f"\n{res['device_name']}, {a.dtype}, {a.model}, K={a.k}, {a.n} prompts per task, commit {res['commit']}\n")
    print(table(rows))
    print("\nSteps by kind (ScheduledBatch.kind; a step's time from its scheduling, or the step before it done, to its "
          "outputs):\n")
    print(kinds_table(rows))
    if not res["identical"]:
        print("\ngreedy replies differ between plain and speculative decoding (see 'mismatches' in the JSON)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        if profiles:
            with open(os.path.splitext(a.out)[0] + ".profile.txt", "w") as f:
                f.write("\n\n".join(profiles) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
