"""The real tritonserver serves the tiny model at TP 2 (CPU, gloo): the stub starts the engine process, which starts
the worker process; answers equal TP 1's; a worker killed mid-generation fails the request and turns the model not
ready within 10 s, and the unload leaves neither engine nor worker behind; a stub that is killed takes both with it."""
from __future__ import annotations

import json
import os
import queue
import signal
import time

import pytest
import tritonclient.grpc as grpcclient

from support.procs import alive, cmdline, engine_pids, wait_until, worker_pids
from triton_helpers import is_final, text_inputs, texts
from tritonserver_proc import ROOT, serve_m3

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tp_server(models_dir, tmp_path_factory):
    with open(os.path.join(ROOT, "model_repository", "m3", "1", "model.json")) as f:
        args = json.load(f)
    args["tensor_parallel_size"] = 2
    srv = serve_m3(tmp_path_factory.mktemp("tp_server"), args, models_dir)
    yield srv
    srv.stop()


def _stub(srv) -> int:
    pids = [p for p in srv.group_pids() if b"m3_0_0" in cmdline(p) and alive(p)]
    assert len(pids) == 1, pids
    return pids[0]


def _engine_and_workers(stub: int) -> tuple[int, list[int]]:
    engines = engine_pids(stub)
    assert len(engines) == 1, "the stub should have started one engine process"
    workers = worker_pids(engines[0])
    assert len(workers) == 1, "the engine process should have spawned one worker (rank 1)"
    return engines[0], workers


def _stream(url: str, inputs, events: queue.Queue):
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error, time.monotonic())))
    client.async_stream_infer("m3", inputs, request_id="long", enable_empty_final_response=True)
    return client


def test_tp2_serves_like_tp1_and_survives_nothing_of_a_dead_worker(tp_server, tiny_model_dir):
    srv = tp_server
    stub = _stub(srv)
    engine, workers = _engine_and_workers(stub)
    # greedy text equals TP 1 in this process
    from m3serve import LLM, SamplingParams
    events: queue.Queue = queue.Queue()
    client = _stream(srv.grpc_url, text_inputs(PROMPT, stream=True, max_tokens=8, extra={"ignore_eos": True}), events)
    got = []
    while True:
        result, error, _ = events.get(timeout=120)
        assert error is None, error
        got.append(result)
        if is_final(result):
            break
    client.stop_stream()
    client.close()
    with LLM(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=1024) as llm:
        want = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    assert "".join(texts(got)) == want
    # a worker killed mid-generation: the request fails and the model turns unready within 10 s
    client = _stream(srv.grpc_url, text_inputs(PROMPT, stream=True, max_tokens=900, extra={"ignore_eos": True}),
                     events)
    control = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        result, error, _ = events.get(timeout=120)
        assert error is None and not is_final(result), error
        t0 = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        while True:
            result, error, t = events.get(timeout=30)
            message = str(error) if error is not None else ""
            if error is not None or is_final(result):
                break
        assert "not healthy" in message, message
        assert t - t0 < 10.0, f"the request failed {t - t0:.1f} s after the worker died"
        client.stop_stream()
        assert wait_until(lambda: not control.is_model_ready("m3"), t0 + 10.0 - time.monotonic()), "still ready"
        assert control.is_server_live()
        # the unload ran the engine's shutdown: no engine process, no worker, and the stub itself exits
        assert wait_until(lambda: not alive(stub), 60), srv.log()[-3000:]
        assert not alive(engine) and not any(alive(p) for p in workers)
        # loaded again: a fresh stub with a fresh worker; SIGKILL to the stub takes the worker with it
        control.load_model("m3", headers=srv.repository_metadata())
        assert control.is_model_ready("m3")
        stub = _stub(srv)
        engine, workers = _engine_and_workers(stub)
        os.kill(stub, signal.SIGKILL)
        assert wait_until(lambda: not any(alive(p) for p in [engine, *workers]), 10), "a process outlived its stub"
    finally:
        client.stop_stream()
        client.close()
        control.close()
