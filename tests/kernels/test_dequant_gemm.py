"""The large-M path (`dequant_gemm`: weights decoded once per call, then torch GEMMs) in the interpreter, on small odd
shapes, against the torch references: the decode launch against `weight_layout.unpack` (every format, a chosen
subset of experts), the quantized linear, the MoE layer (scratch small enough to decode one expert at a time,
skewed routing, expert parallelism), and the dispatch rows that pick it. Outputs are poisoned first."""
import pytest
import torch

from m3serve.kernels import dispatch
from m3serve.kernels import weight_layout as WL
from m3serve.kernels.dequant_gemm import dequant, sorted_rows
from m3serve.kernels.dispatch import tuned
from m3serve.kernels.moe import fused_moe, fused_moe_ref, moe_prepare, moe_prepare_module
from m3serve.kernels.moe_router import route
from m3serve.kernels.quant_linear import quant_linear, quant_linear_prepare, quant_linear_ref
from m3serve.model.weights import QuantWeight
from support.moe import expert_slice, fill_random, random_moe, rel_err, tiny_moe_config
from support.odd_shapes import guard_packed

FORMATS = ["nvfp4", "mxfp8", "fp8", "dense"]
DENSE_MOE = ((None, "dense", dict(scratch_mb=0), dict(scratch_mb=0)),)  # scratch 0: one expert per chunk
DENSE_LINEAR = ((None, "dense", dict()),)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_matches_unpack(fmt, gen):
    qw = QuantWeight(40, 96 if fmt != "mxfp8" else 160, fmt, lead=(5,))  # rows / K padded (48, 128 / 256)
    fill_random(qw, gen)
    pw = WL.pack_quant_weight(qw)
    want = WL.unpack(pw)
    if fmt != "dense":
        guard_packed(pw)  # every tensor ends at a PROT_NONE page: a read past it faults
    got = dequant(pw, dtype=torch.float32)
    assert torch.equal(got, want)  # exact: the same decoded values, padding zeros
    sub = dequant(pw, [4, 1], torch.float32)
    assert torch.equal(sub, want[[4, 1]])


def test_dequant_bf16_rounds_like_torch(gen):
    qw = QuantWeight(32, 128, "nvfp4")
    fill_random(qw, gen)
    pw = WL.pack_quant_weight(qw)
    assert torch.equal(dequant(pw, dtype=torch.bfloat16), WL.unpack(pw).bfloat16())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8"])
def test_dense_linear_path(fmt, gen):
    qw = QuantWeight(40, 208 if fmt != "mxfp8" else 160, fmt)  # K not a multiple of 128
    fill_random(qw, gen)
    ql = quant_linear_prepare(qw)
    with tuned(linear_table=DENSE_LINEAR):
        assert dispatch.linear_config(3, ql.packed, torch.device("cpu"))[0] == "dense"
        for M in (1, 7, 33):
            x = torch.randn(M, qw.k, generator=gen)
            y = quant_linear(x, ql)
            assert y.shape == (M, 40)
            assert rel_err(y, quant_linear_ref(x, ql)) < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8"])
def test_fp8_linear_path(fmt, gen):
    """The "dense8" row (`dequant_gemm.fp8_linear`): the weight decoded straight to e4m3 (`dequant_e4m3`: the bits
    of `unpack(..., e4m3=True)`) and x to e4m3 per row (`to_x8`), then ``torch._scaled_mm`` (here its product in
    fp32): the product of those operands to bf16's rounding, a few per cent from the exact one (the path is lossy);
    K not a multiple of 128, N not of 16, an all-zero row of x."""
    from m3serve.kernels.dequant_gemm import dequant_e4m3
    from m3serve.kernels.moe_router import to_x8_ref

    qw = QuantWeight(40, 208 if fmt != "mxfp8" else 160, fmt)
    fill_random(qw, gen)
    ql = quant_linear_prepare(qw)
    w8, sw = dequant_e4m3(ql.packed)
    assert torch.equal(w8[0].float() * sw[0][:, None], WL.unpack(ql.packed, 0, e4m3=True))
    x = torch.randn(37, qw.k, generator=gen).bfloat16()
    x[5] = 0
    with tuned(linear_table=((None, "dense8", dict()),)):
        assert dispatch.linear_config(37, ql.packed, torch.device("cpu"))[0] == "dense8"
        y = quant_linear(x, ql)
    assert y.shape == (37, 40) and y.dtype == torch.bfloat16 and not y[5].any()
    x8, xs = to_x8_ref(x, ql.packed.k_pad)
    assert rel_err(y, ((x8.float() * xs[:, None]) @ WL.unpack(ql.packed, 0, e4m3=True).T)[:, :40]) < 4e-3
    assert 1e-2 < rel_err(y, quant_linear_ref(x, ql)) < 8e-2


