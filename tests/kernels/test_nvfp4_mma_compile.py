"""The NVFP4 mma.sync kernels (kernels/nvfp4_mma.py) cannot run without an sm_89/sm_90 GPU (Gluon has no
interpreter), so CI checks what can be checked on the CPU: they compile for sm_90 (which proves, through
``convert_layout(..., assert_trivial=True)``, that the decoded registers are the mma fragments as they stand:
no data moves between threads), the SASS has the instructions the design relies on, and the dispatch never picks
them where they cannot run. Their numbers are checked on the H200 (tests/gpu/test_nvfp4_mma_gpu.py)."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m3serve.kernels import dispatch, nvfp4_mma, platform
from m3serve.kernels.codecs import MODE_CVT, MODE_INT
from m3serve.kernels.dispatch import tuned
from m3serve.kernels.indexer import indexer_block_scores, indexer_decode, indexer_decode_ref
from m3serve.kernels.msa_attention import msa_decode, msa_decode_ref
from support.paged import build, rel_err

I32, F32 = "i32", "fp32"
IDX_SIG = {"iq_ptr": "*bf16", "siq_s": I32, "siq_h": I32, "kd_ptr": "*u8", "ks_ptr": "*fp8e4nv", "idx_scale": F32,
           "bt_ptr": "*i32", "sbt_s": I32, "seq_lens_ptr": "*i32", "out_ptr": "*fp32", "so_t": I32, "so_h": I32,
           "blocks_per_prog": I32, "nb": I32, "H": I32}
ATT_SIG = {"q_ptr": "*bf16", "sq_s": I32, "sq_h": I32, "k_ptr": "*u8", "v_ptr": "*u8", "sd_p": I32,
           "ks_ptr": "*fp8e4nv", "vs_ptr": "*fp8e4nv", "ss_p": I32, "bt_ptr": "*i32", "sbt_s": I32,
           "seq_lens_ptr": "*i32", "bid_ptr": "*i32", "pg_ptr": "*i32", "sbid_s": I32, "sbid_h": I32,
           "out_ptr": "*bf16", "so_s": I32, "so_h": I32, "op_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": F32,
           "v_scale": F32, "blocks_per_split": I32, "nsplit": I32, "n_kv": I32}


def _sass(kernel, signature, constexprs, tmp_path):
    cubin = tmp_path / "k.cubin"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    code = (f"from support.gluon import compile_for_sm90; "
            f"compile_for_sm90({kernel!r}, {signature!r}, {constexprs!r}, {str(cubin)!r})")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    import triton
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(cuobjdump), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", sass.stdout)
    usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    return ops, usage


@pytest.mark.parametrize("mode", [MODE_CVT, MODE_INT])
def test_index_scan_compiles_to_register_mma(mode, tmp_path):
    ops, usage = _sass("_indexer_decode_kernel", IDX_SIG, {"LOCAL": 1, "FILL": True, "MODE": mode,
                                                                   "UNROLL": 2}, tmp_path)
    assert ops.count("HMMA") == 2 * 16  # 2 pages x (2 m-tiles of 16 rows per warp x 8 k-steps)
    assert "LDS" in ops  # only the block max crosses warps (through shared memory) ...
    assert ops.count("STS") <= 8  # ... not the decoded tiles (those would be hundreds of stores)
    assert ops.count("F2FP") >= (64 if mode == MODE_CVT else 0)  # the e4m3x2 -> f16x2 converts
    assert "LOCAL:0" in usage.replace(" ", "")  # no spills


def test_decode_attention_compiles_without_spills(tmp_path):
    ops, usage = _sass("_msa_decode_kernel", ATT_SIG, {"TOPK": 16, "SPARSE": True, "SPLIT": True,
                                                               "KMODE": MODE_INT}, tmp_path)
    assert ops.count("HMMA") == 2 * 32  # one block per iteration: 2 tiles x (16 for QK^T + 16 for PV)
    assert "LOCAL:0" in usage.replace(" ", "")


def test_dispatch_checks_shapes_and_never_picks_the_fast_path_here():
    g = torch.Generator().manual_seed(0)
    st = build([300, 40], 1, 128, 128, "nvfp4", "nvfp4", 128, gen=g)  # M3 page / head dims, TP4 head counts
    iq = torch.randn(2, 1, 128, generator=g)
    q = torch.randn(2, 16, 128, generator=g)
    c = st.cache
    assert dispatch.mma_index_shapes_ok(iq, c)
    assert dispatch.mma_attention_shapes_ok(q, c)
    assert not dispatch.mma_attention_shapes_ok(q[:, :8], c)  # 8 query heads per KV head
    assert not dispatch.mma_index_shapes_ok(iq, dataclasses.replace(c, index=c.index[:, :, :32]))  # not whole rows
    assert not dispatch.mma_index_shapes_ok(iq, dataclasses.replace(c, index=c.index.view(torch.float8_e4m3fn)))
    assert not platform.nvfp4_mma_ok(q.device)
    assert not dispatch.use_mma_index_scan(iq, c) and not dispatch.use_mma_decode_attention(q, c)
    # so the portable kernels serve, and match their references (interpreter)
    ids = indexer_decode(iq, c, st.bt, st.seq_lens, 2)
    assert torch.equal(ids, indexer_decode_ref(iq, c, st.bt, st.seq_lens, 2))
    out = msa_decode(q, c, st.bt, st.seq_lens, 128 ** -0.5, ids)
    assert rel_err(out, msa_decode_ref(q, c, st.bt, st.seq_lens, 128 ** -0.5, ids)) < 1e-2


class _Launch:
    """Stands in for a Gluon kernel: records ``kernel[grid](*args, **kw)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


