#!/usr/bin/env python3
"""Host time of a speculative decode step, per part, at a few batch sizes (CPU; the toy cut of M3 bench_spec's
--smoke builds). On the GPU a graphed speculative step is one replay, so what remains of the step's wall time is the
host's Python work before and after it: this measures that work without a GPU.

    python benchmarks/bench_spec_host.py --batches 1,32 --out /tmp/spec_host.json

Per decode step of greedy requests with controlled acceptance p (executor/speculative/controlled.py, the recording
made first with p = 0), steps through the graphs' static-buffer path (run eagerly on the CPU), ms per step:
  schedule   Scheduler.schedule (decodes with their drafts, lookahead pages)
  build      StepBuilder.build (the StepInput's host tensors)
  fill       SpeculativeBuffers.fill_speculative (the step's tensors into the graph buffers: the copies to the device
             on CUDA)
  complete   LLMEngine._complete (tokens appended, stop checks, counters, rollback of rejected drafts' pages)
  host       the step's wall time less the phases (SpeculativeDecoder.run: the graph replay's work on the GPU)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import torch

from m3serve.config import EngineConfig  # noqa: E402
from m3serve.engine.llm_engine import LLMEngine  # noqa: E402
from m3serve.engine.sampling_params import SamplingParams  # noqa: E402
from m3serve.engine.scheduler import Scheduler  # noqa: E402
from m3serve.engine.step_builder import StepBuilder, as_int64  # noqa: E402
from m3serve.executor.speculative.controlled import ControlledProposals  # noqa: E402
from m3serve.executor.speculative.decoder import SpeculativeDecoder  # noqa: E402
from m3serve.executor.speculative.graphs import SpeculativeBuffers  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec import SMOKE_WIDTHS, build_m3_cut  # noqa: E402
from geometry import write_draft  # noqa: E402

PARTS = {"schedule": (Scheduler, "schedule"), "build": (StepBuilder, "build"),
         "fill": (SpeculativeBuffers, "fill_speculative"),
         "complete": (LLMEngine, "_complete"), "phases": (SpeculativeDecoder, "run")}


class Timers:
    """Wall time spent in each part's method (patched on its class while the context is open)."""

    def __init__(self):
        self.s = collections.Counter()
        self._saved = []

    def __enter__(self):
        for name, (cls, meth) in PARTS.items():
            orig = getattr(cls, meth)
            self._saved.append((cls, meth, orig))
            setattr(cls, meth, self._wrap(name, orig))
        return self

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s[name] += time.perf_counter() - t0
        return timed

    def __exit__(self, *exc):
        for cls, meth, orig in self._saved:
            setattr(cls, meth, orig)


def generate(eng: LLMEngine, prompts: list[list[int]], gen: int, timers: Timers | None = None) -> tuple[list, dict]:
    """Greedy decode of the prompts; the outputs and (with timers) ms per decode step of each part."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=gen, ignore_eos=True, seed=1000 + i))
    outs: dict[str, list[int]] = collections.defaultdict(list)
    while len(outs) < len(prompts):  # the prefill step(s): not timed
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
    steps, wall = 0, 0.0
    ctx = timers if timers is not None else Timers()
    with ctx:
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            for o in eng.step():
                outs[o.request_id].extend(o.new_token_ids)
            wall += time.perf_counter() - t0
            steps += 1
    ms = {name: 1e3 * ctx.s[name] / steps for name in PARTS}
    ms["host"] = 1e3 * wall / steps - ms["phases"]
    ms["steps"] = steps
    return [outs[f"r{i}"] for i in range(len(prompts))], ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--p", type=float, default=0.9)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs per batch size (each part's best is reported: a shared host is noisy)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    batches = [int(b) for b in a.batches.split(",")]
    model = build_m3_cut(2, "cpu", torch.float32, **SMOKE_WIDTHS)
    tmp = tempfile.mkdtemp(prefix="bench_spec_host_")
    write_draft(model, os.path.join(tmp, "dspark"), 1, a.k, 16)
    max_len = a.prompt_len + a.gen_len + a.k + 1
    eng = LLMEngine(EngineConfig(
        model=tmp, device="cpu", dtype="float32", max_model_len=max_len, max_num_seqs=max(batches),
        max_num_batched_tokens=max(batches) * max(a.prompt_len, a.k + 1), enable_prefix_caching=False,
        enforce_eager=True, speculative_config={"method": "dspark", "num_speculative_tokens": a.k,
                                                "kv_cache_dtype": "auto"}), model=model)
    drafter = eng.executor.worker.drafter
    drafter.enable_graphs(max(batches), max_len)  # the static-buffer path graphed steps take (eager on the CPU)
    g = torch.Generator().manual_seed(1)
    rows = []
    for b in batches:
        prompts = [torch.randint(0, SMOKE_WIDTHS["vocab_size"] - 1, (a.prompt_len,), generator=g).tolist()
                   for _ in range(b)]
        drafter.proposal_hook = None
        rec, _ = generate(eng, prompts, a.gen_len)
        drafter.proposal_hook = ControlledProposals({as_int64(1000 + i): prompts[i] + rec[i] for i in range(b)},
                                                    a.p, SMOKE_WIDTHS["vocab_size"])
        best = None
        for _ in range(a.repeats):
            toks, ms = generate(eng, prompts, a.gen_len, Timers())
            assert toks == rec, "greedy tokens changed with the controlled proposals"
            best = ms if best is None else {n: min(v, ms[n]) for n, v in best.items()}
        rows.append({"batch": b, "p": a.p, **best})
        print(f"batch {b}: " + ", ".join(f"{k} {v:.3f}" if k != "steps" else f"{k} {v}" for k, v in best.items()),
              flush=True)
    print("\n| batch | steps | " + " | ".join(f"{n} ms" for n in list(PARTS) + ["host"]) + " |")
    print("|---|---|" + "---|" * (len(PARTS) + 1))
    for r in rows:
        print(f"| {r['batch']} | {r['steps']} | " + " | ".join(f"{r[n]:.3f}" for n in list(PARTS) + ["host"]) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"torch": torch.__version__, "args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
