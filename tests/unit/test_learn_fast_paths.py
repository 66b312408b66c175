"""learn/fast_paths.py: the training step's fast attention, experts and indexer selection compute what
transformers' eager MiniMaxM3VLForCausalLM computes (logits, gradients, the indexer's KL), dense and under the MSA
top-k mask; so do its compiled pieces (`--compile`), and a compiler error falls back to the eager step."""
import copy
import os
import random
import shutil
import time

import pytest
import torch

os.environ.setdefault("USE_HUB_KERNELS", "0")
pytest.importorskip("transformers")

from m3serve.learn.config import learned_config  # noqa: E402
from m3serve.learn.fast_paths import (ATTENTION, CompiledPieces, block_keep, experts_all, experts_grouped,  # noqa: E402
                                      install)
from m3serve.learn.step import DenseAttention, IndexerDistill, RouterBalance, answer_loss  # noqa: E402
from m3serve.learn.train import TrainConfig, build_target, train_target  # noqa: E402

from support.learned import MICRO  # noqa: E402



@pytest.fixture(scope="module")
def pair():
    cfg = learned_config(256, 0, 1, **MICRO)
    eager = build_target(cfg, torch.device("cpu"), 3, fast=False)
    fast = build_target(cfg, torch.device("cpu"), 3)
    fast.load_state_dict(eager.state_dict())
    for m in (eager, fast):  # routers that pick different experts per token
        for name, buf in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.linspace(-0.05, 0.05, buf.numel()))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (3, 70), generator=g)
    ids[1, 50:] = 1  # right padding, as the training batches have
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 30:48] = True
    return eager, fast, ids, mask


def test_the_fast_model_is_installed_and_the_reference_is_not(pair):
    eager, fast, _, _ = pair
    assert fast.config._attn_implementation == ATTENTION and eager.config._attn_implementation == "eager"


def _with_experts(fast, experts: str):
    """`fast`, or a copy of it whose experts run as fast_paths.EXPERTS[experts] does."""
    if experts == "all":
        return fast
    twin = copy.deepcopy(fast)
    install(twin, experts)
    return twin


