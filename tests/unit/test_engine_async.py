"""AsyncLLMEngine: concurrent streams in one asyncio loop (and from two loops), bad requests rejected
before the first yield without disturbing others, abort (async, from another thread, by closing the
stream), fault isolation (a request's failure, a step's failure, an unattributed failure: the engine
carries on with every page back; a device fault or a leaked page: EngineDeadError everywhere), chat
templates rendered off the caller's loop under a time bound, shutdown leaving nothing running."""
import asyncio
import threading
import time

import pytest
import torch

from m3serve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from m3serve.engine.faults import RequestFailed, is_device_fault
from m3serve.engine.sampling_params import InvalidRequest, SamplingParams


@pytest.fixture
def make_async(make_engine):
    made = []

    def make(**opts):
        eng = AsyncLLMEngine(None, engine=make_engine(**opts))
        made.append(eng)
        return eng

    yield make
    for e in made:
        e.shutdown()
        assert not e.is_running


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def collect(engine, rid, **kw):
    outs = []
    async for o in engine.generate(rid, **kw):
        outs.append(o)
    return outs


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_concurrent_generate(make_async, reference_greedy, eu, tiny_loaded):
    eng = make_async(max_num_batched_tokens=32)
    prompts = eu.random_prompts([70, 3, 40, 100], seed=40)

    async def main():
        tasks = [collect(eng, f"r{i}", prompt_token_ids=p, sampling_params=greedy(10)) for i, p in enumerate(prompts)]
        tasks.append(collect(eng, "text", prompt="The quick brown fox", sampling_params=greedy(6)))
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    for p, outs in zip(prompts, results):
        assert [t for o in outs for t in o.new_token_ids] == reference_greedy(p, 10)
        assert outs[-1].finished and outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
        assert outs[0].prompt_token_ids == p
    text_outs = results[-1]
    assert "".join(o.text for o in text_outs) == tiny_loaded[2].decode([t for o in text_outs for t in o.new_token_ids])
    assert wait_for(lambda: eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"])
    st = eng.stats()
    assert st["num_running"] == st["num_waiting"] == 0 and st["kv_cache_usage"] == 0.0
    assert st["generation_tokens_total"] == 46 and st["prompt_tokens_total"] == sum(map(len, prompts)) + len(
        text_outs[0].prompt_token_ids)
    assert st["max_running"] >= 3 and eng.is_healthy()


def test_two_event_loops_in_two_threads(make_async, reference_greedy, eu):
    eng = make_async()
    prompts = eu.random_prompts([20, 66], seed=41)
    results = {}

    def worker(i):
        results[i] = asyncio.run(collect(eng, f"t{i}", prompt_token_ids=prompts[i], sampling_params=greedy(8)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, p in enumerate(prompts):
        assert [t for o in results[i] for t in o.new_token_ids] == reference_greedy(p, 8)


def test_bad_requests_raise_before_first_yield(make_async, eu):
    eng = make_async(max_model_len=128)
    good = eu.random_prompts([30], seed=42)[0]

    async def main():
        ok = asyncio.ensure_future(collect(eng, "ok", prompt_token_ids=good, sampling_params=greedy(40)))
        await asyncio.sleep(0.05)
        cases = [dict(prompt_token_ids=[]), dict(prompt=""), dict(prompt_token_ids=[5, 99999]),
                 dict(prompt_token_ids=[1] * 100, sampling_params=greedy(40)),
                 dict(prompt_token_ids=[1], reasoning_parser="bogus")]
        fields = []
        for kw in cases:
            with pytest.raises(InvalidRequest) as e:
                await collect(eng, "bad", **kw)
            fields.append(e.value.field)
        with pytest.raises(InvalidRequest) as e:  # duplicate id while "ok" runs
            await collect(eng, "ok", prompt_token_ids=[1, 2])
        fields.append(e.value.field)
        return fields, await ok

    fields, ok_outs = asyncio.run(main())
    assert fields == ["prompt", "prompt", "prompt_token_ids", "max_tokens", "reasoning_parser", "request_id"]
    assert sum(len(o.new_token_ids) for o in ok_outs) == 40 and ok_outs[-1].finish_reason == "length"

    async def reuse():  # the id is free again once finished
        return await collect(eng, "ok", prompt_token_ids=[1, 2], sampling_params=greedy(2))

    assert asyncio.run(reuse())[-1].finished


def test_abort_paths(make_async, eu):
    eng = make_async(max_num_batched_tokens=32)
    p = eu.random_prompts([50], seed=43)[0]

    async def main():
        got = {}

        async def consume(rid, abort_after=None, how=None):
            outs = []
            async for o in eng.generate(rid, prompt_token_ids=p, sampling_params=greedy(300)):
                outs.append(o)
                if len(outs) == abort_after:
                    if how == "async":
                        await eng.abort(rid)
                    elif how == "thread":
                        threading.Thread(target=eng.abort_sync, args=(rid,)).start()
                    elif how == "close":
                        break
            got[rid] = outs

        await asyncio.gather(consume("a", 3, "async"), consume("b", 5, "thread"), consume("c", 4, "close"),
                             consume("keep"))
        return got

    got = asyncio.run(main())
    for rid in ("a", "b"):
        assert got[rid][-1].finished and got[rid][-1].finish_reason == "abort"
        assert sum(len(o.new_token_ids) for o in got[rid]) < 300
    assert len(got["c"]) == 4
    assert got["keep"][-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in got["keep"]) == 300
    assert wait_for(lambda: eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"])
    assert eng.stats()["num_running"] == 0
    eng.abort_sync("unknown-id")  # harmless
    assert eng.is_healthy()


def run_pair(eng, prompts, n=50):
    async def main():
        return await asyncio.gather(*[collect(eng, f"r{i}", prompt_token_ids=q, sampling_params=greedy(n))
                                      for i, q in enumerate(prompts)], return_exceptions=True)
    return asyncio.run(main())


def all_pages_free(eng):
    return wait_for(lambda: eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"]
                    and eng.stats()["num_running"] == eng.stats()["num_waiting"] == 0)


def fail_on_call(obj, name, when, exc):
    """Patch obj.name to raise `exc` on its `when`-th call (1-based); the real one otherwise."""
    real, calls = getattr(obj, name), [0]

    def patched(*a, **k):
        calls[0] += 1
        if calls[0] == when:
            raise exc
        return real(*a, **k)
    setattr(obj, name, patched)


def test_step_failure_fails_its_requests_and_the_engine_carries_on(make_async, eu, reference_greedy):
    eng = make_async()
    fail_on_call(eng.engine.executor, "launch", 4, RuntimeError("triton kernel: out of resources"))
    res = run_pair(eng, eu.random_prompts([10, 20], seed=44))
    assert all(isinstance(r, RequestFailed) and "out of resources" in str(r) for r in res), res
    assert eng.is_healthy() and all_pages_free(eng)
    p = eu.random_prompts([12], seed=46)[0]
    outs = asyncio.run(collect(eng, "after", prompt_token_ids=p, sampling_params=greedy(8)))
    assert [t for o in outs for t in o.new_token_ids] == reference_greedy(p, 8)


def test_one_requests_failure_leaves_the_others(make_async, eu, reference_greedy):
    eng = make_async()
    inner = eng.engine
    real_append, real_add = inner._append, inner.add_prepared

    def append(seq, *sampled):  # request r1's text state breaks at its third token
        if seq.request_id == "r1" and seq.num_output_tokens == 2:
            raise KeyError("detokenizer state")
        return real_append(seq, *sampled)

    def add(rid, req):
        if rid == "r2":
            raise OverflowError("cannot add this one")
        return real_add(rid, req)
    inner._append, inner.add_prepared = append, add
    prompts = eu.random_prompts([10, 20, 30], seed=47)
    res = run_pair(eng, prompts, n=12)
    assert [t for o in res[0] for t in o.new_token_ids] == reference_greedy(prompts[0], 12)
    assert isinstance(res[1], RequestFailed) and "detokenizer state" in str(res[1])
    assert isinstance(res[2], RequestFailed) and "cannot add this one" in str(res[2])
    assert eng.is_healthy() and all_pages_free(eng)


def test_unattributed_failure_fails_what_is_in_flight_and_recovers(make_async, eu):
    eng = make_async()
    fail_on_call(eng.engine.step_builder, "build", 3, RuntimeError("step builder bug"))  # with steps in flight
    res = run_pair(eng, eu.random_prompts([10, 20], seed=48))
    assert all(isinstance(r, RequestFailed) and "step builder bug" in str(r) for r in res), res
    assert eng.is_healthy() and eng.num_recovered_failures == 1 and all_pages_free(eng)
    outs = asyncio.run(collect(eng, "after", prompt_token_ids=[1, 2, 3], sampling_params=greedy(4)))
    assert outs[-1].finish_reason == "length"


def test_leaked_page_after_a_failure_kills_the_engine(make_async, eu):
    eng = make_async()
    bm, real = eng.engine.block_manager, eng.engine.step_builder.build
    calls = [0]

    def leaky(*a, **k):
        calls[0] += 1
        if calls[0] == 3:  # with steps in flight
            bm._take_free()  # a page nobody owns any more: the pool is not whole
            raise RuntimeError("half-done step")
        return real(*a, **k)
    eng.engine.step_builder.build = leaky
    res = run_pair(eng, eu.random_prompts([10, 20], seed=49))
    assert all(isinstance(r, (RequestFailed, EngineDeadError)) for r in res), res
    assert wait_for(lambda: not eng.is_healthy()) and "half-done step" in eng.dead_reason
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(eng, "late", prompt_token_ids=[1, 2]))


def test_device_fault_kills_engine(make_async, eu):
    eng = make_async()
    fault = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    assert is_device_fault(fault) and is_device_fault(RuntimeError("CUDA error: unspecified launch failure"))
    assert not is_device_fault(torch.OutOfMemoryError("CUDA out of memory")) and not is_device_fault(KeyError("x"))
    fail_on_call(eng.engine.executor, "launch", 4, fault)
    res = run_pair(eng, eu.random_prompts([10, 20], seed=44))
    assert all(isinstance(r, EngineDeadError) and "illegal memory access" in str(r) for r in res)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(eng, "late", prompt_token_ids=[1, 2]))
    assert not eng.is_healthy() and "illegal memory access" in eng.dead_reason
    assert wait_for(lambda: not eng.is_running)


def test_out_of_range_options_never_reach_the_step(make_async):
    eng = make_async()
    for kw in (dict(seed=2**64), dict(seed=-1), dict(top_k=2**63), dict(stop_token_ids=[1.5]), dict(stop=[None]),
               dict(max_tokens=2**40), dict(min_tokens=-1), dict(logprobs=21)):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**kw)
        assert e.value.field == next(iter(kw))
    sp = SamplingParams(temperature=1.0, max_tokens=4)
    sp.seed = 2**64  # changed after construction: the engine validates again
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(collect(eng, "s", prompt_token_ids=[1, 2], sampling_params=sp))
    assert e.value.field == "seed"
    with pytest.raises(InvalidRequest) as e:  # a stop id outside the vocabulary
        asyncio.run(collect(eng, "s", prompt_token_ids=[1, 2], sampling_params=SamplingParams(stop_token_ids=[10**6])))
    assert e.value.field == "stop_token_ids"

    async def sample(seed):
        sp = SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)
        return [t for o in await collect(eng, f"seed-{seed}", prompt_token_ids=[5, 6, 7], sampling_params=sp)
                for t in o.new_token_ids]
    runs = {seed: asyncio.run(sample(seed)) for seed in (2**62, 2**62 + 1, 2**64 - 1)}
    assert asyncio.run(sample(2**64 - 1)) == runs[2**64 - 1]  # exact and reproducible
    assert len({tuple(v) for v in runs.values()}) == 3 and eng.is_healthy()


