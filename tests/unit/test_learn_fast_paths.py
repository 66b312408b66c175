"""learn/fast_paths.py: the training step's fast attention, experts and indexer selection compute what
transformers' eager MiniMaxM3VLForCausalLM computes (logits, gradients, the indexer's KL), dense and under the MSA
top-k mask."""
import copy
import os

import pytest
import torch

os.environ.setdefault("USE_HUB_KERNELS", "0")
pytest.importorskip("transformers")

from m3serve.config import FULL, SPARSE  # noqa: E402
from m3serve.learn.config import learned_config  # noqa: E402
from m3serve.learn.fast_paths import ATTENTION, block_keep  # noqa: E402
from m3serve.learn.train import DenseAttention, IndexerDistill, answer_loss, build_target  # noqa: E402

MICRO = dict(hidden_size=32, head_dim=16, index_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
             index_n_heads=2, intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32,
             num_hidden_layers=3, layer_types=[FULL, SPARSE, SPARSE], mlp_layer_types=["dense", "sparse", "sparse"],
             num_local_experts=4, index_block_size=8, index_topk_blocks=2)


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


@pytest.mark.parametrize("dense", [True, False])
def test_logits_and_gradients_equal_the_eager_models(pair, dense):
    eager, fast, ids, mask = pair
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
        with torch.no_grad(), DenseAttention(m, dense):
            m.model(input_ids=ids)
        kls.append((float(distill.take(real)), distill.last_rows))
        distill.remove()
        assert not hasattr(m.model.layers[1].self_attn, "teacher_sink")
    (ke, re), (kf, rf) = kls
    assert torch.equal(re, rf) and ke > 0
    assert abs(kf - ke) <= 1e-4 * max(1.0, ke), (kf, ke)


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
