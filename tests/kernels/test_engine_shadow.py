"""The engine with the Triton kernels (interpreter) shadowed by the reference at every layer of every step
(tests/support/shadow.py): the tiny model, nvfp4 cache, chunked prefill mixed with decodes. And the shadow
check itself: a backend that is wrong on one token is caught."""
import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.model.layers.attention import TorchAttention
from m3serve.model.layers.triton_attention import TritonAttention
from support.shadow import shadow_of

PROMPT = [(7 * i) % 500 + 3 for i in range(90)]  # > top-k x block = 64 tokens: the indexer drops blocks


def _llm(tiny_model_dir, kv):
    return LLM(model=tiny_model_dir, device="cpu", dtype="float32", kv_cache_dtype=kv, max_model_len=256,
               num_gpu_blocks_override=32, max_num_batched_tokens=40)


def test_engine_kernels_shadow_nvfp4(tiny_model_dir):
    llm = _llm(tiny_model_dir, "nvfp4")
    runner = llm.engine.executor.worker.runner
    cfg = runner.model.config
    assert all(isinstance(b, TorchAttention) for b in runner.attention)  # the CPU's choice; the kernels below
    kernels = [TritonAttention(runner.model.attention_geometry, c, cfg.num_attention_heads, cfg.index_n_heads)
               for c in runner.cache.layers]
    shadow = shadow_of(runner, tol=0.03, kernels=kernels)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    assert shadow.calls == 4 * (3 + 2) and shadow.tokens == 4 * (90 + 2)  # 3 prefill chunks, 2 decode steps
    assert shadow.packed_calls == shadow.calls  # the fused QKV path: qkv_insert from the one GEMM's output
    assert shadow.max_err < 0.03
    assert shadow.flips <= shadow.tokens // 100  # near-tie flips excused: as many as the GPU tests allow


class _WrongOnOneToken(TorchAttention):
    """The reference, wrong on query head `head` of every decode token (right everywhere with head None)."""

    def __init__(self, ref: TorchAttention, head: int | None):
        super().__init__(ref.geometry, ref.cache)
        self.head = head

    def forward(self, q, k, v, iq, ik, batch):
        out = super().forward(q, k, v, iq, ik, batch)
        if q.shape[0] == 1 and self.head is not None:  # a decode step
            out = out.clone()
            out[0, self.head] += 0.5 * out.abs().max()
        return out


def _wrong_at(runner, layer: int, head: int):
    """The reference backends, layer `layer`'s wrong on `head`, shadowed by the reference itself."""
    refs = runner.attention  # the torch reference on the CPU, bound to the engine's page pool
    wrong = [_WrongOnOneToken(r, head if i == layer else None) for i, r in enumerate(refs)]
    return shadow_of(runner, tol=0.03, kernels=wrong, references=refs)


@pytest.mark.parametrize("layer,message", [(0, "layer 0 \\(dense\\)"), (1, "with the same block selection")])
def test_shadow_catches_a_wrong_backend(tiny_model_dir, layer, message):
    llm = _llm(tiny_model_dir, "bfloat16")
    _wrong_at(llm.engine.executor.worker.runner, layer, 0)
    with pytest.raises(AssertionError, match=message):
        llm.generate([PROMPT[:20]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))


def test_a_flip_on_one_head_excuses_no_other(tiny_model_dir, monkeypatch):
    """A backend wrong on query head 3 (indexer head 1) of a decode token while indexer head 0's block choice
    flipped at a tie: the old shadow excused the whole token for head 0's flip; now head 3 must be explained by
    its own head and the error is caught."""
    import support.shadow as S

    llm = _llm(tiny_model_dir, "bfloat16")
    runner = llm.engine.executor.worker.runner
    block_size = runner.model.attention_geometry.block_size
    real = S.indexer_decode

    def head_0_flips(iq, cache, bt, seq_lens, topk, local):
        sel = real(iq, cache, bt, seq_lens, topk, local).clone()
        n_blocks = -(-int(seq_lens.max()) // block_size)
        other = next(b for b in range(n_blocks) if b not in sel[0, 0].tolist())
        sel[:, 0, 0] = other  # indexer head 0 trades one block for another ...
        return sel

    monkeypatch.setattr(S, "indexer_decode", head_0_flips)
    monkeypatch.setattr(S, "_block_scores", lambda iq_t, keys, pos, B: torch.ones(iq_t.shape[0], 8))  # ... at a tie
    _wrong_at(runner, 1, 3)
    with pytest.raises(AssertionError, match="indexer head 1: .* with the same block selection"):
        llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))


def test_the_shadow_sees_every_layer_of_every_step(tiny_model_dir):
    """The engine's layers run the backends bound to the runner (the shadow here), never a cache handed in per
    step: a backend bound after the graphs were captured is refused instead of silently bypassed."""
    llm = _llm(tiny_model_dir, "bfloat16")
    runner = llm.engine.executor.worker.runner
    refs = runner.attention
    shadow = shadow_of(runner, tol=1e-6, references=refs)  # the reference against itself: exact
    assert [layer.self_attn.backend for layer in runner.model.model.layers] == shadow.layers
    assert [layer.self_attn.kv_cache for layer in runner.model.model.layers] == runner.cache.layers
    llm.generate([PROMPT[:20]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert shadow.calls == 4 * (1 + 2) and shadow.flips == 0 and shadow.max_err == 0
    runner.graphs = object()  # as if captured
    with pytest.raises(RuntimeError, match="CUDA graphs were captured"):
        runner.bind_attention(refs)
