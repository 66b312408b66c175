"""Piecewise graphs of prefill and mixed steps (executor/piecewise.py): on the CPU the pieces run eagerly (no capture),
so the tiny engine's steps go through the same decomposition the graphs replay: each step's rows padded to its token
bucket, the attention between the pieces on the real rows. The tokens are the standalone greedy reference's."""
import pytest

from m3serve.config import ConfigError, EngineConfig
from m3serve.executor.piecewise import PiecewiseGraphs, token_buckets


def test_token_buckets():
    assert token_buckets(512) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(1000) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 768, 1000]
    assert token_buckets(8) == [8]


def test_pieces_decode_as_the_reference(make_engine, reference_greedy, eu):
    eng = make_engine(max_num_batched_tokens=96, max_prefill_tokens_with_decodes=20)
    runner = eng.executor.worker.runner
    pieces = PiecewiseGraphs(runner.model, 96, runner.device)
    assert pieces.ok and pieces.buckets == [16, 32, 64, 96]
    runner.piecewise = pieces
    prompts = eu.random_prompts([70, 9, 150, 21], seed=7)
    gens = [8, 12, 6, 10]
    res = eu.run_staggered(eng, prompts, gens, 3)  # arrivals while others decode: mixed steps
    for i, (p, n) in enumerate(zip(prompts, gens)):
        assert res[f"r{i}"] == reference_greedy(p, n), f"r{i}"
    assert eng.scheduler.num_mixed_steps > 0 and eng.scheduler.num_chunked_prefills > 0
    # every step with prompt tokens went through the pieces, padded (the decode steps did not)
    assert pieces.num_steps >= eng.scheduler.num_mixed_steps and pieces.padded_rows > 0


def test_wrong_pieces_are_caught(make_engine, eu, reference_greedy):
    """The comparison above can fail: pieces whose rows all sit at position 0 give other tokens."""

    class AtZero(PiecewiseGraphs):
        def _run(self, i, b):
            if i == 0:
                self.positions.zero_()
            super()._run(i, b)

    eng = make_engine(max_num_batched_tokens=96)
    runner = eng.executor.worker.runner
    runner.piecewise = AtZero(runner.model, 96, runner.device)
    prompts = eu.random_prompts([40], seed=8)
    res = eu.run_staggered(eng, prompts, [6], 1)
    assert runner.piecewise.num_steps > 0 and res["r0"] != reference_greedy(prompts[0], 6)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_piecewise_graph_tokens_validated(value):
    assert EngineConfig(model="m").piecewise_graph_tokens == 512  # on by default (README)
    with pytest.raises(ConfigError, match="piecewise_graph_tokens"):
        EngineConfig(model="m", piecewise_graph_tokens=value).validate()
