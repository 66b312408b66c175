"""EngineProcess: the engine in a process of its own (the Triton model's default). Its streams equal the in-process
engine's; the tokenizer loads in the engine process only (the text a caller asks for comes in the outputs); bad
requests come back as InvalidRequest naming the option; abort frees the pages; a receiver that raises
loses only its request; an engine that dies (device fault) or a process that is killed ends every open stream with
EngineDeadError and turns the engine unhealthy; a factory that fails reports its traceback; shutdown leaves no
process and no thread behind."""
import asyncio
import os
import pickle
import signal
import threading

import pytest

from m3serve.config import EngineConfig
from m3serve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from m3serve.engine.process_client import EngineProcess
from m3serve.engine.sampling_params import InvalidRequest, SamplingParams, TextOptions
from support.procs import wait_until

HERE = os.path.abspath(__file__)


def config(model_dir) -> EngineConfig:
    return EngineConfig(model=model_dir, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                        max_num_seqs=8)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def collect(engine, rid, **kw):
    return [o async for o in engine.generate(rid, **kw)]


def pages_back(engine):
    st = engine.stats()
    return st["num_running"] == 0 and st["num_free_pages"] == st["num_total_pages"]


# engine factories, built in the engine process from this file ("<path>:<function>")
def fails_to_load(cfg):
    raise RuntimeError("no weights here (on purpose)")


def dies_on_second_step(cfg):
    """The real engine, whose executor raises a device fault from its second step on."""
    import torch

    engine = AsyncLLMEngine(cfg)
    executor = engine.engine.executor
    launch, calls = executor.launch, []

    def faulty(step, *prev):
        calls.append(1)
        if len(calls) > 1:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")
        return launch(step, *prev)

    executor.launch = faulty
    return engine


@pytest.fixture(scope="module")
def proc_engine(tiny_model_dir):
    eng = EngineProcess(config(tiny_model_dir))
    yield eng
    eng.shutdown()


def test_streams_equal_the_in_process_engine(proc_engine, tiny_model_dir):
    prompts = [[5, 7, 9, 11], list(range(3, 60)), [100] * 20]
    local = AsyncLLMEngine(config(tiny_model_dir))
    try:
        async def run(eng):
            return await asyncio.gather(*(collect(eng, f"r{i}", prompt_token_ids=p, sampling_params=greedy(12))
                                          for i, p in enumerate(prompts)),
                                        collect(eng, "text", prompt="The quick brown fox", sampling_params=greedy(6)))
        want, got = asyncio.run(run(local)), asyncio.run(run(proc_engine))
    finally:
        local.shutdown()
    for w, g in zip(want, got):
        assert [t for o in g for t in o.new_token_ids] == [t for o in w for t in o.new_token_ids]
        assert "".join(o.text for o in g) == "".join(o.text for o in w)
        assert g[-1].finished and g[-1].finish_reason == "length"
    assert proc_engine.max_model_len == 256
    assert wait_until(lambda: pages_back(proc_engine), 10)


def test_the_tokenizer_loads_in_the_engine_process_only(tiny_model_dir, tokenizer_loads):
    """The client neither loads the tokenizer nor gets it shipped: the text it asks for (TextOptions) is decoded in
    the engine process and comes in the outputs. The counter catches both ways a tokenizer could get here."""
    from m3serve.text.tokenizer import Tokenizer

    eng = EngineProcess(config(tiny_model_dir))
    try:
        msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
        outs = asyncio.run(collect(eng, "c", prompt=msgs, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1),
            text_options=TextOptions(prompt_text=True, logprob_tokens=True)))
    finally:
        eng.shutdown()
    assert tokenizer_loads == [] and not hasattr(eng, "tokenizer")
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    assert outs[0].prompt_text == tok.decode(outs[0].prompt_token_ids, skip_special_tokens=False)
    assert [{i: tok.decode([i], skip_special_tokens=False) for i in e} for o in outs for e in o.logprobs] \
        == [t for o in outs for t in o.logprob_tokens]
    pickle.loads(pickle.dumps(tok))
    assert tokenizer_loads == ["built", "unpickled"]