@pytest.mark.parametrize("dense,experts", [(True, "all"), (False, "all"), (True, "grouped"), (False, "grouped")])
def test_logits_and_gradients_equal_the_eager_models(pair, dense, experts):
    eager, fast, ids, mask = pair
    fast = _with_experts(fast, experts)
    outs = []
    for m in (eager, fast):
        m.zero_grad(set_to_none=True)
        with DenseAttention(m, dense):
            logits = m(input_ids=ids).logits
            loss = answer_loss(m, ids, mask)[0]
        loss.backward()
        grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
        outs.append((logits.detach(), loss.detach(), grads))
    (le, se, ge), (lf, sf, gf) = outs
    torch.testing.assert_close(lf, le, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(sf, se, atol=2e-5, rtol=1e-4)
    assert set(gf) == set(ge) and any("experts" in k for k in gf)
    for k in ge:
        torch.testing.assert_close(gf[k], ge[k], atol=2e-5, rtol=2e-3, msg=k)


def test_the_sparse_mask_is_applied(pair):
    """At 70 tokens, top-2 blocks of 8 keys leave keys out: sparse and dense logits differ (the tests above would
    pass vacuously otherwise)."""
    _, fast, ids, _ = pair
    with torch.no_grad():
        with DenseAttention(fast, True):
            dense = fast(input_ids=ids).logits
        with DenseAttention(fast, False):
            sparse = fast(input_ids=ids).logits
    assert not torch.allclose(dense[:, -10:], sparse[:, -10:], atol=1e-3)
    torch.testing.assert_close(dense[:, :16], sparse[:, :16])  # within the first 2 blocks everything is selected


@pytest.mark.parametrize("dense", [True, False])
def test_the_indexer_kl_equals_the_eager_models(pair, dense):
    eager, fast, ids, _ = pair
    real = ids != 1
    kls = []
    for m in (eager, fast):
        distill = IndexerDistill(m, rows=2, seed=4)
        distill.enabled = True
        distill.select(real, ids.device)
        with torch.no_grad(), DenseAttention(m, dense):
            m.model(input_ids=ids)
        kls.append((float(distill.take(real)), distill.last_rows))
        distill.remove()
        assert not hasattr(m.model.layers[1].self_attn, "teacher_sink")
    (ke, re), (kf, rf) = kls
    assert torch.equal(re, rf) and ke > 0
    assert abs(kf - ke) <= 1e-4 * max(1.0, ke), (kf, ke)


@pytest.mark.parametrize("tokens,routing", [(70, "spread"), (70, "one expert idle"), (70, "all on expert 5"),
                                            (3, "spread")])
def test_grouped_experts_equal_every_expert(tokens, routing):
    """train-learned --experts grouped: the picked experts only, sorted into aligned groups, give the all-experts
    path's output and gradients (hidden states, both expert weights, router weights); whatever the routing, the
    grouped GEMM sees one row count per token count (a captured step's shapes do not follow the router)."""
    g = torch.Generator().manual_seed(tokens)
    e, k, d, f = 8, 2, 32, 16
    h = torch.randn(tokens, d, generator=g)
    gate_up, down = torch.randn(e, 2 * f, d, generator=g), torch.randn(e, d, f, generator=g)
    logits = torch.randn(tokens, e, generator=g)
    if routing == "one expert idle":
        logits[:, 3] = -1e4
    elif routing == "all on expert 5":
        logits[:, 5] = 1e4
    weights, index = torch.topk(logits.softmax(-1), k)
    grad = torch.randn(tokens, d, generator=g)
    rows = []
    real_grouped_mm = torch._grouped_mm

    def spy(a, b, offs):
        rows.append((a.shape[0], int(offs[-1])))
        return real_grouped_mm(a, b, offs=offs)

    outs = []
    for fn in (experts_all, experts_grouped):
        leaves = [t.clone().requires_grad_() for t in (h, gate_up, down, weights)]
        torch._grouped_mm = spy
        try:
            out = fn(leaves[0], index, leaves[3], leaves[1], leaves[2], 1.702, 7.0)
        finally:
            torch._grouped_mm = real_grouped_mm
        out.backward(grad)
        outs.append([out.detach()] + [t.grad for t in leaves])
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if routing == "one expert idle":
        assert not (index == 3).any()
    elif routing == "all on expert 5":
        assert (index == 5).any(-1).all()
    cap = -(-(tokens * k + e * 15) // 16) * 16
    assert rows == [(cap, cap)] * 2  # gate_up, down: the rows depend on the token count alone


def test_block_keep_is_the_selected_blocks_and_causal():
    idx = torch.tensor([[[[0, -1], [0, 2], [1, 2]]]])  # 1 row, 1 head, queries 0, 9, 22 (blocks of 8)
    keep = block_keep(idx, 24, 8, torch.tensor([[0, 9, 22]]))
    assert keep.shape == (1, 1, 3, 24)
    assert keep[0, 0, 0].nonzero().flatten().tolist() == [0]
    assert keep[0, 0, 1].nonzero().flatten().tolist() == list(range(8))  # block 2 lies in the future of 9
    assert keep[0, 0, 2].nonzero().flatten().tolist() == list(range(8, 23))


def test_a_deep_copy_runs_its_own_modules(pair):
    """The swapped forwards are bound per module: a deep copy with other weights computes with its own (a copy that
    called the original's indexer or experts would give the original's logits)."""
    _, fast, ids, _ = pair
    twin = copy.deepcopy(fast)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if ".indexer." in name or ".experts." in name:
                p.mul_(-1.5)
        with DenseAttention(twin, False), DenseAttention(fast, False):
            assert not torch.allclose(twin(input_ids=ids).logits, fast(input_ids=ids).logits, atol=1e-3)
        for a, b in zip(twin.modules(), fast.modules()):
            if "forward" in vars(a):
                assert a.forward.__self__ is a and b.forward.__self__ is b


# ---------------------------------------------------------------------------------------------- --compile

def _step_outputs(model, ids, mask, dense: bool) -> dict:
    """One forward and backward as a training step makes it (answer loss + the indexer's KL on 2 of the 3 rows,
    router loads counted): the loss, KL, logits, gradients and router loads."""
    distill, balance = IndexerDistill(model, rows=2, seed=4), RouterBalance(model, 0.01)
    distill.enabled = balance.enabled = True
    model.zero_grad(set_to_none=True)
    with DenseAttention(model, dense):
        logits = model(input_ids=ids).logits
        distill.reset()  # the KL of the loss's forward only
        distill.select(ids != 1, ids.device)
        loss = answer_loss(model, ids, mask)[0]
    kl = distill.take(ids != 1)
    (loss + kl).backward()
    loads = [balance.loads[id(r)] for r in balance.routers]
    distill.remove()
    balance.remove()
    return {"loss": loss.detach(), "kl": kl.detach(), "logits": logits.detach(), "loads": loads,
            "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}}


def _assert_same_step(got: dict, want: dict, bf16: bool = False) -> None:
    """fp32: every value within float rounding; `bf16` (autocast): the gradients within 1% in norm (the compiled
    backward's bf16 ops round in another order)."""
    torch.testing.assert_close(got["logits"], want["logits"], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got["loss"], want["loss"], atol=2e-5, rtol=1e-4)
    assert float(want["kl"]) > 0 and abs(float(got["kl"] - want["kl"])) <= 1e-4 * max(1.0, float(want["kl"]))
    assert len(want["loads"]) == 2 and all(torch.equal(a, b) for a, b in zip(got["loads"], want["loads"]))
    assert set(got["grads"]) == set(want["grads"]) and any(".indexer." in k for k in want["grads"])
    for k in want["grads"]:
        if bf16:
            assert (got["grads"][k] - want["grads"][k]).norm() <= 1e-2 * want["grads"][k].norm(), k
        else:
            torch.testing.assert_close(got["grads"][k], want["grads"][k], atol=2e-5, rtol=2e-3, msg=k)


@pytest.fixture()
def compiled_pair(pair):
    torch._dynamo.reset()
    _, fast, ids, mask = pair
    twin = copy.deepcopy(fast)
    yield fast, twin, ids, mask
    torch._dynamo.reset()


@pytest.mark.parametrize("dense,experts", [(True, "all"), (False, "all"), (False, "grouped")])
def test_compiled_pieces_compute_the_eager_step(compiled_pair, dense, experts):
    """aot_eager traces the pieces as the compiler does (dynamo + autograd), two batch shapes (dynamic shapes):
    the same logits, loss, indexer KL, router loads (from the router's `load_sink`: the compiled MoE block does not
    call the router module) and gradients as the eager fast model; the MoE block with either experts path (the
    grouped GEMM compiles in bf16 only, as the GPU's autocast runs it: here under the CPU's bf16 autocast)."""
    fast, twin, ids, mask = compiled_pair
    if experts != "all":
        fast, twin = _with_experts(fast, experts), _with_experts(twin, experts)
    pieces = CompiledPieces(twin, "aot_eager")
    assert {type(m).__name__ for m, _ in pieces.modules} == {
        "MiniMaxM3VLRMSNorm", "MiniMaxM3VLDenseMLP", "MiniMaxM3VLSparseMoeBlock", "MiniMaxM3VLRotaryEmbedding",
        "MiniMaxM3VLAttention", "MiniMaxM3VLIndexer"}
    for rows, s in ((3, 70), (2, 53)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=experts == "grouped"):
            want = _step_outputs(fast, ids[:rows, :s], mask[:rows, :s], dense)
            _assert_same_step(_step_outputs(twin, ids[:rows, :s], mask[:rows, :s], dense), want, experts == "grouped")
    pieces.undo()  # the forwards install() swapped stay, the compiled ones are gone
    assert [(n, m.forward.__func__.__name__) for n, m in twin.named_modules() if "forward" in vars(m)] == [
        (n, m.forward.__func__.__name__) for n, m in fast.named_modules() if "forward" in vars(m)]
    assert not any(hasattr(m, "compile_backend") for m in twin.modules())


def test_the_sinks_are_what_the_compiled_step_reads(compiled_pair):
    """Without its load sink the compiled MoE block leaves RouterBalance no loads (the equality above is the
    sink's, not a hook's)."""
    _, twin, ids, _ = compiled_pair
    CompiledPieces(twin, "aot_eager")
    balance = RouterBalance(twin, 0.01)
    balance.enabled = True
    for r in balance.routers:
        del r.load_sink
    with torch.no_grad():
        twin(input_ids=ids)
    assert balance.loads == {}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor on CPU needs a C++ compiler")
def test_inductor_pieces_compute_the_eager_step(compiled_pair):
    """The real backend (C++ kernels on CPU): the sparse step as the eager fast model computes it (compiling takes
    ~1.5 minutes on 2 cores, less with inductor's cache warm)."""
    fast, twin, ids, mask = compiled_pair
    CompiledPieces(twin, "inductor")
    t0 = time.time()
    _assert_same_step(_step_outputs(twin, ids, mask, False), _step_outputs(fast, ids, mask, False))
    print(f"inductor: first compiled step {time.time() - t0:.1f} s")


def _rows(n: int = 12) -> list:
    rng = random.Random(0)
    out = []
    for i in range(n):
        length = rng.randrange(20, 70)
        out.append(([rng.randrange(2, 256) for _ in range(length)], [0] * (length - 6) + [1] * 6, i % 2))
    return out


# 4 steps, dense then sparse, the KL over every row (no random draw a retried step would repeat)
TRAIN = dict(out="-", device="cpu", max_steps=4, warmup_steps=1, tokens_per_batch=256, log_every=1, dense_frac=0.5,
             sparse_ramp_frac=0.0, distill_rows=0, bias_rate=0.01)


def _train(tc, log=lambda _m: None):
    model = build_target(learned_config(256, 0, 1, **MICRO), torch.device("cpu"), 5, experts=tc.experts)
    return model, train_target(model, _rows(), tc, torch.device("cpu"), float("inf"), 1, log)


@pytest.fixture(scope="module")
def eager_training():
    return _train(TrainConfig(**TRAIN))


def _assert_same_training(got, want) -> None:
    (mg, og), (mw, ow) = got, want
    assert og["steps"] == ow["steps"] == 4 and [r["phase"] for r in ow["curve"]][::3] == ["dense", "sparse"]
    for a, b in zip(og["curve"], ow["curve"], strict=True):
        assert a["phase"] == b["phase"]
        for k in ("loss", "indexer_kl", "grad_norm", "max_expert_load_ratio"):
            assert a[k] == pytest.approx(b[k], rel=2e-3, abs=2e-4), (k, a, b)
    sw, sg = mw.state_dict(), mg.state_dict()
    assert any(bool(v.any()) for k, v in sw.items() if k.endswith("e_score_correction_bias"))  # balancing moved
    for k in sw:
        torch.testing.assert_close(sg[k], sw[k], atol=1e-4, rtol=1e-3, msg=k)
    assert not any("compile_backend" in vars(m) for m in mg.modules())  # eager again after training


def test_compiled_training_equals_eager_training(eager_training):
    torch._dynamo.reset()
    said = []
    got = _train(TrainConfig(**TRAIN, compile=True, compile_backend="aot_eager"), said.append)
    info = got[1]["compile"]
    assert info["backend"] == "aot_eager" and info["fallback"] is None and info["first_step_s"] >= 0
    assert any("compiling" in m for m in said)
    _assert_same_training(got, want=eager_training)
    assert eager_training[1]["compile"] is None


def test_grouped_experts_train_as_every_expert(eager_training):
    """train-learned --experts grouped: the same run as the all-experts path, step by step and in the end weights."""
    got = _train(TrainConfig(**TRAIN, experts="grouped"))
    assert got[1]["experts_implementation"] == "fast_paths 'grouped'"
    assert eager_training[1]["experts_implementation"] == "fast_paths 'all'"
    _assert_same_training(got, want=eager_training)


def test_a_compiler_error_falls_back_to_the_eager_step(eager_training):
    """A backend that raises (as inductor may on a device): the step runs again eagerly, the run goes on and
    trains exactly as an eager run does; the log says why."""
    def broken(gm, example_inputs):
        raise RuntimeError("simulated compiler failure")

    torch._dynamo.reset()
    said = []
    got = _train(TrainConfig(**TRAIN, compile=True, compile_backend=broken), said.append)
    assert got[1]["compile"]["fallback"].startswith("step 0: ") and "simulated" in got[1]["compile"]["fallback"]
    assert got[1]["stopped_by"] == "steps" and any("eager from here" in m for m in said)
    _assert_same_training(got, want=eager_training)
    torch._dynamo.reset()


def test_cuda_graphs_off_the_gpu_train_eagerly(eager_training):
    """train-learned --cuda-graphs on the CPU: said once, then the same eager training (no ladder, no graphs)."""
    said = []
    got = _train(TrainConfig(**TRAIN, cuda_graphs=True), said.append)
    assert got[1]["cuda_graphs"] is None and eager_training[1]["cuda_graphs"] is None
    assert sum("--cuda-graphs needs a CUDA device" in m for m in said) == 1
    _assert_same_training(got, want=eager_training)
