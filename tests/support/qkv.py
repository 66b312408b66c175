"""qkv_insert checks shared by the interpreter tests and the GPU tests at M3 shapes."""
import torch

from m3serve.kernels.cache import cache_part, dequant_pages_ref
from m3serve.kernels.qkv_insert import qkv_insert, qkv_insert_ref
from m3serve.model.m3 import Rotary
from support.paged import clone_cache, layer_cache, rel_err

B, N_PAGES = 16, 12
SCALES = (0.02, 0.03, 0.025)  # k, v, index key


def qkv_inputs(layout, T, g, dtype=torch.bfloat16, device="cpu", n_pages=N_PAGES):
    qkv = (torch.randn(T, layout.width, generator=g) * 3).to(device, dtype)
    dims = [layout.head_dim, layout.head_dim] + ([layout.index_dim] * 2 if layout.n_idx else [None, None])
    norms = tuple(None if d is None else (torch.randn(d, generator=g) * 0.3).to(device) for d in dims)
    pos = torch.randint(0, 4000, (T,), generator=g)
    cos, sin = Rotary(layout.rot, 10000.0)(pos, dtype)
    slots = torch.randperm(n_pages * B, generator=g)[:T]
    slots[::7] = -1  # padding tokens: skipped
    return qkv, norms, cos.to(device), sin.to(device), slots.to(device)


def qkv_cache(layout, kv, idx, device="cpu", n_pages=N_PAGES):
    """The layer's pages over random bytes (index pages always, as the engine's sparse layers have them)."""
    return layer_cache(kv, n_pages, layout.n_kv, B, layout.head_dim, idx, layout.index_dim or 16, SCALES, device)


def call_insert(fn, qkv, layout, norms, cos, sin, slots, cache):
    return fn(qkv, layout, norms, 1e-6, cos, sin, slots, cache)


def check_qkv_insert(layout, kv, idx, T, seed=7, device="cpu"):
    """Kernel vs reference on fresh random inputs over pre-filled (poisoned) pages: outputs, written bytes,
    and the slots nobody maps to left alone. Shared with tests/gpu at M3 shapes."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n_pages = T // B + 3
    qkv, norms, cos, sin, slots = qkv_inputs(layout, T, g, device=device, n_pages=n_pages)
    got_c = qkv_cache(layout, kv, idx, device, n_pages)
    ref_c = clone_cache(got_c)
    q, iq = call_insert(qkv_insert, qkv, layout, norms, cos, sin, slots, got_c)
    q_r, iq_r = call_insert(qkv_insert_ref, qkv, layout, norms, cos, sin, slots, ref_c)
    assert q.dtype == torch.bfloat16 and q.shape == (T, layout.n_q, layout.head_dim)
    assert rel_err(q, q_r) < 1e-2
    if layout.n_idx:
        assert iq.shape == (T, layout.n_idx, layout.index_dim) and rel_err(iq, iq_r) < 1e-2
    else:
        assert iq is None
    for part in ("k", "v") + (("index",) if layout.n_idx else ()):
        (a, a_sb, scale), (b, b_sb, _) = (cache_part(c, part) for c in (got_c, ref_c))
        # fp32 either way; an nvfp4/fp8 code may round the other way on an fp32 last-bit tie, rarely
        same = (a.view(torch.uint8) == b.view(torch.uint8)).float().mean()
        assert same > 0.995, same
        assert rel_err(dequant_pages_ref(a, a_sb, scale), dequant_pages_ref(b, b_sb, scale)) < 2e-2
    slots = slots.cpu()
    untouched = ~torch.isin(torch.arange(n_pages * B), slots[slots >= 0])  # slots no token maps to keep their bytes
    ka = got_c.k.transpose(1, 2).reshape(n_pages * B, -1).cpu()
    kb = ref_c.k.transpose(1, 2).reshape(n_pages * B, -1).cpu()
    assert torch.equal(ka[untouched].view(torch.uint8), kb[untouched].view(torch.uint8))
