"""The kernels' dispatch table and platform gates (kernels/dispatch.py, kernels/platform.py): the tuning context,
what the kernels need of the launch rules and tables (their measured values are tuning, not pinned), the gates. Which kernel actually
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


@pytest.mark.parametrize("interpreting", [False, True])
def test_launch_rules_keep_their_contracts(monkeypatch, interpreting):
    """The launch rules on a 132-SM GPU (and in the interpreter), over a sweep of shapes. Their values are tuning
    (measured: docs/performance.md) and are not pinned here; what is pinned is what the kernels need of them: a
    prefill tile gives tl.dot its 16 rows, a key tile never spans two pages, the mma attention takes whole 128-token
    blocks, split-K and index chunks cover every tile with no empty split, and a `tuned` variant is what runs."""
    monkeypatch.setattr(platform, "interpreting", lambda: interpreting)
    monkeypatch.setattr(platform, "num_sms", lambda device: 132)
    for group in (1, 2, 3, 4, 8, 16, 32, 64):
        assert dispatch.attention_block_t(group) * dispatch.next_pow2(group) >= 16
        assert dispatch.index_block_t(group) * dispatch.next_pow2(group) >= 16
        assert dispatch.insert_tokens(dispatch.next_pow2(group)) >= 1
    for fmt in (FMT_PLAIN, FMT_FP8, FMT_NVFP4):
        for sparse in (False, True):
            for block_size in (16, 64, 128):
                bn = dispatch.decode_block_n(fmt, sparse, on_mma=False, block_size=block_size)
                assert block_size % bn == 0 and bn >= 16, (fmt, sparse, block_size, bn)
                assert block_size % dispatch.prefill_block_n(block_size) == 0
            assert dispatch.decode_block_n(fmt, sparse, on_mma=True, block_size=128) == 128
    for tiles in (1, 2, 7, 64, 1000):
        for programs in (1, 5, 32, 4096):
            for sparse, on_mma in ((False, False), (True, False), (False, True), (True, True)):
                splits, per = dispatch.decode_splits(tiles, programs, sparse=sparse, on_mma=on_mma, device=CPU)
                assert 1 <= splits <= tiles and (splits - 1) * per < tiles <= splits * per, (tiles, programs)
            chunks, per = dispatch.index_chunks(tiles, programs, CPU)
            assert 1 <= chunks <= tiles and (chunks - 1) * per < tiles <= chunks * per, (tiles, programs)
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
SMALL_TL = dict(bm=16, bn=64, num_warps=4, num_stages=2)  # the interpreter's / ROCm's / small-M portable tiles
# the tables' portable rows: what runs where the mma kernels do not (values are tuning, taken from the tables)
def _tl_rows(table: tuple) -> dict:
    return {M: next(r[1:] for r in table if r[1] == "tl" and (r[0] is None or M <= r[0])) for M in TOKENS}


MOE_TL, LINEAR_TL = _tl_rows(dispatch.MOE_TABLE), _tl_rows(dispatch.LINEAR_TABLE)
DENSE_FROM = {"moe": dispatch.MOE_DENSE_FROM, "linear": dispatch.LINEAR_DENSE_FROM}  # decode once, then cuBLAS


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
    """Compiled NVIDIA CUDA (not the interpreter this suite runs under, not ROCm), with no shared-memory limit read
    from a device (on a GPU host the real one would pass over tl rows these tests pin: a test that needs one sets
    it)."""
    monkeypatch.setattr(platform, "interpreting", lambda: False)
    monkeypatch.setattr(platform, "rocm", lambda: False)
    monkeypatch.setattr(dispatch, "_shared_memory", lambda index: None)


def _fits(cfg: dict, rows, k_pads) -> bool:
    """An mma grouped-GEMM config whose tiles divide the weights: rows by 16 p, K chunks by warps x unroll."""
    from m3serve.kernels.dispatch import gemm_mma_kernels
    from m3serve.kernels.weight_layout import CHUNK_K
    per = gemm_mma_kernels().NUM_WARPS * cfg["unroll"]
    return all(n % (16 * cfg["p"]) == 0 for n in rows) and all((k // CHUNK_K) % per == 0 for k in k_pads)


def test_moe_and_linear_choices_keep_their_contracts(monkeypatch, gemm_weights):
    """The MoE and linear tables' rows are tuning (measured: docs/performance.md, MoE section), not pinned here. What
    is: an "mma" choice only where the mma kernels run and only with tiles that divide the weights; decode-sized
    steps on the mma kernels where they run (their purpose); the decode-once-then-cuBLAS path ("dense") from its
    crossover on, wherever torch runs it; elsewhere on CUDA the tables' portable rows; off CUDA (the interpreter)
    the small portable tiles below the crossover."""
    moe, lin = gemm_weights
    _nvidia(monkeypatch)
    shapes = {"moe": ((moe.inter_pad, moe.hidden), (moe.gate_up.k_pad, moe.down.k_pad)),
              "linear": ((lin.n_pad,), (lin.k_pad,))}
    for available in (True, False):
        _mma_available(monkeypatch, available)
        # on CUDA by default (Tuning.dense_prefill) the linears' dense rows hold from their crossover on and the MoE's
        # do not (measured slower than the kernels there); turned on, both hold from the crossover
        assert dispatch.moe_config(DENSE_FROM["moe"], moe, CUDA)[0] != "dense"
        assert dispatch.linear_config(DENSE_FROM["linear"], lin, CUDA)[0] == "dense"
        assert dispatch.linear_config(DENSE_FROM["linear"] - 1, lin, CUDA)[0] != "dense"
        with dispatch.tuned(dense_prefill=True):
            for T in TOKENS:
                for name, choice in (("moe", dispatch.moe_config(T, moe, CUDA)),
                                     ("linear", dispatch.linear_config(T, lin, CUDA))):
                    if choice[0] == "mma":
                        assert available and all(_fits(c, *shapes[name]) for c in choice[1:]), (name, T, choice)
                    elif T >= DENSE_FROM[name]:
                        assert choice[0] == "dense", (name, T, choice)
                    else:
                        assert choice == (MOE_TL if name == "moe" else LINEAR_TL)[T], (name, T, choice)
        assert (dispatch.moe_config(1, moe, CUDA)[0] == "mma") == available
        assert (dispatch.linear_config(1, lin, CUDA)[0] == "mma") == available
    small = [T for T in TOKENS if T < DENSE_FROM["moe"]]
    assert {T: dispatch.moe_config(T, moe, CPU) for T in small} == dict.fromkeys(small, ("tl", SMALL_TL, SMALL_TL))
    assert dispatch.moe_config(DENSE_FROM["moe"], moe, CPU)[0] == "dense"
    small = [M for M in TOKENS if M < DENSE_FROM["linear"]]
    assert {M: dispatch.linear_config(M, lin, CPU) for M in small} == dict.fromkeys(small, ("tl", SMALL_TL))
    monkeypatch.setattr(platform, "interpreting", lambda: True)  # a CUDA device under the interpreter: the same
    small = [T for T in TOKENS if T < DENSE_FROM["moe"]]
    assert {T: dispatch.moe_config(T, moe, CUDA) for T in small} == dict.fromkeys(small, ("tl", SMALL_TL, SMALL_TL))


def test_tl_rows_need_tiles_that_fit_the_shared_memory(monkeypatch, gemm_weights):
    """A tl row whose tiles need more shared memory than the device has is passed over (Triton refuses the launch:
    256 x 128 tiles in 3 stages on the H100): an sm_89's 99 KB takes the small tiles where Hopper's 227 KB takes the
    prefill rows' 128 x 128 ones."""
    moe, lin = gemm_weights
    _nvidia(monkeypatch)
    _mma_available(monkeypatch, False)
    hopper = dispatch.moe_config(4095, moe, CUDA), dispatch.linear_config(8192, lin, CUDA)
    assert hopper == (MOE_TL[4096], ("dense", {}))
    with tuned(dense_prefill=False):
        big = dispatch.linear_config(8192, lin, CUDA)
    small = dict(bm=64, bn=64, num_warps=4, num_stages=3)
    monkeypatch.setattr(dispatch, "_shared_memory", lambda index: 101376)
    assert dispatch.moe_config(4095, moe, CUDA) == ("tl", small, small) != hopper[0]
    with tuned(dense_prefill=False):
        assert dispatch.linear_config(8192, lin, CUDA) == ("tl", small) != big
    monkeypatch.setattr(dispatch, "_shared_memory", lambda index: 232448)
    assert dispatch.moe_config(4095, moe, CUDA) == hopper[0]
    with tuned(moe_table=((None, "tl", dict(bm=256, bn=128, num_warps=8, num_stages=3), small),)):
        assert dispatch.moe_config(4095, moe, CUDA) == ("tl", dispatch.PORTABLE_GEMM, dispatch.PORTABLE_GEMM)


