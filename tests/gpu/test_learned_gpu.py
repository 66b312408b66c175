"""The learned model's shape on CUDA (m3serve.learn.config: 32-token MSA blocks, top-4, 64-dim heads; the other
GPU tests run the tiny model's 16-token blocks): the Triton kernels agree with the torch reference at every layer
of every step (the shadow backend, tests/support/shadow.py) on retrieval prompts of ~619 tokens, where the indexer
keeps 4 of ~20 blocks, for each KV cache format. Random weights: only the kernels are under test here."""
from __future__ import annotations

import pytest

from m3serve import LLM, SamplingParams
from m3serve.learn.config import make_learned
from m3serve.learn.render import prompt_ids
from m3serve.learn.tasks import make_examples
from m3serve.model.layers.triton_attention import TritonAttention

from support.shadow import shadow_of

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def learned_random(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("learned_random"))
    make_learned(d)
    return d


@pytest.mark.parametrize("kv", ["bfloat16", "fp8", "nvfp4"])
def test_learned_shape_kernels_shadow(learned_random, kv):
    llm = LLM(model=learned_random, device="cuda", dtype="float32", kv_cache_dtype=kv, max_model_len=1024,
              num_gpu_blocks_override=256, enforce_eager=True)
    runner = llm.engine.executor.worker.runner
    assert all(isinstance(b, TritonAttention) for b in runner.attention)
    shadow = shadow_of(runner, tol=0.05)
    tok = llm.tokenizer
    prompts = [prompt_ids(ex, tok) for ex in make_examples("retrieval", "eval", 3)]
    assert min(map(len, prompts)) > 4 * 32 * 4  # over 4x the span the indexer selects (4 blocks of 32)
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    print(f"{kv}: {shadow.calls} layer calls, {shadow.tokens} token rows, {shadow.flips} near-tie flips, "
          f"max error {shadow.max_err:.3g}")
    assert shadow.calls >= 6 * 16 and shadow.packed_calls == shadow.calls
    assert shadow.flips <= shadow.tokens // 100


def test_grouped_experts_match_every_expert_without_a_host_sync():
    """train-learned `--experts grouped` on CUDA under the training's bf16 autocast: torch's grouped GEMM over the
    picked experts gives the all-experts path's output and gradients (to bf16 rounding), at a token count whose
    groups are not multiples of 16, with an idle expert, and never waits on the host (sync debug mode: an op
    that synchronises raises)."""
    import torch

    from m3serve.learn.fast_paths import experts_all, experts_grouped
    from m3serve.learn.loop import autocast

    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    t, e, k, d, f = 4099, 8, 2, 256, 256
    h = torch.randn(t, d, device=dev, generator=g)
    gate_up = torch.randn(e, 2 * f, d, device=dev, generator=g) * d ** -0.5
    down = torch.randn(e, d, f, device=dev, generator=g) * f ** -0.5
    logits = torch.randn(t, e, device=dev, generator=g)
    logits[:, 6] = -1e4  # expert 6 idle
    weights, index = torch.topk(logits.softmax(-1), k)
    grad = torch.randn(t, d, device=dev, generator=g)
    outs = []
    for fn in (experts_all, experts_grouped):
        leaves = [x.clone().requires_grad_() for x in (h, gate_up, down, weights)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if fn is experts_grouped else "default")
        try:
            with autocast(dev):
                out = fn(leaves[0], index, leaves[3], leaves[1], leaves[2], 1.702, 7.0)
            out.backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append([out.detach().float()] + [x.grad.float() for x in leaves])
    for name, got, want in zip(("out", "h", "gate_up", "down", "weights"), outs[1], outs[0]):
        assert want.norm() > 0 and (got - want).norm() <= 2e-2 * want.norm(), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_rms_norm_matches_transformers_norm(dtype):
    """The fast paths' RMSNorm (torch's rms_norm: fused kernels on CUDA) against transformers' own forward, output and
    gradients, on the residual stream's fp32 and a projection's bf16."""
    import copy

    import torch

    from support.required import require

    require("transformers")
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRMSNorm

    from m3serve.learn.config import learned_config
    from m3serve.learn.train import build_target

    model = build_target(learned_config(2048, 0, 1), torch.device("cuda"), 0)
    fast = model.model.layers[1].input_layernorm
    assert vars(fast)["forward"].__func__.__name__ == "_rms_norm_fused"
    with torch.no_grad():
        fast.weight.normal_(0.0, 0.1)
    ref = copy.deepcopy(fast)
    del ref.forward  # transformers' own
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(4096, 256, device="cuda", generator=g) * 3).to(getattr(torch, dtype))
    grad = torch.randn(4096, 256, device="cuda", generator=g).to(x.dtype)
    outs = []
    for norm in (fast, ref):
        xi = x.clone().requires_grad_()
        y = norm(xi)
        assert y.dtype == x.dtype
        y.backward(grad)
        outs.append((y.float(), xi.grad.float(), norm.weight.grad.float()))
    tol = 1e-5 if dtype == "float32" else 1e-2
    for got, want in zip(*outs):
        assert (got - want).norm() <= tol * want.norm()
    assert type(ref) is MiniMaxM3VLRMSNorm and "forward" not in vars(ref)


