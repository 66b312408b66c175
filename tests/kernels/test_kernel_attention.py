"""TritonAttention (kernels, interpreter) vs TorchAttention (references) over the engine's PagedKVCache:
chunked prefill, a mixed prefill + decode step, then pure decode steps; a full and a sparse layer."""
import pytest

from support.paged import run_attention_scenario


@pytest.mark.parametrize("kv_dtype,index_dtype", [("nvfp4", "fp8"), ("fp8", "bfloat16"), ("bfloat16", "nvfp4")])
def test_triton_attention_matches_torch(kv_dtype, index_dtype):
    run_attention_scenario(kv_dtype, index_dtype)


def test_triton_attention_with_sdpa_prefill(monkeypatch):
    """`Tuning.prefill_sdpa_from` through the backend: the full layer's 150- and 140-token chunks (the second after
    context, beside a decode and a short chunk) run torch's SDPA, given the step's lengths; the same outputs."""
    from m3serve.kernels import msa_attention
    from m3serve.kernels.dispatch import tuned
    calls = []
    real = msa_attention.dense_prefill_sdpa
    monkeypatch.setattr(msa_attention, "dense_prefill_sdpa", lambda *a: calls.append(a[3]) or real(*a))
    with tuned(prefill_sdpa_from=128):
        run_attention_scenario("nvfp4", "fp8", steps=[{0: 150, 1: 25}, {0: 140, 1: 1, 2: 9}, {0: 1, 1: 1, 2: 1}])
    assert calls == [150, 290]


def test_triton_attention_with_sparse_tiles_of_their_own(monkeypatch):
    """`Tuning.prefill_sparse_block_t`: the sparse layer's prefill tiles hold one token each, the full layer's keep
    the default's; the same outputs as the references."""
    import m3serve.model.layers.triton_attention as backend
    from m3serve.kernels.dispatch import tuned
    widths = {True: set(), False: set()}
    real = backend.msa_prefill

    def spy(q, c, bt, qsl, pos, scale, block_ids=None, tiles=None, **kw):
        widths[block_ids is not None].update((tiles[:, 2] - tiles[:, 1]).tolist())
        return real(q, c, bt, qsl, pos, scale, block_ids, tiles=tiles, **kw)

    monkeypatch.setattr(backend, "msa_prefill", spy)
    with tuned(prefill_sparse_block_t=1):
        run_attention_scenario("nvfp4", "fp8", steps=[{0: 40, 1: 25}, {0: 35, 1: 1, 2: 9}])
    assert widths[True] == {1} and max(widths[False]) > 1