def test_wg16_tiles_are_not_taken_for_dense_weights(monkeypatch, gemm_weights):
    """A tl row with ``wg16`` keeps it for quantized weights and drops it where a weight of the launch is dense (the
    wg16 tile would gather a dense weight's columns one by one); the row's other keys stay."""
    from m3serve.kernels.moe import moe_prepare_module
    from support.moe import random_moe, tiny_moe_config
    moe, _ = gemm_weights
    _nvidia(monkeypatch)
    _mma_available(monkeypatch, False)
    cfg = dict(bm=64, bn=128, num_warps=8, num_stages=3, swap=True, wg16=True)
    dense = moe_prepare_module(random_moe(tiny_moe_config(hidden=256, inter=128, experts=2, top_k=1), "nvfp4",
                                          "dense", torch.Generator().manual_seed(0)))
    with tuned(moe_table=((None, "tl", cfg, cfg),)):
        assert dispatch.moe_config(500, moe, CUDA) == ("tl", cfg, cfg)
        assert dispatch.moe_config(500, dense, CUDA) == ("tl", dict(cfg, wg16=False), dict(cfg, wg16=False))


def test_a8_tiles_need_quantized_weights_and_fp8_tensor_cores(monkeypatch, gemm_weights):
    """A tl row with ``a8`` (FP8 dots) keeps it for quantized weights on sm_89+ and drops it, its other keys kept,
    where a weight of the launch is dense (nothing to round: a8 serves quantized weights) or the device has no FP8
    tensor cores (sm_80)."""
    from m3serve.kernels.moe import moe_prepare_module
    from support.moe import random_moe, tiny_moe_config
    moe, lin = gemm_weights
    _nvidia(monkeypatch)
    _mma_available(monkeypatch, False)
    cfg = dict(bm=64, bn=128, num_warps=8, num_stages=3, swap=True, wg16=True, a8=True)
    dense = moe_prepare_module(random_moe(tiny_moe_config(hidden=256, inter=128, experts=2, top_k=1), "nvfp4",
                                          "dense", torch.Generator().manual_seed(0)))
    off = dict(cfg, wg16=False, a8=False)
    plain = dict(cfg, a8=False)
    with tuned(moe_table=((None, "tl", plain, plain),)):  # Tuning.a8 turns a8 on in every tl row (quantized weights)
        assert dispatch.moe_config(500, moe, CUDA) == ("tl", plain, plain)
        monkeypatch.setattr(platform, "capability", lambda device: (9, 0))
        with tuned(a8=True):
            assert dispatch.moe_config(500, moe, CUDA) == ("tl", cfg, cfg)
            assert dispatch.moe_config(500, dense, CUDA) == ("tl", off, off)
    for cap, kept in (((9, 0), cfg), ((8, 9), cfg), ((8, 0), dict(cfg, a8=False))):
        monkeypatch.setattr(platform, "capability", lambda device, cap=cap: cap)
        with tuned(moe_table=((None, "tl", cfg, cfg),), linear_table=((None, "tl", cfg),)):
            assert dispatch.moe_config(500, moe, CUDA) == ("tl", kept, kept)
            assert dispatch.linear_config(500, lin, CUDA) == ("tl", kept)
            assert dispatch.moe_config(500, dense, CUDA) == ("tl", off, off)


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
    assert dispatch.moe_config(4095, moe, CUDA) == MOE_TL[4096] and platform.moe_mma_ok(CUDA)  # the same tiles


