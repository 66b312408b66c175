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


def _padded_and_eager(tiny_model_dir, fill=DecodeBuffers.fill):
    """One decode step of three sequences run eagerly and through `DecodeBuffers` padded to a batch of 4 and a
    table width of 16 (filled by `fill`), over the same cache bytes: (padded logits, eager logits, cache tensors
    after the eager run, after the padded run)."""
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", kv_cache_dtype="nvfp4",
                                 max_model_len=256, num_gpu_blocks_override=24,
                                 async_scheduling=False))  # this test schedules the next step itself
    worker = eng.executor.worker
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate((70, 20, 45)):  # prefill three sequences (torch reference), then look at one decode step
        eng.add_request(f"r{i}", prompt_token_ids=torch.randint(3, 400, (n,), generator=g).tolist(),
                        sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while len(eng.scheduler.running) < 3 or any(s.num_output_tokens < 2 for s in eng.scheduler.running):
        eng.step()
    batch = eng.scheduler.schedule()
    step, _ = eng.step_builder.build(batch)
    assert step.is_decode and step.num_seqs == 3
    runner = ModelRunner(worker.model, worker.cache, worker.device, "triton")  # the kernels (interpreter)
    assert all(isinstance(b, TritonAttention) for b in runner.attention)
    cache = [t for layer in worker.cache.layers for t in layer.tensors()]
    # the same step twice over the same pages: undo the first run's K/V by restoring the cache bytes
    saved = [t.clone() for t in cache]
    want = worker.model.compute_logits(runner.forward(step))
    eager = [t.clone() for t in cache]
    for t, s in zip(cache, saved):
        t.copy_(s)
    buffers = DecodeBuffers(8, 16, worker.cache.block_size, torch.device("cpu"))
    buffers.block_tables.fill_(7)  # stale columns from "earlier steps" must not matter
    fill(buffers, step, 4)
    got = worker.model.compute_logits(runner.forward(buffers.step(4, 16)))
    return got, want, eager, cache


def _same_cache(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def test_padded_buffers_match_the_eager_step(tiny_model_dir):
    got, want, eager, padded = _padded_and_eager(tiny_model_dir)
    assert torch.isfinite(got).all()
    # another batch and table width split the attention differently (fp16 dots in another order): ~5e-4 apart
    torch.testing.assert_close(got[:3], want, rtol=0, atol=5e-3)
    assert torch.equal(got[:3].argmax(-1), want.argmax(-1))
    # the real rows wrote what the eager step wrote, and the padding row wrote nothing: the same cache bytes
    assert _same_cache(padded, eager)


def test_padding_row_writes_are_caught(tiny_model_dir, monkeypatch):
    """A padding row given a real slot (slot 0: the first row of page 0, which the padding rows' block table
    names) writes its K/V there: the cache check above sees it (the old check, some bytes changed, passed it)."""
    def fill_slot_0(self, step, batch, prev_token_ids=None):
        DecodeBuffers.fill(self, step, batch, prev_token_ids)
        self.slot_mapping[step.num_seqs:batch].fill_(0)

    _, _, eager, padded = _padded_and_eager(tiny_model_dir, fill_slot_0)
    assert not _same_cache(padded, eager)


def test_fill_keeps_the_known_rows_of_a_step_launched_ahead():
    """A one-token step launched ahead may hold a prompt's last token (row -1: the host knows it) beside decodes
    whose tokens the previous step samples: those read the previous result by row, the known one keeps its id (an
    index of -1 into the previous result was a device assert on the H100, 2026-12-07)."""
    from types import SimpleNamespace
    buffers = DecodeBuffers(4, 4, 16, torch.device("cpu"))
    ids = torch.tensor([0, 42, 0], dtype=torch.int64)
    step = SimpleNamespace(num_seqs=3, input_ids=ids, positions=torch.tensor([5, 16, 9]),
                           seq_lens=torch.tensor([6, 17, 10], dtype=torch.int32),
                           block_tables=torch.zeros(3, 2, dtype=torch.int32), slot_mapping=torch.tensor([5, 16, 9]),
                           sampling=None)
    prev = torch.tensor([7, 9], dtype=torch.int64)
    for rows, want in (([1, -1, 0], [9, 42, 7]), ([1, 0, 0], [9, 7, 7])):
        step.prev_token_rows = torch.tensor(rows, dtype=torch.int64)
        buffers.fill(step, 4, prev)
        assert buffers.input_ids[:3].tolist() == want
