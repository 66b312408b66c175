"""The portable kernel's wg16 tiles compile for sm_90 with the inline-PTX NVFP4 decoder, which the interpreter cannot
run (it runs the portable words decoder, tests/kernels/test_moe.py): the launch's signature as the runtime builds it,
the SASS has the wgmma and the e4m3 -> f16x2 converts of the decoder, the decoded tiles reach the wgmma without
passing through shared memory, and nothing spills at these tiles.
Numbers: tests/gpu/test_moe_gpu.py on the GPU."""
import re
from pathlib import Path

import pytest

from m3serve.kernels.codecs import FMT_MXFP8, FMT_NVFP4
from m3serve.kernels.grouped_gemm import MODE_DOWN, MODE_GATE_UP, MODE_LINEAR
from support.compiled import compile_sm90, cuobjdump, run_uninterpreted


def _compile(mode: int, bm: int, bn: int, split: int, cubin: str) -> None:
    """In a child process without TRITON_INTERPRET (see support.compiled)."""
    import triton.language as tl

    from m3serve.kernels import grouped_gemm as G

    I, F = "i32", "fp32"
    sig = {"x_ptr": "*fp16", "sx": I, "w_data": "*u8", "w_scale": "*u8", "w_rows": "*fp32", "s_data": "*u8",
           "s_scale": "*fp16" if mode != MODE_LINEAR else "*u8", "s_rows": "*fp32", "counts_ptr": "*i32",
           "bucket_ptr": "*i32", "cap": I,
           "tw_ptr": "*fp32", "out_ptr": "*fp16" if mode == MODE_GATE_UP else "*fp32", "so": I, "T": I, "K": I,
           "N_OUT": I, "NG": I, "n_plain_tiles": I, "x_off": I, "out_off": I, "scaling": F, "alpha": F, "limit": F,
           "E": I, "NT16": I, "KC": I, "N_PAD": I, "K_PAD": I, "S_NT16": I, "S_N_PAD": I}
    linear = mode == MODE_LINEAR
    cx = dict(MODE=mode, FMT=FMT_NVFP4, SFMT=FMT_NVFP4 if linear else FMT_MXFP8, ROUTED=not linear,
              X_DIV=4 if mode == MODE_GATE_UP else 1, E_PAD=128 if not linear else 2, BM=bm, BN=bn, WDT=tl.float16,
              SWAP=True, WG16=True, ASM=True, SPLIT=split)
    aligned = {n for n, v in sig.items() if v.startswith("*")} | {"sx", "so", "K", "NG", "N_PAD", "K_PAD", "S_N_PAD"}
    compiled = compile_sm90(G._grouped_gemm_kernel, sig, cx, aligned, num_warps=8, num_stages=3)
    Path(cubin).write_bytes(compiled.asm["cubin"])


@pytest.mark.parametrize("mode,bm,bn,split", [(MODE_GATE_UP, 128, 64, 1), (MODE_DOWN, 128, 128, 1),
                                              (MODE_LINEAR, 64, 64, 4)])
def test_wg16_tiles_compile_with_the_ptx_decoder(mode, bm, bn, split, tmp_path):
    cubin = tmp_path / "k.cubin"
    run_uninterpreted(__file__, f"t._compile({mode}, {bm}, {bn}, {split}, {str(cubin)!r})")
    sass = cuobjdump("--dump-sass", cubin)
    assert "HGMMA" in sass  # the dots are wgmma
    assert re.search(r"F2FP\.F16\.E4M3", sass)  # the PTX decoder's cvt.rn.f16x2.e4m3x2
    # the decoded tiles are the wgmma's register fragments as they stand: no trip through shared memory (a tile in
    # another order, the mma kernels' x16 one, compiled to 16-32 LDSM here, 2026-12-07)
    assert "LDSM" not in sass
    usage = cuobjdump("--dump-resource-usage", cubin).replace(" ", "")
    assert "STACK:0" in usage and "LOCAL:0" in usage  # no spills