def test_mma_rows_need_shapes_the_tiles_divide_and_mma_on(monkeypatch, gemm_weights):
    """A row whose tiles do not divide the weights is passed over (p=4: 64-row tiles; unroll=3: 12 K chunks); with
    `Tuning.mma` off every mma row is."""
    moe, lin = gemm_weights
    _nvidia(monkeypatch)
    _mma_available(monkeypatch, True)
    wide = ("mma", dict(p=4, nt=8, unroll=2), MMA_8)
    with tuned(moe_table=((16, *wide), (None, "mma", MMA_8, dict(p=1, nt=8, unroll=3)), (None, *MOE_TL[4096]))):
        assert dispatch.moe_config(1, moe, CUDA) == wide  # 1024 rows = 16 tiles of 64
        assert dispatch.moe_config(17, moe, CUDA) == MOE_TL[4096]  # 8 K chunks are not a multiple of 12
    with tuned(linear_table=((None, "mma", dict(p=32, nt=8, unroll=2)), (None, "tl", SMALL_TL))):
        assert dispatch.linear_config(1, lin, CUDA) == ("tl", SMALL_TL)  # 256 rows, tiles of 512
    with tuned(mma=False):  # the portable kernels everywhere
        assert dispatch.moe_config(1, moe, CUDA) == MOE_TL[1] and dispatch.linear_config(1, lin, CUDA) == LINEAR_TL[1]


