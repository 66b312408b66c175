"""The real tritonserver serves a small checkpoint of the M3.1-Flash geometry (`benchmarks/geometry.py`: a full
attention + dense MLP layer, then MSA + MoE layers with NVFP4 routed experts, M3's head ratios at toy widths) at TP 4
on CPU (gloo): the Triton stub starts the engine process, which starts three worker processes (ranks 1-3, one KV head
each); two concurrent streams give TP 1's greedy text; the unload leaves no process behind."""
from __future__ import annotations

import importlib.util
import os
import threading

import pytest
import tritonclient.grpc as grpcclient

from support.procs import alive, cmdline, engine_pids, wait_until, worker_pids
from triton_helpers import run_stream, text_inputs, texts
from tritonserver_proc import ROOT, serve_m3

pytestmark = [pytest.mark.server, pytest.mark.timeout(240)]
PROMPTS = ("The quick brown fox jumps over the lazy dog, then naps under the old oak tree by the river bank.",
           "Tensor parallel ranks")
MAX_TOKENS = 8


def _geometry():
    spec = importlib.util.spec_from_file_location("geometry", os.path.join(ROOT, "benchmarks", "geometry.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def geometry_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("geometry_models")
    geo = _geometry()
    cfg = geo.geometry_checkpoint(str(base / "flash3"), num_layers=3, dense_layers=1, **geo.SMOKE_TP4)
    assert cfg.layer_types[1:] == ["minimax_m3_sparse"] * 2 and cfg.mlp_layer_types == ["dense", "sparse", "sparse"]
    return str(base)


@pytest.fixture(scope="module")
def tp4_server(geometry_dir, tmp_path_factory):
    args = dict(model="flash3", device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4,
                max_num_batched_tokens=512, num_gpu_blocks_override=64, tensor_parallel_size=4)
    srv = serve_m3(tmp_path_factory.mktemp("tp4_server"), args, geometry_dir)
    yield srv
    srv.stop()


def test_tp4_geometry_serves_like_tp1(tp4_server, geometry_dir):
    srv = tp4_server
    stubs = [p for p in srv.group_pids() if b"m3_0_0" in cmdline(p) and alive(p)]
    assert len(stubs) == 1, stubs
    engines = engine_pids(stubs[0])
    assert len(engines) == 1
    workers = worker_pids(engines[0])
    assert len(workers) == 3, "the engine process should run ranks 1-3"
    results: dict[int, tuple] = {}

    def one(i: int) -> None:
        results[i] = run_stream(srv.grpc_url, "m3", text_inputs(PROMPTS[i], stream=True, max_tokens=MAX_TOKENS,
                                                                 extra={"ignore_eos": True}), request_id=f"r{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    from m3serve import LLM, SamplingParams
    with LLM(model=os.path.join(geometry_dir, "flash3"), device="cpu", dtype="float32", max_model_len=512) as llm:
        want = [o.text for o in llm.generate(list(PROMPTS), SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                           ignore_eos=True))]
    for i, text in enumerate(want):
        responses, error = results[i]
        assert error is None, error
        assert "".join(texts(responses)) == text
    control = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        control.unload_model("m3", headers=srv.repository_metadata())
        assert wait_until(lambda: not any(alive(p) for p in [stubs[0], *engines, *workers]), 60), srv.log()[-3000:]
    finally:
        control.close()
