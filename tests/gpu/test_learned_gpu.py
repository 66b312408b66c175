"""The learned model's shape on CUDA (m3serve.learn.config: 32-token MSA blocks, top-4, 64-dim heads; the other
GPU tests run the tiny model's 16-token blocks): the Triton kernels agree with the torch reference at every layer
of every step (the shadow backend, tests/support/shadow.py) on retrieval prompts of ~619 tokens, where the indexer
keeps 4 of ~20 blocks, for each KV cache format. Random weights: only the kernels are under test here."""
from __future__ import annotations

import pytest

from m3serve import LLM, SamplingParams
from m3serve.learn.config import make_learned
from m3serve.learn.render import prompt_ids
from m3serve.learn.tasks import make_examples
from m3serve.model.layers.triton_attention import TritonAttention

from support.shadow import shadow_of

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def learned_random(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("learned_random"))
    make_learned(d)
    return d


@pytest.mark.parametrize("kv", ["bfloat16", "fp8", "nvfp4"])
def test_learned_shape_kernels_shadow(learned_random, kv):
    llm = LLM(model=learned_random, device="cuda", dtype="float32", kv_cache_dtype=kv, max_model_len=1024,
              num_gpu_blocks_override=256, enforce_eager=True)
    runner = llm.engine.executor.worker.runner
    assert all(isinstance(b, TritonAttention) for b in runner.attention)
    shadow = shadow_of(runner, tol=0.05)
    tok = llm.tokenizer
    prompts = [prompt_ids(ex, tok) for ex in make_examples("retrieval", "eval", 3)]
    assert min(map(len, prompts)) > 5 * 32 * 4
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    print(f"{kv}: {shadow.calls} layer calls, {shadow.tokens} token rows, {shadow.flips} near-tie flips, "
          f"max error {shadow.max_err:.3g}")
    assert shadow.calls >= 6 * 16 and shadow.packed_calls == shadow.calls
    assert shadow.flips <= shadow.tokens // 100
