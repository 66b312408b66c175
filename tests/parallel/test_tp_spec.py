"""DSpark speculative decoding under tensor parallelism (CPU, gloo worker processes): every rank runs the draft on
the step's sampling fields and draws the same drafts (were they to differ, the ranks' vocab-parallel embedding of
the verify tokens would mix different ids and the tokens would leave TP 1's); greedy output equals plain TP 1
decoding (TP 2 and TP 4), sampled output equals TP 1 with speculation, token for token."""
from __future__ import annotations

import pytest

from m3serve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 7, 9, 11] * 5, [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
DSPARK = {"method": "dspark", "num_speculative_tokens": 3}


def _generate(tiny_model_dir, tp: int, speculative_config: dict | None, params):
    with LLM(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=tp,
             speculative_config=speculative_config) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, params)], llm.engine.stats()


def test_tp2_speculation_greedy_equals_plain_and_sampled_equals_tp1(tiny_model_dir):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, _ = _generate(tiny_model_dir, 1, None, greedy)
    got, st = _generate(tiny_model_dir, 2, DSPARK, greedy)
    assert got == plain and st["spec_decode_num_drafts"] > 0
    # near-uniform distributions at temperature 4: the random draft's probabilistic drafts are often accepted
    hot = [SamplingParams(temperature=4.0, max_tokens=14, ignore_eos=True, seed=7 + i) for i in range(len(PROMPTS))]
    speculative_config = {**DSPARK, "draft_sample_method": "probabilistic", "kv_cache_dtype": "fp8"}
    one, st1 = _generate(tiny_model_dir, 1, speculative_config, hot)
    two, st2 = _generate(tiny_model_dir, 2, speculative_config, hot)
    assert two == one and st2["spec_decode_num_accepted_tokens"] == st1["spec_decode_num_accepted_tokens"] > 0


def test_tp4_speculation_greedy_equals_plain(tiny_model_dir):
    """TP 4 on the tiny model (2 KV heads: each shared by two ranks), the draft on every rank."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain, _ = _generate(tiny_model_dir, 1, None, greedy)
    got, st = _generate(tiny_model_dir, 4, DSPARK, greedy)
    assert got == plain and st["spec_decode_num_drafts"] > 0


def test_tp2_speculation_with_a_draft_vocab_equals_tp1(tiny_model_dir, tmp_path):
    """A draft vocabulary crowded into rank 1's half of the vocabulary (70 ids below 256, 150 above: rank 0's share
    padded to rank 1's rows, so the gathered logits have padding between the ranks' real columns): greedy output
    equals plain decoding, sampled output and its accepted drafts equal TP 1 with the same draft vocabulary (every
    rank gathers the same subset logits and draws the same drafts; picking the wrong columns fails it)."""
    from m3serve.model.dspark_tiny import make_tiny_dspark

    ids = list(range(300, 450)) + list(range(70))
    make_tiny_dspark(tiny_model_dir, str(tmp_path / "draft"), draft_vocab_ids=ids)
    spec = {**DSPARK, "model": str(tmp_path / "draft"), "draft_vocab_size": len(ids)}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, _ = _generate(tiny_model_dir, 1, None, greedy)
    got, st = _generate(tiny_model_dir, 2, spec, greedy)
    assert got == plain and st["spec_decode_num_drafts"] > 0
    hot = [SamplingParams(temperature=4.0, max_tokens=14, ignore_eos=True, seed=7 + i) for i in range(len(PROMPTS))]
    spec = {**spec, "draft_sample_method": "probabilistic"}
    one, st1 = _generate(tiny_model_dir, 1, spec, hot)
    two, st2 = _generate(tiny_model_dir, 2, spec, hot)
    assert two == one and st2["spec_decode_num_accepted_tokens"] == st1["spec_decode_num_accepted_tokens"] > 0
