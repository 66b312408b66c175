"""TritonAttention (kernels, interpreter) vs TorchAttention (references) over the engine's PagedKVCache:
chunked prefill, a mixed prefill + decode step, then pure decode steps; a full and a sparse layer."""
import pytest

from support.paged import run_attention_scenario


@pytest.mark.parametrize("kv_dtype,index_dtype", [("nvfp4", "fp8"), ("fp8", "bfloat16"), ("bfloat16", "nvfp4")])
def test_triton_attention_matches_torch(kv_dtype, index_dtype):
    run_attention_scenario(kv_dtype, index_dtype)