def test_bad_requests_name_the_option(proc_engine):
    async def main():
        with pytest.raises(InvalidRequest) as e:
            await proc_engine.prepare(prompt_token_ids=[10**9], sampling_params=greedy(4))
        assert e.value.field == "prompt_token_ids"
        with pytest.raises(InvalidRequest) as e:
            await proc_engine.prepare(prompt_token_ids=[5] * 250, sampling_params=greedy(100))
        assert e.value.field == "max_tokens"
        prepared = await proc_engine.prepare(prompt_token_ids=[5, 6], sampling_params=greedy(200))
        got = []
        proc_engine.submit("dup", prepared, got.append)
        with pytest.raises(InvalidRequest):
            proc_engine.submit("dup", prepared, got.append)
        proc_engine.abort_sync("dup")
        assert wait_until(lambda: got and got[-1].finished, 10)
        return got
    got = asyncio.run(main())
    assert got[-1].finish_reason == "abort" and sum(len(o.new_token_ids) for o in got) < 200
    assert wait_until(lambda: pages_back(proc_engine), 10)
    err = pickle.loads(pickle.dumps(InvalidRequest("top_k", "must be >= -1")))
    assert (err.field, err.message, str(err)) == ("top_k", "must be >= -1", "top_k: must be >= -1")


def _started(engine, rid, **request):
    """`start` a request; its events (outputs, or the exception that ends it) once the last has come."""
    got, done = [], threading.Event()

    def sink(item):
        got.append(item)
        if isinstance(item, BaseException) or item.finished:
            done.set()
    engine.start(rid, sink, **request)
    assert done.wait(30)
    return got


def start_checks(engine, tiny_model_dir):
    """`start` (prepare and submit in one call, the Triton model's path) on `engine`: the stream `generate` gives;
    an invalid request's InvalidRequest naming the option as its one event; an abort as soon as it is started ends
    it with "abort" before its tokens are made; an id already running is refused at the call."""
    want = asyncio.run(collect(engine, "g", prompt_token_ids=[5, 7, 9, 11], sampling_params=greedy(10)))
    got = _started(engine, "s", prompt_token_ids=[5, 7, 9, 11], sampling_params=greedy(10))
    assert [t for o in got for t in o.new_token_ids] == [t for o in want for t in o.new_token_ids]
    assert got[-1].finish_reason == "length" and not any(o.finished for o in got[:-1])
    bad = _started(engine, "bad", prompt_token_ids=[10**9], sampling_params=greedy(4))
    assert len(bad) == 1 and isinstance(bad[0], InvalidRequest) and bad[0].field == "prompt_token_ids"
    got, done = [], threading.Event()
    engine.start("gone", lambda item: (got.append(item), done.set() if item.finished else None),
                 prompt_token_ids=list(range(3, 60)), sampling_params=greedy(150))
    engine.abort_sync("gone")  # before the engine has it (prepared on another thread)
    assert done.wait(30) and got[-1].finish_reason == "abort"
    assert sum(len(o.new_token_ids) for o in got) < 150
    hold = threading.Event()
    engine.start("twice", lambda item: hold.set(), prompt_token_ids=[5, 6], sampling_params=greedy(200))
    assert hold.wait(30)
    with pytest.raises(InvalidRequest, match="already running"):
        engine.start("twice", hold.set, prompt_token_ids=[5, 6], sampling_params=greedy(2))
    engine.abort_sync("twice")
    assert wait_until(lambda: pages_back(engine), 10)


def test_start_prepares_and_submits_in_one_message(proc_engine, tiny_model_dir):
    start_checks(proc_engine, tiny_model_dir)


def test_start_on_the_in_process_engine(tiny_model_dir):
    eng = AsyncLLMEngine(config(tiny_model_dir))
    try:
        start_checks(eng, tiny_model_dir)
    finally:
        eng.shutdown()


