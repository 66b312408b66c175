"""Model config reading (every spelling), presets, the capacity planner and the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from m3serve.capacity import CUDA_CONTEXT_GB, param_counts, plan
from m3serve.config import ConfigError, EngineConfig, ModelConfig, preset
from support.required import require


def test_text_config_defaults_match_transformers():
    tf = require("transformers")
    ref = tf.MiniMaxM3VLTextConfig()
    ours = ModelConfig.from_dict({"model_type": "minimax_m3_vl_text"})
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "num_local_experts", "num_experts_per_tok",
              "dense_intermediate_size", "shared_intermediate_size", "routed_scaling_factor", "swiglu_alpha",
              "swiglu_limit", "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
              "index_local_blocks", "layer_types", "mlp_layer_types", "bos_token_id", "tie_word_embeddings"):
        assert getattr(ours, k) == getattr(ref, k), k
    assert ours.eos_token_id == [ref.eos_token_id]
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]


def test_vl_wrapper_and_legacy_spellings():
    raw = {"model_type": "minimax_m3_vl", "text_config": {
        "num_hidden_layers": 4, "moe_layer_freq": [0, 1, 1, 1], "rope_theta": 1e6, "partial_rotary_factor": 0.5,
        "rotary_dim": 64,
        "sparse_attention_config": {"sparse_attention_freq": [0, 0, 1, 1], "sparse_num_index_heads": 4,
                                    "sparse_index_dim": 64, "sparse_block_size": 64, "sparse_topk_blocks": 8,
                                    "sparse_local_block": 2}}}
    c = ModelConfig.from_dict(raw)
    assert c.layer_types == ["full_attention", "full_attention", "minimax_m3_sparse", "minimax_m3_sparse"]
    assert c.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert (c.index_n_heads, c.index_head_dim, c.index_block_size, c.index_topk_blocks, c.index_local_blocks) == \
        (4, 64, 64, 8, 2)
    assert c.rope_theta == 1e6 and c.rotary_dim == 64


def test_rope_without_partial_factor_follows_transformers():
    """transformers 5.25 ignores `rotary_dim` and rotates the whole head when no factor is given."""
    c = ModelConfig.from_dict({"model_type": "minimax_m3_vl_text", "rotary_dim": 64})
    assert c.rotary_dim == 128
    c = ModelConfig.from_dict({"rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                   "partial_rotary_factor": 0.5}})
    assert c.rotary_dim == 64


@pytest.mark.parametrize("raw, match", [
    ({"model_type": "llama"}, "not a MiniMax-M3"),
    ({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types has 1"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4}}, "rope_type 'yarn'"),
    ({"layer_types": ["sliding"] * 60}, "unknown layer_types"),
    ({"num_key_value_heads": 8, "layer_types": ["minimax_m3_sparse"] * 60}, "index_n_heads"),
])
def test_bad_configs_are_named(raw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_presets_have_the_published_geometry():
    c = preset("minimax-m3")
    assert c.num_sparse_layers == 57 and c.num_moe_layers == 57 and c.rotary_dim == 64
    p = param_counts(c)
    assert abs(p["total"] - 426.17e9) / 426.17e9 < 0.001  # formats.md section 4
    assert p["indexer"] // 57 == 3_932_160 and p["attention"] // 60 == 106_954_752
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("minimax-m9")


def test_capacity_bytes_per_token():
    flash = preset("minimax-m3.1-flash")
    nv = plan(flash, "nvfp4", gpus=4, gpu_memory_gb=288, seq_len=262144)
    fp8 = plan(flash, "fp8", gpus=4, gpu_memory_gb=288, seq_len=262144)
    assert nv["kv_bytes_per_token"] == 34_560 and fp8["kv_bytes_per_token"] == 61_440
    assert nv["indexer_bytes_per_token"] == 4_104 and fp8["indexer_bytes_per_token"] == 7_296
    assert nv["max_concurrent_sequences"] > fp8["max_concurrent_sequences"] > 0
    assert abs(nv["weight_bytes"] - 250.1e9) / 250.1e9 < 0.05  # the published checkpoint size
    # a rank's budget leaves out the CUDA context it cannot allocate (measured, CUDA_CONTEXT_GB), and only that
    bare = plan(flash, "nvfp4", gpus=4, gpu_memory_gb=288, seq_len=262144, cuda_context_gb=0.0)
    gone = bare["per_rank"]["cache_budget_bytes"] - nv["per_rank"]["cache_budget_bytes"]
    assert 0.3e9 < gone == pytest.approx(CUDA_CONTEXT_GB * 1e9, abs=1)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cuda_context_gb: must be a finite number >= 0"):
            plan(flash, "nvfp4", gpus=4, cuda_context_gb=bad)


def test_engine_config_names_unsupported_options():
    with pytest.raises(ConfigError) as e:
        EngineConfig(model="x", tensor_parallel_size=4,
                     speculative_config={"method": "dspark", "num_speculative_tokens": 0}).validate()
    assert "speculative_config.num_speculative_tokens" in str(e.value)
    EngineConfig(model="x", tensor_parallel_size=4,  # DSpark under tensor parallelism (tests/parallel/test_tp_spec.py)
                 speculative_config={"method": "dspark", "num_speculative_tokens": 7}).validate()
    EngineConfig(model="x", tensor_parallel_size=4).validate()
    EngineConfig(model="x", speculative_config={"method": "dspark", "num_speculative_tokens": 7}).validate()
    with pytest.raises(ConfigError, match="unknown engine option"):
        EngineConfig.from_dict({"model": "x", "max_num_seq": 3})


def _cli(*args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "m3serve.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300, **kw)


def test_cli_make_tiny_generate_capacity(tmp_path):
    d = str(tmp_path / "tiny")
    r = _cli("make-tiny", "--out", d)
    assert r.returncode == 0, r.stderr
    r = _cli("generate", "--model", d, "--prompt-ids", "5,7,9", "--prompt-ids", "11,12", "--max-tokens", "5",
             "--temperature", "0", "--device", "cpu", "--dtype", "float32", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["prompt_index"] for x in lines] == [0, 1]
    assert all(len(x["token_ids"]) == 5 for x in lines)
    from m3serve import LLM, SamplingParams
    want = LLM(model=d, device="cpu", dtype="float32").generate(
        [[5, 7, 9], [11, 12]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [x["token_ids"] for x in lines] == [o.token_ids for o in want]
    r = _cli("capacity", "--preset", "minimax-m3.1-flash", "--kv-cache-dtype", "fp8")
    assert r.returncode == 0 and json.loads(r.stdout)["kv_bytes_per_token"] == 61_440
    r = _cli("generate", "--model", d, "--prompt-ids", "5", "--tensor-parallel-size", "3", "--device", "cpu")
    assert r.returncode == 2 and "tensor_parallel_size=3 does not divide the model" in r.stderr


@pytest.mark.parametrize("name", ["enforce_eager", "enable_expert_parallel"])
def test_engine_switches_must_be_booleans(name):
    with pytest.raises(ConfigError, match=f"{name}: must be true or false"):
        EngineConfig(model="x", **{name: "yes"}).validate()
    EngineConfig(model="x", **{name: True}).validate()