def _run(moe, cfg, w, x, **extra):
    """(layer output, the fp32 reference on the layer's own routing, the routing); the output poisoned first."""
    kw = dict(top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha,
              limit=cfg.swiglu_limit, **extra)
    out, rl = torch.full_like(x, float("nan")), []
    y = fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, out=out, routing_out=rl, **kw)
    return y, fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, routing=rl[0], **kw), rl[0]


@pytest.mark.parametrize("expert_fmt,shared_fmt", [("nvfp4", "mxfp8"), ("mxfp8", "nvfp4"), ("fp8", "fp8"),
                                                   ("dense", "dense")])
@pytest.mark.parametrize("table", [DENSE_MOE, ((None, "dense", dict(scratch_mb=64), dict(scratch_mb=64)),)])
def test_dense_moe_layer(expert_fmt, shared_fmt, table, gen):
    """Hidden 160 (K pads to 256), intermediate 64 / shared 96 (padded to 128)."""
    cfg = tiny_moe_config(hidden=160, inter=64, experts=8, top_k=2, shared_inter=96)
    moe = random_moe(cfg, expert_fmt, shared_fmt, gen)
    w = moe_prepare_module(moe)
    x = torch.randn(13, cfg.hidden_size, generator=gen)
    with tuned(moe_table=table):
        assert dispatch.moe_config(13, w, x.device)[0] == "dense"
        y, ref, _ = _run(moe, cfg, w, x)
    assert rel_err(y, ref) < 1e-5
    assert rel_err(y, moe(x)) < 1e-5


def test_dense_moe_skewed_and_expert_parallel(gen):
    """Most tokens on one expert, experts without tokens; then a rank holding experts [3, 7) of 8."""
    cfg = tiny_moe_config(hidden=128, inter=64, experts=8, top_k=2)
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen)
    with torch.no_grad():
        moe.gate.e_score_correction_bias[2] += 4.0
        moe.gate.e_score_correction_bias[5:] -= 6.0
    w = moe_prepare_module(moe)
    x = torch.randn(21, cfg.hidden_size, generator=gen)
    with tuned(moe_table=DENSE_MOE):
        y, ref, r = _run(moe, cfg, w, x)
        assert int(r.counts[2]) == 21 and int(r.counts[5:].sum()) == 0
        assert rel_err(y, ref) < 1e-5
        ex, sh = moe.experts, moe.shared_experts
        wl = moe_prepare(expert_slice(ex.gate_up_proj, 3, 4), expert_slice(ex.down_proj, 3, 4),
                         sh.gate_up_proj.w, sh.down_proj.w)
        y_ep, ref_ep, _ = _run(moe, cfg, wl, x, first_expert=3)
    assert rel_err(y_ep, ref_ep) < 1e-5
    assert rel_err(y_ep, y) > 1e-2  # a partial sum: the experts of other ranks are missing


def test_sorted_rows_groups_by_expert(gen):
    x = torch.randn(9, 64, generator=gen)
    r = route(x, torch.randn(6, 64, generator=gen), torch.zeros(6), 2)
    order, counts = sorted_rows(r)
    ids = r.ids.reshape(-1)[order].tolist()
    assert sorted(order.tolist()) == list(range(18))  # every assignment once
    assert ids == sorted(ids) and counts == torch.bincount(r.ids.reshape(-1).long(), minlength=6).tolist()


def test_dense_moe_unaligned_hidden(gen):
    """Hidden 100: odd output columns of the down projection (N_pad 112 computed, 100 kept)."""
    cfg = tiny_moe_config(hidden=100, inter=64, experts=8, top_k=2, shared_inter=96)
    moe = random_moe(cfg, "fp8", "fp8", gen)
    w = moe_prepare_module(moe)
    x = torch.randn(11, 100, generator=gen)
    with tuned(moe_table=DENSE_MOE):
        y, ref, _ = _run(moe, cfg, w, x)
    assert rel_err(y, ref) < 1e-5


def test_dispatch_dense_rows(monkeypatch):
    """The default tables: the decode kernels below the crossover, the dense path from it; a dense row that cannot
    run here (no torch._grouped_mm) falls through to the row after it."""
    dev = torch.device("cpu")
    qw = QuantWeight(32, 128, "nvfp4")
    pw = WL.pack_quant_weight(qw)
    assert dispatch.linear_config(dispatch.LINEAR_DENSE_FROM - 1, pw, dev)[0] == "tl"
    assert dispatch.linear_config(dispatch.LINEAR_DENSE_FROM, pw, dev)[0] == "dense"
    monkeypatch.setattr(dispatch, "dense_path_ok", lambda device, host_sync: False)
    assert dispatch.linear_config(dispatch.LINEAR_DENSE_FROM, pw, dev)[0] == "tl"