@pytest.mark.parametrize("experts", ["all", "grouped"])
def test_graphed_training_steps_match_eager(experts):
    """train-learned `--cuda-graphs` (learn/graphed_step.py): the same steps, captured and replayed, move the learned
    target as eager steps do: two batch shapes, dense and sparse masks, a learning rate that changes every step, the
    indexer distilled on 16 drawn rows (of a batch that is mostly padding too), the MLPs released half-way (the
    graphs dropped and captured again, into a new pool); with either experts path (`--experts`)."""
    import copy
    import random

    import torch

    from support.required import require

    require("transformers")
    from m3serve.learn.config import learned_config
    from m3serve.learn.graphed_step import GraphedSteps
    from m3serve.learn.loop import ShapeLadder, batches
    from m3serve.learn.step import IndexerDistill, RouterBalance, log_record, param_groups, target_step
    from m3serve.learn.train import MlpWarmup, build_target

    dev, tokens, ladder = torch.device("cuda"), 16384, ShapeLadder()
    base = build_target(learned_config(2048, 0, 1), dev, 0, experts=experts)
    g = torch.Generator().manual_seed(0)

    def batch(length: int, real: int = 0):  # one ladder batch of equal rows: 3 of its rows padding, or `real` real
        n = real or ladder.rows(ladder.length(length), tokens) - 3
        rows = [(torch.randint(2, 1500, (length,), generator=g).tolist(), [i >= length // 2 for i in range(length)],
                 r % 5) for r in range(n)]
        return next(batches(rows, tokens, random.Random(0), 0, ladder=ladder))

    # the third: a group's last batch, 4 real rows of 34 (the KL's 16 rows are drawn among the real ones first)
    data = [batch(100), batch(200), batch(400, real=4)]
    plan = [(0, True), (0, True), (1, False), (1, False), (0, True), (1, False),  # the MLPs released after these
            (0, False), (0, False), (1, False), (1, False), (0, False), (1, True), (2, False), (2, False)]

    def train(graphed: bool):
        model = copy.deepcopy(base)
        mlps = MlpWarmup(model, 0.5)
        groups = param_groups(model, 0.1)
        opt = torch.optim.AdamW(groups, lr=torch.tensor(1e-3, device=dev) if graphed else 1e-3, betas=(0.9, 0.95),
                                eps=1e-8, fused=True, capturable=graphed)
        distill, balance = IndexerDistill(model, 16, 11), RouterBalance(model, 1e-2)
        distill.enabled = balance.enabled = True
        graphs = GraphedSteps(model, opt, groups, distill, balance, dev, 0.25, print) if graphed else None
        records = []
        for i, (b, dense) in enumerate(plan):
            if i == 6:
                mlps.release()
                if graphs is not None:
                    graphs.reset("the test releases the MLPs")
            lr = 1e-3 * (1 - i / 24)
            rec = (graphs.step(data[b], lr, dense) if graphs is not None else
                   target_step(model, opt, groups, distill, balance, data[b], lr, dense, dev, 0.25))
            records.append(log_record(rec))
        return model, records, graphs

    eager, eager_log, _ = train(False)
    graphed, graphed_log, graphs = train(True)
    assert graphs.summary() == {"eager": 6, "captures": 5, "replays": 8, "resets": 1, "graphs": 3, "off": None}
    assert all(0 < r["indexer_kl"] < float("inf") for r in eager_log + graphed_log)
    for e, c in zip(eager_log, graphed_log):
        for k in ("loss", "indexer_kl", "grad_norm"):
            assert abs(c[k] - e[k]) <= 2e-2 * max(abs(e[k]), 1e-2), (k, e, c)
    moved = diff = 0.0
    start = dict(base.named_parameters())
    for (name, pe), pc in zip(eager.named_parameters(), graphed.parameters()):
        moved += float((pe - start[name]).float().norm() ** 2)
        diff += float((pc - pe).float().norm() ** 2)
    assert moved > 0 and diff ** 0.5 <= 0.05 * moved ** 0.5, (diff ** 0.5, moved ** 0.5)
    for (name, be), bc in zip(eager.named_buffers(), graphed.buffers()):
        if name.endswith("e_score_correction_bias"):
            # the routers' balancing ran in every replay (steps of 0.01; a near-tie may flip one or two)
            assert bc.abs().sum() > 0 and (bc - be).abs().max() <= 0.041, name


def test_graphed_draft_steps_match_eager():
    """train-learned `--cuda-graphs` trains the DSpark draft from CUDA graphs too (train_draft.DraftSteps): the same
    updates, captured and replayed (the frozen target's forward, the draft's forward and backward, clipping, the fused
    AdamW with a learning rate that changes every step), move the draft as eager ones do; two ladder shapes, one of
    them mostly padding rows."""
    import copy
    import random

    import torch

    from support.required import require

    require("transformers")
    from m3serve.learn.config import learned_config
    from m3serve.learn.loop import ShapeLadder, batches
    from m3serve.learn.train import TrainConfig, build_target
    from m3serve.learn.train_draft import DraftSteps, build_draft, draft_step, with_anchors

    dev, tokens, ladder = torch.device("cuda"), 16384, ShapeLadder()
    cfg = learned_config(2048, 0, 1)
    target = build_target(cfg, dev, 0, experts="grouped").requires_grad_(False).eval()
    tc = TrainConfig(out="unused", device="cuda")
    base = build_draft(target, cfg, tc, 2000, dev)
    g = torch.Generator().manual_seed(0)

    def batch(length: int, real: int = 0):  # a ladder batch of equal rows, the second half of each the answer
        n = real or ladder.rows(ladder.length(length), tokens) - 3
        rows = [(torch.randint(2, 1500, (length,), generator=g).tolist(), [i >= length // 2 for i in range(length)],
                 r % 5) for r in range(n)]
        return next(with_anchors(batches(rows, tokens, random.Random(0), 0, ladder=ladder), tc.draft_anchors,
                                 random.Random(length)))

    data = [batch(100), batch(300, real=5)]
    plan = [0, 0, 1, 1, 0, 1, 0, 1]

    def train(graphed: bool):
        draft = copy.deepcopy(base)
        params = list(draft.parameters())
        opt = torch.optim.AdamW(params, lr=torch.tensor(1e-3, device=dev) if graphed else 1e-3, betas=(0.9, 0.95),
                                weight_decay=0.0, fused=True, capturable=graphed)
        graphs = DraftSteps(draft, target, params, opt, dev, print) if graphed else None
        losses = []
        for i, b in enumerate(plan):
            lr = 1e-3 * (1 - i / 16)
            out = (graphs.step(data[b], lr) if graphs is not None else
                   draft_step(draft, target, params, opt, data[b], lr, dev))
            losses.append({k: float(out[k]) for k in ("loss", "ce", "tv", "bce")})
        return draft, losses, graphs

    eager, eager_log, _ = train(False)
    graphed, graphed_log, graphs = train(True)
    assert graphs.summary() == {"eager": 2, "captures": 2, "replays": 6, "resets": 0, "graphs": 2, "off": None}
    for e, c in zip(eager_log, graphed_log):
        for k in e:
            assert abs(c[k] - e[k]) <= 2e-2 * max(abs(e[k]), 1e-2), (k, e, c)
    moved = diff = 0.0
    for pb, pe, pc in zip(base.parameters(), eager.parameters(), graphed.parameters()):
        moved += float((pe - pb).float().norm() ** 2)
        diff += float((pc - pe).float().norm() ** 2)
    assert moved > 0 and diff ** 0.5 <= 0.05 * moved ** 0.5, (diff ** 0.5, moved ** 0.5)
