"""The kernels' dispatch table and platform gates (kernels/dispatch.py, kernels/platform.py): the tuning context,
the launch defaults a GPU gets (the measured ones of docs/performance.md), the gates. Which kernel actually
launches with which arguments: test_nvfp4_mma_compile.py (launches recorded) and the kernel tests."""
import threading

import pytest
import torch

from m3serve.kernels import dispatch, platform
from m3serve.kernels.codecs import FMT_FP8, FMT_NVFP4, FMT_PLAIN, MODE_INT
from m3serve.kernels.dispatch import Tuning, tuned, tuning

CPU = torch.device("cpu")


def test_tuned_scopes_nests_and_restores():
    assert tuning() == Tuning()
    with tuned(decode_block_n=32) as t:
        assert tuning() is t and t.decode_block_n == 32
        with tuned(decode_num_warps=8):
            assert (tuning().decode_block_n, tuning().decode_num_warps) == (32, 8)
        assert tuning().decode_num_warps == 4
    assert tuning() == Tuning()
    with pytest.raises(RuntimeError), tuned(mma=False):
        raise RuntimeError("a failing benchmark variant")
    assert tuning().mma
    with pytest.raises(TypeError), tuned(block_n=64):  # not a field (the kernels' old keyword): refused
        pass
    with tuned(Tuning(asm=False), index_num_stages=4):  # a whole table, changed
        assert tuning().asm is False and tuning().index_num_stages == 4


def test_tuned_holds_for_its_own_thread_only():
    seen = []
    with tuned(decode_splits=3):
        worker = threading.Thread(target=lambda: seen.append(tuning().decode_splits))
        worker.start()
        worker.join()
        assert tuning().decode_splits == 3
    assert seen == [None]


def test_gpu_launch_defaults(monkeypatch):
    """What a 132-SM GPU gets without a `tuned` block (the interpreter takes smaller tiles)."""
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    monkeypatch.setattr(platform, "num_sms", lambda device: 132)
    assert dispatch.attention_block_t(16) == 4 and dispatch.attention_block_t(4) == 16  # 64 rows
    assert dispatch.index_block_t(4) == 16 and dispatch.index_block_t(64) == 1
    assert dispatch.decode_block_n(FMT_NVFP4, sparse=False, on_mma=False, block_size=128) == 128
    assert dispatch.decode_block_n(FMT_NVFP4, sparse=True, on_mma=False, block_size=128) == 64
    assert dispatch.decode_block_n(FMT_FP8, sparse=False, on_mma=False, block_size=128) == 64
    assert dispatch.decode_block_n(FMT_NVFP4, sparse=True, on_mma=True, block_size=128) == 128  # whole blocks
    assert dispatch.decode_block_n(FMT_PLAIN, sparse=True, on_mma=False, block_size=16) == 16  # at most a page
    assert dispatch.decode_words(FMT_NVFP4, sparse=True) is False and dispatch.decode_words(FMT_NVFP4, False) is True
    assert dispatch.decode_words(FMT_FP8, sparse=True) is True
    # split-K over 64 tiles for 8 sequences x 4 KV heads: ~2 programs per SM portable, 1 (sparse) / 8 (dense) on mma
    assert dispatch.decode_splits(64, 32, sparse=True, on_mma=False, device=CPU) == (8, 8)
    assert dispatch.decode_splits(64, 32, sparse=True, on_mma=True, device=CPU) == (5, 13)
    assert dispatch.decode_splits(64, 32, sparse=False, on_mma=True, device=CPU) == (32, 2)
    assert dispatch.index_chunks(1000, 64, CPU) == (9, 112) and dispatch.index_chunks(41, 5, CPU) == (41, 1)
    assert [dispatch.index_num_warps(f) for f in (FMT_PLAIN, FMT_FP8, FMT_NVFP4)] == [8, 4, 4]
    assert dispatch.insert_tokens(4) == 4 and dispatch.insert_tokens(1) == 16
    t = tuning()
    assert (t.index_num_stages, t.index_mma_mode, t.index_mma_unroll, t.decode_mma_kmode) == (3, MODE_INT, 3, MODE_INT)
    with tuned(decode_splits=3, decode_block_n=32, decode_words="split", prefill_block_t=2, index_chunks=7):
        assert dispatch.decode_splits(64, 32, sparse=True, on_mma=False, device=CPU) == (3, 22)
        assert dispatch.decode_block_n(FMT_NVFP4, sparse=False, on_mma=False, block_size=128) == 32
        assert dispatch.decode_words(FMT_NVFP4, sparse=True) == "split"
        assert dispatch.attention_block_t(16) == 2 and dispatch.index_chunks(1000, 64, CPU) == (7, 143)


