"""Async scheduling (`LLMEngine._launch_ahead`): the next decode step is queued before the current step's tokens are
back, its input ids read from the current step's sampled ids on the device. The engine's outputs must be exactly
those of the synchronous engine: tokens, logprobs, texts, finish reasons, stop strings / tokens ending a sequence
while its next step already runs, min_tokens, seeds, arrivals and aborts between steps; the page pool whole."""
import dataclasses

import pytest
import torch

from m3serve.engine.sampling_params import SamplingParams


def _params(eos_like: int, stop: str):
    return [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=33, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[eos_like]),  # ends early, mid-pipeline
        SamplingParams(temperature=0.7, top_p=0.8, seed=3, max_tokens=25, ignore_eos=True, min_tokens=20,
                       stop_token_ids=[eos_like]),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),  # done by its prefill
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),  # a stop string, mid-run
    ]


def _run(make_engine, eu, async_scheduling: bool, late=None, abort_at=None):
    """All requests of `_params`, two more arriving at steps 5 and 9 (`late`), one aborted at step 14 (`abort_at`).
    {request id: (tokens, finish reason, text, logprobs)}, the engine and the number of steps launched ahead."""
    eng = make_engine(max_num_seqs=8, num_gpu_blocks_override=96, max_num_batched_tokens=96,
                      enable_prefix_caching=False, async_scheduling=async_scheduling)
    prompts = eu.random_prompts([30, 70, 9, 50, 17, 40, 25, 60], seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    probe = make_engine(max_num_seqs=1, num_gpu_blocks_override=32, async_scheduling=False)
    probe.add_request("p", prompt_token_ids=prompts[2], sampling_params=greedy)
    toks, _, outs = eu.run_to_completion(probe)["p"]
    text = "".join(o.text for o in outs)
    eos_like, stop = toks[3], text[len(text) // 2:len(text) // 2 + 2]  # met after a few steps (r2), mid-run (r5)
    for i, sp in enumerate(_params(eos_like, stop)):
        eng.add_request(f"r{i}", prompt_token_ids=prompts[2 if i == 5 else i], sampling_params=sp)
    late = late or {5: ("late0", prompts[6]), 9: ("late1", prompts[7])}
    res, ahead = eu.run_queued(eng, {step: (rid, p, greedy) for step, (rid, p) in late.items()}, abort_at)
    return res, eng, ahead


def test_async_equals_sync(make_engine, eu):
    sync, _, ahead_sync = _run(make_engine, eu, False)
    asyn, eng, ahead = _run(make_engine, eu, True)
    assert ahead_sync == 0 and ahead > 20  # the pipeline ran for most steps
    eu.same_outputs(sync, asyn)
    reasons = {rid: r for rid, (_, r, _, _) in asyn.items()}
    assert reasons["r2"] == "stop" and len(asyn["r2"][0]) == 4  # ended by a stop token while its next step ran
    assert reasons["r5"] == "stop" and len(asyn["r5"][0]) < 30  # ended by a stop string likewise
    assert len(asyn["r3"][0]) >= 20  # min_tokens held with the pending token counted
    assert len(asyn["r4"][0]) == 1 and reasons["r4"] == "length"


def test_abort_while_a_step_is_queued(make_engine, eu):
    sync, _, _ = _run(make_engine, eu, False, abort_at=(14, "r0"))
    asyn, _, _ = _run(make_engine, eu, True, abort_at=(14, "r0"))
    assert asyn["r0"][1] == "abort" and 0 < len(asyn["r0"][0]) < 40
    eu.same_outputs(sync, asyn)


def test_penalties_keep_steps_synchronous(make_engine, eu):
    """A repetition penalty reads the output tokens, which a step launched ahead does not have: no step goes
    ahead while such a request runs, and its tokens are those of the synchronous engine."""
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)
    out = {}
    for mode in (False, True):
        eng = make_engine(max_num_seqs=4, num_gpu_blocks_override=32, async_scheduling=mode)
        eng.add_request("a", prompt_token_ids=eu.random_prompts([20], seed=2)[0], sampling_params=sp)
        toks, ahead = [], 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks += o.new_token_ids
            ahead += eng._inflight is not None
        out[mode] = toks
        assert ahead == 0
    assert out[True] == out[False] and len(out[True]) == 20


def test_launch_ahead_reads_the_previous_tokens_on_the_device(make_engine, eu):
    """The queued step's input ids are zeros on the host and the running step's sampled ids by row."""
    eng = make_engine(max_num_seqs=4, num_gpu_blocks_override=32)
    for i, p in enumerate(eu.random_prompts([12, 20], seed=5)):
        eng.add_request(f"q{i}", prompt_token_ids=p,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()  # the prefills; the first decode step goes ahead
    queued = eng._inflight
    assert queued is not None and queued.step.prev_token_rows is not None
    assert torch.equal(queued.step.input_ids, torch.zeros(2, dtype=torch.int64))
    assert queued.step.prev_token_rows.tolist() == [0, 1]
    # step() processed the prefills' tokens after queueing: the queued step feeds each at its position
    fed = [s.num_tokens - 1 for s in queued.seqs]
    assert queued.step.positions.tolist() == fed and queued.step.seq_lens.tolist() == [n + 1 for n in fed]
    assert queued.step.sampling.positions.tolist() == [n + 1 for n in fed]


@pytest.mark.parametrize("flag", ["yes", 1])
def test_async_scheduling_must_be_boolean(make_engine, flag):
    from m3serve.config import ConfigError

    with pytest.raises(ConfigError, match="async_scheduling"):
        make_engine(async_scheduling=flag)


@pytest.mark.parametrize("cap", [0, 16])
def test_mixed_steps_go_ahead(make_engine, eu, cap):
    """A long prompt prefilled in chunks beside decoding streams: the step after a mixed step whose prompt chunk is
    not the last is queued ahead too (the decodes' tokens read on the device, the prompt's next chunk after the one
    still running), with the outputs of the synchronous engine; with `max_prefill_tokens_with_decodes` as well."""
    prompts = eu.random_prompts([9, 14, 11, 300], seed=23)
    params = [SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=45, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)]
    late = {3: ("long", prompts[3], SamplingParams(temperature=0.6, seed=9, max_tokens=12, ignore_eos=True))}
    res, kinds = {}, {}
    for mode in (False, True):
        eng = make_engine(max_num_seqs=8, num_gpu_blocks_override=96, max_num_batched_tokens=40,
                          max_prefill_tokens_with_decodes=cap, enable_prefix_caching=False, async_scheduling=mode)
        for i, sp in enumerate(params):
            eng.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=sp)
        res[mode], kinds[mode] = _run_recording_ahead(eng, eu, late)
        assert eng.scheduler.num_mixed_steps >= 300 // 40  # the prompt's chunks went beside the decodes
    assert not kinds[False] and kinds[True].count("decode+prefill") >= 300 // 40 - 1
    eu.same_outputs(res[False], res[True])
    assert len(res[True]["long"][0]) == 12


