"""The MoE layer and quantized linears on the GPU at M3 shapes (hidden 6144, expert FFN 3072, 128 experts top-4,
shared FFN 3072): NVFP4 and MXFP8 experts with the MXFP8 shared expert, against the fp32 torch references; the mma
(Gluon) and portable paths against each other; skewed routing; poisoned outputs; the whole layer captured in a CUDA
graph. Skipped without CUDA (CI runs the same kernels in the interpreter on small shapes: tests/kernels)."""
import pytest
import torch
import triton

from m3serve.kernels import dispatch
from m3serve.kernels.dispatch import gemm_mma_kernels
from m3serve.kernels.dispatch import moe_config, tuned
from m3serve.kernels.moe import fused_moe, fused_moe_ref, moe_prepare_module
from m3serve.kernels.moe_router import grouping_ref, route_ref
from m3serve.kernels.quant_linear import quant_linear, quant_linear_prepare, quant_linear_ref
from m3serve.model.weights import QuantWeight
from support.moe import fill_random, m3_moe_config, random_moe, rel_err, tiny_moe_config

pytestmark = pytest.mark.gpu
DEV = "cuda"
_LAYERS: dict = {}


def _layer(expert_fmt: str):
    """One M3-shaped layer per expert format (built once: GBs of weights)."""
    if expert_fmt not in _LAYERS:
        _LAYERS.clear()
        torch.cuda.empty_cache()
        cfg = m3_moe_config()
        g = torch.Generator(device=DEV).manual_seed(7)
        moe = random_moe(cfg, expert_fmt, "mxfp8", g, device=DEV, dtype=torch.bfloat16)
        _LAYERS[expert_fmt] = (cfg, moe, moe_prepare_module(moe))
    return _LAYERS[expert_fmt]


def _run(cfg, moe, w, x, bias=None):
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    routing = []
    y = fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias if bias is None else bias, w,
                  top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha,
                  limit=cfg.swiglu_limit, out=out, routing_out=routing)
    return y, routing[0]


def _run_with(config, cfg, moe, w, x):
    """The layer with ``config`` = (path, gate_up cfg, down cfg) as the only row of the dispatch table."""
    with tuned(moe_table=((None, *config),)):
        assert moe_config(x.shape[0], w, x.device) == config  # dispatch takes it (shapes allow it)
        return _run(cfg, moe, w, x)


def _ref(cfg, moe, w, x, routing, bias=None):
    return fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias if bias is None else bias, w,
                         top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor,
                         alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, routing=routing)


def _check_routing(cfg, moe, x, routing, bias=None):
    """Ids as the reference picks them (but for near ties), weights, counts and buckets consistent."""
    bias = moe.gate.e_score_correction_bias if bias is None else bias
    w_ref, idx_ref, logits = route_ref(x, moe.gate.weight, bias, cfg.num_experts_per_tok)
    got = torch.sort(routing.ids.long(), dim=1).values
    want = torch.sort(idx_ref, dim=1).values
    sel = torch.sigmoid(logits) + bias.float()
    kth = torch.topk(sel, cfg.num_experts_per_tok + 1, dim=1).values
    near_tie = (kth[:, -2] - kth[:, -1]) < 1e-5
    assert torch.equal(got[~near_tie], want[~near_tie])
    counts, lists = grouping_ref(routing.ids, cfg.num_local_experts)
    assert torch.equal(routing.counts.cpu().long(), counts)
    for e in range(cfg.num_local_experts):
        assert sorted(routing.bucket[e, : counts[e]].tolist()) == lists[e]
    assert torch.allclose(routing.weights.sum(1), torch.ones(x.shape[0], device=x.device), atol=1e-5)


