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
