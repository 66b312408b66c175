"""Gathering arrivals (`max_waiting_steps`, `waiting_served_ratio`; engine/scheduler.py): while decodes run, a new
request waits until the ratio of waiting to running requests is reached or it has waited the steps allowed; with
nothing decoding, or with the option off, it is admitted at once; a preempted sequence is never held; the tokens
are those of the standalone greedy reference either way."""
import pytest

from m3serve.config import ConfigError, EngineConfig
from m3serve.engine.block_manager import BlockManager
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import Scheduler
from m3serve.engine.sequence import Sequence

B = 4


def _seq(rid: str) -> Sequence:
    return Sequence(rid, 0, [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), 64)


def _step(sch: Scheduler) -> list[str]:
    """One schedule + update (each scheduled sequence gets its sampled token): the request ids that ran a prompt
    chunk in it."""
    batch = sch.schedule()
    prompts = [s.request_id for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_uncomputed_tokens == n > 1]
    for s in batch.seqs:
        s.token_ids.append(7)
    sch.update(batch)
    return prompts


def _decoding(n: int, **opts) -> Scheduler:
    """A scheduler with `n` requests admitted and decoding."""
    sch = Scheduler(BlockManager(64, B), 16, 256, **opts)
    for i in range(n):
        sch.add(_seq(f"run{i}"))
    assert sorted(_step(sch)) == sorted(f"run{i}" for i in range(n))  # nothing decoding yet: no hold
    return sch


def test_an_arrival_waits_the_steps_allowed():
    sch = _decoding(4, max_waiting_steps=3)
    sch.add(_seq("late"))
    assert [_step(sch) for _ in range(3)] == [[], [], []]  # held for 3 steps beside the 4 decodes
    assert _step(sch) == ["late"] and sch.num_held_steps == 3


def test_enough_waiting_requests_are_admitted_at_once():
    sch = _decoding(4, max_waiting_steps=8, waiting_served_ratio=1.2)
    for i in range(4):  # 4 < 1.2 x 4 running: held
        sch.add(_seq(f"w{i}"))
    assert _step(sch) == []
    sch.add(_seq("w4"))  # 5 >= 4.8
    assert sorted(_step(sch)) == [f"w{i}" for i in range(5)]


def test_off_and_preempted_are_not_held():
    sch = _decoding(4)  # max_waiting_steps 0: off
    sch.add(_seq("late"))
    assert _step(sch) == ["late"] and sch.num_held_steps == 0
    sch = _decoding(4, max_waiting_steps=5)
    back = _seq("back")
    back.num_preemptions = 1  # as `_preempt` leaves a sequence it sent back to the queue
    sch.add(back)
    assert _step(sch) == ["back"]


def test_gathered_arrivals_decode_as_the_reference(make_engine, reference_greedy, eu):
    prompts = eu.random_prompts([40, 9, 66, 25, 80, 12], seed=4)
    gens = [14, 10, 12, 16, 8, 11]
    eng = make_engine(max_num_batched_tokens=256, max_waiting_steps=3, waiting_served_ratio=2.0)
    res = eu.run_staggered(eng, prompts, gens, 2)  # one arrival every other step while others decode
    for i, (p, n) in enumerate(zip(prompts, gens)):
        assert res[f"r{i}"] == reference_greedy(p, n), f"r{i}"
    st = eng.stats()
    assert st["num_held_steps"] > 0 and st["num_prompt_steps"] < len(prompts)  # arrivals shared prompt steps


@pytest.mark.parametrize("field, value", [("max_waiting_steps", -1), ("max_waiting_steps", 1.5),
                                          ("waiting_served_ratio", 0), ("waiting_served_ratio", True),
                                          ("waiting_served_ratio", float("nan")), ("waiting_served_ratio", "2")])
def test_bad_values_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(model="m", **{field: value}).validate()
