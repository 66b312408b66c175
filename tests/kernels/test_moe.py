"""The MoE layer's kernels in the interpreter, on small shapes, each against its torch reference: the packed weight
layout, the router (top-k and the grouping by expert), the grouped GEMMs (gate_up + SwiGLU, down; routed and
shared in one launch, formats mixed), the whole layer against `SparseMoE.forward` for every expert format, skewed
routing (experts with no token, one expert with most), the quantized linears. Outputs are poisoned first: every
element must be written. The mma (Gluon) kernels cannot run here: tests/kernels/test_moe_mma_compile.py compiles
them, tests/gpu/test_moe_gpu.py runs them."""
import pytest
import torch

from m3serve.kernels import weight_layout as WL
from m3serve.kernels.grouped_gemm import MODE_DOWN, MODE_GATE_UP, grouped_gemm, grouped_gemm_ref
from m3serve.kernels.dispatch import moe_config
from m3serve.kernels.moe import fused_moe, fused_moe_ref, moe_prepare_module
from m3serve.kernels.moe_router import grouping_ref, route, route_ref
from m3serve.kernels.quant_linear import quant_linear, quant_linear_prepare, quant_linear_ref
from m3serve.model.weights import QuantWeight
from support.moe import fill_random, random_moe, rel_err, tiny_moe_config