def test_gates_here():
    """This machine: no GPU, the interpreter on: only the portable kernels, without inline PTX."""
    assert platform.interpreting() and platform.num_sms(CPU) == 4
    assert not platform.compiled_cuda(CPU) and not platform.nvfp4_mma_ok(CPU) and not platform.nvfp4_asm_allowed(CPU)
    assert platform.gluon_present()  # Triton 3.6 has Gluon (the compile test builds its kernels)
    assert not dispatch.asm(CPU)
    with tuned(asm=True):  # a variant forces it (a benchmark on a GPU)
        assert dispatch.asm(CPU)


@pytest.mark.parametrize("cap,mma,asm", [((8, 0), False, False), ((8, 9), True, True), ((9, 0), True, True),
                                         ((10, 0), False, True)])
def test_gates_on_cuda_devices(monkeypatch, cap, mma, asm):
    """The mma kernels: sm_89 / sm_90 only; the PTX decoder: sm_89+; both off under ROCm, the interpreter, or their
    environment switch."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    monkeypatch.setattr(platform, "rocm", lambda: False)
    monkeypatch.setattr(platform, "_capability", lambda index: cap)
    assert platform.compiled_cuda(dev)
    assert platform.nvfp4_mma_ok(dev) == mma and platform.nvfp4_asm_allowed(dev) == asm
    monkeypatch.setenv("M3SERVE_NVFP4_MMA", "0")
    monkeypatch.setenv("M3SERVE_NVFP4_ASM", "0")
    assert not platform.nvfp4_mma_ok(dev) and not platform.nvfp4_asm_allowed(dev)
    monkeypatch.delenv("M3SERVE_NVFP4_MMA")
    monkeypatch.delenv("M3SERVE_NVFP4_ASM")
    monkeypatch.setattr(platform, "rocm", lambda: True)
    assert not platform.nvfp4_mma_ok(dev) and not platform.nvfp4_asm_allowed(dev)


# ---------------------------------------------------------------------------------- MoE experts, quantized linears
CUDA = torch.device("cuda", 0)  # a device of type cuda (nothing runs on it: the choices only read its type)
TOKENS = (1, 16, 64, 65, 512, 4096)
MMA_8 = dict(p=1, nt=8, unroll=2)
MMA_16 = dict(p=1, nt=16, unroll=2)
SMALL_TL = dict(bm=16, bn=64, num_warps=4, num_stages=2)  # the interpreter's / ROCm's / small-M portable tiles
# what the tables of kernels/moe.py (MOE_TUNING) and kernels/quant_linear.py (LINEAR_TUNING, PORTABLE_*) selected
MOE_TL = ("tl", dict(bm=64, bn=64, num_warps=4, num_stages=3), dict(bm=64, bn=128, num_warps=8, num_stages=3))
MOE_MMA = {1: ("mma", MMA_8, MMA_8), 16: ("mma", MMA_8, MMA_8), 64: ("mma", MMA_8, MMA_8),
           65: ("mma", MMA_8, MMA_8), 512: ("mma", MMA_16, dict(p=2, nt=16, unroll=2)), 4096: MOE_TL}
LARGE_TL = ("tl", dict(bm=64, bn=128, num_warps=8, num_stages=3))
LINEAR_MMA = {1: ("mma", MMA_8), 16: ("mma", MMA_8), 64: ("mma", MMA_16), 65: ("mma", MMA_16), 512: LARGE_TL,
              4096: LARGE_TL}
LINEAR_TL = {1: ("tl", SMALL_TL), 16: ("tl", SMALL_TL), 64: ("tl", SMALL_TL), 65: LARGE_TL, 512: LARGE_TL,
             4096: LARGE_TL}


@pytest.fixture(scope="module")
def gemm_weights():
    """MoE weights (NVFP4 experts, MXFP8 shared expert) and an FP8 linear whose shapes every mma config divides."""
    from m3serve.kernels.moe import moe_prepare_module
    from m3serve.kernels.quant_linear import quant_linear_prepare
    from m3serve.model.weights import QuantWeight
    from support.moe import fill_random, random_moe, tiny_moe_config
    g = torch.Generator().manual_seed(0)
    moe = moe_prepare_module(random_moe(tiny_moe_config(hidden=1024, inter=1024, experts=2, top_k=1), "nvfp4",
                                        "mxfp8", g))
    qw = QuantWeight(256, 1024, "fp8")
    fill_random(qw, g)
    return moe, quant_linear_prepare(qw).packed


def _mma_available(monkeypatch, yes: bool):
    from m3serve.kernels import grouped_gemm_mma
    monkeypatch.setattr(grouped_gemm_mma, "available", lambda device: yes)


def _nvidia(monkeypatch):
    """Compiled NVIDIA CUDA (not the interpreter this suite runs under, not ROCm)."""
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    monkeypatch.setattr(platform, "rocm", lambda: False)


def test_moe_and_linear_defaults_select_the_measured_tables(monkeypatch, gemm_weights):
    moe, lin = gemm_weights
    _nvidia(monkeypatch)
    _mma_available(monkeypatch, True)  # sm_89 / sm_90
    assert {T: dispatch.moe_config(T, moe, CUDA) for T in TOKENS} == MOE_MMA
    assert {M: dispatch.linear_config(M, lin, CUDA) for M in TOKENS} == LINEAR_MMA
    _mma_available(monkeypatch, False)  # other CUDA devices
    assert {T: dispatch.moe_config(T, moe, CUDA) for T in TOKENS} == dict.fromkeys(TOKENS, MOE_TL)
    assert {M: dispatch.linear_config(M, lin, CUDA) for M in TOKENS} == LINEAR_TL
    # off CUDA the small portable tiles, whatever the token count
    assert {T: dispatch.moe_config(T, moe, CPU) for T in TOKENS} == dict.fromkeys(TOKENS, ("tl", SMALL_TL, SMALL_TL))
    assert {M: dispatch.linear_config(M, lin, CPU) for M in TOKENS} == dict.fromkeys(TOKENS, ("tl", SMALL_TL))
    monkeypatch.setattr(platform, "interpreting", lambda: True)  # a CUDA device under the interpreter: the same
    assert {T: dispatch.moe_config(T, moe, CUDA) for T in TOKENS} == dict.fromkeys(TOKENS, ("tl", SMALL_TL, SMALL_TL))


def test_rocm_takes_the_portable_choices(monkeypatch, gemm_weights):
    """A ROCm device reports type "cuda": with a HIP torch (faked here) every NVIDIA-only choice is off: no mma or
    PTX kernels, the portable GEMM tiles instead of the H200's tl rows, the portable decode key tile."""
    moe, lin = gemm_weights
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", "7.2.26015")
    monkeypatch.setattr(platform, "_capability", lambda index: (9, 4))  # gfx942's, as torch reports it
    assert platform.rocm() and not platform.compiled_cuda(CUDA)
    assert not platform.nvfp4_mma_ok(CUDA) and not platform.moe_mma_ok(CUDA) and not platform.nvfp4_asm_allowed(CUDA)
    assert {T: dispatch.moe_config(T, moe, CUDA) for T in TOKENS} == dict.fromkeys(TOKENS, ("tl", SMALL_TL, SMALL_TL))
    assert {M: dispatch.linear_config(M, lin, CUDA) for M in TOKENS} == dict.fromkeys(TOKENS, ("tl", SMALL_TL))
    assert dispatch.decode_block_n(FMT_NVFP4, sparse=False, on_mma=False, block_size=128) == 64
    monkeypatch.setattr(torch.version, "hip", None)  # the same device on NVIDIA: the H200's choices
    assert dispatch.decode_block_n(FMT_NVFP4, sparse=False, on_mma=False, block_size=128) == 128
    assert dispatch.moe_config(4096, moe, CUDA) == MOE_TL and platform.moe_mma_ok(CUDA)