@pytest.mark.parametrize("expert_fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 300])
def test_layer_matches_reference(expert_fmt, T):
    cfg, moe, w = _layer(expert_fmt)
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    y, routing = _run(cfg, moe, w, x)
    assert not torch.isnan(y).any()
    _check_routing(cfg, moe, x, routing)
    assert rel_err(y, _ref(cfg, moe, w, x, routing)) < 1e-2


def test_layer_matches_sparse_moe_forward():
    cfg, moe, w = _layer("nvfp4")
    x = torch.randn(6, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    y, _ = _run(cfg, moe, w, x)
    assert rel_err(y, moe(x)) < 2e-2


@pytest.mark.parametrize("T", [3, 40, 520])
def test_mma_and_portable_paths_agree(T):
    cfg, moe, w = _layer("nvfp4")
    if gemm_mma_kernels() is None or not gemm_mma_kernels().available(torch.device(DEV)):
        pytest.skip("no mma kernels on this device")
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    mma_cfg = ("mma", dict(p=1, nt=16, unroll=2), dict(p=2, nt=8, unroll=3))
    tl_cfg = ("tl", dict(bm=32, bn=64, num_warps=4, num_stages=3), dict(bm=32, bn=128, num_warps=4, num_stages=3))
    ya, ra = _run_with(mma_cfg, cfg, moe, w, x)
    yb, rb = _run_with(tl_cfg, cfg, moe, w, x)
    assert torch.equal(torch.sort(ra.ids, 1).values, torch.sort(rb.ids, 1).values)
    assert rel_err(ya, yb) < 1e-2
    assert rel_err(ya, _ref(cfg, moe, w, x, ra)) < 1e-2


@pytest.mark.parametrize("T", [2, 48])
def test_shared_expert_on_a_side_stream_matches_one_launch(T):
    """The shared expert overlapped on a side stream computes what its tiles compute inside the routed launches."""
    cfg, moe, w = _layer("nvfp4")
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    with tuned(moe_overlap=True):
        a, ra = _run(cfg, moe, w, x)
    with tuned(moe_overlap=False):
        b, rb = _run(cfg, moe, w, x)
    assert torch.equal(torch.sort(ra.ids, 1).values, torch.sort(rb.ids, 1).values)
    assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("T", [1, 16, 300, 2000])
def test_shared_expert_of_its_own_width(T):
    """A shared expert narrower than the routed experts (an EP rank: whole experts, the shared expert's TP slice)
    keeps its own width and runs in its own launches, on the mma kernels too where its K chunks allow (1,024 here;
    M3's 768 at EP4 does not: the EP test below runs it on the portable path)."""
    from m3serve.kernels.dispatch import moe_shared_config
    from m3serve.kernels.moe import MoEStep

    _LAYERS.clear()
    cfg = tiny_moe_config(hidden=2048, inter=3072, experts=16, top_k=4, shared_inter=1024)
    g = torch.Generator(device=DEV).manual_seed(5)
    moe = random_moe(cfg, "nvfp4", "mxfp8", g, device=DEV, dtype=torch.bfloat16)
    w = moe_prepare_module(moe)
    assert (w.inter_pad, w.shared_inter_pad, w.shared_rides) == (3072, 1024, False)
    dev = torch.device(DEV)
    if T <= dispatch.MOE_MMA_MAX_TOKENS and gemm_mma_kernels() is not None and gemm_mma_kernels().available(dev):
        assert moe_config(T, w, dev)[0] == "mma" and moe_shared_config(T, w, dev)[0] == "mma"
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    y, routing = _run(cfg, moe, w, x)
    assert not torch.isnan(y).any()
    assert rel_err(y, _ref(cfg, moe, w, x, routing)) < 1e-2
    kw = dict(top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha,
              limit=cfg.swiglu_limit)
    step = MoEStep(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, **kw)
    assert step.apart and step.inter.shape == (T * 4, 3072) and step.inter_s.shape == (T, 1024)


@pytest.mark.parametrize("T", [64, 700])
def test_skewed_routing(T):
    """Expert 5 takes every token (many tiles of one expert), 64 experts can never be chosen (0 tokens)."""
    cfg, moe, w = _layer("nvfp4")
    bias = moe.gate.e_score_correction_bias.clone()
    bias[5] += 10.0
    bias[64:] -= 10.0
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    y, routing = _run(cfg, moe, w, x, bias=bias)
    assert int(routing.counts[5]) == T and int(routing.counts[64:].sum()) == 0
    _check_routing(cfg, moe, x, routing, bias)
    assert rel_err(y, _ref(cfg, moe, w, x, routing, bias)) < 1e-2


@pytest.mark.parametrize("T", [1, 16, 64])
@pytest.mark.cuda_graph
def test_cuda_graph_capture_matches_eager(T):
    cfg, moe, w = _layer("nvfp4")
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    eager, _ = _run(cfg, moe, w, x)
    args = (moe.gate.weight, moe.gate.e_score_correction_bias, w)
    kw = dict(top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha,
              limit=cfg.swiglu_limit)
    fused_moe(x, *args, **kw)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe(x, *args, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, *args, **kw)
    x.copy_(torch.randn_like(x))  # a new step through the same graph
    graph.replay()
    torch.cuda.synchronize()
    fresh, _ = _run(cfg, moe, w, x)
    assert rel_err(out, fresh) < 1e-5  # only the order of the top-k rows' fp32 sums may differ
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("t_first,t_then", [(65, 80), (100, 112), (257, 272)])
def test_a_new_token_count_compiles_nothing(t_first, t_then):
    """A prefill step of a new length reuses the kernels its dispatch row already compiled: token counts, and the
    capacities and offsets that follow from them, are not specialized on (Triton would compile again for each
    divisibility by 16; 2026-12-03 on the H200 one such compile of the mma MoE kernel stalled the server benchmark
    3 s inside a timed run). The lengths of a pair differ in that divisibility and share their dispatch row."""
    cfg, moe, w = _layer("nvfp4")
    assert moe_config(t_first, w, torch.device(DEV)) == moe_config(t_then, w, torch.device(DEV))
    compiles = []
    old = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = lambda *, src, **_: compiles.append(getattr(src, "name", "?"))
    try:
        _run(cfg, moe, w, torch.randn(t_first, cfg.hidden_size, device=DEV, dtype=torch.bfloat16))
        first = len(compiles)
        _run(cfg, moe, w, torch.randn(t_then, cfg.hidden_size, device=DEV, dtype=torch.bfloat16))
    finally:
        triton.knobs.compilation.listener = old
    assert compiles[first:] == []


def test_config_table_picks_the_mma_path_for_decode():
    cfg, moe, w = _layer("nvfp4")
    if gemm_mma_kernels() is None or not gemm_mma_kernels().available(torch.device(DEV)):
        pytest.skip("no mma kernels on this device")
    assert moe_config(1, w, torch.device(DEV))[0] == "mma"
    assert moe_config(64, w, torch.device(DEV))[0] == "mma"
    assert moe_config(dispatch.MOE_DENSE_FROM - 1, w, torch.device(DEV))[0] == "tl"
    with dispatch.tuned(dense_prefill=True):  # off on CUDA by default (measured slower than the kernels)
        assert moe_config(dispatch.MOE_DENSE_FROM, w, torch.device(DEV))[0] == "dense"  # decode once, then cuBLAS


@pytest.mark.parametrize("wg16", [False, True])
@pytest.mark.parametrize("expert_fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("T,bm,bn,stages,fuse", [(37, 64, 128, 3, False), (520, 128, 128, 3, False),
                                                 (1500, 128, 128, 3, False), (700, 128, 64, 3, False),
                                                 (1500, 128, 128, 3, True), (2000, 256, 128, 2, True)])
def test_portable_tiles_with_the_transposed_product(expert_fmt, T, bm, bn, stages, fuse, wg16):
    """The portable kernel with ``swap`` (decoded weights as the dot's first operand; `grouped_gemm._tile_gemm`) at
    odd token counts and each tile shape the prefill tables may pick, both expert formats (the MXFP8 shared expert
    rides in the same launches), with and without the wg16 tiles (fp16 activations, the words decoders: the inline
    PTX one for NVFP4 here), against the fp32 reference; ``fuse``: gate_up's tiles hold the gate and up rows of half
    as many columns, one product (the down launch as the table's 128-token tiles)."""
    cfg, moe, w = _layer(expert_fmt)
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    tl_cfg = dict(bm=bm, bn=bn, num_warps=bn // 16, num_stages=stages, swap=True, wg16=wg16)
    down = dict(tl_cfg, bm=min(bm, 128), num_stages=3)
    y, r = _run_with(("tl", dict(tl_cfg, fuse=True) if fuse else tl_cfg, down), cfg, moe, w, x)
    assert not torch.isnan(y).any()
    assert rel_err(y, _ref(cfg, moe, w, x, r)) < 1e-2


@pytest.mark.parametrize("wg16,split", [(False, 1), (True, 1), (False, 4), (True, 3)])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8"])
@pytest.mark.parametrize("M,bm,bn", [(33, 64, 64), (600, 128, 128), (1100, 128, 64)])
def test_quant_linear_with_the_transposed_product(fmt, M, bm, bn, wg16, split):
    g = torch.Generator(device=DEV).manual_seed(M)
    with torch.device(DEV):
        qw = QuantWeight(6144 + 16, 3072, fmt, torch.bfloat16)  # a last row block past the weight's rows
    fill_random(qw, g)
    ql = quant_linear_prepare(qw)
    x = torch.randn(M, 3072, device=DEV, dtype=torch.bfloat16)
    cfg = ("tl", dict(bm=bm, bn=bn, num_warps=bn // 16, num_stages=3, swap=True, wg16=wg16, split=split))
    with tuned(linear_table=((None, *cfg),)):
        assert dispatch.linear_config(M, ql.packed, x.device) == cfg
        assert rel_err(quant_linear(x, ql), quant_linear_ref(x, ql)) < 1e-2


@pytest.mark.parametrize("expert_fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("T,bm,bn,fuse,down_bn", [(520, 128, 128, False, 128), (1500, 128, 128, True, 128),
                                                  (2000, 64, 256, True, 256)])
def test_portable_tiles_with_fp8_dots(expert_fmt, T, bm, bn, fuse, down_bn):
    """The a8 tiles (e4m3 activations with a scale per row, the decoded weights rounded to e4m3, FP8 wgmma) in the
    layer at M3 shapes, the MXFP8 shared expert riding along: every output written, within FP8's error of the fp32
    reference and of the fp16 tiles (the exact check of the rounding: `test_quant_linear_fp8_tiles`)."""
    cfg, moe, w = _layer(expert_fmt)
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    gu = dict(bm=bm, bn=bn, num_warps=8, num_stages=3, swap=True, wg16=True, fuse=fuse)
    dn = dict(bm=bm, bn=down_bn, num_warps=8, num_stages=3, swap=True, wg16=True)
    y16, _ = _run_with(("tl", gu, dn), cfg, moe, w, x)
    y, r = _run_with(("tl", dict(gu, a8=True), dict(dn, a8=True)), cfg, moe, w, x)
    assert not torch.isnan(y).any()
    assert 1e-3 < rel_err(y, _ref(cfg, moe, w, x, r)) < 0.08 and rel_err(y, y16) < 0.08


def _fp8_linear_case(fmt: str, M: int, cfg: tuple):
    """A linear at M3's widths whose x rows span four decades, run on the dispatch row ``cfg``: `to_x8` gives
    `to_x8_ref`'s bits, the output is the fp32 product of the e4m3 activations and the e4m3-rounded weights
    (`unpack(..., e4m3=True)`) to bf16's rounding, and FP8's error from the exact product."""
    from m3serve.kernels.moe_router import to_x8, to_x8_ref
    from m3serve.kernels.weight_layout import unpack

    g = torch.Generator(device=DEV).manual_seed(M)
    with torch.device(DEV):
        qw = QuantWeight(6144 + 16, 3072, fmt, torch.bfloat16)
    fill_random(qw, g)
    ql = quant_linear_prepare(qw)
    x = torch.randn(M, 3072, device=DEV, dtype=torch.bfloat16) * torch.logspace(-2, 2, M, device=DEV)[:, None]
    x8, xs = to_x8_ref(x, ql.packed.k_pad)
    got8, got_s = to_x8(x, ql.packed.k_pad)
    assert torch.equal(got8.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(got_s, xs)
    with tuned(linear_table=((None, *cfg),)):
        assert dispatch.linear_config(M, ql.packed, x.device) == cfg
        y = quant_linear(x, ql)
    ref = (x8.float() * xs[:, None]) @ unpack(ql.packed, 0, e4m3=True).T
    assert rel_err(y, ref[:, : qw.n]) < 5e-3
    assert 1e-3 < rel_err(y, quant_linear_ref(x, ql)) < 0.08


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8"])
@pytest.mark.parametrize("M,bm,bn,split", [(33, 64, 128, 4), (600, 128, 128, 1), (1100, 64, 256, 1)])
def test_quant_linear_fp8_tiles(fmt, M, bm, bn, split):
    """The a8 tiles compiled (the hardware e4m3 converts, FP8 wgmma) against their exact reference."""
    _fp8_linear_case(fmt, M, ("tl", dict(bm=bm, bn=bn, num_warps=bn // 16, num_stages=3, swap=True, wg16=True,
                                         split=split, a8=True)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8"])
@pytest.mark.parametrize("M", [256, 1024])
def test_quant_linear_dense8(fmt, M):
    """The "dense8" path (`dequant_e4m3`, `to_x8`, cuBLAS's FP8 GEMM with a scale per row and per column): the same
    arithmetic as the a8 tiles, against the same reference."""
    _fp8_linear_case(fmt, M, ("dense8", {}))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8"])
@pytest.mark.parametrize("M", [1, 16, 200, 600])
def test_quant_linear(fmt, M):
    g = torch.Generator(device=DEV).manual_seed(M)
    with torch.device(DEV):
        qw = QuantWeight(6144, 3072, fmt, torch.bfloat16)
    fill_random(qw, g)
    ql = quant_linear_prepare(qw)
    x = torch.randn(M, 3072, device=DEV, dtype=torch.bfloat16)
    assert rel_err(quant_linear(x, ql), quant_linear_ref(x, ql)) < 1e-2


@pytest.mark.parametrize("T", [1, 16, 64, 300])
@pytest.mark.cuda_graph
def test_expert_parallel_rank_runs_the_fused_kernel(T):
    """Rank 1 of EP 4 at M3 shapes (experts 32-63 whole, the shared expert's quarter): `select_moe_method` picks
    the fused kernel, whose partial sum matches the torch reference of the same rank; captured in a CUDA graph it
    replays a new step to what eager gives (no host synchronisation under EP)."""
    from m3serve.distributed.parallel import Parallel
    from m3serve.model.layers.moe import KernelMoE, SparseMoE, TorchMoE

    _LAYERS.clear()
    torch.cuda.empty_cache()
    cfg = m3_moe_config()
    g = torch.Generator(device=DEV).manual_seed(11)
    with torch.device(DEV):
        layer = SparseMoE(cfg, torch.bfloat16, "nvfp4", "mxfp8", Parallel(1, 4, expert_parallel=True))
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randn(layer.gate.weight.shape, generator=g, device=DEV) * 2.4
                                / cfg.hidden_size ** 0.5)
        layer.gate.e_score_correction_bias.normal_(0, 0.05, generator=g)
    for qw in (layer.experts.gate_up_proj, layer.experts.down_proj, layer.shared_experts.gate_up_proj.w,
               layer.shared_experts.down_proj.w):
        fill_random(qw, g)
    assert (layer.experts.first_expert, layer.experts.num_experts) == (32, 32)
    x = torch.randn(T, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    ref = TorchMoE().apply(layer, x)  # before prepare: the kernel method releases the checkpoint layout
    layer.prepare(torch.device(DEV))
    assert isinstance(layer.method, KernelMoE)
    pw = layer.method.weights  # the shared expert's quarter at its own width, not padded to the experts' 3072
    assert (pw.inter_pad, pw.shared_inter_pad, pw.shared_rides) == (3072, 768, False)
    y = layer.method.apply(layer, x)
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) < 2e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer.method.apply(layer, x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.method.apply(layer, x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, layer.method.apply(layer, x)) < 1e-5
