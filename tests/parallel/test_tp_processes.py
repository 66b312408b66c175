"""The tensor-parallel worker processes (CPU, gloo): `m3serve generate -tp 2` equals TP 1; a worker that is killed
or hangs mid-generation fails every running request within 10 s and the engine reports itself unhealthy (also
when it dies while the engine is idle); shutdown, garbage collection and SIGTERM leave no process and no shared
memory behind."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.config import EngineConfig
from m3serve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from support.procs import alive, wait_until, worker_pids

pytestmark = pytest.mark.timeout(240)
PROMPTS = [[5, 7, 9, 11] * 5, [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]


def _shm_held() -> int:
    """File descriptors and mappings of the step channel's shared memory that this process holds."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "memfd:m3serve-step" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        return n + sum("memfd:m3serve-step" in line for line in f)


def _engine(tiny_model_dir) -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=512,
                                       tensor_parallel_size=2))


def _cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "m3serve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), **kw)


def test_cli_generate_tp2_equals_tp1_and_sigterm_leaves_no_worker(tiny_model_dir):
    ids = ["--prompt-ids", "5,7,9", "--prompt-ids", "11,12"]
    opts = ["--device", "cpu", "--dtype", "float32", "--temperature", "0", "--ignore-eos"]
    proc = _cli("generate", "--model", tiny_model_dir, *ids, *opts, "--max-tokens", "6", "-tp", "2")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    with LLM(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=512) as llm:
        want = [o.token_ids for o in llm.generate([[5, 7, 9], [11, 12]], SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True))]
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == want
    # a long generation, SIGTERM to the engine process: its workers go with it (PR_SET_PDEATHSIG, watchdog)
    proc = _cli("generate", "--model", tiny_model_dir, *ids, *opts, "--max-tokens", "3000", "--max-model-len", "4096",
                "-tp", "2")
    try:
        assert wait_until(lambda: worker_pids(proc.pid), 120), proc.stderr.read() if proc.poll() else ""
        workers = worker_pids(proc.pid)
        time.sleep(2.0)
        assert proc.poll() is None, "the generation ended before SIGTERM"
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert wait_until(lambda: not any(alive(p) for p in workers), 10), "a worker outlived the engine"
    finally:
        proc.kill()
        proc.communicate()


async def _generate(engine, rid, prompt, seen: asyncio.Event):
    """Run one long request; return what ended it (an exception, or None) and when."""
    try:
        async for _ in engine.generate(rid, prompt_token_ids=prompt,
                                       sampling_params=SamplingParams(max_tokens=450, temperature=0, ignore_eos=True)):
            seen.set()
        return None, time.monotonic()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e, time.monotonic()


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_worker_killed_or_hung_mid_generation_fails_every_request_within_10s(tiny_model_dir, fault):
    engine = _engine(tiny_model_dir)
    workers = worker_pids(os.getpid())
    assert len(workers) == 1
    try:
        async def main():
            seen = [asyncio.Event() for _ in PROMPTS]
            tasks = [asyncio.create_task(_generate(engine, f"r{i}", p, seen[i])) for i, p in enumerate(PROMPTS)]
            for ev in seen:
                await asyncio.wait_for(ev.wait(), 60)
            t0 = time.monotonic()
            os.kill(workers[0], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            return t0, await asyncio.wait_for(asyncio.gather(*tasks), 30)

        t0, results = asyncio.run(main())
        for err, t in results:
            assert isinstance(err, EngineDeadError), err
            assert "tensor-parallel" in str(err)
            assert t - t0 < 10.0, f"{fault}: a request failed {t - t0:.1f} s after the fault"
        assert not engine.is_healthy()
    finally:
        engine.shutdown()
    assert wait_until(lambda: not worker_pids(os.getpid()), 10), "a worker survived shutdown"
    assert not alive(workers[0])


def test_idle_worker_death_turns_the_engine_unhealthy_and_shutdown_leaves_nothing(tiny_model_dir):
    gc.collect()
    held = _shm_held()  # what earlier tests of this process may still map (a test of the channel alone)
    engine = _engine(tiny_model_dir)
    workers = worker_pids(os.getpid())
    assert _shm_held() > held
    try:
        async def one():
            return [o async for o in engine.generate("a", prompt_token_ids=[5, 6, 7],
                                                     sampling_params=SamplingParams(max_tokens=3, temperature=0))]
        assert asyncio.run(one())[-1].finished
        assert engine.is_healthy()
        os.kill(workers[0], signal.SIGKILL)
        assert wait_until(lambda: not engine.is_healthy(), 5), "a dead worker went unnoticed"
        with pytest.raises(EngineDeadError, match="rank 1"):
            asyncio.run(one())
    finally:
        engine.shutdown()
    assert not worker_pids(os.getpid()) and _shm_held() == held
    # an LLM that is only dropped (never shut down) leaves no worker, shared memory or process group behind
    llm = LLM(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=512, tensor_parallel_size=2)
    workers = worker_pids(os.getpid())
    del llm
    gc.collect()
    assert wait_until(lambda: not any(alive(p) for p in workers), 10) and _shm_held() == held
    assert not torch.distributed.is_initialized()  # the group went too: a next engine can start
