"""The load-time warm-up's steps (backend/executor/warmup.py): they cover both sides of every dispatch limit, are
well-formed steps the runner executes (here on the CPU's torch path: on CUDA they compile the kernels), and leave
nothing behind that a request could see (the same tokens after them)."""
from __future__ import annotations

import torch

from m3serve import LLM, SamplingParams
from m3serve.executor import warmup as W
from m3serve.kernels import dispatch


def test_token_counts_straddle_every_dispatch_limit():
    counts = W.token_counts(4096)
    for table in (dispatch.MOE_TABLE, dispatch.LINEAR_TABLE):
        for limit, *_ in table:
            if limit is not None:
                assert limit in counts and limit + 1 in counts
    assert {1, 16, 17, 4096} <= set(counts) and max(W.token_counts(100)) == 100


def _run_steps_between_two_generations(model: str, opts: dict, steps_of, speculative: bool = False):
    """Generate on a fresh engine; on a second one run the warm-up steps `steps_of(runner)` (each greedy and sampled),
    then generate again: the same tokens (the steps left nothing a request sees). Returns the second LLM."""
    prompts = [[5, 7, 9, 11], list(range(3, 70))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=model, **opts) as llm:
        fresh = [o.token_ids for o in llm.generate(prompts, sp)]
    with LLM(model=model, **opts) as llm:
        runner = llm.engine.executor.worker.runner
        k = runner.drafter.config.num_speculative_tokens if speculative else 0
        for item in steps_of(runner):  # a step's sequences, or (its sequences, how many are prefill chunks first)
            seqs, prefills = item if isinstance(item, tuple) else (item, 0)
            for kind in ("greedy", "sampled"):
                out = runner.execute(W.dummy_step(seqs, runner.cache.block_size, runner.cache.num_pages, "cpu", kind,
                                                  k=k, prefills=prefills))
                assert out.token_ids.shape[0] == len(seqs)
                if k:  # a prefill chunk emits one token, a sequence with j drafts up to j + 1
                    emitted = [1] * len(seqs) if out.num_tokens is None else out.num_tokens.tolist()
                    assert all(1 <= n <= (1 if i < prefills else q) for i, (n, (q, _)) in
                               enumerate(zip(emitted, seqs)))
        assert [o.token_ids for o in llm.generate(prompts, sp)] == fresh
    return llm


def test_warmup_steps_run_and_leave_no_trace(tiny_model_dir):
    opts = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128,
                num_gpu_blocks_override=24)

    def steps_of(runner):
        steps = W.plan(4, 128, 256, runner.cache.block_size, eager_decodes=True)
        assert any(len(s) > 1 and s[0][0] > 1 and s[1][0] == 1 for s in steps)  # a mixed step
        assert {len(s) for s in steps if all(q == 1 for q, _ in s)} == {1, 2, 3, 4}  # every decode batch size
        bs = runner.cache.block_size  # every batch size meets every table width
        widths = {(len(s), -(-(s[0][1] + 1) // bs)) for s in steps if all(q == 1 for q, _ in s)}
        assert widths == {(b, w) for b in range(1, 5) for w in range(1, -(-255 // bs) + 1)}
        assert max(q + c for s in steps for q, c in s) == 255  # the longest context a request can reach
        return steps
    llm = _run_steps_between_two_generations(tiny_model_dir, opts, steps_of)
    assert llm.engine.stats()["load_seconds"] > 0 and llm.engine.stats()["warmup_seconds"] == 0.0  # CPU: none
    runner = llm.engine.executor.worker.runner
    assert W.warm_up(runner, llm.engine.config, 256) is None and torch.device("cpu") == runner.device


def test_speculative_warmup_steps_run_and_leave_no_trace(tiny_model_dir):
    """The speculative decode steps of the warm-up (anchor + drafts, every batch size, fewer drafts near the end)
    run through the speculative runner (drafts, verification), and the same tokens come out after them."""
    opts = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=3, num_gpu_blocks_override=24,
                speculative_config={"method": "dspark", "num_speculative_tokens": 3})

    def steps_of(runner):
        bs = runner.cache.block_size
        steps = W.speculative_plan(3, 128, runner.drafter.config.num_speculative_tokens, bs)
        assert {len(s) for s in steps} == {1, 2, 3} and {q for s in steps for q, _ in s} == {2, 3, 4}
        widths = {(len(s), -(-(s[0][0] + s[0][1]) // bs)) for s in steps if s[0][0] == 4}
        assert widths == {(b, w) for b in range(1, 4) for w in range(1, -(-127 // bs) + 1)}
        mixed = W.mixed_speculative_plan(3, 512, 128, 3, bs)  # a prefill chunk beside 1 or 2 speculating sequences
        assert {(len(s) - 1, s[1][0] - 1) for s in mixed} == {(b, j) for b in (1, 2) for j in (1, 2, 3)}
        assert all(s[0][1] == 0 and s[0][0] > 1 and len({x for x in s[1:]}) == 1 for s in mixed)
        return steps + [(s, 1) for s in mixed]
    _run_steps_between_two_generations(tiny_model_dir, opts, steps_of, speculative=True)


def test_table_widths_cover_each_class_when_not_every_width():
    assert W.table_widths(16, 1023, 128) == list(range(1, 9))  # 16 x 8 pairs: all
    w = W.table_widths(256, 131071, 128)  # 256 x 1024: each class of each power-of-two range
    assert w == [1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024]
