"""The CUDA-graph decode path without a GPU: the persistent buffers (`DecodeBuffers`) filled from a decode step and
padded to a larger batch and block-table width give the same logits for the real rows as the eager step, through
the kernel attention backend (interpreter). The graphs themselves are checked on the GPU (tests/gpu)."""
import torch

from m3serve.config import EngineConfig
from m3serve.engine.llm_engine import LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.executor.cuda_graph import DecodeBuffers, batch_buckets, width_buckets
from m3serve.executor.model_runner import ModelRunner
from m3serve.model.layers.triton_attention import TritonAttention


def test_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(200)[-4:] == [128, 160, 192, 200]
    assert width_buckets(20) == [20] and width_buckets(2048) == [32, 128, 512, 2048]


def test_simple_sampling():
    from m3serve.engine.sequence import Sequence
    from m3serve.engine.step_builder import StepBuilder

    def simple(*sps):
        return StepBuilder(16, {1}).sampling([Sequence("x", 0, [3], sp, 9, 1) for sp in sps]).is_simple

    assert simple(SamplingParams(temperature=0))
    assert simple(SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=3), SamplingParams(logprobs=0))
    for sp in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.1), SamplingParams(logprobs=2),
               SamplingParams(repetition_penalty=1.1), SamplingParams(min_tokens=2, max_tokens=4)):
        assert not simple(SamplingParams(temperature=0), sp)


def test_padded_buffers_match_the_eager_step(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", kv_cache_dtype="nvfp4",
                                 max_model_len=256, num_gpu_blocks_override=24,
                                 async_scheduling=False))  # this test schedules the next step itself
    worker = eng.executor.worker
    cfg = worker.model.config
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate((70, 20, 45)):  # prefill three sequences (torch reference), then look at one decode step
        eng.add_request(f"r{i}", prompt_token_ids=torch.randint(3, 400, (n,), generator=g).tolist(),
                        sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while len(eng.scheduler.running) < 3 or any(s.num_output_tokens < 2 for s in eng.scheduler.running):
        eng.step()
    batch = eng.scheduler.schedule()
    step, _ = eng.step_builder.build(batch)
    assert step.is_decode and step.num_seqs == 3
    backend = TritonAttention(worker.model.attention_spec, worker.cache, cfg.num_attention_heads, cfg.index_n_heads)
    runner = ModelRunner(worker.model, worker.cache, worker.device, backend)  # the kernels (interpreter)
    # the same step twice over the same pages: undo the first run's K/V by restoring the cache bytes
    saved = [t.clone() for layer in worker.cache.layers for t in layer.tensors()]
    want = worker.model.compute_logits(runner.forward(step))
    for t, s in zip((t for layer in worker.cache.layers for t in layer.tensors()), saved):
        t.copy_(s)
    buffers = DecodeBuffers(8, 16, worker.cache.block_size, torch.device("cpu"))
    buffers.block_tables.fill_(7)  # stale columns from "earlier steps" must not matter
    buffers.fill(step, 4)
    got = worker.model.compute_logits(runner.forward(buffers.step(4, 16)))
    assert torch.isfinite(got).all()
    # another batch and table width split the attention differently (fp16 dots in another order): ~5e-4 apart
    torch.testing.assert_close(got[:3], want, rtol=0, atol=5e-3)
    assert torch.equal(got[:3].argmax(-1), want.argmax(-1))
    after = [t for layer in worker.cache.layers for t in layer.tensors()]
    changed = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).any()) for a, b in zip(after, saved))
    assert changed > 0  # the real rows were written (and the padding row wrote nothing: same logits as eager)