def test_mma_rows_need_shapes_the_tiles_divide_and_mma_on(monkeypatch, gemm_weights):
    """A row whose tiles do not divide the weights is passed over (p=4: 64-row tiles; unroll=3: 12 K chunks); with
    `Tuning.mma` off every mma row is."""
    moe, lin = gemm_weights
    _nvidia(monkeypatch)
    _mma_available(monkeypatch, True)
    wide = ("mma", dict(p=4, nt=8, unroll=2), MMA_8)
    with tuned(moe_table=((16, *wide), (None, "mma", MMA_8, dict(p=1, nt=8, unroll=3)), (None, *MOE_TL))):
        assert dispatch.moe_config(1, moe, CUDA) == wide  # 1024 rows = 16 tiles of 64
        assert dispatch.moe_config(17, moe, CUDA) == MOE_TL  # 8 K chunks are not a multiple of 12
    with tuned(linear_table=((None, "mma", dict(p=32, nt=8, unroll=2)), (None, "tl", SMALL_TL))):
        assert dispatch.linear_config(1, lin, CUDA) == ("tl", SMALL_TL)  # 256 rows, tiles of 512
    with tuned(mma=False):  # the portable kernels everywhere
        assert dispatch.moe_config(1, moe, CUDA) == MOE_TL and dispatch.linear_config(1, lin, CUDA) == LINEAR_TL[1]