# the recorded (not run) Gluon attention leaves its split partials unwritten, and the real merge kernel reads them
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy overflow / invalid value on those bytes
def test_dispatch_launches_the_fast_kernels_with_the_measured_defaults(monkeypatch):
    """Where `platform.nvfp4_mma_ok` holds (sm_89/sm_90), M3-shaped NVFP4 decode goes to these kernels: the Python
    glue (grid, strides, scales, the tuning table's defaults and variants) is checked here with the launches
    recorded; the kernels' numbers on the H200."""
    g = torch.Generator().manual_seed(1)
    st = build([128 * 20 + 5, 40], 4, 128, 128, "nvfp4", "nvfp4", 128, gen=g)
    iq = torch.randn(2, 4, 128, generator=g)
    q = torch.randn(2, 64, 128, generator=g)
    scan, attn = _Launch(), _Launch()
    monkeypatch.setattr(platform, "nvfp4_mma_ok", lambda device: True)
    monkeypatch.setattr(nvfp4_mma, "_indexer_decode_kernel", scan)
    monkeypatch.setattr(nvfp4_mma, "_msa_decode_kernel", attn)
    c = st.cache
    out = indexer_block_scores(iq, c, st.bt, seq_lens=st.seq_lens)
    (grid, args, kw), = scan.calls
    assert grid[0] == 2 and out.shape == (2, 4, st.bt.shape[1])
    assert kw["MODE"] == MODE_INT and kw["UNROLL"] == 3 and kw["FILL"] and kw["LOCAL"] == 1
    assert args[5] == pytest.approx(c.index_scale * nvfp4_mma.UNSCALE[MODE_INT])  # the decoder's unscale
    with tuned(index_mma_mode=MODE_CVT, index_mma_unroll=1):  # a benchmark's variant
        indexer_block_scores(iq, c, st.bt, seq_lens=st.seq_lens)
    kw = scan.calls[1][2]
    assert kw["MODE"] == MODE_CVT and kw["UNROLL"] == 1 and scan.calls[1][1][5] == pytest.approx(
        c.index_scale * nvfp4_mma.UNSCALE[MODE_CVT])
    ids = torch.tensor([[[0, 3, -1, -1]] * 4, [[0, -1, -1, -1]] * 4], dtype=torch.int32)
    msa_decode(q, c, st.bt, st.seq_lens, 128 ** -0.5, ids)
    (grid, args, kw), = attn.calls
    assert grid == (2, 4, 1)  # sparse: one program per (sequence, KV head) when there are fewer than SMs x 1 ...
    assert kw["SPARSE"] and not kw["SPLIT"] and kw["TOPK"] == 4 and kw["KMODE"] == MODE_INT
    msa_decode(q, c, st.bt, st.seq_lens, 128 ** -0.5, None)
    grid, args, kw = attn.calls[1]
    assert not kw["SPARSE"] and kw["SPLIT"] and grid[2] > 1  # ... dense-mode splits whole blocks 8 per SM
    with tuned(decode_mma_kmode=MODE_CVT, decode_splits=3):
        msa_decode(q, c, st.bt, st.seq_lens, 128 ** -0.5, None)
    grid, args, kw = attn.calls[2]
    assert kw["KMODE"] == MODE_CVT and grid[2] == 3
    with tuned(mma=False):  # the portable kernels (interpreter), no Gluon launch
        msa_decode(q, c, st.bt, st.seq_lens, 128 ** -0.5, ids)
        indexer_block_scores(iq, c, st.bt, seq_lens=st.seq_lens)
    assert len(attn.calls) == 3 and len(scan.calls) == 2
    assert not dispatch.use_mma_decode_attention(q[:, :32], c)  # not 16 query heads per KV head
