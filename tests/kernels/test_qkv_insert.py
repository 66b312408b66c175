"""qkv_insert (one launch: QK RMSNorm + partial RoPE + K/V/index-key insert from the fused projection output)
against its torch reference and against the model's own unfused path, under the interpreter."""
import pytest
import torch

from m3serve.config import ModelConfig
from m3serve.kernels.kv_insert import dequant_pages_ref, kv_insert_ref
from m3serve.kernels.qkv_insert import QKVLayout, qkv_insert, qkv_insert_ref
from m3serve.model.m3 import Attention, Rotary
from paged_testing import alloc, rel_err

B, N_PAGES = 16, 12


def _inputs(layout, T, g, dtype=torch.bfloat16, device="cpu", n_pages=N_PAGES):
    qkv = (torch.randn(T, layout.width, generator=g) * 3).to(device, dtype)
    dims = [layout.head_dim, layout.head_dim] + ([layout.index_dim] * 2 if layout.n_idx else [None, None])
    norms = tuple(None if d is None else (torch.randn(d, generator=g) * 0.3).to(device) for d in dims)
    pos = torch.randint(0, 4000, (T,), generator=g)
    cos, sin = Rotary(layout.rot, 10000.0)(pos, dtype)
    slots = torch.randperm(n_pages * B, generator=g)[:T]
    slots[::7] = -1  # padding tokens: skipped
    return qkv, norms, cos.to(device), sin.to(device), slots.to(device)


def _caches(layout, kv, idx, device="cpu", n_pages=N_PAGES):
    k = alloc(kv, (n_pages, layout.n_kv, B), layout.head_dim, device)
    v = alloc(kv, (n_pages, layout.n_kv, B), layout.head_dim, device)
    i = alloc(idx, (n_pages, B), layout.index_dim or 16, device)
    return k, v, i


def _call(fn, qkv, layout, norms, cos, sin, slots, k, v, i):
    return fn(qkv, layout, norms, 1e-6, cos, sin, slots, k[0], v[0], k[1], v[1], 0.02, 0.03,
              idx_data=i[0], idx_scale_blocks=i[1], idx_scale=0.025)


def _values(c, scale):
    return dequant_pages_ref(c[0], c[1], scale)


def check_qkv_insert(layout, kv, idx, T, seed=7, device="cpu"):
    """Kernel vs reference on fresh random inputs over pre-filled (poisoned) pages: outputs, written bytes,
    and the slots nobody maps to left alone. Shared with tests/gpu at M3 shapes."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n_pages = T // B + 3
    qkv, norms, cos, sin, slots = _inputs(layout, T, g, device=device, n_pages=n_pages)
    got_c = _caches(layout, kv, idx, device, n_pages)
    ref_c = tuple(tuple(None if t is None else t.clone() for t in c) for c in got_c)
    q, iq = _call(qkv_insert, qkv, layout, norms, cos, sin, slots, *got_c)
    q_r, iq_r = _call(qkv_insert_ref, qkv, layout, norms, cos, sin, slots, *ref_c)
    assert q.dtype == torch.bfloat16 and q.shape == (T, layout.n_q, layout.head_dim)
    assert rel_err(q, q_r) < 1e-2
    if layout.n_idx:
        assert iq.shape == (T, layout.n_idx, layout.index_dim) and rel_err(iq, iq_r) < 1e-2
    else:
        assert iq is None
    pairs = [(got_c[0], ref_c[0], 0.02), (got_c[1], ref_c[1], 0.03)] + (
        [(got_c[2], ref_c[2], 0.025)] if layout.n_idx else [])
    for a, b, scale in pairs:
        # fp32 either way; an nvfp4/fp8 code may round the other way on an fp32 last-bit tie, rarely
        same = (a[0].view(torch.uint8) == b[0].view(torch.uint8)).float().mean()
        assert same > 0.995, same
        assert rel_err(_values(a, scale), _values(b, scale)) < 2e-2
    slots = slots.cpu()
    untouched = ~torch.isin(torch.arange(n_pages * B), slots[slots >= 0])  # slots no token maps to keep their bytes
    ka = got_c[0][0].transpose(1, 2).reshape(n_pages * B, -1).cpu()
    kb = ref_c[0][0].transpose(1, 2).reshape(n_pages * B, -1).cpu()
    assert torch.equal(ka[untouched].view(torch.uint8), kb[untouched].view(torch.uint8))


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
    k, v, i = _caches(layout, "bfloat16", "bfloat16")
    k = (k[0].float(), None); v = (v[0].float(), None); i = (i[0].float(), None)
    q, iq = _call(qkv_insert, qkv, layout, attn.norm_weights, cos, sin, slots, k, v, i)
    k2, v2, i2 = (torch.zeros_like(k[0]), None), (torch.zeros_like(v[0]), None), (torch.zeros_like(i[0]), None)
    kv_insert_ref(k_m, v_m, slots, k2[0], v2[0], ik=ik_m, idx_data=i2[0])
    assert rel_err(q, q_m) < 1e-5 and rel_err(iq, iq_m) < 1e-5
    for a, b in ((k, k2), (v, v2), (i, i2)):
        if a[0].dim() == 4:
            got, want = a[0][slots // B, :, slots % B], b[0][slots // B, :, slots % B]
        else:
            got, want = a[0][slots // B, slots % B], b[0][slots // B, slots % B]
        assert rel_err(got, want) < 1e-5


def test_qkv_insert_rejects_bad_layouts():
    g = torch.Generator().manual_seed(0)
    layout = QKVLayout(2, 1, 32, 16, 1, 32)
    qkv, norms, cos, sin, slots = _inputs(layout, 5, g)
    k, v, i = _caches(layout, "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="columns"):
        _call(qkv_insert, qkv[:, :-1], layout, norms, cos, sin, slots, k, v, i)
    with pytest.raises(ValueError, match="rotary"):
        _call(qkv_insert, qkv, QKVLayout(2, 1, 32, 24, 1, 32), norms, cos, sin, slots, k, v, i)
