"""The MSA prefill attention's larger tiles compile for sm_90 without spilling: 8 query tokens x 16 heads (128 rows)
on 8 warps, with the NVFP4 byte decoder and with the word decoder (inline PTX, which the interpreter cannot run: it
runs the portable words decoder, tests/kernels/test_msa_paged.py). The same 128 rows on 4 warps spilled (sm_90 SASS,
2026-12-07: 255 registers, a 256-288-byte stack). Timings: benchmarks/bench_msa.py --prefill-variants."""
import re
from pathlib import Path

import pytest

from support.compiled import compile_sm90, cuobjdump, run_uninterpreted


def _compile(block_t: int, warps: int, words: bool, sparse: bool, cubin: str, walk: bool = False) -> None:
    """In a child process without TRITON_INTERPRET (see support.compiled)."""
    import triton.language as tl

    from m3serve.kernels import msa_attention as M
    from m3serve.kernels.codecs import FMT_NVFP4, NVFP4

    I = "i32"
    sig = {"q_ptr": "*bf16", "sq_t": I, "sq_h": I, "k_ptr": "*u8", "v_ptr": "*u8", "sd_p": I, "sd_h": I, "sd_t": I,
           "ks_ptr": "*fp8e4nv", "vs_ptr": "*fp8e4nv", "ss_p": I, "ss_h": I, "ss_t": I, "bt_ptr": "*i32", "sbt_s": I,
           "tiles_ptr": "*i32", "pos_ptr": "*i32", "bid_ptr": "*i32", "sbid_t": I, "sbid_h": I, "out_ptr": "*bf16",
           "so_t": I, "so_h": I, "qk_scale": "fp32", "v_scale": "fp32", "G": I, "B": I}
    ns_k, ns_v, _, _, perm = M._slots(FMT_NVFP4, 128, words)
    cx = dict(G_PAD=16, BLOCK_T=block_t, D=128, BN=64, TOPK=16 if sparse else 1, SPARSE=sparse, FMT=NVFP4, NS_K=ns_k,
              NS_V=ns_v, DOT_DT=tl.float16, PERM=perm, ASM=perm, SORTED=walk)
    aligned = {n for n, v in sig.items() if v.startswith("*")} | {"sq_t", "sd_p", "sd_h", "sd_t", "so_t"}
    compiled = compile_sm90(M._msa_prefill_kernel, sig, cx, aligned, num_warps=warps)
    Path(cubin).write_bytes(compiled.asm["cubin"])


@pytest.mark.parametrize("words,sparse,walk", [(False, False, False), (True, True, False), (True, True, True)])
def test_prefill_8_token_tiles_on_8_warps_do_not_spill(words, sparse, walk, tmp_path):
    """walk: the sparse tiles' selections walked sorted (`Tuning.prefill_sorted_blocks`)."""
    cubin = tmp_path / "k.cubin"
    run_uninterpreted(__file__, f"t._compile(8, 8, {words}, {sparse}, {str(cubin)!r}, {walk})")
    sass = cuobjdump("--dump-sass", cubin)
    assert "HGMMA" in sass  # QK^T and PV are wgmma
    # the PTX word decoder's cvt.rn.f16x2.e4m3x2 (34 of them here, 2026-12-07; the byte decoder has 2, the scales')
    assert len(re.findall(r"F2FP\.F16\.E4M3", sass)) >= (16 if words else 1)
    usage = cuobjdump("--dump-resource-usage", cubin).replace(" ", "")
    assert "STACK:0" in usage and "LOCAL:0" in usage  # no spills