def _run_recording_ahead(eng, eu, late=None):
    """`run_queued`, and the kind of each step left queued ahead."""
    kinds, real_step = [], eng.step

    def step():
        out = real_step()
        if eng._inflight is not None:
            kinds.append(eng._inflight.batch.kind)
        return out

    eng.step = step
    res, _ = eu.run_queued(eng, late)
    return res, kinds


def test_prompt_chunks_alone_go_ahead(make_engine, eu):
    """A prompt prefilled in chunks with nothing decoding: each chunk after the first is queued while the one
    before runs; a second prompt arriving meanwhile joins the next step queued (`test_arrivals_join_...`). The
    outputs are the synchronous engine's."""
    prompts = eu.random_prompts([300, 50], seed=31)
    late = {4: ("second", prompts[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))}
    res, kinds = {}, {}
    for mode in (False, True):
        eng = make_engine(max_num_seqs=4, num_gpu_blocks_override=64, max_num_batched_tokens=32,
                          enable_prefix_caching=False, async_scheduling=mode)
        eng.add_request("long", prompt_token_ids=prompts[0],
                        sampling_params=SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True))
        res[mode], kinds[mode] = _run_recording_ahead(eng, eu, late)
    assert not kinds[False] and kinds[True][:3] == ["prefill"] * 3
    eu.same_outputs(res[False], res[True])
    assert [len(res[True][r][0]) for r in ("long", "second")] == [10, 10]



