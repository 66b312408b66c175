"""Async scheduling with speculative decoding (`LLMEngine._launch_ahead`, executor/ahead.py): the next speculative step
is queued before the current one's accepted runs reach the host; its anchors, positions, slots, cache lengths and
sampling positions are completed on the device from the current step's result. The outputs must be exactly those of
the synchronous engine (and, greedy, of plain decoding): tokens, logprobs, texts, finish reasons, with stop tokens
and stop strings inside accepted runs, max_tokens, min_tokens, arrivals and an abort between steps; the page pool
whole at the end. On the eager path and on the graphs' static-buffer path (run eagerly on the CPU)."""
import pytest
import torch

from m3serve.engine.sampling_params import SamplingParams
from m3serve.executor import ahead, model_runner
from m3serve.executor.speculative.controlled import ControlledProposals
from m3serve.step_io import SamplerOutput, SamplingInput, StepInput

K = 4


def _engine(make_engine, static: bool, async_scheduling: bool = True, **speculative):
    eng = make_engine(max_num_seqs=8, num_gpu_blocks_override=64, max_model_len=256, max_num_batched_tokens=128,
                      enable_prefix_caching=False, async_scheduling=async_scheduling,
                      speculative_config={"method": "dspark", "num_speculative_tokens": K, **speculative})
    if static:
        eng.executor.worker.drafter.enable_graphs(8, 256)
    return eng