def test_tuned_overrides_the_moe_and_linear_tables_inside_its_block(monkeypatch, gemm_weights):
    """The choices come from `Tuning`'s tables: a benchmark's one-row table is taken inside the block only, and the
    layer launches what dispatch picks."""
    from m3serve.kernels import grouped_gemm_mma
    from m3serve.kernels import quant_linear as quant_linear_module
    from m3serve.kernels.quant_linear import QuantLinear, quant_linear
    moe, lin = gemm_weights
    _nvidia(monkeypatch)
    _mma_available(monkeypatch, True)
    assert Tuning().moe_table is dispatch.MOE_TABLE and Tuning().linear_table is dispatch.LINEAR_TABLE
    assert Tuning().moe_overlap is False
    before_moe = dispatch.moe_config(4096, moe, CUDA), dispatch.moe_config(1, moe, CUDA)
    before_linear = dispatch.linear_config(1, lin, CUDA)
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
            monkeypatch.setattr(quant_linear_module, "to_x16", lambda x, k_pad: x)
            monkeypatch.setattr(grouped_gemm_mma, "grouped_gemm_mma", lambda *a, **kw: seen.append(kw))
            quant_linear(torch.randn(3, 1024), QuantLinear(256, 1024, packed=lin))  # the override is launched
            assert seen and {k: seen[0][k] for k in ("p", "nt", "unroll")} == dict(p=2, nt=32, unroll=1)
        assert dispatch.linear_config(8, lin, CUDA) == tl_v
    assert (dispatch.moe_config(4096, moe, CUDA), dispatch.moe_config(1, moe, CUDA)) == before_moe
    assert dispatch.linear_config(1, lin, CUDA) == before_linear and not tuning().moe_overlap
