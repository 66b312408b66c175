#!/usr/bin/env python3
"""DSpark speculative decoding in the engine: decode tokens/s with and without speculation, against the ideal
speedup for the acceptance measured in the same run, on the M3.1-Flash geometry cut to a few layers (random weights).

    python benchmarks/bench_spec.py --out /tmp/bench_spec.json        (H200, ~3-4 minutes)
    python benchmarks/bench_spec.py --smoke --out /tmp/s.json          (CPU, toy sizes: checks the script runs)

Model: benchmarks/geometry.py's `flash_geometry(--layers)` + `random_model`: MiniMax-M3.1-Flash's shapes, layer 0
full attention + dense MLP, the rest MSA + MoE with NVFP4 routed experts and an MXFP8 shared expert, bf16 elsewhere;
NVFP4 KV cache and index keys. The DSpark draft: the tiny draft's architecture at these widths (--draft-layers dense
layers, Markov rank 256, confidence head), random, written as a checkpoint to a temporary folder and loaded by the
engine's loader. (--smoke: a toy fp32 cut of M3, `build_m3_cut`, where greedy speculation must match exactly.)

Controlled acceptance (a random draft is never right): the real draft runs for its cost, then its proposals go
through `ControlledProposals` (executor/speculative/controlled.py): at each drafted position the draft's token is
replaced, with probability p, by the token the target itself produces there (its greedy continuation, recorded
first by the speculative engine with p = 0 so the numerics are the verify path's), and the verifier is handed the
true mixture distribution. With greedy decoding a drafted position whose prefix was accepted is then accepted
with probability ~p.

Per batch size B (--batches, default 1,4,8,16,32) the same B random prompts (--prompt-len tokens, --gen-len greedy
tokens each, ignore_eos) run through:
  plain      the engine without speculation, CUDA graphs for decode (the default)
  spec p=0   speculation with K = --k drafts, none replaced: the recording run, and the cost of drafts that are all
             rejected; speculative steps replay their CUDA graphs (executor/speculative/graphs.py; --eager: eagerly)
  spec p     for each p in --ps
Decode tokens/s = tokens generated after every request's first token / wall time of those steps (the prefill
step is excluded); with graphs the same run goes once before, so every bucket it reaches is captured beforehand.
Ideal speedup = the measured mean accepted length tau = 1 + accepted / drafts (tokens a speculative step emits:
what a free draft and a verify forward as cheap as a decode step would give).
Efficiency = speedup / tau (goal >= 0.8). "step cost" = mean speculative step time / mean plain step time, in plain
steps. The split: mean device time of each phase graph of the graphed steps (CUDA events between the replays:
draft backbone, Markov positions, verify = the target's forward over K+1 tokens per sequence, rule = logits, sampling
and acceptance, insert = the draft-cache rows; measured in a second pass over the same prompts, as the events cost
time), and "host" = the first pass's step wall time minus those. "eager steps" = decode steps of the first pass that
ran eagerly (not graphed: mixed steps; at most the prefill's neighbours with greedy requests). "ahead" = steps of
that pass queued before the previous step's tokens were back (async scheduling, `LLMEngine._launch_ahead`: the
host's work then overlaps the device's; in a request's last ~2K+2 tokens its next drafts depend on the accepted
run: it joins every other step, and steps where every request is there run synchronously). "match" = fraction
of requests whose tokens equal the plain run's (greedy: 1.0 up to bf16 near-ties between the decode and verify
kernels).
"recorded" = fraction of requests whose tokens equal the p = 0 recording: controlled acceptance means what it says
only at 1.0. With random bf16 weights the logits are near-ties everywhere, so a position computed by other kernels
than in the recording run (another rounding) can change the target's greedy token; from there on the recording no
longer predicts the target, that request's drafts are the random draft's, and its acceptance falls to ~0. One
such cause is a decode verified inside a mixed step (beside a prefill chunk: the prefill-sized attention and MoE
paths), which the recording run and a p run do at different positions (the p run's accepted drafts included). So
the token budget (--max-num-batched-tokens) defaults to the whole batch's prompts: they prefill in one step and no
decode shares a step with a prefill chunk; the columns below tell whether another cause remains. (2026-12-04 on the H200, under the old budget of 4096 tokens: batch 32
x 512 prompt tokens runs 4 mixed steps (the scheduler's count, on the CPU) and its p = 0.9 run measured a mean
accepted length of 2.23; batches 1 and 8 prefill in one step and measured 5.5-5.6.) "mixed" and
"preempted" count the measured pass's mixed steps and preemptions (a preempted request is recomputed by a
prefill: the same effect); "captures" the graphs captured during it (each costs a capture's time: the warm pass
before should have made them); "repeat" the fraction of requests whose tokens equal those of the pass before it
(the same prompts, the same p: below 1.0, the device's arithmetic differed between two identical runs, and
"recorded" cannot hold either).

Caveat, to read the figures: the cut model has few layers while the draft keeps its full width, so the draft's
share of a step is larger than on the 60-layer model. Hence the projection to 60 layers (graphed runs): the
target's layers scaled by 60 / --layers, everything else as measured: a speculative step = its measured time + the
verify phase x (60 - L) / L; a plain step = its measured time + (its decode forward graph - the lm_head alone) x
(60 - L) / L (the forward graph of the batch replayed and the lm_head over the batch's rows, timed with CUDA events
after the plain run). Projected speedup = tau x plain / speculative step, efficiency = plain / speculative step.

--draft-vocab N: the draft proposes from N ids only (speculative_config `draft_vocab_size`, model/dspark_vocab.py):
its base logits read N lm_head rows instead of the vocabulary's, its Markov head N rows of W2. The subset, written
into the draft checkpoint before the speculative engine loads it, is what a frequency-ranked draft vocabulary would
hold here: the tokens the plain runs produced (every batch's, most frequent first), then seeded random ids up to N.
Controlled acceptance stays inside the subset (a known token outside it is not proposed: controlled.py), so the
recorded continuations must be in it; a token the recording run produced but the plain runs did not (a near-tie)
falls back to the draft's own token there.

--confidence-scheduling: a third engine with confidence-scheduled verification (executor/speculative/confidence.py) and
the measured cost table, for each p (p > 0) at each batch size: the controlled proposals' confidence is p, the
true chance of each drafted token (a calibrated head); the workload runs once to capture every width's graphs,
then timed. Reported beside the fixed-K run: tokens/s, the ratio, the mean verify width, match.

`cost_table` (JSON; per p, the figures of p = 0): [verify tokens = B (K+1), speculative step ms] per batch size B, as
measured and projected to 60 layers: what `speculative_config.confidence_cost_table` takes (the step time at that
many verify tokens; executor/speculative/confidence.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.config import FULL, KV_BYTES_PER_ELEMENT, SPARSE, EngineConfig, ModelConfig  # noqa: E402
from m3serve.engine.llm_engine import LLMEngine  # noqa: E402
from m3serve.engine.sampling_params import SamplingParams  # noqa: E402
from m3serve.executor.speculative.controlled import ControlledProposals  # noqa: E402
from m3serve.engine.speculative_metrics import SpeculativeStats  # noqa: E402
from m3serve.engine.step_builder import as_int64  # noqa: E402
from m3serve.executor.cuda_graph import _bucket  # noqa: E402
from m3serve.model.m3 import M3ForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from geometry import flash_geometry, random_model, speculative_floor, weight_bytes, write_draft  # noqa: E402

PHASES = ("draft", "markov", "verify", "rule", "insert")  # SpeculativeDecoder.phases (target forward = "verify")
TARGET_LAYERS = 60  # MiniMax-M3's (3 dense + 57 MoE); the projection scales the cut's layers evenly

M3_WIDTHS = dict(hidden_size=6144, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                 intermediate_size=3072, num_local_experts=128, num_experts_per_tok=4, dense_intermediate_size=12288,
                 shared_intermediate_size=3072, vocab_size=200064, index_n_heads=4, index_head_dim=128,
                 index_block_size=128, index_topk_blocks=16, partial_rotary_factor=0.5)
SMOKE_WIDTHS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=64,
                    num_local_experts=8, num_experts_per_tok=2, dense_intermediate_size=128,
                    shared_intermediate_size=64, vocab_size=512, index_n_heads=2, index_head_dim=32,
                    index_block_size=16, index_topk_blocks=4, partial_rotary_factor=0.5)


def build_m3_cut(num_layers: int, device: str, dtype: torch.dtype, seed: int = 0, **widths) -> M3ForCausalLM:
    """MiniMax-M3 cut to `num_layers` layers (layer 0: full attention + dense MLP; the rest: MSA + MoE), random
    weights (normal, std 1/sqrt(fan-in); norms around 1; embedding std 1), on `device`. `widths` override
    M3's (the smoke run passes toy ones)."""
    w = {**M3_WIDTHS, **widths}
    cfg = ModelConfig(num_hidden_layers=num_layers, layer_types=[FULL] + [SPARSE] * (num_layers - 1),
                      mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1), dtype=str(dtype).split(".")[1], **w)
    with torch.device(device):
        model = M3ForCausalLM(cfg, dtype)
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary" in name:
                continue
            if "norm" in name or "e_score_correction_bias" in name:
                t.normal_(0.0, 0.1, generator=g)  # RMSNorm weights are offsets: (1 + w)
            else:
                t.normal_(0.0, 1.0 if "embed" in name else t.shape[-1] ** -0.5, generator=g)
    return model.eval()