def _requests(eu, reference_greedy, eng, static=False):
    """(request id, prompt, params) and the known greedy continuations for ControlledProposals (by seed). `static`:
    without the options the graphs do not take (top-n logprobs, min_tokens' suppressed ids), so that steps do."""
    prompts = eu.random_prompts([30, 12, 21, 40, 17, 9, 25], seed=31)
    ref2 = reference_greedy(prompts[2], 40)
    j = next(j for j in range(15, 40) if ref2[j] not in ref2[:j])  # its first occurrence: the stop token
    text = eng.tokenizer.decode(reference_greedy(prompts[5], 40))
    reqs = [
        ("g0", prompts[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, seed=1000)),
        ("s1", prompts[1], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=45, ignore_eos=True, seed=1001,
                                          logprobs=None if static else 2)),
        ("stop2", prompts[2], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ref2[j]], seed=1002)),
        ("min3", prompts[3], SamplingParams(temperature=0.7, max_tokens=36, ignore_eos=True,
                                            min_tokens=0 if static else 12,
                                            stop_token_ids=[3], seed=1003)),
        ("short4", prompts[4], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, seed=1004)),
        ("str5", prompts[5], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, seed=1005,
                                            stop=[text[len(text) * 2 // 3:len(text) * 2 // 3 + 3]])),
    ]
    late = ("late6", prompts[6], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, seed=1006))
    known = {sp.seed: p + reference_greedy(p, 60) for _, p, sp in reqs + [late] if sp.temperature == 0.0}
    return reqs, late, known, j


def _run(eng, eu, reference_greedy, abort_at=None, static=False):
    """{request id: (tokens, finish reason, text, logprobs)} and the steps that found a step queued after them."""
    reqs, late, known, _ = _requests(eu, reference_greedy, eng, static)
    drafter = eng.executor.worker.drafter
    drafter.proposal_hook = ControlledProposals(known, 0.8, drafter.draft.config.vocab_size)
    for rid, p, sp in reqs:
        eng.add_request(rid, prompt_token_ids=p, sampling_params=sp)
    return eu.run_queued(eng, {6: late}, abort_at)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_speculative_async_equals_sync(static, make_engine, reference_greedy, eu):
    sync, queued_sync = _run(_engine(make_engine, static, async_scheduling=False), eu, reference_greedy,
                             static=static)
    eng = _engine(make_engine, static)
    launch, rows = eng.executor.launch, []
    eng.executor.launch = lambda step, prev=None: (rows.append(step.prev_token_rows), launch(step, prev))[1]
    asyn, queued = _run(eng, eu, reference_greedy, static=static)
    st = eng.stats()
    # a decode left out of a queued step (near its max_tokens) joined the next one beside sequences read on the device
    assert any(r is not None and (r < 0).any() and (r >= 0).any() for r in rows)
    assert queued_sync == 0 and st["num_steps_ahead"] == queued >= 8  # speculative steps went ahead
    if static:
        assert eng.executor.worker.drafter.graphs.num_ahead >= 8  # through the static buffers
    eu.same_outputs(sync, asyn)
    reqs, late, _, j = _requests(eu, reference_greedy, eng, static)
    for rid, p, sp in reqs + [late]:
        if sp.temperature == 0.0 and not sp.stop and not sp.stop_token_ids:
            assert asyn[rid][0] == reference_greedy(p, sp.max_tokens), rid  # plain greedy decoding's tokens
    assert asyn["stop2"][1] == "stop" and len(asyn["stop2"][0]) == j + 1  # a stop token, mid-run
    assert asyn["str5"][1] == "stop" and len(asyn["str5"][0]) < 40
    assert len(asyn["min3"][0]) >= (0 if static else 12) and len(asyn["short4"][0]) == 7
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]  # runs of all lengths
    assert st["spec_decode_mean_accepted_length"] > 1.5


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_arrivals_beside_speculative_steps_are_prefilled_ahead(static, make_engine, reference_greedy, eu):
    """Requests that arrive while speculative steps are queued: the prefill turn `prefill_apart` gives them (their
    prompts alone, after a step of drafting decodes) is queued behind that step, and the decodes after it go ahead
    too (their tokens known by then): no arrival makes a step wait for the one before it. The outputs are the
    synchronous engine's; greedy ones are plain decoding's."""
    out, held, kinds = {}, {}, {}
    for mode in (False, True):
        eng = _engine(make_engine, static, async_scheduling=mode)
        reqs, late, known, _ = _requests(eu, reference_greedy, eng, static)
        drafter = eng.executor.worker.drafter
        drafter.proposal_hook = ControlledProposals(known, 0.8, drafter.draft.config.vocab_size)
        for rid, p, sp in reqs[:2]:
            eng.add_request(rid, prompt_token_ids=p, sampling_params=sp)
        calls, real_step = [], eng.step

        def step(eng=eng, calls=calls, real_step=real_step):
            res = real_step()
            calls.append(eng._inflight.batch.kind if eng._inflight is not None else
                         "held" if eng.scheduler.waiting else "")  # a request waits, and nothing is queued
            return res

        eng.step = step
        arrivals = {3: reqs[2], 5: reqs[4], 9: late, 14: reqs[5]}
        out[mode], _ = eu.run_queued(eng, arrivals)
        held[mode], kinds[mode] = calls.count("held"), calls
    assert held[True] == 0  # (before: the call after each arrival's)
    assert kinds[True].count("prefill") >= 4  # each arrival's prompt queued behind drafting decodes
    eu.same_outputs(out[False], out[True])
    for rid, p, sp in [r for r in _requests(eu, reference_greedy, eng, static)[0] if r[0] in ("g0", "short4")]:
        assert out[True][rid][0] == reference_greedy(p, sp.max_tokens), rid


def test_abort_while_a_speculative_step_is_queued(make_engine, reference_greedy, eu):
    sync, _ = _run(_engine(make_engine, False, async_scheduling=False), eu, reference_greedy, abort_at=(5, "g0"))
    asyn, queued = _run(_engine(make_engine, False), eu, reference_greedy, abort_at=(5, "g0"))
    assert asyn["g0"][1] == "abort" and 0 < len(asyn["g0"][0]) < 50 and queued > 0
    eu.same_outputs(sync, asyn)


