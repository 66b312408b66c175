"""The MoE mma kernels (kernels/grouped_gemm_mma.py) need an sm_89/sm_90 GPU to run (Gluon has no interpreter), so
CI checks what the CPU can: they compile for sm_90, which proves (``convert_layout(..., assert_trivial=True)``) that
the decoded weights and the activations are the mma fragments as they stand; the SASS has the mma instructions and
no byte shuffles or spills; and the dispatch glue (grids, configs, the activation copy) is right, with the launches
recorded. Their numbers are checked on the H200 (tests/gpu/test_moe_gpu.py)."""
import re
from pathlib import Path

import pytest
import torch

from m3serve.kernels import grouped_gemm_mma as mma
from m3serve.kernels.grouped_gemm import MODE_DOWN, MODE_GATE_UP, MODE_LINEAR
from m3serve.kernels.dispatch import moe_config
from m3serve.kernels.moe import fused_moe, moe_prepare_module
from m3serve.kernels.quant_linear import quant_linear, quant_linear_prepare
from m3serve.kernels.codecs import FMT_FP8, FMT_MXFP8, FMT_NVFP4
from m3serve.model.weights import QuantWeight
from support.compiled import compile_sm90, cuobjdump, run_uninterpreted
from support.moe import fill_random, random_moe, tiny_moe_config
from test_nvfp4_mma_compile import _Launch

_SCALE_PTR = {FMT_NVFP4: "*fp8e4nv", FMT_MXFP8: "*fp16", FMT_FP8: "*fp32"}


def _compile(mode: int, fmt: int, sfmt: int, p: int, nt: int, unroll: int, cubin: str) -> None:
    """Run in a child process without TRITON_INTERPRET (the interpreter patches the language functions)."""
    I, F = "i32", "fp32"
    sig = {"x_ptr": "*fp16", "sx": I, "w_data": "*u8", "w_scale": _SCALE_PTR[fmt], "w_rows": "*fp32",
           "s_data": "*u8", "s_scale": _SCALE_PTR[sfmt], "s_rows": "*fp32", "counts_ptr": "*i32",
           "bucket_ptr": "*i32", "cap": I, "tw_ptr": "*fp32", "out_ptr": "*fp16" if mode == MODE_GATE_UP else "*fp32",
           "so": I, "T": I, "NG": I, "N_OUT": I, "n_plain_tiles": I, "x_off": I, "out_off": I, "scaling": F,
           "alpha": F, "limit": F, "w_unscale": F, "s_unscale": F, "E": I, "NT16": I, "KC": I, "N_PAD": I}
    lay = mma.layouts(p, nt)
    lw, ls = mma._fmt_layouts(lay, fmt), mma._fmt_layouts(lay, sfmt)
    cx = dict(MODE=mode, FMT=fmt, SFMT=sfmt, ROUTED=True, X_DIV=4 if mode == MODE_GATE_UP else 1, E_PAD=128,
              W=mma.NUM_WARPS, R=16 * p, NT=nt, UNROLL=unroll, LD_W=lw[0], LS_W=lw[1], L4_W=lw[2], LD_S=ls[0],
              LS_S=ls[1], L4_S=ls[2], LACT=lay["act"], MMA=lay["mma"], LA=lay["a"], LB=lay["b"], LE=lay["e"])
    # pointers 16-byte aligned, row strides and sizes multiples of 16, as the runtime specializes them
    aligned = {n for n, v in sig.items() if v.startswith("*")} | {"sx", "so", "NG", "N_OUT", "N_PAD"}
    compiled = compile_sm90(mma._grouped_gemm_mma_kernel, sig, cx, aligned, gluon=True, num_warps=mma.NUM_WARPS)
    Path(cubin).write_bytes(compiled.asm["cubin"])


def _sass(tmp_path, *args):
    """(SASS opcodes, resource usage) of the kernel compiled by `_compile` in a child process."""
    cubin = tmp_path / "k.cubin"
    run_uninterpreted(__file__, f"t._compile(*{args!r}, {str(cubin)!r})")
    opcode = r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)"
    return re.findall(opcode, cuobjdump("--dump-sass", cubin)), cuobjdump("--dump-resource-usage", cubin)


@pytest.mark.parametrize("mode,fmt,sfmt", [(MODE_GATE_UP, FMT_NVFP4, FMT_MXFP8), (MODE_DOWN, FMT_MXFP8, FMT_FP8)])
def test_mma_kernels_compile_to_register_fragments(mode, fmt, sfmt, tmp_path):
    ops, usage = _sass(tmp_path, mode, fmt, sfmt, 1, 8, 2)
    # per unrolled iteration and weight format: 2 chunks x 8 k16-steps x (gate and up | one weight)
    assert ops.count("HMMA") == 2 * 2 * 8 * (2 if mode == MODE_GATE_UP else 1)
    assert ops.count("HMUL2") >= 2 * 2 * 32  # the block scales, one f16x2 multiply per decoded pair
    # no byte / half shuffles of the fragments (a chunk's would be hundreds; a few pack the epilogue's fp16 stores)
    assert ops.count("PRMT") <= 8
    assert "LOCAL:0" in usage.replace(" ", "")  # no spills


def test_dispatch_launches_the_mma_kernels_with_the_table_configs(monkeypatch):
    """Where the mma kernels can run (sm_89 / sm_90), decode-sized steps go to them: grids, configs and the fp16
    activation copy checked here with the launches recorded (the router runs for real in the interpreter)."""
    g = torch.Generator().manual_seed(3)
    cfg = tiny_moe_config(hidden=1024, inter=1024, experts=8, top_k=2)
    moe = random_moe(cfg, "nvfp4", "mxfp8", g)
    w = moe_prepare_module(moe)
    rec = _Launch()
    monkeypatch.setattr(mma, "available", lambda device: True)
    monkeypatch.setattr(mma, "_grouped_gemm_mma_kernel", rec)
    path, gu, dn = moe_config(5, w, torch.device("cpu"))
    assert path == "mma" and (gu["nt"], gu["p"]) == (8, 1)
    x = torch.randn(5, 1024, generator=g)
    fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, top_k=2, routed_scaling=2.0, alpha=1.702,
              limit=7.0)
    (g1, a1, k1), (g2, a2, k2) = rec.calls
    tiles = 1 + (5 * 2 // 8 + min(8, 10))  # one shared tile of 8 tokens + the routed bound
    assert g1 == (tiles, 1024 // 16) and g2 == (tiles, 1024 // 16)
    assert (k1["MODE"], k1["FMT"], k1["SFMT"], k1["X_DIV"], k1["NT"], k1["UNROLL"]) == (
        MODE_GATE_UP, FMT_NVFP4, FMT_MXFP8, 2, 8, 2)
    assert (k2["MODE"], k2["X_DIV"]) == (MODE_DOWN, 1)
    x16 = a1[0]
    assert x16.dtype == torch.float16 and x16.shape == (5, 1024)
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    assert torch.equal(x16, x.reshape(5, 128, 8)[:, :, order].reshape(5, 1024).half())  # written by the router
    inter = a1[12]
    assert a2[0] is inter and inter.shape == (5 * 2 + 5, w.inter_pad)  # gate_up's output is down's input
    qw = QuantWeight(256, 1024, "fp8")
    fill_random(qw, g)
    quant_linear(torch.randn(3, 1024, generator=g), quant_linear_prepare(qw))
    grid, args, kw = rec.calls[2]
    assert grid == (1, 256 // 16) and kw["MODE"] == MODE_LINEAR and kw["SFMT"] == FMT_FP8 and not kw["ROUTED"]
