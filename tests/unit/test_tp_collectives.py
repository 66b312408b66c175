"""The collective path without processes: a `Parallel` with a group of one (gloo here, NCCL in
tests/gpu/test_cuda_graphs_gpu.py) runs every all-reduce and the logits all-gather for real and gives the tokens of
no group; decode graphs follow the device, not the world size (gloo ranks stay eager, NCCL ranks capture)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from m3serve import LLM, SamplingParams
from m3serve.config import EngineConfig, ModelConfig
from m3serve.distributed import parallel as par
from m3serve.executor import worker as worker_module

PROMPTS = [[5, 7, 9, 11] * 5, [11, 12, 13]]


def _tokens(tiny_model_dir) -> list[list[int]]:
    with LLM(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=256) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0,
                                                                           ignore_eos=True))]


def test_a_group_of_one_runs_the_collectives(tiny_model_dir, monkeypatch):
    want = _tokens(tiny_model_dir)
    group = par.Parallel(0, 1)
    par.join_group(group, par.create_store(1, 30.0), torch.device("cpu"), 30.0)
    calls = []
    for name in ("all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, lambda *a, _real=getattr(dist, name), _name=name, **k: (
            calls.append(_name), _real(*a, **k))[1])
    monkeypatch.setattr(worker_module, "Parallel", lambda: group)
    try:
        got = _tokens(tiny_model_dir)
    finally:
        par.destroy_group()
    assert got == want
    assert calls.count("all_gather") >= 6 and calls.count("all_reduce") > 8 * calls.count("all_gather")


def test_decode_graphs_follow_the_device_not_the_world_size(tiny_model_dir):
    cfg = EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=256)
    w = worker_module.Worker(cfg, ModelConfig.from_pretrained(tiny_model_dir), parallel=par.Parallel(0, 2))
    assert w.model.parallel.size == 2 and not w.use_cuda_graphs  # gloo: eager
    w.device = torch.device("cuda")
    assert w.use_cuda_graphs  # NCCL ranks capture together at init_cache
    w.config = dataclasses.replace(cfg, enforce_eager=True)
    assert not w.use_cuda_graphs