def test_a_receiver_that_raises_loses_only_its_request(proc_engine):
    async def main():
        a = await proc_engine.prepare(prompt_token_ids=[5, 6, 7], sampling_params=greedy(50))
        calls = []

        def bad(item):
            calls.append(item)
            raise RuntimeError("receiver bug")
        proc_engine.submit("bad", a, bad)
        return calls, await collect(proc_engine, "good", prompt_token_ids=[8, 9], sampling_params=greedy(8))
    calls, good = asyncio.run(main())
    assert len(calls) == 1  # aborted after its first output
    assert sum(len(o.new_token_ids) for o in good) == 8 and good[-1].finish_reason == "length"
    assert wait_until(lambda: pages_back(proc_engine), 10)
    assert proc_engine.is_healthy()


def test_a_killed_process_ends_every_stream(tiny_model_dir):
    eng = EngineProcess(config(tiny_model_dir))
    try:
        async def main():
            p = await eng.prepare(prompt_token_ids=[5, 6], sampling_params=greedy(200))
            got, done = [], threading.Event()

            def sink(item):
                got.append(item)
                if isinstance(item, BaseException):
                    done.set()
            eng.submit("long", p, sink)
            assert wait_until(lambda: got, 10)
            os.kill(eng.proc.pid, signal.SIGKILL)
            assert await asyncio.to_thread(done.wait, 10)
            return got
        got = asyncio.run(main())
        assert isinstance(got[-1], EngineDeadError)
        assert not eng.is_healthy() and "signal 9" in eng.dead_reason
        with pytest.raises(EngineDeadError):
            asyncio.run(eng.prepare(prompt_token_ids=[5], sampling_params=greedy(2)))
        with pytest.raises(EngineDeadError):
            eng.submit("later", None, got.append)
    finally:
        eng.shutdown()


def test_an_engine_that_dies_reports_it(tiny_model_dir):
    eng = EngineProcess(config(tiny_model_dir), factory=f"{HERE}:dies_on_second_step")
    try:
        async def main():
            with pytest.raises(EngineDeadError):
                await collect(eng, "r", prompt_token_ids=[5, 6, 7], sampling_params=greedy(10))
        asyncio.run(main())
        assert wait_until(lambda: not eng.is_healthy(), 5)
        assert "illegal memory access" in eng.dead_reason
        assert eng.is_running  # the process stays until it is shut down (the model unloads it)
    finally:
        eng.shutdown()
    assert not eng.is_running


def test_a_factory_that_fails_reports_its_traceback(tiny_model_dir):
    with pytest.raises(RuntimeError, match="no weights here"):
        EngineProcess(config(tiny_model_dir), factory=f"{HERE}:fails_to_load")


def test_shutdown_leaves_nothing_behind(tiny_model_dir):
    before = {t.ident for t in threading.enumerate()}
    eng = EngineProcess(config(tiny_model_dir))
    pid = eng.proc.pid

    async def main():
        p = await eng.prepare(prompt_token_ids=[5, 6], sampling_params=greedy(250))
        got = []
        eng.submit("open", p, got.append)
        assert wait_until(lambda: got, 10)
        return got
    got = asyncio.run(main())
    eng.shutdown()
    assert isinstance(got[-1], EngineDeadError)  # an open stream ends
    assert eng.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert wait_until(lambda: {t.ident for t in threading.enumerate()} <= before, 5)


def test_an_engine_without_rounds_streams_each_output(tiny_model_dir):
    """The benchmark's zero-cost engine (no `round_listeners`: each output is sent on its own) through the process."""
    factory = os.path.join(os.path.dirname(HERE), "..", "..", "benchmarks", "bench_server.py") + ":null_engine"
    eng = EngineProcess(config(tiny_model_dir), factory=os.path.abspath(factory))
    try:
        outs = asyncio.run(collect(eng, "n", prompt_token_ids=[5, 6, 7], sampling_params=greedy(5)))
    finally:
        eng.shutdown()
    assert [len(o.new_token_ids) for o in outs] == [1] * 5 and outs[-1].finished
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5]
