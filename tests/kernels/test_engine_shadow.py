"""The engine with the Triton kernels (interpreter) shadowed by the reference at every layer of every step
(tests/support/shadow.py): the tiny model, nvfp4 cache, chunked prefill mixed with decodes. And the shadow
check itself: a backend that is wrong on one token is caught."""
import pytest

from m3serve import LLM, SamplingParams
from m3serve.model.layers.attention import TorchAttention
from m3serve.model.layers.triton_attention import TritonAttention
from support.shadow import ShadowAttention, shadow_of

PROMPT = [(7 * i) % 500 + 3 for i in range(90)]  # > top-k x block = 64 tokens: the indexer drops blocks


def _llm(tiny_model_dir, kv):
    return LLM(model=tiny_model_dir, device="cpu", dtype="float32", kv_cache_dtype=kv, max_model_len=256,
               num_gpu_blocks_override=32, max_num_batched_tokens=40)


def test_engine_kernels_shadow_nvfp4(tiny_model_dir):
    llm = _llm(tiny_model_dir, "nvfp4")
    runner = llm.engine.executor.worker.runner
    cfg = runner.model.config
    shadow = shadow_of(TritonAttention(runner.model.attention_spec, runner.cache, cfg.num_attention_heads,
                                       cfg.index_n_heads), tol=0.03)
    runner.backend = shadow
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    assert shadow.calls == 4 * (3 + 2) and shadow.tokens == 4 * (90 + 2)  # 3 prefill chunks, 2 decode steps
    assert shadow.packed_calls == shadow.calls  # the fused QKV path: qkv_insert from the one GEMM's output
    assert shadow.max_err < 0.03


class _WrongOnOneToken(TorchAttention):
    wrong_layer = 0

    def forward(self, layer, q, k, v, iq, ik, batch):
        out = super().forward(layer, q, k, v, iq, ik, batch)
        if q.shape[0] == 1 and layer == self.wrong_layer:  # a decode step
            out = out.clone()
            out[0, 0] += 0.5 * out.abs().max()
        return out


@pytest.mark.parametrize("layer,message", [(0, "layer 0 \\(dense\\)"), (1, "with the same block selection")])
def test_shadow_catches_a_wrong_backend(tiny_model_dir, layer, message):
    llm = _llm(tiny_model_dir, "bfloat16")
    runner = llm.engine.executor.worker.runner
    ref = runner.backend  # the torch reference on the CPU
    wrong = _WrongOnOneToken(ref.spec, ref.cache)
    wrong.wrong_layer = layer
    wrong.plan = lambda step: None
    runner.backend = ShadowAttention(wrong, ref, tol=0.03)
    with pytest.raises(AssertionError, match=message):
        llm.generate([PROMPT[:20]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