def _run_counting_held(eng, eu, late):
    """`run_queued`, and how many `step()` calls left no step queued while requests were still to run."""
    calls, real_step = [], eng.step

    def step():
        out = real_step()
        calls.append(eng._inflight is None and eng.has_unfinished_requests())
        return out

    eng.step = step
    res, _ = eu.run_queued(eng, late)
    return res, sum(calls)


@pytest.mark.parametrize("penalized", [False, True])
def test_arrivals_join_a_step_queued_ahead(make_engine, eu, penalized):
    """Requests that arrive while steps are queued are admitted into the next step launched ahead, beside the
    decodes (`Scheduler.schedule_ahead`), as `schedule` would admit them: no step in the run waits for the one
    before it to come back, a long arrival's chunks follow ahead too, and the outputs are the synchronous engine's.
    An arrival with a repetition penalty is admitted ahead as well (it reads only its prompt there); the steps it
    then decodes in are synchronous."""
    prompts = eu.random_prompts([12, 20, 15, 33, 90, 8], seed=41)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=2, max_tokens=24, ignore_eos=True, logprobs=1)
    last = dataclasses.replace(seeded, repetition_penalty=1.3, max_tokens=3) if penalized else seeded
    late = {2: ("a", prompts[2], greedy), 5: ("b", prompts[3], seeded), 6: ("c", prompts[4], greedy),
            40: ("d", prompts[5], last)}
    res, held = {}, {}
    for mode in (False, True):
        eng = make_engine(max_num_seqs=8, num_gpu_blocks_override=96, max_num_batched_tokens=40,
                          enable_prefix_caching=False, async_scheduling=mode)
        eng.add_request("r0", prompt_token_ids=prompts[0], sampling_params=dataclasses.replace(greedy, max_tokens=60))
        eng.add_request("r1", prompt_token_ids=prompts[1], sampling_params=dataclasses.replace(seeded, max_tokens=60))
        res[mode], held[mode] = _run_counting_held(eng, eu, late)
        assert eng.scheduler.num_mixed_steps >= len(late)
    assert held[False] > 30 and held[True] == (3 if penalized else 0)  # d's 3 steps after its admission
    eu.same_outputs(res[False], res[True])
    assert {r: len(res[True][r][0]) for r in res[True]} == {"r0": 60, "r1": 60, "a": 30, "b": 24, "c": 30,
                                                             "d": 3 if penalized else 24}


def test_arrivals_ahead_keep_their_prefix_cache_hits(make_engine, eu):
    """Two requests with a common prefix arrive a step apart while a stream decodes: the second is not admitted into a
    step queued ahead while the first's prompt (its first block) is still being computed, so it finds that block in
    the prefix cache as it does without async scheduling, and the outputs are the same."""
    probe = make_engine(async_scheduling=False)
    bs = probe.block_manager.block_size
    stream, prefix, tail_a, tail_b = eu.random_prompts([9, 2 * bs, 5, 7], seed=53)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    late = {2: ("a", prefix + tail_a, greedy), 3: ("b", prefix + tail_b, greedy)}
    res, hits = {}, {}
    for mode in (False, True):
        eng = make_engine(max_num_seqs=8, num_gpu_blocks_override=64, max_num_batched_tokens=4 * bs,
                          async_scheduling=mode)
        eng.add_request("r0", prompt_token_ids=stream, sampling_params=dataclasses.replace(greedy, max_tokens=30))
        res[mode], held = _run_counting_held(eng, eu, late)
        hits[mode] = eng.stats()["prefix_cache_hit_tokens"]
        assert held == 0 or not mode
    assert hits[True] == hits[False] == 2 * bs  # b took both prefix blocks from a's
    eu.same_outputs(res[False], res[True])
