"""AsyncLLMEngine: concurrent streams in one asyncio loop (and from two loops), bad requests rejected
before the first yield without disturbing others, abort (async, from another thread, by closing the
stream), a failing step loop (EngineDeadError everywhere), shutdown leaving nothing running."""
import asyncio
import threading
import time

import pytest

from m3serve.engine.async_engine import AsyncLLMEngine, EngineDeadError
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


def test_step_loop_failure_kills_engine(make_async, eu):
    eng = make_async()
    inner = eng.engine
    real_step, calls = inner.step, [0]

    def flaky_step():
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("boom")
        return real_step()

    inner.step = flaky_step
    prompts = eu.random_prompts([10, 20], seed=44)

    async def main():
        res = await asyncio.gather(*[collect(eng, f"r{i}", prompt_token_ids=q, sampling_params=greedy(50))
                                     for i, q in enumerate(prompts)], return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await collect(eng, "late", prompt_token_ids=[1, 2])
        return res

    res = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in res)
    assert not eng.is_healthy()
    assert wait_for(lambda: not eng.is_running)


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
