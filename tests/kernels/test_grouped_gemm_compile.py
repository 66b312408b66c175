"""The portable kernel's wg16 tiles compile for sm_90 with the inline-PTX NVFP4 decoder, which the interpreter cannot
run (it runs the portable words decoder, tests/kernels/test_moe.py): the launch's signature as the runtime builds it,
the SASS has the wgmma and the e4m3 -> f16x2 converts of the decoder, the decoded tiles reach the wgmma without
passing through shared memory, and nothing spills at these tiles.
Numbers: tests/gpu/test_moe_gpu.py on the GPU."""
import re
from pathlib import Path

import pytest

from m3serve.kernels.codecs import FMT_DENSE, FMT_MXFP8, FMT_NVFP4
from m3serve.kernels.grouped_gemm import MODE_DOWN, MODE_GATE_UP, MODE_LINEAR
from m3serve.kernels.weight_layout import A8_UNIT
from support.compiled import compile_sm90, cuobjdump, run_uninterpreted


def _compile(mode: int, bm: int, bn: int, split: int, cubin: str, fuse: bool = False, stages: int = 3,
             a8: bool = False) -> None:
    """In a child process without TRITON_INTERPRET (see support.compiled)."""
    import triton.language as tl

    from m3serve.kernels import grouped_gemm as G

    I, F = "i32", "fp32"
    sig = {"x_ptr": "*fp8e4nv" if a8 else "*fp16", "sx": I, "xs_ptr": "*fp32", "w_data": "*u8", "w_scale": "*u8",
           "w_rows": "*fp32", "s_data": "*u8", "s_scale": "*fp16" if mode != MODE_LINEAR else "*u8", "s_rows": "*fp32",
           "counts_ptr": "*i32", "bucket_ptr": "*i32", "cap": I, "tw_ptr": "*fp32",
           "out_ptr": "*fp16" if mode == MODE_GATE_UP else "*fp32", "so": I, "T": I, "K": I,
           "N_OUT": I, "NG": I, "n_plain_tiles": I, "x_off": I, "out_off": I, "scaling": F, "alpha": F, "limit": F,
           "E": I, "NT16": I, "KC": I, "N_PAD": I, "K_PAD": I, "S_NT16": I, "S_N_PAD": I}
    linear = mode == MODE_LINEAR
    cx = dict(MODE=mode, FMT=FMT_NVFP4, SFMT=FMT_NVFP4 if linear else FMT_MXFP8, ROUTED=not linear,
              X_DIV=4 if mode == MODE_GATE_UP else 1, E_PAD=128 if not linear else 2, BM=bm, BN=bn, WDT=tl.float16,
              SWAP=True, WG16=True, ASM=True, SPLIT=split, A8U=A8_UNIT[FMT_NVFP4],
              SA8U=A8_UNIT[FMT_NVFP4 if linear else FMT_MXFP8], FUSE=fuse, A8=a8, EXACT=False)
    aligned = {n for n, v in sig.items() if v.startswith("*")} | {"sx", "so", "K", "NG", "N_PAD", "K_PAD", "S_N_PAD"}
    compiled = compile_sm90(G._grouped_gemm_kernel, sig, cx, aligned, num_warps=8, num_stages=stages)
    Path(cubin).write_bytes(compiled.asm["cubin"])


@pytest.mark.parametrize("mode,bm,bn,split,fuse,stages,a8", [
    (MODE_GATE_UP, 128, 64, 1, False, 3, False), (MODE_DOWN, 128, 128, 1, False, 3, False),
    (MODE_LINEAR, 64, 64, 4, False, 3, False),
    # fused gate_up: one accumulator for the gate and up rows of 64 columns, where the pair of 128 x 128 tiles
    # spilled (255 registers, a 112-byte stack, 2026-12-07); 256 token rows fit in 2 stages; 64 token rows against
    # 256 weight rows (232 registers)
    (MODE_GATE_UP, 128, 128, 1, True, 3, False), (MODE_GATE_UP, 256, 128, 1, True, 2, False),
    (MODE_GATE_UP, 64, 256, 1, True, 3, False),
    # a8: FP8 dots
    (MODE_GATE_UP, 128, 128, 1, True, 3, True), (MODE_DOWN, 128, 128, 1, False, 3, True),
    (MODE_LINEAR, 128, 128, 1, False, 3, True)])