def run_batch(eng: LLMEngine, prompts: list[list[int]], gen: int, seed0: int) -> dict:
    """Greedy decode of `prompts`; decode tokens/s after the prefill step, the outputs, steps and their time."""
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}", prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=gen, ignore_eos=True, seed=seed0 + i))
    outs: dict[str, list[int]] = {}
    while len(outs) < len(prompts) or not all(outs.values()):
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    first = sum(len(v) for v in outs.values())
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    steps, t0 = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
    sync()
    dt = time.perf_counter() - t0
    decoded = sum(len(v) for v in outs.values()) - first
    return {"tokens": [outs[f"b{i}"] for i in range(len(prompts))], "decode_tokens": decoded, "seconds": dt,
            "steps": steps, "tok_s": decoded / dt if dt > 0 else 0.0, "step_ms": 1e3 * dt / max(steps, 1)}


def engine_counts(eng: LLMEngine) -> dict:
    """Counters whose change over a run says what else ran besides graphed decode steps (see 'recorded')."""
    st, graphs = eng.stats(), eng.executor.worker.drafter.graphs
    return {"mixed": st["num_mixed_steps"], "preempted": st["num_preemptions"],
            "captures": 0 if graphs is None else len(graphs.graphs), "ahead": st["num_steps_ahead"]}