def test_tuned_overrides_the_moe_and_linear_tables_inside_its_block(monkeypatch, gemm_weights):
    """The choices come from `Tuning`'s tables: a benchmark's one-row table is taken inside the block only, and the
    layer launches what dispatch picks."""
    from m3serve.kernels import grouped_gemm_mma
    from m3serve.kernels.quant_linear import QuantLinear, quant_linear
    moe, lin = gemm_weights
    _nvidia(monkeypatch)
    _mma_available(monkeypatch, True)
    assert Tuning().moe_table is dispatch.MOE_TABLE and Tuning().linear_table is dispatch.LINEAR_TABLE
    assert Tuning().moe_overlap is False
    mma_v = ("mma", dict(p=2, nt=32, unroll=1), dict(p=1, nt=16, unroll=1))
    tl_v = ("tl", dict(bm=32, bn=64, num_warps=4, num_stages=3))
    with tuned(moe_table=((None, *mma_v),), linear_table=((None, *tl_v),), moe_overlap=True) as t:
        assert t.moe_overlap and tuning().moe_overlap
        assert dispatch.moe_config(4096, moe, CUDA) == mma_v and dispatch.moe_config(1, moe, CUDA) == mma_v
        assert dispatch.linear_config(1, lin, CUDA) == tl_v
        with tuned(linear_table=((8, "mma", dict(p=2, nt=32, unroll=1)), (None, *tl_v))):  # nested
            assert dispatch.linear_config(8, lin, CUDA) == ("mma", dict(p=2, nt=32, unroll=1))
            assert dispatch.linear_config(9, lin, CUDA) == tl_v
            seen = []
            monkeypatch.setattr(grouped_gemm_mma, "to_x16", lambda x, k_pad: x)
            monkeypatch.setattr(grouped_gemm_mma, "grouped_gemm_mma", lambda *a, **kw: seen.append(kw))
            quant_linear(torch.randn(3, 1024), QuantLinear(256, 1024, packed=lin))  # the override is launched
            assert seen and {k: seen[0][k] for k in ("p", "nt", "unroll")} == dict(p=2, nt=32, unroll=1)
        assert dispatch.linear_config(8, lin, CUDA) == tl_v
    assert dispatch.moe_config(4096, moe, CUDA) == MOE_TL and dispatch.moe_config(1, moe, CUDA) == MOE_MMA[1]
    assert dispatch.linear_config(1, lin, CUDA) == LINEAR_MMA[1] and not tuning().moe_overlap
