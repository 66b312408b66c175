"""Sampler: the sampled distribution matches the one computed from the logits (chi-square), seeded
requests reproduce whatever the batch mix, penalties / min_tokens / logprobs follow vLLM semantics.
The sampler runs on tensors: `StepBuilder.sampling` turns the sequences into its `SamplingInput`."""
import math

import pytest
import torch

from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.sequence import Sequence
from m3serve.engine.step_builder import StepBuilder
from m3serve.executor.sampler import Sampler, apply_penalties
from m3serve.kernels.sampling import uniforms
from support.reference import reference_logits


def seq_with(sp, prompt=(1, 2, 3), outputs=(), seed=0):
    s = Sequence("x", 0, list(prompt), sp, 100, seed)
    s.token_ids += list(outputs)
    return s


def sample(logits, seqs, eos=()):
    """Token ids the sampler draws for `seqs` (one logits row each)."""
    return Sampler()(logits, StepBuilder(16, set(eos)).sampling(seqs)).token_ids.tolist()


def expected_probs(logits, t, top_k, top_p, min_p):
    """Independent statement of temperature -> min_p -> top_k -> top_p, renormalized."""
    p = torch.softmax(logits.double() / t, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    order = torch.argsort(p, descending=True)
    ranked = [int(i) for i in order if keep[i]]
    if top_k > 0:
        ranked = ranked[:top_k]
    q = p[ranked] / p[ranked].sum()
    mass, kept = 0.0, []
    for i, qi in zip(ranked, q.tolist()):
        if mass >= top_p:
            break
        kept.append(i)
        mass += qi
    out = torch.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


@pytest.mark.parametrize("t,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 20, 1.0, 0.0), (1.0, 0, 0.8, 0.0),
    (0.9, 50, 0.9, 0.05), (1.0, 0, 1.0, 0.1)])
def test_sampling_distribution_chi_square(t, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(512, generator=g) * 2.5
    expect = expected_probs(logits, t, top_k, top_p, min_p)
    sp = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    rows, calls = 2000, 10
    counts = torch.zeros(512, dtype=torch.float64)
    for c in range(calls):
        seqs = [seq_with(sp, seed=1000 + c * rows + i) for i in range(rows)]
        toks = sample(logits.expand(rows, -1).clone(), seqs)
        counts += torch.bincount(torch.tensor(toks), minlength=512).double()
    n = rows * calls
    assert counts[expect == 0].sum() == 0, "sampled a token outside the top-k / top-p / min-p support"
    e = expect * n
    big = e >= 5
    obs = torch.cat([counts[big], counts[~big & (expect > 0)].sum()[None]])
    exp = torch.cat([e[big], e[~big & (expect > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    # mean df, sd sqrt(2 df): 6 sd above is a false alarm far below 1e-6; a wrong rule (e.g. no
    # temperature, top-p off by one token) gives chi2 in the thousands
    assert chi2 < df + 6 * math.sqrt(2 * df) + 10, (chi2, df)
    tv = 0.5 * float((counts / n - expect).abs().sum())
    assert tv < 0.03, tv


def test_greedy_and_tiny_temperature_pick_argmax():
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    seqs = [seq_with(SamplingParams(temperature=0.0)) for _ in range(4)]
    assert sample(logits.clone(), seqs) == logits.argmax(-1).tolist()
    mixed = [seq_with(SamplingParams(temperature=t), seed=i) for i, t in enumerate((0.0, 1.0, 0.0, 1e-6))]
    got = sample(logits.clone(), mixed)
    assert [got[0], got[2], got[3]] == logits.argmax(-1)[[0, 2, 3]].tolist()


def test_counter_uniforms_depend_on_seed_and_position_only():
    seeds = torch.tensor([1, 1, 2, -5, (1 << 62) + 1, (1 << 62) + 2])
    pos = torch.tensor([7, 8, 7, 7, 7, 7])
    u = uniforms(seeds, pos, 4096)
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    for i in range(len(seeds)):  # every seed bit and the position matter
        for j in range(i):
            assert not torch.equal(u[i], u[j])
    again = uniforms(seeds[[3, 0]], pos[[3, 0]], 4096)  # a row's draws do not depend on the other rows
    assert torch.equal(again, u[[3, 0]])


def test_penalties_vllm_semantics():
    v = 8
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 0.25]])
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    s = seq_with(sp, prompt=[0, 1], outputs=[3, 3, 4])
    got = apply_penalties(logits.clone(), StepBuilder(16, set()).sampling([s]))[0]
    exp = logits[0].clone()
    for i in (0, 1, 3, 4):  # prompt or output tokens: repetition penalty
        exp[i] = exp[i] / 2.0 if exp[i] > 0 else exp[i] * 2.0
    counts = torch.bincount(torch.tensor([3, 3, 4]), minlength=v).float()
    exp -= 0.5 * counts + 0.25 * (counts > 0).float()  # output tokens only: frequency, presence
    torch.testing.assert_close(got, exp)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, 16)
    logits[0, 5] = logits[0, 7] = 10.0
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    s = seq_with(sp, outputs=[1])
    assert sample(logits.clone(), [s], {5})[0] not in (5, 7)
    s.token_ids.append(2)  # min_tokens reached
    assert sample(logits.clone(), [s], {5})[0] in (5, 7)
    sp_ie = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(logits.clone(), [seq_with(sp_ie)], {5})[0] == 5  # eos not masked with ignore_eos


def test_seeded_sampling_reproducible_across_batch_mixes(make_engine, eu):
    prompts = eu.random_prompts([75, 12, 40, 100, 5], seed=11)
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=20, ignore_eos=True)

    def run(others, **opts):
        eng = make_engine(**opts)
        for i, (p, sp) in enumerate(others):
            eng.add_request(f"o{i}", prompt_token_ids=p, sampling_params=sp)
        eng.add_request("t", prompt_token_ids=prompts[0], sampling_params=target)
        res = eu.run_to_completion(eng)
        return res["t"][0], eng.stats()

    alone, _ = run([])
    mix = [(prompts[1], SamplingParams(temperature=1.0, max_tokens=30)),
           (prompts[2], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
           (prompts[3], SamplingParams(temperature=0.5, seed=7, max_tokens=25, ignore_eos=True)),
           (prompts[4], SamplingParams(temperature=1.2, top_k=5, max_tokens=12))]
    mixed, st = run(mix, max_num_batched_tokens=24, num_gpu_blocks_override=10, max_model_len=160)
    assert st["num_preemptions"] > 0 and st["num_mixed_steps"] > 0
    assert mixed == alone and len(alone) == 20
    again, _ = run([])  # a fresh engine
    assert again == alone
    eng = make_engine()
    eng.add_request("d", prompt_token_ids=prompts[0],
                    sampling_params=SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=99, max_tokens=20,
                                                   ignore_eos=True))
    assert eu.run_to_completion(eng)["d"][0] != alone  # another seed, another sample


