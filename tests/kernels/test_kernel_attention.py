"""TritonAttention (kernels, interpreter) vs TorchAttention (references) over the engine's PagedKVCache:
chunked prefill, a mixed prefill + decode step, then pure decode steps; a full and a sparse layer."""
import pytest
import torch

from m3serve.config import ModelConfig
from m3serve.engine.step import StepInput
from m3serve.executor.kv_cache import PagedKVCache
from m3serve.model.layers.attention import AttentionSpec, TorchAttention
from m3serve.model.layers.triton_attention import TritonAttention
from support.paged import rel_err


# (sequence -> new tokens) per step: A is chunk-prefilled, B and C join, then everyone decodes
STEPS = [{0: 40, 1: 25}, {0: 35, 1: 1, 2: 9}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]


def run_scenario(kv_dtype, index_dtype, device="cpu", h_q=8, h_kv=2, d=64, di=32, b=16, topk=4, steps=None,
                 seed=42, tol=1.5e-2):
    """Drive both backends through `steps` ({sequence: new tokens} per step) on a full and a sparse layer."""
    steps = steps or STEPS
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(num_hidden_layers=2, num_attention_heads=h_q, num_key_value_heads=h_kv, head_dim=d,
                      layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "dense"],
                      index_n_heads=h_kv, index_head_dim=di, index_block_size=b, index_topk_blocks=topk)
    seqs_all = sorted({s for st in steps for s in st})
    total = {s: sum(st.get(s, 0) for st in steps) for s in seqs_all}
    n_pages = sum(-(-n // b) for n in total.values()) + 3
    scales = {0: (0.004, 0.003), 1: (0.002, 0.005)} if kv_dtype != "bfloat16" else None
    iscales = {1: 0.003} if index_dtype != "bfloat16" else None
    caches = [PagedKVCache(cfg, n_pages, kv_dtype, index_dtype, device=device, kv_scales=scales,
                           index_scales=iscales) for _ in range(2)]
    spec = AttentionSpec(b, topk, 1, d ** -0.5)
    backends = [TorchAttention(spec, caches[0]), TritonAttention(spec, caches[1], h_q, h_kv)]
    free = torch.randperm(n_pages, generator=g).tolist()
    pages = {s: [] for s in seqs_all}
    done = {s: 0 for s in seqs_all}
    for step in steps:
        seqs = sorted(step)
        pos, slots, qsl, lens = [], [], [0], []
        for s in seqs:
            start, end = done[s], done[s] + step[s]
            while len(pages[s]) * b < end:
                pages[s].append(free.pop())
            pos += range(start, end)
            slots += [pages[s][p // b] * b + p % b for p in range(start, end)]
            qsl.append(qsl[-1] + step[s])
            lens.append(end)
            done[s] = end
        T = qsl[-1]
        tables = torch.zeros(len(seqs), max(len(pages[s]) for s in seqs), dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(pages[s])] = torch.tensor(pages[s], dtype=torch.int32)
        step_in = StepInput(torch.zeros(T, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                            torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), qsl, lens,
                            all(step[s] == 1 for s in seqs), max(step.values()), max(lens), block_tables=tables,
                            slot_mapping=torch.tensor(slots, dtype=torch.int64)).to(device)
        backends[1].plan(step_in)
        for layer in range(2):
            rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, torch.bfloat16)  # noqa: E731
            q, k, v = rnd(T, h_q, d), rnd(T, h_kv, d), rnd(T, h_kv, d)
            iq = ik = None
            if cfg.is_sparse_attention(layer):
                iq, ik = rnd(T, h_kv, di), rnd(T, di)
            outs = [backend.forward(layer, q, k, v, iq, ik, step_in) for backend in backends]
            assert outs[1].shape == q.shape and outs[1].dtype == q.dtype
            err = rel_err(outs[1], outs[0])
            assert err < tol, (step, layer, err)
    assert max(done.values()) > topk * b  # the sparse layer's selection dropped blocks
    for a, c in zip(caches[0].layers, caches[1].layers):
        for x, y in zip(a.tensors(), c.tensors()):  # same bytes written by both paths
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype,index_dtype", [("nvfp4", "fp8"), ("fp8", "bfloat16"), ("bfloat16", "nvfp4")])
def test_triton_attention_matches_torch(kv_dtype, index_dtype):
    run_scenario(kv_dtype, index_dtype)
