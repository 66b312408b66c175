"""The engine on CUDA uses the Triton kernels (insert, indexer, block-sparse attention) and its
outputs still match the reference path: the same engine with the torch reference attention over the
same paged cache. fp32 model compute; the kernels' dots take bf16/fp16 operands, so logprobs differ by
0.02-0.07 (measured, also under the interpreter); a wrong kernel moves them by whole units.

Two free runs can part at a near-tie (see tests/support/shadow.py), so the per-layer check is the
shadow run: kernels and reference on the same inputs at every layer of every step."""
from __future__ import annotations

import pytest

from m3serve import LLM, SamplingParams
from m3serve.model.layers.attention import TorchAttention
from m3serve.model.layers.triton_attention import TritonAttention

from support.shadow import shadow_of

pytestmark = pytest.mark.gpu

# > top-k x block = 64 tokens for the tiny model, so the indexer really drops blocks
PROMPTS = [list(range(3, 23)), [(7 * i) % 500 + 3 for i in range(90)], [(13 * i) % 480 + 5 for i in range(150)]]


def _run(tiny_model_dir, kv_cache_dtype, reference: bool, **kw):
    llm = LLM(model=tiny_model_dir, device="cuda", dtype="float32", kv_cache_dtype=kv_cache_dtype,
              max_model_len=512, num_gpu_blocks_override=64, enforce_eager=True, **kw)  # backends swapped below
    runner = llm.engine.executor.worker.runner
    if reference:
        runner.bind_attention([TorchAttention(runner.model.attention_geometry, c)  # over the same PagedKVCache
                               for c in runner.cache.layers])
    else:
        assert all(isinstance(b, TritonAttention) for b in runner.attention), "the engine did not pick the kernels"
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    return llm.generate(PROMPTS, sp)


@pytest.mark.parametrize("kv", ["bfloat16", "fp8", "nvfp4"])
@pytest.mark.parametrize("budget", [8192, 40])  # whole prefills, and chunked prefill mixed with decodes
def test_engine_kernels_match_reference(tiny_model_dir, kv, budget):
    ref = _run(tiny_model_dir, kv, True, max_num_batched_tokens=budget)
    got = _run(tiny_model_dir, kv, False, max_num_batched_tokens=budget)
    for r, g in zip(ref, got):
        # identical cache bytes: greedy tokens agree until a near-tie meets bf16 rounding
        n = next((i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b), len(r.token_ids))
        assert n >= 8, (kv, budget, n, r.token_ids, g.token_ids)
        if kv == "nvfp4":
            # one flipped block moves a later logprob by 0.5 (2026-12-02): the shadow test checks nvfp4 per layer
            continue
        lp_r = [d[t] for d, t in zip(r.logprobs, r.token_ids)][:n]
        lp_g = [d[t] for d, t in zip(g.logprobs, g.token_ids)][:n]
        assert len(lp_r) == n and max(abs(a - b) for a, b in zip(lp_r, lp_g)) < 0.15


@pytest.mark.parametrize("kv", ["bfloat16", "fp8", "nvfp4"])
@pytest.mark.parametrize("budget", [8192, 40])
def test_engine_kernels_shadow(tiny_model_dir, kv, budget):
    llm = LLM(model=tiny_model_dir, device="cuda", dtype="float32", kv_cache_dtype=kv, max_model_len=512,
              num_gpu_blocks_override=64, max_num_batched_tokens=budget, enforce_eager=True)
    runner = llm.engine.executor.worker.runner
    assert all(isinstance(b, TritonAttention) for b in runner.attention)
    shadow = shadow_of(runner, tol=0.05)
    llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    print(f"{kv} budget={budget}: {shadow.calls} layer calls, {shadow.tokens} token rows, "
          f"{shadow.flips} near-tie flips, max error {shadow.max_err:.3g}")
    assert shadow.calls >= 4 * 24 and shadow.packed_calls == shadow.calls
    assert shadow.flips <= shadow.tokens // 100