def phase_split(r: dict, graphs, timed: dict) -> None:
    """Mean device time of each phase of the graphed speculative steps of the `timed` pass (CUDA events between the
    phase graphs), and the host's share of `r` (a pass without events): its step's wall time not covered by them."""
    if graphs is None:
        return
    graphs.flush_timing()
    ms = graphs.phase_ms
    if ms:
        mean = [sum(col) / len(ms) for col in zip(*ms)]
        r["phase_ms"] = dict(zip(PHASES, mean))
        r["phase_ms"]["host"] = max(0.0, r["step_ms"] - sum(mean))
        r["graphed_steps"] = len(ms)
        r["timed_pass_step_ms"] = timed["step_ms"]
    graphs.phase_ms = []


def _device_ms(fn, reps: int = 20) -> float:
    """Mean device time of fn() over `reps` calls (CUDA events; one warm call first)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def plain_layers_ms(eng: LLMEngine, b: int, pages: int) -> float | None:
    """The plain engine's target layers at batch b: its decode forward graph (bucket of b, `pages` table columns;
    the buffers as the last step left them: the same rows rewritten) less the lm_head over b rows. None without
    graphs."""
    r = eng.executor.worker.runner
    g = r.graphs
    if g is None or not g.forward_graphs:
        return None
    graph = g.forward_graphs[(_bucket(g.batches, b), _bucket(g.widths, pages))]
    h = torch.randn(b, r.model.config.hidden_size, device=r.device, dtype=r.model.dtype)
    with torch.inference_mode():
        head = _device_ms(lambda: r.model.compute_logits(h))
    return max(0.0, _device_ms(graph.replay) - head)


def project(r: dict, layers: int, plain_layers: float | None) -> dict | None:
    """A row's plain and speculative steps at 60 layers (see the module docstring); None without the split."""
    if r["phase_ms"] is None or plain_layers is None:
        return None
    f = (TARGET_LAYERS - layers) / layers
    plain, speculative = r["baseline_step_ms"] + f * plain_layers, r["spec_step_ms"] + f * r["phase_ms"]["verify"]
    return {"plain_step_ms": plain, "spec_step_ms": speculative, "step_cost": speculative / plain,
            "speedup": r["ideal_speedup"] * plain / speculative, "efficiency": plain / speculative,
            "verify_ms": r["phase_ms"]["verify"] * (1 + f)}


