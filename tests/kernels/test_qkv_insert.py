"""qkv_insert (one launch: QK RMSNorm + partial RoPE + K/V/index-key insert from the fused projection output)
against its torch reference and against the model's own unfused path, under the interpreter."""
import dataclasses

import pytest
import torch

from m3serve.config import ModelConfig
from m3serve.kernels.kv_insert import kv_insert_ref
from m3serve.kernels.qkv_insert import QKVLayout, qkv_insert
from m3serve.model.m3 import Attention, Rotary
from support.paged import rel_err
from support.qkv import B, call_insert, check_qkv_insert, qkv_cache, qkv_inputs

LAYOUTS = [QKVLayout(4, 2, 32, 16, 2, 32), QKVLayout(8, 2, 64, 64, 0, 0), QKVLayout(2, 1, 32, 32, 1, 64)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["sparse-partial", "dense-full", "sparse-wide-index"])
@pytest.mark.parametrize("kv,idx", [("nvfp4", "nvfp4"), ("fp8", "bfloat16"), ("bfloat16", "fp8")])
def test_qkv_insert_matches_reference(layout, kv, idx):
    check_qkv_insert(layout, kv, idx, 37)


def test_qkv_insert_matches_the_models_unfused_path():
    """Same values as the model's Attention (5 GEMMs, RMSNorm, apply_rope, then kv_insert), fp32 model."""
    cfg = ModelConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      partial_rotary_factor=0.5, num_hidden_layers=2,
                      layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "dense"],
                      index_n_heads=2, index_head_dim=32)
    g = torch.Generator().manual_seed(3)
    attn = Attention(cfg, 1, torch.float32)
    for p in attn.buffers():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(21, 48, generator=g)
    pos = torch.arange(100, 121)
    cos, sin = Rotary(cfg.rotary_dim, cfg.rope_theta)(pos, torch.float32)
    q_m, k_m, v_m, iq_m, ik_m = attn.finish(attn.project(x), cos, sin)
    attn.fuse_projections()
    assert attn.qkv_weight is not None and attn.q_proj.w.weight.data_ptr() == attn.qkv_weight.data_ptr()
    qkv = torch.nn.functional.linear(x, attn.qkv_weight)
    layout = QKVLayout(4, 2, 32, cfg.rotary_dim, 2, 32)
    slots = torch.arange(21) + 5
    c = qkv_cache(layout, "bfloat16", "bfloat16")
    c = dataclasses.replace(c, k=c.k.float(), v=c.v.float(), index=c.index.float())  # fp32 pages
    q, iq = call_insert(qkv_insert, qkv, layout, attn.norm_weights, cos, sin, slots, c)
    c2 = dataclasses.replace(c, k=torch.zeros_like(c.k), v=torch.zeros_like(c.v), index=torch.zeros_like(c.index))
    kv_insert_ref(k_m, v_m, slots, c2, ik=ik_m)
    assert rel_err(q, q_m) < 1e-5 and rel_err(iq, iq_m) < 1e-5
    for a, b in ((c.k, c2.k), (c.v, c2.v), (c.index, c2.index)):
        if a.dim() == 4:
            got, want = a[slots // B, :, slots % B], b[slots // B, :, slots % B]
        else:
            got, want = a[slots // B, slots % B], b[slots // B, slots % B]
        assert rel_err(got, want) < 1e-5


def test_qkv_insert_rejects_bad_layouts():
    g = torch.Generator().manual_seed(0)
    layout = QKVLayout(2, 1, 32, 16, 1, 32)
    qkv, norms, cos, sin, slots = qkv_inputs(layout, 5, g)
    c = qkv_cache(layout, "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="columns"):
        call_insert(qkv_insert, qkv[:, :-1], layout, norms, cos, sin, slots, c)
    with pytest.raises(ValueError, match="rotary"):
        call_insert(qkv_insert, qkv, QKVLayout(2, 1, 32, 24, 1, 32), norms, cos, sin, slots, c)
    with pytest.raises(ValueError, match="index-key pages"):  # a sparse layout over a layer without index pages
        call_insert(qkv_insert, qkv, layout, norms, cos, sin, slots, dataclasses.replace(c, index=None))
