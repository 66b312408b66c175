"""Prefill and mixed steps replayed from piecewise CUDA graphs (`piecewise_graph_tokens`, executor/piecewise.py) give
the eager engine's tokens: chunked prefill beside decodes, steps padded to their token bucket, the attention eager
between the pieces. The pieces run at the bucket's token count, so a kernel may take other tiles there than at the
step's own count (dispatch by token count): logprobs may differ in the last bits, greedy tokens part only at a
near-tie; a wrong piece (a stale buffer, a dropped layer) moves them by whole units."""
import pytest
import torch

from m3serve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _generate(tiny_model_dir, pieces: int):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 480, (n,), generator=g).tolist() for n in (20, 90, 150, 7, 64, 33, 120)]
    llm = LLM(model=tiny_model_dir, device="cuda", dtype="float32", kv_cache_dtype="bfloat16", max_model_len=512,
              num_gpu_blocks_override=96, max_num_batched_tokens=64, max_num_seqs=8, piecewise_graph_tokens=pieces)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2))
    return outs, llm.engine.executor.worker.runner.piecewise


def test_piecewise_graphs_give_the_eager_tokens(tiny_model_dir):
    eager, none = _generate(tiny_model_dir, 0)
    assert none is None
    graphed, pieces = _generate(tiny_model_dir, 64)
    assert pieces is not None and pieces.buckets == [16, 32, 64] and set(pieces.graphs) == {16, 32, 64}
    assert pieces.num_steps > 0 and pieces.padded_rows > 0  # prefill / mixed steps replayed, padded
    for e, g in zip(eager, graphed):
        n = next((i for i, (a, b) in enumerate(zip(e.token_ids, g.token_ids)) if a != b), len(e.token_ids))
        assert n >= 8, (n, e.token_ids, g.token_ids)
        lp_e = [d[t] for d, t in zip(e.logprobs, e.token_ids)][:n]
        lp_g = [d[t] for d, t in zip(g.logprobs, g.token_ids)][:n]
        assert max(abs(a - b) for a, b in zip(lp_e, lp_g)) < 0.05