def test_chat_template_renders_off_the_loop_under_a_time_bound(make_async, monkeypatch):
    monkeypatch.setenv("M3SERVE_CHAT_TEMPLATE_TIMEOUT", "2")
    eng = make_async()
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]

    async def main():
        await collect(eng, "warm", prompt=messages, sampling_params=greedy(1))
        t0 = time.monotonic()
        slow = asyncio.ensure_future(collect(eng, "slow", prompt=messages,
                                             chat_template_kwargs={"chat_template": forever}))
        await asyncio.sleep(0.05)
        prepared = await eng.prepare(prompt=messages, sampling_params=greedy(4))  # rendered beside the runaway
        t_render = time.monotonic() - t0
        outs = await collect(eng, "fast", prompt=messages, sampling_params=greedy(4))
        with pytest.raises(InvalidRequest) as e:
            await slow
        return outs, prepared, t_render, time.monotonic() - t0, e.value

    outs, prepared, t_render, t_slow, err = asyncio.run(main())
    assert outs[-1].finish_reason == "length" and outs[0].prompt_token_ids  # rendered by the model's template
    assert prepared.prompt_token_ids == outs[0].prompt_token_ids
    # the other request's template rendered while the runaway ran (not queued behind it: that would take the
    # whole bound); the runaway failed at its bound
    assert t_render < 1.5 and 2.0 < t_slow < 6.0, (t_render, t_slow)
    assert err.field == "prompt" and "within 2 s" in str(err)
    with pytest.raises(InvalidRequest) as e:  # a keyword the renderer cannot take
        asyncio.run(collect(eng, "kw", prompt=messages, chat_template_kwargs={"tokenize": False}))
    assert e.value.field == "chat_template_kwargs"
    assert eng.is_healthy()