def test_wg16_tiles_compile_with_the_ptx_decoder(mode, bm, bn, split, fuse, stages, a8, tmp_path):
    cubin = tmp_path / "k.cubin"
    run_uninterpreted(__file__, f"t._compile({mode}, {bm}, {bn}, {split}, {str(cubin)!r}, {fuse}, {stages}, {a8})")
    sass = cuobjdump("--dump-sass", cubin)
    assert re.search(r"F2FP\.F16\.E4M3", sass)  # the PTX decoder's cvt.rn.f16x2.e4m3x2
    if a8:  # FP8 wgmma (QGMMA) with the weights from registers, rounded by the hardware convert
        # (cvt.rn.satfinite.e4m3x2.f16x2) and packed 4 K values a register by byte permutes
        assert re.search(r"QGMMA\.\S+\.E4M3\.E4M3 R\d+, R\d+, gdesc", sass) and "HGMMA" not in sass
        assert re.search(r"F2FP\.SATFINITE\.E4M3\.F16", sass)
    else:
        assert "HGMMA" in sass  # the dots are wgmma
    # the decoded tiles reach the wgmma's register fragments without a trip through shared memory (a tile in another
    # order, the mma kernels' x16 one, compiled to 16-32 LDSM here, 2026-12-07)
    assert "LDSM" not in sass
    usage = cuobjdump("--dump-resource-usage", cubin).replace(" ", "")
    assert "STACK:0" in usage and "LOCAL:0" in usage  # no spills


FUSED_256 = dict(bm=256, bn=128, num_warps=8, num_stages=3, swap=True, wg16=True, fuse=True)  # 231,424 bytes


