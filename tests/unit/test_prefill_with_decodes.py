"""Prefill beside decodes (`max_prefill_tokens_with_decodes`; engine/scheduler.py): a step that decodes takes at
most that many prompt tokens, chunks in progress and admissions together; a step with nothing decoding takes the
whole `max_num_batched_tokens`; the tokens are those of the standalone greedy reference either way."""
import pytest

from m3serve.config import ConfigError, EngineConfig
from m3serve.engine.block_manager import BlockManager
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import Scheduler
from m3serve.engine.sequence import Sequence

B = 4


def _seq(rid: str, n: int) -> Sequence:
    """n prompt tokens of its own (no prefix shared with another request's)."""
    base = 1000 * (sum(map(ord, rid)) % 97)
    return Sequence(rid, 0, list(range(base, base + n)), SamplingParams(max_tokens=50, ignore_eos=True), 256)


def _step(sch: Scheduler) -> tuple[int, int]:
    """One schedule + update: (decodes, prompt tokens) of the step."""
    batch = sch.schedule()
    prompt = sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_uncomputed_tokens > 1)
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        if s.num_uncomputed_tokens == n:  # the prompt's last chunk or a decode: it samples a token
            s.token_ids.append(7)
    sch.update(batch)
    return batch.num_decodes, prompt


@pytest.mark.parametrize("cap", [0, 24])
def test_a_long_prompt_beside_decodes_takes_the_cap(cap):
    sch = Scheduler(BlockManager(512, B), 16, 128, max_prefill_tokens_with_decodes=cap)
    alone = _seq("alone", 300)
    sch.add(alone)
    assert _step(sch) == (0, 128)  # nothing decoding: the whole budget, whatever the cap
    while alone.num_uncomputed_tokens > 1:
        _step(sch)
    for i in range(3):
        sch.add(_seq(f"short{i}", 4))
    _step(sch)  # admitted beside alone's first decode
    sch.add(_seq("long", 200))
    sch.add(_seq("next", 50))
    steps = [_step(sch) for _ in range(12)]
    want = cap or 128 - 4  # off: what the 4 decodes leave of the step's budget
    assert steps[:2] == [(4, want)] * 2  # long's chunks beside every decode, within the cap
    assert all(d >= 4 and p <= want for d, p in steps)  # no step drops a decode or passes the cap
    assert sum(p for _, p in steps) == min(250, 12 * want)  # long, then next, in as few steps as the cap allows


def test_off_takes_the_budget_and_bad_values_are_refused():
    assert EngineConfig(model="m").max_prefill_tokens_with_decodes == 0
    for value in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="max_prefill_tokens_with_decodes"):
            EngineConfig(model="m", max_prefill_tokens_with_decodes=value).validate()


def test_capped_prefills_decode_as_the_reference(make_engine, reference_greedy, eu):
    prompts = eu.random_prompts([200, 9, 150, 25], seed=5)
    gens = [10, 24, 12, 20]
    eng = make_engine(max_num_batched_tokens=256, max_prefill_tokens_with_decodes=16)
    res = eu.run_staggered(eng, prompts, gens, 3)  # arrivals while others decode
    for i, (p, n) in enumerate(zip(prompts, gens)):
        assert res[f"r{i}"] == reference_greedy(p, n), f"r{i}"
    assert eng.scheduler.num_chunked_prefills > 0  # the long prompts went in capped chunks
