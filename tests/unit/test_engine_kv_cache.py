"""The paged KV cache: tensor layout per dtype (the kernels depend on it), store/load through scattered
pages, and the end-to-end error of FP8 and NVFP4 K/V (and indexer-key) caches against a bf16 cache.

Measured on the tiny random model (4 prompts of 70-130 tokens, 16 teacher-forced decode steps each;
error = mean |logit - logit_bf16| / std(logit_bf16) per position):
    cache (kv / indexer)   mean err  median err  top-1 agreement with bf16
    fp32 / fp32             0.015     0.003       0.95   (bf16 rounding alone, for scale)
    fp8 / fp8               0.13      0.035       0.77
    nvfp4 / nvfp4           0.24      0.15        0.75
The random model is chaotic (one changed MSA block choice or MoE route moves the logits a lot), so the
bands asserted below are loose; a broken codec (wrong scale, nibble order) gives errors of order 1.
"""
import pytest
import torch

from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import ScheduledBatch
from m3serve.engine.sequence import Sequence
from m3serve.step_io import StepInput
from m3serve.model.kv_cache import PagedKVCache, page_bytes
from m3serve.model.kv_codec import KVCodec

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}


@pytest.mark.parametrize("kv,idx", [("bfloat16", "bfloat16"), ("fp8", "fp8"), ("nvfp4", "nvfp4"),
                                    ("nvfp4", "bfloat16"), ("float32", "fp8")])