def cost_table(rows: list[dict], k: int) -> dict:
    """[verify tokens, speculative step ms] per batch size (p = 0), measured and projected to 60 layers."""
    zero = [r for r in rows if r["p"] == 0.0]
    return {"measured": [[r["batch"] * (k + 1), r["spec_step_ms"]] for r in zero],
            "projected_60_layers": [[r["batch"] * (k + 1), r["projection_60"]["spec_step_ms"]] for r in zero
                                    if r["projection_60"] is not None]}


def run_sched(eng: LLMEngine, results: dict, b: int, ps: list[float], prompts: list[list[int]], a, rows: list[dict]
              ) -> None:
    """Confidence-scheduled verification at batch b for each p (the controlled proposals' confidence is p: a
    calibrated head): the workload once to capture every width's graphs, then timed; its figures join b's rows."""
    drafter, vocab = eng.executor.worker.drafter, eng.model_config.vocab_size
    rec = results[("spec", b, 0.0)]["tokens"]
    known = {as_int64(1000 + i): prompts[i] + rec[i] for i in range(b)}
    for p in ps:
        drafter.proposal_hook = ControlledProposals(known, p, vocab, drafter.runner.device)
        run_batch(eng, prompts, a.gen_len, 1000)
        eng.speculative_stats = SpeculativeStats(a.k)
        r = run_batch(eng, prompts, a.gen_len, 1000)
        st = eng.speculative_stats.as_dict()
        row = next(x for x in rows if x["batch"] == b and x["p"] == p)
        row.update({"sched_tok_s": r["tok_s"], "sched_speedup": r["tok_s"] / row["baseline_tok_s"],
                    "sched_over_spec": r["tok_s"] / row["spec_tok_s"],
                    "sched_mean_width": st["spec_decode_num_draft_tokens"] / max(st["spec_decode_num_drafts"], 1),
                    "sched_acceptance_rate": st["spec_decode_acceptance_rate"],
                    "sched_match": sum(x == y for x, y in zip(r["tokens"], results[("plain", b)]["tokens"])) / b})


def draft_vocab(results: dict, batches: list[int], n: int, vocab_size: int) -> list[int]:
    """N distinct ids, most frequent first: the plain runs' output tokens by count, then seeded random ids."""
    counts: dict[int, int] = {}
    for b in batches:
        for seq in results[("plain", b)]["tokens"]:
            for t in seq:
                counts[t] = counts.get(t, 0) + 1
    ids = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    seen = set(ids)
    fill = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(2)).tolist()
    return ids + [t for t in fill if t not in seen][:n - len(ids)]


def describe(a) -> tuple[str, str]:
    """(the device, the model geometry) of the run."""
    dev = platform.processor() or "cpu" if a.smoke else torch.cuda.get_device_name()
    return dev, "toy fp32" if a.smoke else "M3.1-Flash (NVFP4 experts, MXFP8 shared expert, NVFP4 KV)"


def save(out: str | None, rows: list[dict], a) -> None:
    """The rows so far as JSON (rewritten after each batch size)."""
    if out:
        dev, geometry = describe(a)
        with open(out, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "geometry": geometry, "args": vars(a),
                       "rows": rows, "cost_table": cost_table(rows, a.k)}, f, indent=1)


