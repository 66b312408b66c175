"""The quantized linears and the fused MoE layer on the GPU at shapes that are not multiples of 64 or 128, 1 to 4,096
tokens, every expert / shared-expert format pair, against the fp32 torch references on the same packed weights
(bf16 activations): the shapes whose N tails made the portable kernel read past a weight (the 64-wide shared expert's
illegal memory access on the H200), now clamped, so no torch fallback is left. Every path: the portable kernel (K not
a multiple of 1,024, or many tokens), the mma kernel (K padded to 1,024, N odd, up to its table rows' counts) and the
decode-once-then-cuBLAS path (linears from `LINEAR_DENSE_FROM` rows, the MoE at 4,096 tokens). Run it under
compute-sanitizer memcheck too (docs/performance.md). The CPU twin: tests/kernels/test_odd_shapes.py."""
from __future__ import annotations

import pytest
import torch

from m3serve.kernels.dispatch import (LINEAR_DENSE_FROM, LINEAR_MMA_MAX_ROWS, MOE_DENSE_FROM, MOE_MMA_MAX_TOKENS,
                                      linear_config, moe_config, tuned)
from m3serve.kernels.moe import moe_prepare_module
from m3serve.kernels.quant_linear import quant_linear_prepare
from m3serve.model.weights import QuantWeight
from support.moe import random_moe, tiny_moe_config
from support.odd_shapes import FORMATS, check_linear, check_moe

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOKENS = (1, 3, 16, 17, 65, 300, 1024, 4096)


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(5)


@pytest.mark.parametrize("fmt", FORMATS[:3])
@pytest.mark.parametrize("n,k", [(40, 96), (200, 160), (333, 1056), (200, 992), (48, 4000)])
def test_quant_linear_odd_shapes(fmt, n, k, gen):
    check_linear(fmt, n, k, TOKENS, DEV, gen)


def test_odd_linear_shapes_reach_both_paths(gen):
    """K = 992 pads to 8 chunks: the mma kernel takes it up to its row limit; K = 1056 only the portable one."""
    with torch.device(DEV):
        a, b = QuantWeight(200, 992, "nvfp4", torch.bfloat16), QuantWeight(200, 1056, "nvfp4", torch.bfloat16)
    pa, pb = quant_linear_prepare(a).packed, quant_linear_prepare(b).packed
    dev = torch.device(DEV)
    assert linear_config(LINEAR_MMA_MAX_ROWS, pa, dev)[0] == "mma"
    assert linear_config(LINEAR_MMA_MAX_ROWS + 1, pa, dev)[0] == "tl"
    assert linear_config(LINEAR_DENSE_FROM - 1, pa, dev)[0] == "tl"
    assert linear_config(LINEAR_DENSE_FROM, pa, dev)[0] == "dense"  # decode once, then cuBLAS (on by default)
    with tuned(dense_prefill=False):
        assert linear_config(LINEAR_DENSE_FROM, pa, dev)[0] == "tl"
    assert linear_config(LINEAR_MMA_MAX_ROWS, pb, dev)[0] == "tl"


@pytest.mark.parametrize("expert_fmt", FORMATS)
@pytest.mark.parametrize("shared_fmt", FORMATS)
def test_moe_every_format_pair_portable_odd_shapes(expert_fmt, shared_fmt, gen):
    """hidden 96 (the down projection's N: a 128-wide tile reaches past it), expert FFN 96, shared FFN 160."""
    check_moe(expert_fmt, shared_fmt, 96, 96, 160, TOKENS, DEV, gen)


@pytest.mark.parametrize("expert_fmt", FORMATS)
def test_moe_aligned_shapes_every_table_row(expert_fmt, gen):
    """The learned model's widths (hidden, FFNs 256: 16-byte aligned, so the tiles' loads are pipelined through
    shared memory, where hidden 96 above is not) through every MoE row: bf16 experts at 2,000 tokens once asked
    for 294,912 bytes of it and failed to launch (the learned model's warm-up, H100, 2026-12-07)."""
    check_moe(expert_fmt, expert_fmt, 256, 256, 256, (1, 100, 200, 700, 2000, 4096), DEV, gen)


@pytest.mark.parametrize("expert_fmt", FORMATS[:3])
@pytest.mark.parametrize("shared_fmt", FORMATS[:3])
def test_moe_every_quantized_pair_mma_odd_shapes(expert_fmt, shared_fmt, gen):
    """hidden 992 and FFNs 992 / 960 pad to 8 chunks of 128: the mma kernels' token counts, N not a multiple
    of 64; the tiny model's widths (64) too."""
    check_moe(expert_fmt, shared_fmt, 992, 992, 960, TOKENS, DEV, gen, experts=16, top_k=4)
    check_moe(expert_fmt, shared_fmt, 64, 64, 64, TOKENS, DEV, gen)


def test_odd_moe_shapes_reach_the_mma_path(gen):
    cfg = tiny_moe_config(hidden=992, inter=992, experts=16, top_k=4, shared_inter=960)
    w = moe_prepare_module(random_moe(cfg, "mxfp8", "nvfp4", gen, device=DEV, dtype=torch.bfloat16))
    dev = torch.device(DEV)
    assert moe_config(1, w, dev)[0] == "mma" and moe_config(MOE_MMA_MAX_TOKENS, w, dev)[0] == "mma"
    assert moe_config(MOE_MMA_MAX_TOKENS + 1, w, dev)[0] == "tl"
    assert moe_config(MOE_DENSE_FROM - 1, w, dev)[0] == "tl" and moe_config(MOE_DENSE_FROM, w, dev)[0] == "tl"
    with tuned(dense_prefill=True):
        assert moe_config(MOE_DENSE_FROM, w, dev)[0] == "dense"