def test_shutdown_fails_pending_and_joins(make_async, eu):
    eng = make_async()
    p = eu.random_prompts([30], seed=45)[0]

    async def main():
        agen = eng.generate("long", prompt_token_ids=p, sampling_params=greedy(400))
        first = await agen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        return first

    assert asyncio.run(main()).new_token_ids
    assert not eng.is_running and not eng.is_healthy()
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"] and st["num_running"] == 0
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(eng, "after", prompt_token_ids=[1]))
    assert not any(t.name == "m3serve-engine" and t.is_alive() for t in threading.enumerate()
                   if t is eng._thread)


def test_submit_hands_outputs_to_a_callable_on_the_engine_thread(make_async, eu, reference_greedy):
    """`submit` (the Triton model's path): each output goes to the request's callable on the engine thread, in
    order, without an event loop; a step's failure arrives as the exception; a receiver that raises loses only its
    own request (aborted, its pages back); an id already running is refused without calling the receiver."""
    eng = make_async()
    prompts = eu.random_prompts([12, 30, 7], seed=50)
    got: dict[str, list] = {"a": [], "b": [], "bad": []}
    threads, done, first, hold = set(), threading.Event(), threading.Event(), threading.Event()

    def sink(rid, out):
        threads.add(threading.current_thread().name)
        got[rid].append(out)
        if rid == "a" and len(got[rid]) == 1:  # hold the engine thread: "a" is surely still running
            first.set()
            hold.wait(30)
        if rid == "bad" and len(got[rid]) == 2:
            raise ValueError("receiver broke")
        if all(got[r] and (isinstance(got[r][-1], BaseException) or got[r][-1].finished) for r in ("a", "b")):
            done.set()

    async def prepare(p, n):
        return await eng.prepare(prompt_token_ids=p, sampling_params=greedy(n))

    prepared = [asyncio.run(prepare(p, n)) for p, n in zip(prompts, (9, 6, 20))]
    for rid, req in zip(("a", "b", "bad"), prepared):
        eng.submit(rid, req, lambda out, rid=rid: sink(rid, out))
    assert first.wait(30)
    with pytest.raises(InvalidRequest, match="already running"):
        eng.submit("a", prepared[0], lambda out: got["a"].append(("second receiver", out)))
    hold.set()
    assert done.wait(30)
    for rid, p, n in (("a", prompts[0], 9), ("b", prompts[1], 6)):
        assert [t for o in got[rid] for t in o.new_token_ids] == reference_greedy(p, n)
        assert got[rid][-1].finished and not any(o.finished for o in got[rid][:-1])
    assert len(got["bad"]) == 2 and not got["bad"][-1].finished  # nothing more after the receiver failed
    assert threads == {"m3serve-engine"} and wait_for(lambda: all_pages_free(eng))
    fail_on_call(eng.engine.executor, "launch", 2, RuntimeError("triton kernel: out of resources"))
    failed = threading.Event()
    eng.submit("c", asyncio.run(prepare(prompts[2], 8)),
               lambda out: failed.set() if isinstance(out, RequestFailed) and "out of resources" in str(out) else None)
    assert failed.wait(30) and eng.is_healthy() and wait_for(lambda: all_pages_free(eng))
