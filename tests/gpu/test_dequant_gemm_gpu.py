"""The large-M path on the GPU (`dequant_gemm`: weights decoded once per call to bf16, then cuBLAS /
``torch._grouped_mm``) against the torch references, every format, odd shapes: the decode launch against
`weight_layout.unpack`, the quantized linear (also captured in a CUDA graph), the MoE layer (small and M3 shapes,
scratch small enough to decode one expert at a time, hidden not 16-byte aligned), and the dispatch's fall-back
while a graph is captured. Skipped without CUDA (tests/kernels/test_dequant_gemm.py runs the same in the
interpreter)."""
import pytest
import torch

from m3serve.kernels import dispatch
from m3serve.kernels import weight_layout as WL
from m3serve.kernels.dequant_gemm import dequant
from m3serve.kernels.dispatch import tuned
from m3serve.kernels.moe import fused_moe, fused_moe_ref, moe_prepare_module
from m3serve.kernels.platform import interpreting
from m3serve.kernels.quant_linear import quant_linear, quant_linear_prepare, quant_linear_ref
from m3serve.model.weights import QuantWeight
from support.moe import fill_random, m3_moe_config, random_moe, rel_err, tiny_moe_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET is set: these test compiled kernels")]
DEV = "cuda"
DENSE_MOE = ((None, "dense", dict(scratch_mb=0), dict(scratch_mb=0)),)  # one expert per chunk
DENSE_LINEAR = ((None, "dense", dict()),)


@pytest.fixture(autouse=True)
def dense_rows_on():
    """The MoE's dense rows are off on CUDA by default (`Tuning.dense_prefill`): on for these tests."""
    with tuned(dense_prefill=True):
        yield


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(99)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8", "dense"])
def test_dequant_matches_unpack(fmt, gen):
    qw = QuantWeight(72, 208 if fmt != "mxfp8" else 160, fmt, torch.bfloat16, lead=(3,), device=DEV)
    fill_random(qw, gen)
    pw = WL.pack_quant_weight(qw)
    want = WL.unpack(pw)
    assert torch.equal(dequant(pw, dtype=torch.float32), want)
    assert torch.equal(dequant(pw, [2, 0], torch.bfloat16), want[[2, 0]].bfloat16())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8"])
@pytest.mark.parametrize("n,k", [(40, 208), (6144, 8192)])
@pytest.mark.cuda_graph
def test_dense_linear(fmt, n, k, gen):
    k = k if fmt != "mxfp8" or k % 32 == 0 else 224
    qw = QuantWeight(n, k, fmt, torch.bfloat16, device=DEV)
    fill_random(qw, gen)
    ql = quant_linear_prepare(qw)
    with tuned(linear_table=DENSE_LINEAR):
        for M in (1, 33, 1500):
            x = torch.randn(M, k, generator=gen, device=DEV).bfloat16()
            y = quant_linear(x, ql)
            assert y.shape == (M, n) and rel_err(y, quant_linear_ref(x, ql)) < 1e-2
        graph = torch.cuda.CUDAGraph()  # no host synchronisation: capturable
        out = []
        with torch.cuda.graph(graph):
            assert dispatch.linear_config(M, ql.packed, x.device)[0] == "dense"
            out.append(quant_linear(x, ql))
        x.copy_(torch.randn(M, k, generator=gen, device=DEV))
        graph.replay()
        assert rel_err(out[0], quant_linear_ref(x, ql)) < 1e-2


def _check(cfg, moe, w, x, err):
    kw = dict(top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha,
              limit=cfg.swiglu_limit)
    out, rl = torch.full_like(x, float("nan")), []
    y = fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, out=out, routing_out=rl, **kw)
    ref = fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, routing=rl[0], **kw)
    assert rel_err(y, ref) < err


@pytest.mark.parametrize("expert_fmt,shared_fmt,hidden", [("nvfp4", "mxfp8", 160), ("mxfp8", "nvfp4", 160),
                                                          ("fp8", "fp8", 100), ("dense", "dense", 100)])
def test_dense_moe_small(expert_fmt, shared_fmt, hidden, gen):
    """Hidden 100 in bf16: rows of 200 bytes, padded to K_pad for cuBLAS's grouped GEMM; odd output columns."""
    cfg = tiny_moe_config(hidden=hidden, inter=64, experts=8, top_k=2, shared_inter=96)
    moe = random_moe(cfg, expert_fmt, shared_fmt, gen, device=DEV, dtype=torch.bfloat16)
    w = moe_prepare_module(moe)
    with tuned(moe_table=DENSE_MOE):
        for T in (1, 37, 300):
            _check(cfg, moe, w, torch.randn(T, hidden, generator=gen, device=DEV).bfloat16(), 1e-2)


@pytest.mark.parametrize("expert_fmt", ["nvfp4", "mxfp8"])
def test_dense_moe_m3_shapes(expert_fmt, gen):
    """No graph here, so memcheck's pass with the caching allocator off runs it: under the sanitizer with the
    allocator on, M3-sized weights beside the cached segments ran the 80 GB card out of memory (2026-12-07)."""
    cfg = m3_moe_config()
    torch.cuda.empty_cache()
    moe = random_moe(cfg, expert_fmt, "mxfp8", gen, device=DEV, dtype=torch.bfloat16, bias_std=0.01, router_std=1.0)
    w = moe_prepare_module(moe)
    x = torch.randn(dispatch.MOE_DENSE_FROM, cfg.hidden_size, generator=gen, device=DEV).bfloat16()
    assert dispatch.moe_config(x.shape[0], w, x.device)[0] == "dense"  # the default table at the crossover
    _check(cfg, moe, w, x, 1e-2)


@pytest.mark.cuda_graph
def test_dense_moe_never_chosen_while_capturing(gen):
    """The MoE's dense path synchronises with the host: a table that picks it outside a capture is passed over
    inside one, and the graph the portable rows make replays to the reference."""
    cfg = tiny_moe_config(hidden=160, inter=64, experts=8, top_k=2, shared_inter=96)
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen, device=DEV, dtype=torch.bfloat16)
    w = moe_prepare_module(moe)
    x = torch.randn(300, cfg.hidden_size, generator=gen, device=DEV).bfloat16()
    kw = dict(top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha,
              limit=cfg.swiglu_limit)
    args = (x, moe.gate.weight, moe.gate.e_score_correction_bias, w)
    out, rl = torch.full_like(x, float("nan")), []
    fused_moe(*args, out=out, **kw)  # the default table's row for 300 tokens, compiled outside the capture
    with tuned(moe_table=DENSE_MOE + dispatch.tuning().moe_table):
        assert dispatch.moe_config(x.shape[0], w, x.device)[0] == "dense"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert dispatch.moe_config(x.shape[0], w, x.device)[0] != "dense"
            fused_moe(*args, out=out, routing_out=rl, **kw)
    out.fill_(float("nan"))
    graph.replay()
    assert rel_err(out, fused_moe_ref(*args, routing=rl[0], **kw)) < 1e-2