def rows_of(results: dict, b: int, ps: list[float], layers: int) -> list[dict]:
    """The table rows of batch size b: each p against the plain run."""
    base, out = results[("plain", b)], []
    for p in [0.0] + ps:
        r, st = results[("spec", b, p)], results[("spec", b, p)]["stats"]
        tau = st["spec_decode_mean_accepted_length"]
        speedup = r["tok_s"] / base["tok_s"]
        out.append({
            "batch": b, "p": p, "baseline_tok_s": base["tok_s"], "spec_tok_s": r["tok_s"], "speedup": speedup,
            "acceptance_rate": st["spec_decode_acceptance_rate"],
            "acceptance_per_pos": st["spec_decode_acceptance_rate_per_pos"], "ideal_speedup": tau,
            "efficiency": speedup / tau if tau else 0.0, "step_cost": r["step_ms"] / base["step_ms"],
            "baseline_step_ms": base["step_ms"], "spec_step_ms": r["step_ms"],
            "phase_ms": r.get("phase_ms"), "graphed_steps": r.get("graphed_steps", 0),
            "eager_steps": r["eager_steps"], "steps": r["steps"],
            "match": sum(x == y for x, y in zip(r["tokens"], base["tokens"])) / b,
            "recorded": sum(x == y for x, y in zip(r["tokens"], results[("spec", b, 0.0)]["tokens"])) / b,
            "mixed": r["mixed"], "preempted": r["preempted"], "captures": r["captures"], "repeat": r["repeat"],
            "ahead": r["ahead"],
            "draft_columns": r["draft_columns"], "byte_floor": r["byte_floor"]})
        out[-1]["projection_60"] = project(out[-1], layers, base.get("plain_layers_ms"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, toy widths, few tokens: checks the script runs")
    ap.add_argument("--out", default=None, help="JSON results (a markdown table is printed)")
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--ps", default="0.5,0.9")
    ap.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--draft-sample-method", default="greedy", choices=["greedy", "probabilistic"])
    ap.add_argument("--draft-kv-cache-dtype", default="fp8")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="token budget per step (default: the largest batch's prompts, at least 4096: one prefill "
                         "step, no mixed steps; see 'recorded')")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="the draft proposes from N ids only (draft_vocab_size): the plain runs' tokens, then random")
    ap.add_argument("--eager", action="store_true", help="speculative steps eagerly (no graphs), for comparison")
    ap.add_argument("--prefill-mixed", action="store_true",
                    help="prefill chunks beside speculating decodes (speculative_config prefill_apart false)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="speculative steps synchronous (none queued ahead of the previous result), for comparison")
    ap.add_argument("--confidence-scheduling", action="store_true",
                    help="also confidence-scheduled verification, with the cost table these runs measured")
    a = ap.parse_args(argv)
    if a.smoke:
        a.batches, a.ps, a.layers, a.prompt_len, a.gen_len, a.k = "1,2", "0.8", 2, 20, 10, 3
    device = "cpu" if a.smoke else "cuda"
    batches = [int(b) for b in a.batches.split(",")]
    if a.confidence_scheduling and len(set(batches)) < 2:
        ap.error("--confidence-scheduling needs two batch sizes or more (its cost table's points)")
    ps = [float(p) for p in a.ps.split(",")]
    t_build = time.perf_counter()
    if a.smoke:  # fp32 toy widths: greedy speculation must match exactly
        model = build_m3_cut(a.layers, device, torch.float32, **SMOKE_WIDTHS)
        kv, cache = {}, "float32"
    else:  # M3.1-Flash: NVFP4 routed experts, MXFP8 shared expert, bf16 elsewhere; NVFP4 KV and index keys
        model = random_model(flash_geometry(a.layers), device)
        kv, cache = dict(kv_cache_dtype="nvfp4", attention_config={"indexer_kv_dtype": "nvfp4"}), "nvfp4"
    cfg = model.config
    # the byte floor's cache formats: the target's KV and index keys, the draft's KV
    floor_kv = dict(kv_dtype=cache, index_dtype=cache,
                    draft_kv_bytes_per_element=int(KV_BYTES_PER_ELEMENT.get(a.draft_kv_cache_dtype, 2)))
    tmp = tempfile.mkdtemp(prefix="bench_spec_")
    if not a.draft_vocab:  # with one, written once the plain runs tell the subset
        write_draft(model, os.path.join(tmp, "dspark"), a.draft_layers, a.k, 16 if a.smoke else 256)
    print(f"built the model and its draft in {time.perf_counter() - t_build:.1f} s", flush=True)

    bs = cfg.index_block_size
    max_len = a.prompt_len + a.gen_len + a.k + 1
    pages = max(batches) * -(-max_len // bs) + 8
    common = dict(model=tmp, device=device, dtype=str(model.dtype).split(".")[1], max_model_len=max_len,
                  max_num_seqs=max(batches), max_num_batched_tokens=a.max_num_batched_tokens or max(
                      4096, max(batches) * max(a.prompt_len, a.k + 1)),
                  num_gpu_blocks_override=pages, enable_prefix_caching=False, enforce_eager=a.smoke, **kv)
    speculative_config = {"method": "dspark", "num_speculative_tokens": a.k,
                          "draft_sample_method": a.draft_sample_method, "kv_cache_dtype": a.draft_kv_cache_dtype,
                          "prefill_apart": not a.prefill_mixed}
    if a.draft_vocab:
        if not 1 <= a.draft_vocab <= cfg.vocab_size:
            ap.error(f"--draft-vocab must be in 1..{cfg.vocab_size} (the vocabulary)")
        speculative_config["draft_vocab_size"] = a.draft_vocab
    g = torch.Generator().manual_seed(1)
    prompts = {b: [torch.randint(0, cfg.vocab_size - 1, (a.prompt_len,), generator=g).tolist() for _ in range(b)]
               for b in batches}
    warm = [torch.randint(0, cfg.vocab_size - 1, (a.prompt_len,), generator=g).tolist() for _ in range(max(batches))]
    engines = {"plain": {}, "spec": dict(speculative_config=speculative_config, enforce_eager=a.smoke or a.eager,
                                         async_scheduling=not a.no_async_scheduling)}
    if a.confidence_scheduling:  # its options once the spec runs measured the cost table
        engines["sched"] = None
    rows, results = [], {}
    for name, opts in engines.items():
        if name == "spec" and a.draft_vocab:  # the subset, from the plain runs' tokens (written before loading)
            write_draft(model, os.path.join(tmp, "dspark"), a.draft_layers, a.k, 16 if a.smoke else 256,
                        draft_vocab(results, batches, a.draft_vocab, cfg.vocab_size))
        if name == "sched":
            opts = dict(engines["spec"], speculative_config={
                **speculative_config, "confidence_scheduling": True,
                "confidence_cost_table": cost_table(rows, a.k)["measured"]})
            print(f"confidence scheduling with the cost table {opts['speculative_config']['confidence_cost_table']}",
                  flush=True)
        eng = LLMEngine(EngineConfig(**{**common, **opts}), model=model)
        drafter = eng.executor.worker.drafter
        if a.smoke and not a.eager and drafter is not None:  # the graphs' static-buffer path, run eagerly on the CPU
            drafter.enable_graphs(max(batches), max_len)
        for b in batches:
            if not a.smoke:  # compile / warm every shape first
                run_batch(eng, warm[:b], min(a.gen_len, 3 * (a.k + 1)), 500)
            if name == "sched":
                run_sched(eng, results, b, ps, prompts[b], a, rows)
                save(a.out, rows, a)
                continue
            if drafter is None:
                results[(name, b)] = run_batch(eng, prompts[b], a.gen_len, 1000)
                results[(name, b)]["plain_layers_ms"] = plain_layers_ms(eng, b, -(-(a.prompt_len + a.gen_len) // bs))
                continue
            for p in [0.0] + ps:
                if p > 0:
                    rec = results[("spec", b, 0.0)]["tokens"]
                    known = {as_int64(1000 + i): prompts[b][i] + rec[i] for i in range(b)}
                    drafter.proposal_hook = ControlledProposals(known, p, cfg.vocab_size, device)
                else:
                    drafter.proposal_hook = None
                graphs, first = drafter.graphs, None
                if graphs is not None:  # capture this p's graphs: the same run first (every batch and width bucket
                    first = run_batch(eng, prompts[b], a.gen_len, 1000)  # it reaches, captured outside the figures)
                eng.speculative_stats = SpeculativeStats(a.k)
                static0 = graphs.num_steps if graphs is not None else 0
                before = engine_counts(eng)
                r = run_batch(eng, prompts[b], a.gen_len, 1000)  # no events: the figures
                r.update({name: n - before[name] for name, n in engine_counts(eng).items()})
                r["repeat"] = None if first is None else \
                    sum(x == y for x, y in zip(r["tokens"], first["tokens"])) / b
                r["stats"] = eng.speculative_stats.as_dict()
                r["draft_columns"] = drafter.draft_columns  # N with a draft vocabulary, else the vocabulary
                r["byte_floor"] = speculative_floor(
                    weight_bytes(model), cfg, drafter.draft, b, a.prompt_len + a.gen_len // 2, a.k,
                    drafter.draft_columns if a.draft_vocab else None, **floor_kv)["ratio"]
                # steps that did not replay the graphs (prefill excluded: run_batch times decode steps only)
                r["eager_steps"] = r["steps"] - (graphs.num_steps - static0 if graphs is not None else 0)
                if graphs is not None:  # a second pass, CUDA events between the phases: the split
                    graphs.timing, graphs.phase_ms = True, []
                    timed = run_batch(eng, prompts[b], a.gen_len, 1000)
                    graphs.timing = False
                    phase_split(r, graphs, timed)
                results[("spec", b, p)] = r
            if drafter is not None:  # this batch's rows now (and the JSON so far: a run cut short keeps them)
                rows += rows_of(results, b, ps, a.layers)
                save(a.out, rows, a)
            print(f"batch {b} done ({time.perf_counter() - t_build:.0f} s)", flush=True)
        del eng
        if device == "cuda":
            torch.cuda.empty_cache()
    dev, geometry = describe(a)
    print(f"\n{dev}, torch {torch.__version__}; {geometry}, {a.layers} layers, draft {a.draft_layers} layer(s), "
          f"K={a.k}, prompt {a.prompt_len}, {a.gen_len} tokens, drafts {a.draft_sample_method}, draft vocabulary "
          f"{a.draft_vocab or 'all'}, speculative steps "
          f"{'eager' if a.eager else 'through the static buffers (CPU)' if a.smoke else 'graphed'}"
          f"{', synchronous' if a.no_async_scheduling else ''}\n")
    head = ("| batch | p | plain tok/s | spec tok/s | speedup | acceptance | ideal (tau) | efficiency | step cost "
            "(plain steps) | byte floor (plain steps) | " + " | ".join(f"{ph} ms" for ph in PHASES + ("host",))
            + " | eager steps | ahead | match | recorded | "
            "mixed | preempted | captures | repeat |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        split = " | ".join("-" if r["phase_ms"] is None else f"{r['phase_ms'][ph]:.2f}" for ph in PHASES + ("host",))
        print(f"| {r['batch']} | {r['p']} | {r['baseline_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f} | "
              f"{r['acceptance_rate']:.2f} | {r['ideal_speedup']:.2f} | {r['efficiency']:.2f} | {r['step_cost']:.2f} | "
              f"{r['byte_floor']:.2f} | {split} | {r['eager_steps']}/{r['steps']} | {r['ahead']}/{r['steps']} | "
              f"{r['match']:.2f} | {r['recorded']:.2f} | {r['mixed']} | "
              f"{r['preempted']} | {r['captures']} | {'-' if r['repeat'] is None else format(r['repeat'], '.2f')} |")
    print(f"\nProjected to {TARGET_LAYERS} layers (the target's layers x {TARGET_LAYERS}/{a.layers}, the rest as "
          "measured; graphed runs only)\n")
    head = ("| batch | p | plain step ms | spec step ms | step cost (plain steps) | verify ms | speedup | "
            "efficiency |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        pr = r["projection_60"]
        if pr is not None:
            print(f"| {r['batch']} | {r['p']} | {pr['plain_step_ms']:.2f} | {pr['spec_step_ms']:.2f} | "
                  f"{pr['step_cost']:.2f} | {pr['verify_ms']:.2f} | {pr['speedup']:.2f} | {pr['efficiency']:.2f} |")
    print("\ncost_table (verify tokens, speculative step ms; for speculative_config.confidence_cost_table):",
          json.dumps(cost_table(rows, a.k)))
    if a.confidence_scheduling:
        print("\nConfidence-scheduled verification (the measured cost table; confidence = p)\n")
        head = "| batch | p | spec tok/s | scheduled tok/s | scheduled / spec | speedup | mean verify width | match |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for r in rows:
            if "sched_tok_s" in r:
                print(f"| {r['batch']} | {r['p']} | {r['spec_tok_s']:.1f} | {r['sched_tok_s']:.1f} | "
                      f"{r['sched_over_spec']:.2f} | {r['sched_speedup']:.2f} | {r['sched_mean_width']:.2f} | "
                      f"{r['sched_match']:.2f} |")
    save(a.out, rows, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
