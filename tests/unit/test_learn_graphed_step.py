"""The trainer's captured steps (train-learned `--cuda-graphs`) on the CPU: the batches come in a ShapeLadder's few
shapes with every row once per pass; the padding that brings a batch to its rung changes neither the loss nor a
gradient; off the GPU, graphs are refused (GraphedSteps) or fall back to eager steps (the trainer). The captures
themselves are tested against eager steps on the GPU (tests/gpu/test_learned_gpu.py)."""
import copy
import os
import random

import pytest
import torch

os.environ.setdefault("USE_HUB_KERNELS", "0")

from m3serve.learn.loop import ShapeLadder, batches, collate  # noqa: E402


def test_ladder_rungs():
    ladder = ShapeLadder(align=32, ratio=1.25)
    rungs = sorted({ladder.length(n) for n in range(1, 1300)})
    assert rungs[:4] == [32, 64, 96, 128]
    assert all(r % 32 == 0 for r in rungs)
    assert all(b / a <= 1.25 + 32 / a for a, b in zip(rungs, rungs[1:]))  # about `ratio` apart, at least one align
    assert len(rungs) <= 16  # the few shapes there are to capture
    for n in range(1, 1300):
        r = ladder.length(n)
        assert r >= n and (r == 32 or max(x for x in rungs if x < r) < n)  # the lowest rung that holds n


def _rows(n: int, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.choice([rng.randint(5, 60), rng.randint(100, 300)])
        ids = [1000 + i] + [rng.randint(2, 90) for _ in range(length - 1)]  # the first id names the row
        rows.append((ids, [rng.random() < 0.3 for _ in range(length)], i % 5))
    return rows


def test_ladder_batches_take_every_row_once_in_its_rung():
    ladder, tokens = ShapeLadder(align=32, ratio=1.25), 2048
    rows = _rows(300)
    it = batches(rows, tokens, random.Random(1), pad_id=0, group_batches=4, ladder=ladder)
    seen, shapes, n = [], set(), 0
    while n < len(rows):
        ids, mask, real, task = next(it)
        b, s = ids.shape
        shapes.add((b, s))
        assert s == ladder.length(int(real.sum(1).max())) and b == max(1, tokens // s) and task.shape == (b,)
        for r in range(b):
            k = int(real[r].sum())
            if k == 0:  # a padding row: nothing to learn from it
                assert not mask[r].any() and (ids[r] == 0).all() and task[r] == 0
                continue
            row = rows[int(ids[r, 0]) - 1000]
            assert ids[r, :k].tolist() == row[0] and mask[r, :k].tolist() == row[1] and task[r] == row[2]
            assert k == len(row[0]) and not real[r, k:].any() and (ids[r, k:] == 0).all()
            seen.append(int(ids[r, 0]))
            n += 1
    assert sorted(seen) == list(range(1000, 1300))  # one pass: every row once
    assert len(shapes) <= len({ladder.length(len(r[0])) for r in rows})


def _micro():
    pytest.importorskip("transformers")
    from m3serve.learn.config import learned_config
    from m3serve.learn.train import build_target

    from support.learned import MICRO

    return build_target(learned_config(256, 0, 1, **MICRO), torch.device("cpu"), 3)


@pytest.mark.parametrize("dense", [True, False])
def test_ladder_padding_changes_no_loss_or_gradient(dense):
    """Padding columns sit after each row's real tokens (causal: no real query sees them; MSA blocks keep their
    boundaries) and padding rows carry no loss: the step's loss, the indexer's KL and every gradient are the same."""
    from m3serve.learn.step import DenseAttention, IndexerDistill, answer_loss

    model = _micro()
    rows = [([2] + ids[1:], mask, task) for ids, mask, task in _rows(12, seed=2) if len(ids) < 60][:5]
    ladder = ShapeLadder(align=32, ratio=1.25)
    length = ladder.length(max(len(r[0]) for r in rows))
    plain = (*collate(rows, 0), torch.tensor([r[2] for r in rows]))
    task = torch.zeros(8, dtype=torch.long)
    task[:len(rows)] = plain[3]
    padded = (*collate(rows, 0, length, 8), task)
    assert padded[0].shape == (8, length) and length > plain[0].shape[1]
    out = []
    for ids, mask, real, task in (plain, padded):
        m = copy.deepcopy(model)
        distill = IndexerDistill(m, 0)
        distill.enabled = True
        with DenseAttention(m, dense):
            lm, _, _ = answer_loss(m, ids, mask, task, real, 0.25)
        kl = distill.take(real)
        (lm + kl).backward()
        out.append((lm.detach(), kl.detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                                               if p.grad is not None}))
    (lm0, kl0, g0), (lm1, kl1, g1) = out
    torch.testing.assert_close(lm1, lm0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl1, kl0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and any(".indexer." in n for n in g0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_graphed_steps_refuse_the_cpu():
    from m3serve.learn.graphed_step import GraphedSteps
    from m3serve.learn.step import IndexerDistill, RouterBalance, param_groups

    model = _micro()
    groups = param_groups(model, 0.1)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedSteps(model, opt, groups, IndexerDistill(model, 0), RouterBalance(model, 1e-2), torch.device("cpu"),
                     0.25, print)


def test_cuda_graphs_flag_reaches_the_trainer():
    from m3serve.cli import build_parser

    a = build_parser().parse_args(["train-learned", "--out", "x", "--cuda-graphs", "--graph-ladder-ratio", "1.5",
                                   "--profile-steps", "3", "--profile-from", "1500"])
    assert a.cuda_graphs is True and a.graph_ladder_ratio == 1.5
    assert (a.profile_steps, a.profile_from) == (3, 1500)  # a profile of replays of the whole step