def _teacher_forced_logits(model, prompt, outputs):
    """Logits predicting every output token, from one pass over prompt + outputs (reference cache)."""
    ids = list(prompt) + list(outputs)
    return reference_logits(model, ids)[len(prompt) - 1:len(ids) - 1]


def test_logprobs_are_raw_model_logprobs(make_engine, tiny_loaded, eu):
    model = tiny_loaded[0]
    prompt = eu.random_prompts([70], seed=12)[0]
    eng = make_engine(max_num_batched_tokens=32)
    eng.add_request("g", prompt_token_ids=prompt,
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True))
    eng.add_request("s", prompt_token_ids=prompt,
                    sampling_params=SamplingParams(temperature=1.5, max_tokens=8, logprobs=2, seed=5, ignore_eos=True))
    eng.add_request("n", prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0.0, max_tokens=3))
    res = eu.run_to_completion(eng)
    assert all(o.logprobs is None for o in res["n"][2])
    for rid, n in (("g", 3), ("s", 2)):
        toks, _, outs = res[rid]
        ref = torch.log_softmax(_teacher_forced_logits(model, prompt, toks), -1)
        lps = [lp for o in outs for lp in o.logprobs]
        assert len(lps) == len(toks) == 8
        total = 0.0
        for i, (tok, lp) in enumerate(zip(toks, lps)):
            top = ref[i].topk(n)
            want = {**dict(zip(top.indices.tolist(), top.values.tolist())), tok: float(ref[i, tok])}
            assert set(lp) == set(want)
            for k in want:
                assert abs(lp[k] - want[k]) < 1e-4
            total += want[tok]
        assert abs(outs[-1].cumulative_logprob - total) < 1e-3
    assert len(res["g"][2][0].logprobs[0]) == 3  # greedy: the sampled token is the top-1


def test_penalties_end_to_end(make_engine, tiny_loaded, eu):
    """Engine output with penalties == a greedy loop applying vLLM's penalty rules to reference logits."""
    model, _, tok = tiny_loaded
    prompt = tok.encode("The quick brown fox")  # its greedy continuation repeats itself
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8,
                        frequency_penalty=0.6, presence_penalty=0.4)
    eng = make_engine()
    eng.add_request("p", prompt_token_ids=prompt, sampling_params=sp)
    eng.add_request("b", prompt_token_ids=prompt,
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    res = eu.run_to_completion(eng)
    out = []
    for _ in range(16):
        x = _teacher_forced_logits(model, prompt, out + [0])[-1].clone()
        seen = set(prompt) | set(out)
        for t in seen:
            x[t] = x[t] / 1.8 if x[t] > 0 else x[t] * 1.8
        for t in set(out):
            x[t] -= 0.6 * out.count(t) + 0.4
        out.append(int(x.argmax()))
    assert res["p"][0] == out
    assert res["p"][0] != res["b"][0]
    assert len(set(res["p"][0])) > len(set(res["b"][0]))  # penalties reduce repetition