def _shared(fmt: int, sfmt: int, out: str, fused: bool = False) -> None:
    """The MoE's large gate_up tile (dispatch._MOE_TL) for ``fmt`` experts and a ``sfmt`` shared expert, compiled
    for sm_90 as dispatch launches it (wg16 unless a weight is dense): Triton's count of its shared memory into
    ``out``."""
    import triton.language as tl

    from m3serve.kernels import dispatch
    from m3serve.kernels import grouped_gemm as G

    wg16 = FMT_DENSE not in (fmt, sfmt)
    act = "*fp16" if wg16 else "*bf16"
    types = {FMT_DENSE: ("*bf16", "*bf16", act), FMT_NVFP4: ("*u8", "*u8", "*fp32"),
             FMT_MXFP8: ("*u8", "*fp16", "*fp32")}
    data, scale, rows = types[fmt]
    sdata, sscale, srows = types[sfmt]
    I, F = "i32", "fp32"
    sig = {"x_ptr": act, "sx": I, "xs_ptr": "*fp32", "w_data": data, "w_scale": scale, "w_rows": rows,
           "s_data": sdata, "s_scale": sscale, "s_rows": srows, "counts_ptr": "*i32", "bucket_ptr": "*i32", "cap": I,
           "tw_ptr": "*fp32",
           "out_ptr": act, "so": I, "T": I, "K": I, "N_OUT": I, "NG": I, "n_plain_tiles": I, "x_off": I,
           "out_off": I, "scaling": F, "alpha": F, "limit": F, "E": I, "NT16": I, "KC": I, "N_PAD": I, "K_PAD": I,
           "S_NT16": I, "S_N_PAD": I}
    cfg = FUSED_256 if fused else dispatch._MOE_TL
    cx = dict(MODE=MODE_GATE_UP, FMT=fmt, SFMT=sfmt, ROUTED=True, X_DIV=4, E_PAD=128, BM=cfg["bm"], BN=cfg["bn"],
              WDT=tl.float16 if wg16 else tl.bfloat16, SWAP=cfg["swap"], WG16=wg16, ASM=FMT_NVFP4 in (fmt, sfmt),
              SPLIT=1, A8U=A8_UNIT.get(fmt, 1.0), SA8U=A8_UNIT.get(sfmt, 1.0), FUSE=fused, A8=False, EXACT=False)
    aligned = {n for n, v in sig.items() if v.startswith("*")} | {"sx", "so", "K", "NG", "N_PAD", "K_PAD", "S_N_PAD"}
    compiled = compile_sm90(G._grouped_gemm_kernel, sig, cx, aligned, num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"])
    Path(out).write_text(str(compiled.metadata.shared))


def _packed(fmt: int):
    import torch

    from m3serve.kernels import weight_layout as W
    g, n, k = 2, 256, 256
    if fmt == FMT_DENSE:
        return W.pack_dense(torch.zeros(g, n, k, dtype=torch.bfloat16))
    if fmt == FMT_NVFP4:
        return W.pack_nvfp4(torch.zeros(g, n, k // 2, dtype=torch.uint8),
                            torch.zeros(g, n, k // 16, dtype=torch.float8_e4m3fn), 1.0)
    return W.pack_mxfp8(torch.zeros(g, n, k, dtype=torch.float8_e4m3fn), torch.full((g, n, k // 32), 127,
                                                                                     dtype=torch.uint8))


HOPPER_SHARED = 232448  # bytes a block may opt in to on the H100 / H200 (Triton's "Hardware limit")


@pytest.mark.parametrize("fmt,sfmt,fused", [(FMT_DENSE, FMT_DENSE, False), (FMT_NVFP4, FMT_NVFP4, False),
                                            (FMT_MXFP8, FMT_MXFP8, False), (FMT_NVFP4, FMT_MXFP8, False),
                                            (FMT_NVFP4, FMT_DENSE, False), (FMT_NVFP4, FMT_MXFP8, True),
                                            (FMT_DENSE, FMT_DENSE, True)],
                         ids=["dense", "nvfp4", "mxfp8", "nvfp4-mxfp8", "nvfp4-dense", "fused-nvfp4-mxfp8",
                              "fused-dense"])
def test_tl_rows_skip_exactly_the_tiles_that_do_not_fit(fmt, sfmt, fused, tmp_path, monkeypatch):
    """dispatch's shared-memory count decides as the compiler does whether the MoE's 128 x 128 gate_up tile (or a
    fused one of 256 token rows) fits Hopper. It once counted a byte per weight value and one weight tile: bf16
    experts (the learned model) passed and the launch failed at 294,912 bytes (H100, 2026-12-07)."""
    import torch

    from m3serve.kernels import dispatch
    out = tmp_path / "shared"
    run_uninterpreted(__file__, f"t._shared({fmt}, {sfmt}, {str(out)!r}, {fused})")
    actual = int(out.read_text())
    w, s = _packed(fmt), _packed(sfmt)
    gate_up = FUSED_256 if fused else dispatch._MOE_TL
    estimate = dispatch.tl_shared_bytes(gate_up, (w, s), tiles=2)
    assert actual <= estimate <= 1.02 * actual, (estimate, actual)  # never under: a row it passes must launch
    monkeypatch.setattr(dispatch, "_shared_memory", lambda index: HOPPER_SHARED)
    cfgs = (gate_up, dispatch._MOE_TL)
    assert dispatch._tl_fits(cfgs, (w, w, s, s), (2, 1), torch.device("cuda", 0)) == (actual <= HOPPER_SHARED)
    if fmt == FMT_DENSE and not fused:
        assert actual > HOPPER_SHARED  # the case the old count let through