FORMATS = ["nvfp4", "mxfp8", "fp8", "dense"]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_layout_round_trip(fmt, gen):
    qw = QuantWeight(40, 96 if fmt != "mxfp8" else 160, fmt, lead=(3,))  # rows and K padded (to 48, 128 / 256)
    fill_random(qw, gen)
    pw = WL.pack_quant_weight(qw)
    full = WL.unpack(pw)
    assert full.shape == (3, pw.n_pad, pw.k_pad)
    assert torch.equal(full[:, : qw.n, : qw.k], qw.dequantize())
    assert not full[:, qw.n:].any() and not full[:, :, qw.k:].any()  # padding decodes to zeros
    if fmt != "dense":  # one contiguous block per (16-row tile, 128-element chunk)
        assert pw.data.shape == (3, pw.n_pad // 16, pw.k_pad // 128, 16, WL.DATA_BYTES[pw.fmt])


def test_mxfp8_prepared_multipliers_keep_small_blocks(gen):
    """Block exponents spread over 40 binades in one row: blocks within 22 binades of the row's largest are exact."""
    qw = QuantWeight(16, 1280, "mxfp8")
    fill_random(qw, gen)
    qw.scale_e8m0[:] = (torch.arange(40, dtype=torch.uint8) + 100).repeat(16, 1)
    full = WL.unpack(WL.pack_quant_weight(qw))[0, :, :1280]
    ref = qw.dequantize()
    exact = slice((40 - 23) * 32, 1280)
    assert torch.equal(full[:, exact], ref[:, exact])
    assert rel_err(full, ref) < 1e-6


@pytest.mark.parametrize("T,H", [(1, 96), (7, 96), (40, 96), (130, 1152), (1100, 1152)])
def test_router_matches_reference(T, H, gen):
    """Every launch shape: 9 K chunks of 1152 are 9 slices at 130 tokens (5 blocks of 32), 3 at 1100 (35 blocks)."""
    from m3serve.kernels.moe_router import router_config
    assert (router_config(130, 9)["KS"], router_config(1100, 9)["KS"]) == (9, 3)
    E, k = 16, 4
    x = torch.randn(T, H, generator=gen)
    rw = torch.randn(E, H, generator=gen) * 0.2
    bias = torch.randn(E, generator=gen) * 0.1
    r = route(x, rw, bias, k)
    w_ref, idx_ref, _ = route_ref(x, rw, bias, k)
    order_ref, order = torch.sort(idx_ref, 1), torch.sort(r.ids.long(), 1)
    assert torch.equal(order.values, order_ref.values)
    assert torch.allclose(r.weights.gather(1, order.indices), w_ref.gather(1, order_ref.indices), atol=1e-6)
    counts, lists = grouping_ref(r.ids, E)
    assert torch.equal(r.counts.long(), counts)
    for e in range(E):
        assert sorted(r.bucket[e, : counts[e]].tolist()) == lists[e]


def test_router_skewed_and_x16_copy(gen):
    """One expert takes every token, half the experts none; the fp16 copy for the mma kernels is written in their
    element order, zero-padded."""
    E, H, k, T = 16, 96, 2, 9
    x = torch.randn(T, H, generator=gen)
    rw = torch.randn(E, H, generator=gen) * 0.2
    bias = torch.zeros(E)
    bias[3], bias[8:] = 10.0, -10.0
    x16 = torch.full((T, 128), float("nan"), dtype=torch.float16)
    r = route(x, rw, bias, k, x16=x16, h_pad=128)
    assert int(r.counts[3]) == T and int(r.counts[8:].sum()) == 0 and int(r.counts.sum()) == T * k
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    expect = torch.cat([x, torch.zeros(T, 32)], 1).reshape(T, 16, 8)[:, :, order].reshape(T, 128)
    assert torch.equal(x16, expect.half())


def _wg16_order() -> torch.Tensor:
    """Element held at each column of a 128-chunk in the wg16 order, from its definition: element 8w + j + 4h of
    the chunk (w = 4a + b) at column 32b + 8j + 2a + h."""
    order = torch.empty(128, dtype=torch.long)
    for a in range(4):
        for b in range(4):
            for j in range(4):
                for h in range(2):
                    order[32 * b + 8 * j + 2 * a + h] = 8 * (4 * a + b) + j + 4 * h
    return order


def _from_wg16(t: torch.Tensor) -> torch.Tensor:
    """Columns in the wg16 order -> element order."""
    out = torch.empty(t.shape, dtype=torch.float32)
    out.view(t.shape[0], -1, 128)[:, :, _wg16_order()] = t.float().view(t.shape[0], -1, 128)
    return out


@pytest.mark.parametrize("wg16,fuse", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("routed_fmt,shared_fmt", [("nvfp4", "mxfp8"), ("fp8", "dense"), ("mxfp8", "nvfp4")])
def test_grouped_gemm_routed_and_shared_in_one_launch(routed_fmt, shared_fmt, swap, wg16, fuse, gen):
    """gate_up then down, routed and shared rows in one launch each, every format, against the references. With
    ``wg16``: fp16 activations in the wg16 order (`to_x16(..., wg16=True)`), the weights decoded by the words
    decoders straight into that order, gate_up's intermediate written in it (what the down launch reads); the
    references then take the same fp16 activations. The padded intermediate columns are exact zeros. With ``fuse``:
    gate_up's tiles of 64 weight rows are the gate and up rows of 32 columns (a 64-column intermediate: two tiles,
    then its padding's)."""
    from m3serve.kernels.moe_router import to_x16

    cfg = tiny_moe_config(hidden=96, inter=64 if fuse else 32, experts=6, top_k=2)
    moe = random_moe(cfg, routed_fmt, shared_fmt, gen)
    w = moe_prepare_module(moe)
    T, k, ip = 11, 2, w.inter_pad
    x = torch.randn(T, 96, generator=gen)
    bias = torch.zeros(6)
    bias[1], bias[4] = 5.0, -9.0  # expert 1 in every token's top 2 (one tile of 16 rows), expert 4 in none
    r = route(x, moe.gate.weight, bias, k)
    A = T * k
    if wg16:
        xin = to_x16(x, w.gate_up.k_pad, wg16=True)
        assert torch.equal(_from_wg16(xin)[:, :96], x.half().float()) and not _from_wg16(xin)[:, 96:].any()
        x, tol, unorder = x.half().float(), 2e-3, _from_wg16
    else:
        xin, tol, unorder = x, 1e-5, lambda t: t
    inter = torch.full((A + T, ip), float("nan"), dtype=torch.float16 if wg16 else torch.float32)
    grouped_gemm(xin, inter, MODE_GATE_UP, routed=w.gate_up, plain=w.shared_gate_up, routing=r, T=T, x_div=k,
                 out_off=A, ng=ip, scaling=2.0, swap=swap, wg16=wg16, fuse=fuse)
    rows = torch.cat([torch.arange(A) // k, torch.arange(T)])
    ref_r = grouped_gemm_ref(x, w.gate_up, rows[:A], r.ids.reshape(-1).long(), MODE_GATE_UP, ng=ip,
                             row_weight=r.weights.reshape(-1) * 2.0)
    ref_s = grouped_gemm_ref(x, w.shared_gate_up, rows[A:], torch.zeros(T, dtype=torch.long), MODE_GATE_UP, ng=ip)
    plain = unorder(inter)
    assert rel_err(plain[:A], ref_r) < tol and rel_err(plain[A:], ref_s) < tol
    assert not plain[:, cfg.intermediate_size:].any()
    y = torch.full((A + T, 96), float("nan"))
    grouped_gemm(inter, y, MODE_DOWN, routed=w.down, plain=w.shared_down, routing=r, T=T, x_off=A, out_off=A,
                 swap=swap, wg16=wg16)
    assert rel_err(y[:A], grouped_gemm_ref(plain, w.down, torch.arange(A), r.ids.reshape(-1).long(), MODE_DOWN)) < 1e-5
    assert rel_err(y[A:], grouped_gemm_ref(plain, w.shared_down, torch.arange(A, A + T),
                                           torch.zeros(T, dtype=torch.long), MODE_DOWN)) < 1e-5
    if wg16:  # element-order or bf16 activations are refused
        with pytest.raises(ValueError, match="wg16 activations"):
            grouped_gemm(x, inter, MODE_GATE_UP, routed=w.gate_up, routing=r, T=T, x_div=k, ng=ip, wg16=True)


@pytest.mark.parametrize("swap,wg16,fuse", [(True, False, False), (True, True, False), (True, True, True),
                                           (False, False, False)])
@pytest.mark.parametrize("routed_fmt,shared_fmt", [("nvfp4", "mxfp8"), ("fp8", "nvfp4"), ("mxfp8", "fp8")])
def test_grouped_gemm_fp8_activations(routed_fmt, shared_fmt, swap, wg16, fuse, gen):
    """The ``a8`` tiles: x as e4m3 with a scale per row (`to_x8`: the bits of `to_x8_ref`, in the wg16 order with
    ``wg16``; a zero row's scale is 0), each decoded weight rounded to e4m3 (`unpack(..., e4m3=True)`), FP8 dots:
    gate_up then down, routed and shared rows in one launch, against the fp32 references of those values; their
    error against the unrounded product is FP8's, not more."""
    from m3serve.kernels.moe_router import to_x8, to_x8_ref

    cfg = tiny_moe_config(hidden=96, inter=64 if fuse else 32, experts=6, top_k=2)
    moe = random_moe(cfg, routed_fmt, shared_fmt, gen)
    w = moe_prepare_module(moe)
    T, k, ip = 11, 2, w.inter_pad
    x = torch.randn(T, 96, generator=gen) * torch.logspace(-2, 2, T)[:, None]  # rows four decades apart
    x[3] = 0.0
    bias = torch.zeros(6)
    bias[1], bias[4] = 5.0, -9.0
    r = route(x, moe.gate.weight, bias, k)
    A = T * k
    unorder = _from_wg16 if wg16 else (lambda t: t.float())
    x8, xs = to_x8(x, w.gate_up.k_pad, wg16=wg16)
    r8, rs = to_x8_ref(x, w.gate_up.k_pad)
    assert torch.equal(unorder(x8), r8.float()) and torch.equal(xs, rs) and xs[3] == 0
    xq = r8.float()[:, :96] * rs[:, None]
    inter = torch.full((A + T, ip), float("nan"), dtype=torch.float16 if wg16 else torch.float32)
    grouped_gemm(x8, inter, MODE_GATE_UP, routed=w.gate_up, plain=w.shared_gate_up, routing=r, T=T, x_div=k,
                 out_off=A, ng=ip, scaling=2.0, swap=swap, wg16=wg16, fuse=fuse, a8=True, xs=xs)
    rows = torch.cat([torch.arange(A) // k, torch.arange(T)])
    ids = r.ids.reshape(-1).long()
    shared = torch.zeros(T, dtype=torch.long)
    ref_r = grouped_gemm_ref(xq, w.gate_up, rows[:A], ids, MODE_GATE_UP, ng=ip, row_weight=r.weights.reshape(-1) * 2.0,
                             e4m3=True)
    ref_s = grouped_gemm_ref(xq, w.shared_gate_up, rows[A:], shared, MODE_GATE_UP, ng=ip, e4m3=True)
    plain = unorder(inter)
    tol = 2e-3 if wg16 else 1e-5  # wg16: the intermediate is written in fp16
    assert rel_err(plain[:A], ref_r) < tol and rel_err(plain[A:], ref_s) < tol
    exact = grouped_gemm_ref(x, w.gate_up, rows[:A], ids, MODE_GATE_UP, ng=ip, row_weight=r.weights.reshape(-1) * 2.0)
    assert 1e-3 < rel_err(plain[:A], exact) < 0.12  # e4m3's rounding: 4-8% on these rows (2026-12-07), not more
    i8, i_s = to_x8(inter, ip)  # the intermediate keeps the order gate_up wrote it in
    y = torch.full((A + T, 96), float("nan"))
    grouped_gemm(i8, y, MODE_DOWN, routed=w.down, plain=w.shared_down, routing=r, T=T, x_off=A, out_off=A,
                 swap=swap, wg16=wg16, a8=True, xs=i_s)
    iq = unorder(i8) * i_s[:, None]
    assert rel_err(y[:A], grouped_gemm_ref(iq, w.down, torch.arange(A), ids, MODE_DOWN, e4m3=True)) < 1e-5
    assert rel_err(y[A:], grouped_gemm_ref(iq, w.shared_down, torch.arange(A, A + T), shared, MODE_DOWN,
                                           e4m3=True)) < 1e-5
    with pytest.raises(ValueError, match="a8 activations"):  # bf16 / fp16 activations, or no scales, are refused
        grouped_gemm(x8, inter, MODE_GATE_UP, routed=w.gate_up, routing=r, T=T, x_div=k, ng=ip, a8=True)


def _layer(moe, cfg, w, x, **kw):
    out = torch.full_like(x, float("nan"))
    rl = []
    y = fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, top_k=cfg.num_experts_per_tok,
                  routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, out=out,
                  routing_out=rl, **kw)
    return y, (rl[0] if rl else None)


@pytest.mark.parametrize("expert_fmt,shared_fmt", [("nvfp4", "mxfp8"), ("mxfp8", "mxfp8"), ("fp8", "nvfp4"),
                                                   ("dense", "dense")])
def test_layer_matches_sparse_moe(expert_fmt, shared_fmt, gen):
    cfg = tiny_moe_config(hidden=128, inter=64, experts=8, top_k=2, shared_inter=96)
    moe = random_moe(cfg, expert_fmt, shared_fmt, gen)
    w = moe_prepare_module(moe)
    x = torch.randn(7, cfg.hidden_size, generator=gen)
    y, r = _layer(moe, cfg, w, x)
    assert rel_err(y, moe(x)) < 1e-5
    kw = dict(top_k=2, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    assert rel_err(fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, routing=r, **kw),
                   moe(x)) < 1e-5


@pytest.mark.parametrize("inter,shared_inter", [(256, 64), (64, 160)])
def test_shared_expert_of_another_width_runs_in_its_own_launches(inter, shared_inter, gen):
    """A shared expert whose intermediate pads differently from the routed experts' (an expert-parallel rank: whole
    experts, the shared expert's TP slice) is laid out at its own width, not padded to theirs (which held and read
    twice its bytes at (256, 64)), and runs in two launches of its own; the layer still equals `SparseMoE`. Every
    buffer is poisoned: the routed intermediate has no shared rows and the shared one is fully written."""
    from m3serve.kernels.moe import MoEStep

    cfg = tiny_moe_config(hidden=128, inter=inter, experts=8, top_k=2, shared_inter=shared_inter)
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen)
    w = moe_prepare_module(moe)
    pad = lambda n: -(-n // 128) * 128
    assert (w.inter_pad, w.shared_inter_pad) == (pad(inter), pad(shared_inter)) and not w.shared_rides
    assert w.shared_gate_up.n_pad == 2 * pad(shared_inter) and w.shared_down.k_pad == pad(shared_inter)
    x = torch.randn(9, cfg.hidden_size, generator=gen)
    kw = dict(top_k=2, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    step = MoEStep(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, out=torch.full_like(x, float("nan")),
                   **kw)
    assert step.apart and step.inter.shape == (9 * 2, pad(inter)) and step.inter_s.shape == (9, pad(shared_inter))
    for buf in (step.inter, step.inter_s, step.y):
        buf.fill_(float("nan"))
    y = step.run()
    assert torch.isfinite(step.inter_s).all() and rel_err(y, moe(x)) < 1e-5
    assert rel_err(fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, routing=step.routing, **kw),
                   moe(x)) < 1e-5


@pytest.mark.parametrize("inter,shared_inter,routed_wg16,shared_wg16", [
    (64, 64, True, True), (64, 160, True, True), (64, 160, False, True), (64, 160, True, False)])
def test_layer_with_wg16_tiles(monkeypatch, inter, shared_inter, routed_wg16, shared_wg16, gen):
    """The layer on tables whose tl rows take the wg16 order (as a GPU table would; here the dispatch would give the
    interpreter's portable row): the shared expert riding in the routed launches, or in its own launches with the
    routed launches' fp16 copy, a copy of its own, or element-order activations beside wg16 routed launches."""
    from m3serve.kernels import dispatch
    from m3serve.kernels.moe import MoEStep

    cfg = tiny_moe_config(hidden=128, inter=inter, experts=8, top_k=2, shared_inter=shared_inter)
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen)
    w = moe_prepare_module(moe)
    tl_cfg = lambda on: dict(bm=16, bn=64, num_warps=4, num_stages=2, swap=True, wg16=on)
    monkeypatch.setattr(dispatch, "moe_config", lambda T, w, d: ("tl", tl_cfg(routed_wg16), tl_cfg(routed_wg16)))
    monkeypatch.setattr(dispatch, "moe_shared_config", lambda T, w, d: ("tl", tl_cfg(shared_wg16),
                                                                        tl_cfg(shared_wg16)))
    x = torch.randn(9, cfg.hidden_size, generator=gen)
    kw = dict(top_k=2, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    step = MoEStep(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, out=torch.full_like(x, float("nan")),
                   **kw)
    assert step.apart == (inter != shared_inter) and step.x16 is None
    assert step.inter.dtype == (torch.float16 if routed_wg16 else torch.float32)
    y = step.run()
    assert (step.xwg is not None) == routed_wg16
    assert rel_err(y, moe(x.half().float())) < 3e-3


def test_quant_linear_wg16_tiles(monkeypatch, gen):
    from m3serve.kernels import dispatch

    monkeypatch.setattr(dispatch, "linear_config", lambda M, w, d: ("tl", dict(bm=16, bn=64, swap=True, wg16=True)))
    qw = QuantWeight(40, 208, "nvfp4")
    fill_random(qw, gen)
    ql = quant_linear_prepare(qw)
    x = torch.randn(5, 208, generator=gen)
    y = quant_linear(x, ql)
    assert y.dtype == x.dtype and rel_err(y, quant_linear_ref(x.half().float(), ql)) < 1e-5


@pytest.mark.parametrize("inter,shared_inter", [(64, 64), (64, 160)])
def test_layer_with_fp8_tiles(monkeypatch, inter, shared_inter, gen):
    """The layer on a table whose tl rows take the a8 tiles (FP8 dots, in the wg16 order), the shared expert riding in
    the routed launches or in its own: every launch reads e4m3 activations (x, then each intermediate), and the
    layer is FP8's few per cent from `SparseMoE`."""
    from m3serve.kernels import dispatch
    from m3serve.kernels import moe as M

    cfg = tiny_moe_config(hidden=128, inter=inter, experts=8, top_k=2, shared_inter=shared_inter)
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen)
    w = moe_prepare_module(moe)
    a8 = dict(bm=16, bn=64, num_warps=4, num_stages=2, swap=True, wg16=True, a8=True)
    monkeypatch.setattr(dispatch, "moe_config", lambda T, w, d: ("tl", a8, a8))
    monkeypatch.setattr(dispatch, "moe_shared_config", lambda T, w, d: ("tl", a8, a8))
    seen, real = [], M.grouped_gemm
    monkeypatch.setattr(M, "grouped_gemm", lambda x, *a, **k: seen.append((x.dtype, k["xs"].shape)) or real(x, *a, **k))
    x = torch.randn(9, cfg.hidden_size, generator=gen)
    y, r = _layer(moe, cfg, w, x)
    assert len(seen) == (2 if inter == shared_inter else 4)
    assert all(dt == torch.float8_e4m3fn for dt, _ in seen)
    assert 1e-3 < rel_err(y, moe(x)) < 0.1
    kw = dict(top_k=2, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    ref8 = fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, routing=r, a8=True, **kw)
    assert rel_err(y, ref8) < 1e-2  # the a8 reference: its arithmetic, but for the fp16 intermediate's rounding


def test_fp8_dots_on_the_cpu_run_their_reference(gen):
    """Off CUDA, `Tuning.a8` gives a quantized layer the a8 tiles' arithmetic in torch (`Fp8DotsReferenceMoE`:
    `fused_moe_ref(..., a8=True)`), a few per cent from the exact layer; dense experts keep the torch reference, and
    so does a quantized layer without a8."""
    from m3serve.kernels.dispatch import tuned
    from m3serve.model.layers.moe import Fp8DotsReferenceMoE, TorchMoE

    cfg = tiny_moe_config(hidden=128, inter=64, experts=8, top_k=2, shared_inter=96)
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen)
    x = torch.randn(7, cfg.hidden_size, generator=gen)
    exact = moe(x)
    with tuned(a8=True):
        moe.prepare(torch.device("cpu"))
        dense = random_moe(cfg, "dense", "dense", gen)
        dense.prepare(torch.device("cpu"))
    assert isinstance(moe.method, Fp8DotsReferenceMoE) and isinstance(dense.method, TorchMoE)
    y = moe(x)
    kw = dict(top_k=2, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    assert torch.equal(y, fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias, moe.method.weights,
                                        a8=True, **kw))
    assert 1e-3 < rel_err(y, exact) < 0.1
    moe.prepare(torch.device("cpu"))
    assert isinstance(moe.method, TorchMoE) and torch.equal(moe(x), exact)


@pytest.mark.parametrize("fmt,split", [("nvfp4", 1), ("mxfp8", 1), ("fp8", 1), ("nvfp4", 2)])
def test_quant_linear_fp8_tiles(monkeypatch, fmt, split, gen):
    """A linear on the a8 tiles equals the fp32 product of its e4m3 activations (`to_x8_ref`) and e4m3-rounded weights
    (`unpack(..., e4m3=True)`), its K split over two programs too (each partial scaled by x's row scales)."""
    from m3serve.kernels import dispatch
    from m3serve.kernels.moe_router import to_x8_ref
    from m3serve.kernels.weight_layout import unpack

    monkeypatch.setattr(dispatch, "linear_config",
                        lambda M, w, d: ("tl", dict(bm=16, bn=64, swap=True, wg16=fmt != "fp8", a8=True,
                                                    split=split)))
    qw = QuantWeight(40, 224, fmt)
    fill_random(qw, gen)
    ql = quant_linear_prepare(qw)
    x = torch.randn(5, 224, generator=gen)
    y = quant_linear(x, ql)
    x8, xs = to_x8_ref(x, ql.packed.k_pad)
    ref = (x8.float() * xs[:, None]) @ unpack(ql.packed, 0, e4m3=True).T
    assert y.dtype == x.dtype and rel_err(y, ref[:, :40]) < 1e-5
    assert 1e-3 < rel_err(y, quant_linear_ref(x, ql)) < 0.1


def test_layer_skewed_routing(gen):
    """Most tokens on one expert (several tiles of it), experts without tokens, a bf16 layer."""
    cfg = tiny_moe_config(hidden=128, inter=64, experts=8, top_k=2)
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen, dtype=torch.bfloat16)
    with torch.no_grad():
        moe.gate.e_score_correction_bias[2] += 4.0
        moe.gate.e_score_correction_bias[5:] -= 6.0
    w = moe_prepare_module(moe)
    x = torch.randn(37, cfg.hidden_size, generator=gen).bfloat16()
    y, r = _layer(moe, cfg, w, x)
    assert int(r.counts[2]) == 37 and int(r.counts[5:].sum()) == 0
    assert rel_err(y, moe(x)) < 1e-2


def test_empty_step(gen):
    cfg = tiny_moe_config()
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen)
    w = moe_prepare_module(moe)
    y, r = _layer(moe, cfg, w, torch.zeros(0, cfg.hidden_size))
    assert y.shape == (0, cfg.hidden_size)
    assert moe_config(1, w, torch.device("cpu"))[0] == "tl"  # no mma kernels here


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8"])
def test_quant_linear(fmt, gen):
    qw = QuantWeight(40, 96, fmt)
    fill_random(qw, gen)
    ql = quant_linear_prepare(qw)
    for M in (1, 5, 33):
        x = torch.randn(M, 96, generator=gen)
        y = quant_linear(x, ql)
        assert y.shape == (M, 40)
        assert rel_err(y, quant_linear_ref(x, ql)) < 1e-5
        assert rel_err(y, x @ qw.dequantize().T) < 1e-5
    assert quant_linear(torch.randn(2, 3, 96, generator=gen), ql).shape == (2, 3, 40)


@pytest.mark.parametrize("split,wg16", [(2, False), (3, False), (3, True), (8, False)])
def test_quant_linear_split_k(monkeypatch, split, wg16, gen):
    """K shared out over ``split`` programs per tile, their partial products summed in a second launch: the same
    values as one program per tile (K = 400: 4 chunks, so 3 splits of 2 chunks leave the last with none and 8 are
    cut to 4); refused where the epilogue is not linear."""
    from m3serve.kernels import dispatch

    qw = QuantWeight(40, 400, "nvfp4")
    fill_random(qw, gen)
    ql = quant_linear_prepare(qw)
    x = torch.randn(7, 400, generator=gen)
    cfg = dict(bm=16, bn=64, swap=True, wg16=wg16)
    monkeypatch.setattr(dispatch, "linear_config", lambda M, w, d: ("tl", cfg))
    one = quant_linear(x, ql)
    monkeypatch.setattr(dispatch, "linear_config", lambda M, w, d: ("tl", dict(cfg, split=split)))
    parts = quant_linear(x, ql)
    assert rel_err(parts, one) < 1e-6 and rel_err(parts, quant_linear_ref(x.half().float() if wg16 else x, ql)) < 1e-5
    with pytest.raises(ValueError, match="split K"):
        grouped_gemm(x, torch.empty(7, 40), MODE_GATE_UP, plain=ql.packed, T=7, ng=20, split=2)


def _dense_linear_check(qw, gen, monkeypatch):
    """A dense (bf16 / fp32) weight is not converted, at prepare or per call: the linear reads the checkpoint's own
    tensor through cuBLAS (no Triton kernel launch) and matches an fp64 product of it."""
    import m3serve.kernels.quant_linear as QL

    launches = []
    real = QL.grouped_gemm
    monkeypatch.setattr(QL, "grouped_gemm", lambda *a, **k: launches.append(1) or real(*a, **k))
    ql = quant_linear_prepare(qw)
    assert ql.dense is qw.weight
    for M in (1, 5, 33):
        x = torch.randn(M, 96, generator=gen)
        y = QL.quant_linear(x, ql)
        want = (x.double()[:, None, :] * qw.weight.double()[None]).sum(-1)
        assert y.shape == (M, 40) and rel_err(y, want) < 1e-6
    assert QL.quant_linear(torch.randn(2, 3, 96, generator=gen), ql).shape == (2, 3, 40)
    assert not launches, "a dense weight went through the Triton kernel"


def test_dense_linear_is_cublas_on_the_weight_itself(gen, monkeypatch):
    qw = QuantWeight(40, 96, "dense")
    fill_random(qw, gen)
    _dense_linear_check(qw, gen, monkeypatch)


def test_dense_linear_check_fails_on_a_converted_weight(gen, monkeypatch):
    """The old dense case (F.linear against F.linear) passed a linear that packs a dense weight into the kernel
    layout on every call and runs the kernel: same numbers. The check above does not."""
    import m3serve.kernels.quant_linear as QL

    qw = QuantWeight(40, 96, "dense")
    fill_random(qw, gen)
    real = QL.quant_linear

    def repacks(x, w):
        if w.dense is not None:
            w = QL.QuantLinear(w.n, w.k, packed=WL.pack_quant_weight(qw))
        return real(x, w)

    monkeypatch.setattr(QL, "quant_linear", repacks)
    with pytest.raises(AssertionError, match="Triton kernel"):
        _dense_linear_check(qw, gen, monkeypatch)


def test_fp8_quant_weight_loads_per_tensor_and_per_channel_scales(gen):
    """The FP8 `QuantWeight` format (E4M3 + an fp32 scale per tensor or per output row), as the loader fills it."""
    qw = QuantWeight(4, 32, "fp8", lead=(2,))
    q = torch.randn(4, 32, generator=gen).to(torch.float8_e4m3fn)
    qw.load("weight", q, index=1)
    qw.load("weight_scale", torch.tensor(0.5), index=1)
    assert torch.equal(qw.dequantize(1), q.float() * 0.5)
    rows = torch.tensor([1.0, 2.0, 3.0, 4.0])
    qw.load("weight", q, index=0)
    qw.load("weight_scale", rows.reshape(4, 1), index=0)
    assert torch.equal(qw.dequantize(0), q.float() * rows[:, None])
    with pytest.raises(ValueError):
        qw.load("weight_scale", torch.ones(3), index=0)
    with pytest.raises(ValueError):
        qw.load("weight", torch.zeros(4, 32, dtype=torch.uint8), index=0)


@pytest.mark.parametrize("hidden,expert_fmt,shared_fmt,method", [
    (64, "nvfp4", "mxfp8", "KernelMoE"), (128, "nvfp4", "nvfp4", "KernelMoE"), (64, "mxfp8", "nvfp4", "KernelMoE"),
    (64, "nvfp4", "dense", "KernelMoE"), (96, "fp8", "fp8", "KernelMoE"), (64, "dense", "dense", "DenseMoE")])
def test_cuda_method_takes_the_kernel_for_every_quantized_format_and_shape(monkeypatch, hidden, expert_fmt, shared_fmt,
                                                                          method):
    """On CUDA every quantized expert / shared-expert pair runs the fused kernel at any width (the N-tail reads that
    made the 64-wide shared expert fault are clamped: grouped_gemm._tile_body); only fp32 dense experts run
    `DenseMoE`. Quantized linears likewise take the kernels at any N and K."""
    import m3serve.model.layers.linear as linear_layers
    import m3serve.model.layers.moe as moe_layers

    cfg = tiny_moe_config(hidden=hidden, inter=128, shared_inter=96)
    dtype = torch.float32 if expert_fmt == "dense" else torch.bfloat16
    layer = random_moe(cfg, expert_fmt, shared_fmt, torch.Generator().manual_seed(0), dtype=dtype)
    monkeypatch.setattr(moe_layers, "KernelMoE", type("KernelMoE", (), {"__init__": lambda self, layer: None}))
    got = moe_layers.select_moe_method(layer, torch.device("cuda"))
    assert type(got).__name__ == method
    monkeypatch.setattr(linear_layers, "KernelQuantLinear", type("KernelQuantLinear", (), {"__init__": lambda s, w: None}))
    qw = QuantWeight(40, 96, "nvfp4")
    assert type(linear_layers.select_linear_method(qw, torch.device("cuda"))).__name__ == "KernelQuantLinear"


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_ranks_sum_to_the_layer(ranks, gen):
    """Expert parallelism: each rank's kernel runs only its experts (router over all 8, ids remapped, the other
    ranks' assignments masked in the combine); the shared expert on rank 0 only here. Every rank's output equals
    the reference restricted to its experts and the ranks' sum is the whole layer. The intermediate rows are
    poisoned: the rows of other ranks' assignments are never written, and summing them unmasked gives NaN."""
    from m3serve.kernels.moe import MoEStep, combine, moe_prepare
    from support.moe import expert_slice

    cfg = tiny_moe_config(hidden=128, inter=64, experts=8, top_k=2, shared_inter=96)
    moe = random_moe(cfg, "nvfp4", "mxfp8", gen)
    ex, sh = moe.experts, moe.shared_experts
    x = torch.randn(9, cfg.hidden_size, generator=gen)
    kw = dict(top_k=2, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    full, _ = _layer(moe, cfg, moe_prepare_module(moe), x)
    n = 8 // ranks
    total = torch.zeros_like(x)
    for r in range(ranks):
        shared = (sh.gate_up_proj.w, sh.down_proj.w) if r == 0 else (None, None)
        w = moe_prepare(expert_slice(ex.gate_up_proj, r * n, n), expert_slice(ex.down_proj, r * n, n), *shared,
                        dtype=torch.float32)
        step = MoEStep(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, first_expert=r * n,
                       out=torch.full_like(x, float("nan")), **kw)
        step.inter.fill_(float("nan"))
        step.y.fill_(float("nan"))
        y = step.run()
        assert torch.isfinite(y).all()
        assert rel_err(y, fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, routing=step.routing,
                                        first_expert=r * n, **kw)) < 1e-5
        assert torch.isnan(combine(step.y, step.T, 2, r == 0, torch.empty_like(x))).any()  # the mask matters
        total += y
    assert rel_err(total, full) < 1e-5
    with pytest.raises(ValueError, match="outside the router"):
        MoEStep(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, first_expert=8 - n + 1, **kw)


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_rank_of_a_loaded_model(tmp_path, ranks):
    """Rank r of N of a checkpoint loaded expert-parallel (its whole experts, its slice of the shared expert): the
    fused kernel (`KernelMoE`, the CUDA method) gives the torch method's partial sum of that rank, and the ranks'
    partial sums add up to the layer of the unsharded model (what the all-reduce computes)."""
    from m3serve.distributed.parallel import Parallel
    from m3serve.model.layers.moe import KernelMoE, TorchMoE
    from m3serve.model.loader import load_model
    from m3serve.model.tiny import make_tiny

    d = str(tmp_path / "m")
    make_tiny(d, seed=3, num_attention_heads=8, num_key_value_heads=4, index_n_heads=4)
    layer = 1  # the first MoE layer
    full, _ = load_model(d, "cpu", torch.float32, progress=False)
    moe = full.model.layers[layer].mlp
    x = torch.randn(6, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = TorchMoE().apply(moe, x)
    total = torch.zeros_like(want)
    for r in range(ranks):
        shard, _ = load_model(d, "cpu", torch.float32, progress=False, parallel=Parallel(r, ranks, True))
        part = shard.model.layers[layer].mlp
        assert part.experts.num_experts == 8 // ranks and part.experts.first_expert == r * 8 // ranks
        ref = TorchMoE().apply(part, x)
        got = KernelMoE(part).apply(part, x)
        assert rel_err(got, ref) < 1e-5
        total += got
    assert rel_err(total, want) < 1e-5