def test_layout(tiny_loaded, kv, idx):
    cfg = tiny_loaded[0].config
    P, H, B, D, Di = 5, cfg.num_key_value_heads, cfg.index_block_size, cfg.head_dim, cfg.index_head_dim
    c = PagedKVCache(cfg, P, kv, idx, "cpu", kv_scales={1: (0.5, 0.25)})
    assert (c.kv_dtype, c.index_dtype, c.block_size, c.num_pages) == (kv, idx, B, P)
    assert len(c.layers) == cfg.num_hidden_layers
    for layer, lc in enumerate(c.layers):
        for data, blocks in ((lc.k, lc.k_scale_blocks), (lc.v, lc.v_scale_blocks)):
            assert data.dtype == DT[kv]
            assert data.shape == (P, H, B, D // 2 if kv == "nvfp4" else D)
            if kv == "nvfp4":
                assert blocks.dtype == torch.float8_e4m3fn and blocks.shape == (P, H, B, D // 16)
            else:
                assert blocks is None
        assert (lc.k_scale, lc.v_scale) == ((0.5, 0.25) if layer == 1 else (1.0, 1.0))
        if cfg.is_sparse_attention(layer):
            assert lc.index_dtype == idx and lc.index.dtype == DT[idx]
            assert lc.index.shape == (P, B, Di // 2 if idx == "nvfp4" else Di)
            assert (lc.index_scale_blocks is None) == (idx != "nvfp4")
            assert lc.index_scale == 1.0
        else:
            assert lc.index_dtype is None and lc.index is None and lc.index_scale_blocks is None
    assert c.nbytes == P * page_bytes(cfg, kv, idx)


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "fp8", "nvfp4"])
def test_store_load_through_scattered_pages(tiny_loaded, kv):
    """Two sequences on interleaved, out-of-order pages, written in two steps: load returns each
    sequence's history exactly as the codec round-trips it."""
    cfg = tiny_loaded[0].config
    B, H, D, Di = cfg.index_block_size, cfg.num_key_value_heads, cfg.head_dim, cfg.index_head_dim
    c = PagedKVCache(cfg, 8, kv, kv, "cpu", kv_scales={1: (0.7, 1.3)})
    pages = [[6, 1, 4], [0, 7]]
    lens = [40, 21]
    g = torch.Generator().manual_seed(0)
    hist = [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g), torch.randn(n, Di, generator=g))
            for n in lens]
    layer = 1  # sparse, non-default scales
    for lo_hi in ([(0, 17), (0, 5)], [(17, 40), (5, 21)]):
        pos, slots, qsl = [], [], [0]
        for s, (lo, hi) in enumerate(lo_hi):
            pos += range(lo, hi)
            slots += [pages[s][p // B] * B + p % B for p in range(lo, hi)]
            qsl.append(len(pos))
        tables = torch.tensor([pages[0], pages[1] + [0]], dtype=torch.int32)
        ends = [hi for _, hi in lo_hi]
        step = StepInput(torch.zeros(len(pos), dtype=torch.int64), torch.tensor(pos), torch.tensor(qsl),
                         torch.tensor(ends, dtype=torch.int32), qsl, ends, False, max(qsl[1] - qsl[0], qsl[2] - qsl[1]),
                         max(ends), block_tables=tables, slot_mapping=torch.tensor(slots))
        for s, (lo, hi) in enumerate(lo_hi):
            k, v, ik = (t[lo:hi] for t in hist[s])
            c.layers[layer].store(s, step, k, v, ik)
        for s, (lo, hi) in enumerate(lo_hi):
            K, V, IK = c.layers[layer].load(s, step)
            k, v, ik = (t[:hi] for t in hist[s])
            assert K.shape == (hi, H, D) and IK.shape == (hi, Di)
            torch.testing.assert_close(K, KVCodec(kv, 0.7).roundtrip(k), rtol=0, atol=0)
            torch.testing.assert_close(V, KVCodec(kv, 1.3).roundtrip(v), rtol=0, atol=0)
            torch.testing.assert_close(IK, KVCodec(kv).roundtrip(ik), rtol=0, atol=0)


def test_each_attention_layer_is_bound_to_its_cache(tiny_loaded):
    """`bind_kv_cache` binds layer l's attention to the pool's layer l (the reference on the CPU); a model without a
    binding, or a binding of the wrong length, is a clear error, not a wrong cache."""
    from m3serve.model.layers.attention import TorchAttention
    from m3serve.model.m3 import M3ForCausalLM

    cfg = tiny_loaded[0].config
    model = M3ForCausalLM(cfg)
    step = StepInput.contiguous([[3, 4, 5]], [0], "cpu")
    with pytest.raises(RuntimeError, match="attention layer 0 has no KV cache"):
        model(step)
    pool = PagedKVCache(cfg, 4, "float32", "float32", "cpu")
    with pytest.raises(ValueError, match=f"{cfg.num_hidden_layers - 1} layer caches for a model of"):
        model.bind_kv_cache(pool.layers[1:])
    with pytest.raises(ValueError, match="'cuda' is not one of"):
        model.bind_kv_cache(pool, "cuda")
    model.bind_kv_cache(pool)
    attns = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(a.backend, TorchAttention) for a in attns)
    assert [a.kv_cache for a in attns] == pool.layers and model.attention_backends() == tuple(a.backend for a in attns)


def _teacher_forced(eng, tokens, prompt_len, chunk=32):
    """Logits predicting tokens[prompt_len:], through the engine's runner and paged cache: the prompt
    in chunks, then one token per step (decode)."""
    seq = Sequence("tf", 0, tokens, SamplingParams(), 1)
    eng.block_manager.allocate(seq)
    out, pos = [], 0
    while pos < len(tokens) - 1:
        n = min(chunk, prompt_len - pos) if pos < prompt_len else 1
        step, _ = eng.step_builder.build(ScheduledBatch([seq], [n]))
        runner = eng.executor.worker.runner
        hidden = runner.forward(step)
        if pos + n >= prompt_len:
            out.append(runner.model.compute_logits(hidden[-1:]))
        seq.num_computed_tokens += n
        pos += n
    eng.block_manager.free(seq)
    return torch.cat(out)


def test_quantized_kv_error_against_bf16(make_engine, eu):
    prompts = eu.random_prompts([100, 70, 130, 90], seed=0)
    gen = 16
    caches = {"fp32": ("auto", "auto"), "bf16": ("bfloat16", "bfloat16"), "fp8": ("fp8", "fp8"),
              "nvfp4": ("nvfp4", "nvfp4")}
    engines = {name: make_engine(kv_cache_dtype=kv, attention_config={"indexer_kv_dtype": idx},
                                 enable_prefix_caching=False, max_num_batched_tokens=64)
               for name, (kv, idx) in caches.items()}
    assert engines["nvfp4"].executor.worker.cache.layers[0].k.dtype == torch.uint8
    assert engines["fp8"].executor.worker.cache.layers[1].index.dtype == torch.float8_e4m3fn
    free_run = {}
    for name, eng in engines.items():  # end to end: batched greedy generation on each cache
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", prompt_token_ids=p,
                            sampling_params=SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True))
        res = eu.run_to_completion(eng)
        free_run[name] = [res[f"r{i}"][0] for i in range(len(prompts))]
        assert all(len(t) == gen for t in free_run[name])
        assert eng.stats()["num_free_pages"] == eng.stats()["num_total_pages"]
    seqs = [p + t for p, t in zip(prompts, free_run["bf16"])]
    ref = [_teacher_forced(engines["bf16"], s, len(p)) for s, p in zip(seqs, prompts)]
    report = {}
    for name in ("fp32", "fp8", "nvfp4"):
        got = [_teacher_forced(engines[name], s, len(p)) for s, p in zip(seqs, prompts)]
        err = torch.cat([(g - r).abs().mean(-1) / r.std(-1) for g, r in zip(got, ref)])
        agree = float(torch.cat([(g.argmax(-1) == r.argmax(-1)).float() for g, r in zip(got, ref)]).mean())
        same_prefix = sum(next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), gen)
                          for x, y in zip(free_run[name], free_run["bf16"])) / (gen * len(prompts))
        report[name] = (float(err.mean()), float(err.median()), agree, same_prefix)
    print("\nKV cache error vs bf16 (mean err, median err, top-1 agreement, free-run common prefix):")
    for name, r in report.items():
        print(f"  {name:6s} {r[0]:.4f} {r[1]:.4f} {r[2]:.3f} {r[3]:.3f}")
    bands = {"fp32": (0.05, 0.02, 0.9), "fp8": (0.25, 0.08, 0.65), "nvfp4": (0.4, 0.25, 0.55)}
    for name, (mean_max, median_max, agree_min) in bands.items():
        mean, median, agree, _ = report[name]
        assert mean < mean_max and median < median_max and agree >= agree_min, (name, report[name])
    assert report["fp32"][1] < report["fp8"][1] < report["nvfp4"][1]