def test_steps_ahead_need_the_device_to_move_positions(make_engine, reference_greedy, eu, monkeypatch):
    """The check above fails when the queued step is not moved by the accepted runs (only its anchors read from
    the result, every position as if one token had been emitted)."""
    def ids_only(step, prev, rows, block_size, num_seqs):
        t = step.query_start_loc_cpu[num_seqs]
        n = prev.num_tokens[rows[:t]]
        step.input_ids[:t] = prev.token_ids[rows[:t]].gather(1, (n - 1)[:, None])[:, 0]

    monkeypatch.setattr(model_runner, "follow_previous", ids_only)
    sync, _ = _run(_engine(make_engine, False, async_scheduling=False), eu, reference_greedy)
    asyn, queued = _run(_engine(make_engine, False), eu, reference_greedy)
    assert queued > 0 and any(sync[r][0] != asyn[r][0] for r in sync)


def test_confidence_scheduling_and_the_switch_keep_steps_synchronous(make_engine, reference_greedy, eu):
    """Confidence-scheduled verification picks the next width from this step's confidences on the host: no step
    goes ahead with it (nor with async_scheduling off); the tokens stay those of the synchronous engine."""
    sched = _engine(make_engine, False, confidence_scheduling=True,
                    confidence_cost_table=[[1, 1.0], [8, 1.1], [16, 1.3], [64, 2.0]])
    res, queued = _run(sched, eu, reference_greedy)
    sync, _ = _run(_engine(make_engine, False, async_scheduling=False), eu, reference_greedy)
    assert queued == 0 and sched.stats()["num_steps_ahead"] == 0
    greedy = [r for r in res if r in ("g0", "late6")]
    assert all(res[r][0] == sync[r][0] for r in greedy)


def test_follow_previous_moves_each_sequence_by_its_run():
    """Three sequences of 3 tokens (anchor + 2 placeholders), pages of 4 tokens; the previous step emitted 3 tokens
    for sequence 0 (its row 1) and 1 for sequence 1 (its row 0); sequence 2's tokens are known (row -1). Built as
    if 1 each: sequence 0 at positions 5..7, sequence 1 at 9..11, sequence 2 (anchor 77) at 2..4."""
    tables = torch.tensor([[7, 2, 5, 0], [3, 8, 1, 6], [4, 9, 0, 0]], dtype=torch.int32)
    pos = torch.tensor([5, 6, 7, 9, 10, 11, 2, 3, 4])
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    slots = tables[seq, pos // 4].long() * 4 + pos % 4
    sampling = SamplingInput.full(3, temperature=0.0)
    sampling.positions = torch.tensor([6, 10, 3])
    step = StepInput(input_ids=torch.tensor([0, 0, 0, 0, 0, 0, 77, 0, 0]), positions=pos.clone(),
                     query_start_loc=torch.tensor([0, 3, 6, 9], dtype=torch.int32),
                     seq_lens=torch.tensor([8, 12, 5], dtype=torch.int32), query_start_loc_cpu=[0, 3, 6, 9],
                     seq_lens_cpu=[8, 12, 5], is_decode=False, max_query_len=3, max_seq_len=12, block_tables=tables,
                     slot_mapping=slots.clone(), logits_indices=torch.tensor([0, 3, 6]), sampling=sampling,
                     prev_token_rows=torch.tensor([1, 1, 1, 0, 0, 0, -1, -1, -1]))
    prev = SamplerOutput(torch.tensor([[40, -1, -1], [11, 12, 13]]), torch.zeros(2, 3),
                         num_tokens=torch.tensor([1, 3]))
    ahead.follow_previous(step, prev, step.prev_token_rows, 4, 3)
    assert step.input_ids.tolist() == [13, 13, 13, 40, 40, 40, 77, 0, 0]
    assert step.positions.tolist() == [7, 8, 9, 9, 10, 11, 2, 3, 4]
    assert step.slot_mapping.tolist() == [2 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1] + slots[3:].tolist()
    assert step.seq_lens.tolist() == [10, 12, 5] and step.sampling.positions.tolist() == [8, 10, 3]
