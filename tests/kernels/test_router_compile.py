"""The router logits kernel compiles for sm_90 with its NVIDIA precision (`moe_router.router_precision`: "tf32x3"),
which the interpreter does not model (it multiplies in fp32 whatever the precision): the dots run on the tensor
cores (TF32 HMMA / HGMMA), where "ieee" ran them on the FMA units. Numbers: tests/gpu/test_moe_gpu.py."""
from pathlib import Path

import pytest

from support.compiled import compile_sm90, cuobjdump, run_uninterpreted


def _compile(prec: str, cubin: str) -> None:
    """In a child process without TRITON_INTERPRET (see support.compiled): a prefill-sized launch (router_config
    past 64 tokens) of M3's router."""
    from m3serve.kernels import moe_router as R

    I = "i32"
    sig = {"x_ptr": "*bf16", "sx": I, "w_ptr": "*fp32", "part_ptr": "*fp32", "counts_ptr": "*i32",
           "x16_ptr": "*fp16", "sx16": I, "T": I, "H": I, "H_PAD": I, "E": I, "KSL": I}
    cfg = R.router_config(4096, 48)
    cx = dict(BT=cfg["BT"], BK=128, SUB=cfg["SUB"], E_PAD=128, USE_DOT=cfg["USE_DOT"], WRITE_X16=True, PREC=prec)
    aligned = {n for n, v in sig.items() if v.startswith("*")} | {"sx", "sx16", "H", "H_PAD", "KSL"}
    compiled = compile_sm90(R._router_logits_kernel, sig, cx, aligned, num_warps=cfg["warps"])
    Path(cubin).write_bytes(compiled.asm["cubin"])


@pytest.mark.parametrize("prec", ["tf32x3", "ieee"])
def test_router_logits_precision_picks_the_units(prec, tmp_path):
    cubin = tmp_path / "k.cubin"
    run_uninterpreted(__file__, f"t._compile({prec!r}, {str(cubin)!r})")
    sass = cuobjdump("--dump-sass", cubin)
    tensor = "HMMA" in sass or "HGMMA" in sass
    assert tensor == (prec == "tf32x3"), prec  # "ieee": fp32 FMAs only
    if prec == "tf32x3":
        assert "TF32" in sass
