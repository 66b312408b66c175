"""`m3serve train-learned` on a micro config (CPU, under a minute): training on a few rows lowers the answer loss
until the model answers most of them, and the engine's greedy replies are right exactly where the teacher-forced
exact match says so; the trained indexer follows the attention better than its initial one; the saved checkpoint's
greedy tokens in the engine equal transformers' on it; the trained draft loads in the engine and speculative greedy
decoding reproduces plain decoding; batching, packing, the experts-path fallback."""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import tarfile

import pytest
import torch
import torch.nn.functional as F

from support.required import require

transformers = require("transformers")
from transformers import MiniMaxM3VLForCausalLM  # noqa: E402

from m3serve import LLM, SamplingParams  # noqa: E402
from m3serve.learn.config import learned_config  # noqa: E402
from m3serve.learn.render import prompt_ids  # noqa: E402
from m3serve.learn.tasks import TASKS as TASKS_ALL  # noqa: E402
from m3serve.learn.tasks import make_examples, retrieval_follow_ups  # noqa: E402
from m3serve.learn.tokenizer import build_tokenizer  # noqa: E402
from m3serve.learn.step import DenseAttention, IndexerDistill, answer_loss  # noqa: E402
from m3serve.learn.train import (MlpWarmup, SparseRamp, TrainConfig,  # noqa: E402
                                 batches, build_target, collate, exact_match, fresh_init, keep_better,
                                 load_weights, make_rows, mlp_parameters, pack,
                                 pick_experts_implementation, save_target, train_target)
from m3serve.learn.train_draft import (MASK_TOKEN, build_draft, draft_step, tap_layers,  # noqa: E402
                                       train_and_save_draft, with_anchors)
from m3serve.text.tokenizer import Tokenizer  # noqa: E402

from support.learned import MICRO_2L as MICRO  # noqa: E402

TASKS = ("arithmetic", "multi_turn")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("learned") / "model")
    tc = TrainConfig(out=out, device="cpu", tasks=TASKS, train_examples=4, eval_examples=6, workers=1,
                     tokens_per_batch=4096, max_steps=60, warmup_steps=5, lr=1e-2, dense_frac=0.3, log_every=10,
                     draft_max_steps=3, draft_tokens_per_batch=1024, draft_anchors=4, model_overrides=MICRO,
                     profile_steps=3)
    tok = build_tokenizer(out)
    cfg = learned_config(-(-tok["vocab_size"] // 64) * 64, tok["bos_token_id"], tok["eos_token_id"], **MICRO)
    rows = make_rows(out, TASKS, "train", tc.train_examples, 0)
    eval_rows = make_rows(out, TASKS, "eval", tc.eval_examples, 1)
    model = build_target(cfg, torch.device("cpu"), 0)
    fresh_init(model, tc.init, 0, tc.mlp_warmup_frac > 0)  # as `run` starts a fresh target
    pad = tok["eos_token_id"]
    far = float("inf")
    target = train_target(model, rows, tc, torch.device("cpu"), far, pad, lambda _msg: None)
    save_target(model, cfg, out)
    draft = train_and_save_draft(model, cfg, rows, eval_rows, tc, torch.device("cpu"), far, pad,
                                 os.path.join(out, "dspark"), lambda _msg: None)
    return dict(out=out, tc=tc, target=target, draft=draft, model=model, rows=rows, eval_rows=eval_rows, pad=pad,
                cfg=cfg)


def test_training_lowers_the_losses(trained):
    curve = trained["target"]["curve"]
    # the ramp runs from step index 18 (0.3 x 60) over 0.15 x 60 = 9 steps: logged at steps 1, 10, 20 .. 60
    assert trained["target"]["steps"] == 60 and trained["target"]["sparse_from_step"] == 18
    assert trained["target"]["mlps_from_step"] == 15  # 0.25 x 60: the MLPs learn from there
    assert trained["target"]["sparse_full_from_step"] == 27
    phases = [r["phase"] for r in curve]
    assert phases[:2] == ["dense"] * 2 and phases[3:] == ["sparse"] * 4, phases
    assert all(set(r["task_loss"]) <= set(TASKS) and r["task_loss"] for r in curve)
    prof = trained["target"]["profile"]  # 3 profiled steps: the ops a step spends its time in
    assert prof and all(p["calls"] >= 1 and p["ms_per_step"] >= 0 for p in prof)
    assert any("mm" in p["op"] or "matmul" in p["op"] or "linear" in p["op"] for p in prof)
    first, last = curve[0], curve[-1]
    assert last["loss"] < 0.2 * first["loss"], (first, last)
    assert all(r["indexer_kl"] >= 0 for r in curve)
    assert trained["draft"]["steps"] == 3
    assert {"loss", "ce", "tv", "bce"} <= set(trained["draft"]["curve"][0])
    acc = trained["draft"]["eval"]["all"]
    assert len(acc["alpha"]) == 7 and acc["blocks"] > 0


def _dense_indexer_kl(model, ids, real, rows: int = 0, seed: int = 0) -> tuple[float, torch.Tensor | None]:
    distill = IndexerDistill(model, rows, seed)
    distill.enabled = True
    distill.select(real, ids.device)
    with torch.no_grad(), DenseAttention(model):
        model.model(input_ids=ids)
    distill.remove()
    return float(distill.take(real)), distill.last_rows


def test_the_indexer_kl_on_a_sample_of_rows_is_the_kl_of_those_rows(trained):
    """distill_rows: the KL of a forward over the whole batch, taken on 3 random rows, equals the KL of a forward
    over just those rows (rows are independent), and another seed picks other rows."""
    ids, _, real = collate(trained["eval_rows"][-8:], trained["pad"])
    model = trained["model"]
    kl, rows = _dense_indexer_kl(model, ids, real, rows=3, seed=1)
    assert rows is not None and len(rows) == 3
    alone, none = _dense_indexer_kl(model, ids[rows], real[rows])
    assert none is None and abs(kl - alone) < 1e-4 * max(1.0, alone), (kl, alone)
    assert not torch.equal(_dense_indexer_kl(model, ids, real, rows=3, seed=2)[1], rows)
    whole, _ = _dense_indexer_kl(model, ids, real)
    assert abs(whole - kl) > 1e-6  # the sample is not the whole batch
    with pytest.raises(ValueError, match="distill_rows"):
        IndexerDistill(model, rows=-1)


def test_the_indexer_kl_sample_is_drawn_from_the_rows_with_a_real_token(trained):
    """A ShapeLadder's batch (--cuda-graphs) is filled with padding rows where a group's rows ran out. The KL's
    sample is drawn among the rows that hold a real token (all of them, then padding, where there are fewer), and a
    sample without a real position gives 0, not 0 / 0: drawn from every row, run 15's samples were all padding often
    enough that the KL went NaN at step ~260 and its NaN gradients emptied the indexer for the rest of the run."""
    model = trained["model"]
    ids, _, real = collate(trained["eval_rows"][-2:], trained["pad"], n_rows=10)  # 2 real rows, 8 of padding
    alone, _ = _dense_indexer_kl(model, ids[:2], real[:2])
    for seed in range(20):  # drawn from all 10 rows, 56 in 120 samples of 3 would hold neither real row
        kl, rows = _dense_indexer_kl(model, ids, real, rows=3, seed=seed)
        assert len(rows) == 3 and {0, 1} <= set(rows.tolist()), rows
        assert math.isfinite(kl) and abs(kl - alone) < 1e-4 * max(1.0, alone), (kl, alone)  # padding weighs nothing
    ids, _, real = collate(trained["eval_rows"][-6:], trained["pad"], n_rows=12)
    picked = [_dense_indexer_kl(model, ids, real, rows=3, seed=seed)[1] for seed in range(20)]
    assert all(set(r.tolist()) <= set(range(6)) for r in picked)  # real rows only where there are enough
    assert len({tuple(r.tolist()) for r in picked}) > 1
    distill = IndexerDistill(model, rows=3)
    distill.kls, distill.sel = [torch.rand(3, 2, ids.shape[1])], torch.tensor([7, 8, 10])  # padding rows only
    assert float(distill.take(real)) == 0.0
    distill.remove()


def test_the_draft_step_ignores_a_ladder_batchs_padding(trained):
    """--cuda-graphs: the draft's batches come in a ShapeLadder's shapes too (train_draft.DraftSteps), right-padded
    and filled with padding rows. A padding row gets no anchor, and the padding changes neither the draft's losses nor
    its update: one draft step on the batch as it is and on its ladder copy move the draft alike."""
    from m3serve.learn.loop import ShapeLadder

    rows = [r for r in trained["rows"] if sum(r[1]) >= 2][:5]
    pad, tc, model = trained["pad"], trained["tc"], trained["model"]
    length = ShapeLadder().length(max(len(r[0]) for r in rows)) + 32
    plain, padded = (collate(rows, pad), collate(rows, pad, length, 8))
    outs, drafts = [], []
    for ids, mask, real in (plain, padded):
        batch = next(with_anchors(iter([(ids, mask, real, None)]), tc.draft_anchors, random.Random(3)))
        if ids.shape[0] == 8:
            assert not batch[3][5:].any() and batch[3][:5].any()  # padding rows: no anchor
        draft = build_draft(model, trained["cfg"], tc, Tokenizer.from_pretrained(trained["out"]).token_id(MASK_TOKEN),
                            torch.device("cpu"))
        params = list(draft.parameters())
        opt = torch.optim.SGD(params, lr=1.0)  # the update is the gradient (Adam's would blow up rounding)
        outs.append(draft_step(draft, model, params, opt, batch, 1.0, torch.device("cpu")))
        drafts.append(draft)
    for k in ("loss", "ce", "tv", "bce"):
        torch.testing.assert_close(outs[1][k], outs[0][k], rtol=1e-4, atol=1e-6, msg=k)
    assert int(outs[0]["ok"].sum()) == int(outs[1]["ok"].sum()) > 0
    moved = 0.0
    for (name, p0), p1, p in zip(drafts[0].named_parameters(), drafts[1].parameters(),
                                 build_draft(model, trained["cfg"], tc, 0, torch.device("cpu")).parameters()):
        torch.testing.assert_close(p1 - p, p0 - p, rtol=1e-3, atol=1e-6, msg=name)
        moved += float((p0 - p).detach().norm())
    assert moved > 0


def test_indexer_learns_the_attention(trained):
    """Same trained backbone, same batch: the trained indexer's KL to the dense attention is well below the KL of
    the indexer it started from."""
    model = trained["model"]
    untrained = copy.deepcopy(model)
    fresh = build_target(trained["cfg"], torch.device("cpu"), 0)
    untrained.load_state_dict({k: v for k, v in fresh.state_dict().items() if ".indexer." in k}, strict=False)
    ids, _, real = collate(trained["eval_rows"][-8:], trained["pad"])
    kl_trained, kl_start = _dense_indexer_kl(model, ids, real)[0], _dense_indexer_kl(untrained, ids, real)[0]
    assert kl_trained < 0.8 * kl_start, (kl_trained, kl_start)


def test_engine_greedy_equals_transformers_and_dspark(trained):
    out = trained["out"]
    tok = Tokenizer.from_pretrained(out)
    prompts = [prompt_ids(e, tok) for task in TASKS for e in make_examples(task, "eval", 1, seed=5)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    hf = MiniMaxM3VLForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            gen = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            want.append(gen[0, len(p):].tolist())
    with LLM(model=out, device="cpu", dtype="float32") as llm:
        got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    spec = {"method": "dspark", "num_speculative_tokens": 7}
    with LLM(model=out, device="cpu", dtype="float32", speculative_config=spec) as llm:
        drafted = [o.token_ids for o in llm.generate(prompts, sp)]
    assert drafted == got  # greedy DSpark is lossless with the trained draft loaded


def test_engine_answers_where_teacher_forcing_says_so(trained):
    """The 8 training problems, memorised: teacher-forced exact match (on the reloaded checkpoint) is high, and the
    engine's greedy replies pass each example's check on exactly as many problems per task."""
    out = trained["out"]
    hf = MiniMaxM3VLForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    em = exact_match(hf, trained["rows"], torch.device("cpu"), trained["pad"], 4096)
    assert sum(em.values()) / len(em) >= 0.75, em
    tok = Tokenizer.from_pretrained(out)
    examples = [e for task in TASKS for e in make_examples(task, "train", 4, seed=0)]  # the rows' problems
    with LLM(model=out, device="cpu", dtype="float32") as llm:
        replies = llm.generate([prompt_ids(e, tok) for e in examples], SamplingParams(max_tokens=16, temperature=0))
    for task in TASKS:
        ok = [e.check(r.text) for e, r in zip(examples, replies) if e.task == task]
        assert sum(ok) / len(ok) == em[task], (task, ok, em)


def test_saved_weights_are_the_trained_ones(trained):
    """The checkpoint holds the trained model (exact match on the eval rows is the same after reloading)."""
    model = trained["model"]
    hf = MiniMaxM3VLForCausalLM.from_pretrained(trained["out"], dtype=torch.float32).eval()
    ours = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    for k, v in hf.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), ours[k]), k
    em = exact_match(model, trained["eval_rows"], torch.device("cpu"), trained["pad"], 4096)
    assert set(em) == set(TASKS)


def test_batches_fit_the_token_budget():
    rows = [([1] * n, [0] * (n - 2) + [1, 1], 0) for n in (5, 40, 17, 90, 33, 8, 61, 2, 300)]
    it = batches(rows, 128, random.Random(0), pad_id=7, group_batches=1)
    seen = []
    while len(seen) < len(rows):  # the first pass
        ids, mask, real, task = next(it)
        assert task.tolist() == [0] * ids.shape[0]
        assert ids.numel() <= 128 or ids.shape[0] == 1
        assert ids.shape[1] == int(real.sum(-1).max())  # padded to the batch's longest row only
        assert bool((ids[~real] == 7).all()) and not bool((mask & ~real).any())
        seen += real.sum(-1).tolist()
    assert sorted(seen) == sorted(len(r[0]) for r in rows)  # every row exactly once


def test_long_rows_do_not_make_most_batches():
    """A few long rows among many short ones (retrieval among the other tasks) share the pass's batches with the
    rest: a pass takes about as many steps as its tokens fill, part-filled batches (a group's tail) are few (groups
    of 256 rows took 1.9 times the steps here, a third of them part-filled)."""
    rng = random.Random(1)
    rows = [([1] * n, [1] * n, int(n > 500)) for n in
            (rng.choice([1000, 1200]) if rng.random() < 0.02 else rng.randint(60, 140) for _ in range(20000))]
    it = batches(rows, 20000, random.Random(0), pad_id=0)
    sizes, seen = [], 0
    while seen < len(rows):  # the first pass
        ids, _, real, _ = next(it)
        sizes.append(ids.numel())
        seen += ids.shape[0]
    assert seen == len(rows)
    assert len(sizes) <= 1.2 * sum(len(r[0]) for r in rows) / 20000, len(sizes)
    assert sum(s < 10000 for s in sizes) <= len(sizes) / 10, sizes


def test_rows_added_meanwhile_join_the_next_pass():
    """FreshRows appends to the list batches() reads: the next pass takes the new rows too."""
    rows = [([1] * 4, [1] * 4, 0) for _ in range(6)]
    it = batches(rows, 64, random.Random(0), pad_id=0)
    seen = 0
    while seen < 6:
        seen += next(it)[0].shape[0]
    assert seen == 6
    rows.extend([([1] * 4, [1] * 4, 1) for _ in range(6)])  # arrive during the first pass's last batch
    tasks = []
    while len(tasks) < 12:
        tasks += next(it)[3].tolist()
    assert sorted(tasks) == [0] * 6 + [1] * 6


def test_pack_reassembles(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    payload = os.urandom(2_500_000)
    (src / "w.bin").write_bytes(payload)
    names = pack(str(src), str(tmp_path / "out"), part_bytes=1 << 20)
    assert names == ["part-aa", "part-ab", "part-ac"]
    joined = tmp_path / "all.tar"
    joined.write_bytes(b"".join((tmp_path / "out" / n).read_bytes() for n in names))
    with tarfile.open(joined) as tar:
        tar.extractall(tmp_path / "x")
    assert (tmp_path / "x" / "m" / "w.bin").read_bytes() == payload


def test_tap_layers():
    assert tap_layers(6) == [1, 3, 4]  # never the last layer (post-norm in HF's convention)
    assert tap_layers(4) == [1, 2] and tap_layers(3) == [1] and tap_layers(2) == [-1]


def test_cli_parses_train_options():
    from m3serve.cli import build_parser

    a = build_parser().parse_args(["train-learned", "--out", "x", "--budget-s", "30", "--tasks", "arithmetic",
                                   "--model-overrides", '{"hidden_size": 64}'])
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    tc = TrainConfig(**{k: v for k, v in vars(a).items() if k in fields and v is not None})
    assert tc.budget_s == 30.0 and tc.tasks == ["arithmetic"] and tc.model_overrides == {"hidden_size": 64}
    assert tc.lr == TrainConfig.lr  # options not given keep the defaults
    assert tc.compile is False and tc.experts == "all"
    assert build_parser().parse_args(["train-learned", "--out", "x", "--experts", "grouped"]).experts == "grouped"
    flags = [build_parser().parse_args(["train-learned", "--out", "x", *f]).compile
             for f in ([], ["--compile"], ["--no-compile"])]
    assert flags == [None, True, False]  # None: TrainConfig's default


def test_grouped_experts_fall_back_to_every_expert(monkeypatch, trained):
    """`--experts grouped` whose weights' gradient fails (as a device's grouped GEMM might): the probe asks for every
    gradient, frozen MLPs included (they are released later in the run), so it finds the failure and the run
    trains with the all-experts path."""
    from m3serve.learn import fast_paths

    class WeightGradFails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, gate_up):
            return h.clone()

        @staticmethod
        def backward(ctx, g):
            if ctx.needs_input_grad[1]:
                raise RuntimeError("no grouped GEMM for this weight's gradient")
            return g, None

    def grouped(h, index, weights, gate_up, down, alpha, limit):
        return fast_paths.experts_all(WeightGradFails.apply(h, gate_up), index, weights, gate_up, down, alpha, limit)

    monkeypatch.setitem(fast_paths.EXPERTS, "grouped", grouped)
    model = build_target(trained["cfg"], torch.device("cpu"), 0, experts="grouped")
    for p in mlp_parameters(model):
        p.requires_grad_(False)  # MlpWarmup's frozen MLPs
    ids, mask, _ = collate(trained["eval_rows"][:2], trained["pad"])
    said = []
    assert pick_experts_implementation(model, ids, mask, torch.device("cpu"), said.append) == "fast_paths 'all'"
    assert "'grouped' failed" in said[0] and fast_paths.experts_path(model) == "all"
    assert all(p.grad is None for p in model.parameters())
    assert not any(p.requires_grad for p in mlp_parameters(model))  # still frozen
    said.clear()
    fast_paths.set_experts(model, "all")
    assert pick_experts_implementation(model, ids, mask, torch.device("cpu"), said.append) == "fast_paths 'all'"
    assert said == []  # the path that runs everywhere is not tried


def test_experts_implementation_falls_back_to_the_loop(monkeypatch, trained):
    """A grouped-GEMM experts path that fails (e.g. a dtype a device's kernel lacks) is replaced by the loop."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    def broken(*args, **kwargs):
        raise RuntimeError("no grouped_mm kernel for this dtype")

    model = build_target(trained["cfg"], torch.device("cpu"), 0, fast=False)  # transformers' own experts
    model.set_experts_implementation("grouped_mm")
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "grouped_mm", broken)
    ids, mask, _ = collate(trained["eval_rows"][:2], trained["pad"])
    said = []
    assert pick_experts_implementation(model, ids, mask, torch.device("cpu"), said.append) == "eager"
    assert "failed" in said[0] and model.config._experts_implementation == "eager"
    assert all(p.grad is None for p in model.parameters())
    answer_loss(model, ids, mask)  # runs


def test_a_failing_step_stops_training_and_keeps_the_last_good_weights(monkeypatch, trained):
    import m3serve.learn.step as step

    model = build_target(trained["cfg"], torch.device("cpu"), 1)
    calls, real_loss = [], step.answer_loss

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:  # steps 0 and 1 run; step 2 fails (the fast experts need no probe of their path)
            raise RuntimeError("device-side assert (simulated)")
        return real_loss(*args)

    monkeypatch.setattr(step, "answer_loss", flaky)
    tc = dataclasses.replace(trained["tc"], max_steps=10, log_every=1)
    said = []
    out = train_target(model, trained["rows"], tc, torch.device("cpu"), float("inf"), trained["pad"], said.append)
    assert out["steps"] == 2 and out["stopped_by"].startswith("RuntimeError")
    assert any("step 2 failed" in m for m in said)
    assert all(p.grad is None for p in model.parameters())  # no half-accumulated gradients left behind


def test_a_non_finite_loss_stops_the_run_at_its_logged_step(monkeypatch, trained):
    """A NaN that reaches the gradients empties what it reaches (run 15's indexer KL: 2,250 steps went on with an
    indexer that selected nothing useful, and only the final eval showed it): the first logged step whose loss,
    indexer KL or gradient norm is not finite stops the run, and the reason is its `stopped_by`."""
    import m3serve.learn.step as step

    model = build_target(trained["cfg"], torch.device("cpu"), 1)
    real_take, calls = step.IndexerDistill.take, []

    def nan_from_step_5(self, real):
        calls.append(1)
        kl = real_take(self, real)
        return kl * float("nan") if len(calls) >= 5 else kl

    monkeypatch.setattr(step.IndexerDistill, "take", nan_from_step_5)
    tc = dataclasses.replace(trained["tc"], max_steps=20, log_every=3)
    said = []
    out = train_target(model, trained["rows"], tc, torch.device("cpu"), float("inf"), trained["pad"], said.append)
    assert out["steps"] == 6 and out["stopped_by"] == "non-finite indexer_kl at step 6", out["stopped_by"]
    assert any("non-finite indexer_kl at step 6; stopping here" in m for m in said)


def test_out_of_memory_halves_the_batches_and_runs_the_step_again(monkeypatch, trained):
    """A step that runs out of memory is run again on batches of half the tokens (not counted, no gradient left
    over); below MIN_TOKENS_PER_BATCH the run stops with the last good weights."""
    import m3serve.learn.step as step
    import m3serve.learn.train as train

    model = build_target(trained["cfg"], torch.device("cpu"), 1)
    sizes, real_loss = [], step.answer_loss

    def big_batches_fail(model, ids, *args):
        sizes.append(ids.numel())
        if ids.numel() > 600:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_loss(model, ids, *args)

    monkeypatch.setattr(step, "answer_loss", big_batches_fail)
    monkeypatch.setattr(train, "MIN_TOKENS_PER_BATCH", 256)
    tc = dataclasses.replace(trained["tc"], max_steps=6, log_every=1, tokens_per_batch=4096)
    said = []
    out = train_target(model, trained["rows"], tc, torch.device("cpu"), float("inf"), trained["pad"], said.append)
    assert out["steps"] == 6 and out["stopped_by"] == "steps" and out["tokens_per_batch"] < 4096
    assert sum("going on with" in m for m in said) >= 1 and max(sizes[-6:]) <= 600, sizes
    monkeypatch.setattr(train, "MIN_TOKENS_PER_BATCH", 4096)
    said = []
    out = train_target(model, trained["rows"], tc, torch.device("cpu"), float("inf"), trained["pad"], said.append)
    assert out["steps"] == 0 and out["stopped_by"].startswith("OutOfMemoryError")
    assert all(p.grad is None for p in model.parameters())


def test_the_sparse_ramp_rises_from_dense_to_sparse():
    ramp = SparseRamp(TrainConfig(out="-", sparse_ramp_frac=0.25), random.Random(0))
    assert all(ramp.dense(i) for i in range(50))  # before begin: dense
    ramp.begin(100, 400)  # 100 ramp steps
    assert ramp.full == 200
    share = [sum(not ramp.dense(s) for s in range(a, a + 25)) / 25 for a in (100, 175)]
    assert share[0] < 0.35 and share[1] > 0.65, share  # the sparse share rises along the ramp
    assert not any(ramp.dense(s) for s in range(200, 260))


def test_the_retrieval_first_phase_trains_on_short_retrieval_then_every_task(trained):
    """RetrievalFirst: the first focus_frac of the planned steps take their batches from the short retrieval rows
    only (2 to focus_max_pairs pairs), the probe runs once when the phase ends, then the other rows train; a logged
    accuracy at focus_until_acc ends the phase early."""
    focus_rows = make_rows(trained["out"], ("retrieval",), "train", 6, 3, workers=1, packed={"retrieval": 4},
                           max_pairs=4)
    retrieval = TASKS_ALL.index("retrieval")
    assert focus_rows and all(r[2] == retrieval for r in focus_rows)
    tc = dataclasses.replace(trained["tc"], max_steps=10, log_every=1, focus_frac=0.4, focus_until_acc=1.1,
                             profile_steps=0)
    probes = []
    model = build_target(trained["cfg"], torch.device("cpu"), 2)

    def probe():  # a real forward between two steps (with the distillation's and the balance's hooks in place)
        probes.append(exact_match(model, trained["eval_rows"][:4], torch.device("cpu"), trained["pad"], 4096))
        return {"eval_retrieval": 0.5}

    out = train_target(model, trained["rows"], tc, torch.device("cpu"), float("inf"), trained["pad"],
                       lambda _m: None, focus_rows, probe)
    curve = out["curve"]  # logged at steps 1..10; steps 0-3 (0.4 x 10) are the phase's
    assert [bool(r.get("retrieval_first")) for r in curve] == [True] * 4 + [False] * 6
    assert all(set(r["task_loss"]) == {"retrieval"} for r in curve[:4])
    assert all("retrieval" not in r["task_loss"] for r in curve[4:])
    assert out["retrieval_first"] == {"step": 4, "by": "steps", "probe": {"eval_retrieval": 0.5}}
    assert len(probes) == 1 and out["stopped_by"] == "steps" and out["steps"] == 10
    early = dataclasses.replace(tc, focus_until_acc=0.0)  # any accuracy ends it at the first logged step
    out = train_target(model, trained["rows"], early, torch.device("cpu"), float("inf"), trained["pad"],
                       lambda _m: None, focus_rows)
    assert out["retrieval_first"] == {"step": 1, "by": "accuracy"}
    assert [bool(r.get("retrieval_first")) for r in out["curve"]] == [True] + [False] * 9
    none = train_target(model, trained["rows"], early, torch.device("cpu"), float("inf"), trained["pad"],
                        lambda _m: None)
    assert none["retrieval_first"] is None and not any(r.get("retrieval_first") for r in none["curve"])


def test_keep_better_keeps_the_weights_that_answer_better(trained):
    model, rows, pad = trained["model"], trained["rows"], trained["pad"]  # rows it was trained on: it answers some
    good = {k: v.clone() for k, v in model.state_dict().items()}
    score = exact_match(model, rows, torch.device("cpu"), pad, 4096)
    assert sum(score.values()) > 0, score
    torch.manual_seed(5)
    noise = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in good.items()}
    try:
        for final, snap, kept in ((noise, good, "dense_phase_end"), (good, noise, "final")):
            model.load_state_dict(final)
            model.dense_snapshot = {k: v.clone() for k, v in snap.items()}
            out = keep_better(model, rows, torch.device("cpu"), pad, 4096, lambda _m: None)
            assert out["kept"] == kept, out
            assert all(torch.equal(model.state_dict()[k], good[k]) for k in good)
            assert model.dense_snapshot is None
    finally:
        model.load_state_dict(good)



def test_packed_rows_hold_several_problems_each_prompt_as_the_engine_builds_it(tmp_path):
    """A packed training row is a chat of several problems: the loss covers exactly each answer and its end-of-turn
    token, and the tokens before each answer are the chat template's prompt over the conversation so far."""
    out = str(tmp_path / "tok")
    build_tokenizer(out)
    tok = Tokenizer.from_pretrained(out)
    for task, per_row in (("arithmetic", 4), ("retrieval", 3)):
        n = per_row if task == "arithmetic" else 1
        (ids, mask, _), = make_rows(out, (task,), "train", n, 0, workers=1, packed={task: per_row})
        problems = make_examples(task, "train", n, seed=0)  # chunk 0 of seed 0
        turns = ([(e.messages[-1]["content"], e.answer) for e in problems[1:]] if task == "arithmetic" else
                 retrieval_follow_ups(problems[0], per_row - 1, random.Random(0)))
        first = problems[0]
        messages = list(first.messages)
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        assert len(starts) == per_row and not mask[0]
        for k, s in enumerate(starts):
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             **first.chat_template_kwargs)
            assert prompt == ids[:s], (task, k)
            answer = first.answer if k == 0 else turns[k - 1][1]
            target = tok.encode(answer) + [tok.eos_token_id]
            assert ids[s:s + len(target)] == target and all(mask[s:s + len(target)]), (task, k)
            assert not any(mask[s + len(target):(starts + [len(mask)])[k + 1]]), (task, k)
            messages += [{"role": "assistant", "content": answer}] + (
                [{"role": "user", "content": turns[k][0]}] if k < len(turns) else [])
        assert len(ids) == starts[-1] + len(target)


def test_a_run_can_start_from_an_earlier_checkpoint(trained, tmp_path):
    fresh = build_target(trained["cfg"], torch.device("cpu"), seed=99)
    load_weights(fresh, trained["out"], trained["out"])
    saved = MiniMaxM3VLForCausalLM.from_pretrained(trained["out"], dtype=torch.float32).state_dict()
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
    other = tmp_path / "other"
    build_tokenizer(str(other), seed=5)
    with pytest.raises(ValueError, match="tokenizer differs"):
        load_weights(fresh, trained["out"], str(other))


def test_packed_rows_fall_back_to_whole_prompts_where_the_text_is_not_as_predicted(tmp_path, monkeypatch):
    """render_turns tokenizes only each turn's new text; a tokenizer whose row text it mispredicts (here an
    end-of-turn token whose text is not what the template writes) gets the rows that tokenizing every prompt whole
    gives."""
    from m3serve.learn import render as R

    out = str(tmp_path / "tok")
    build_tokenizer(out)
    tok = Tokenizer.from_pretrained(out)
    problems = make_examples("arithmetic", "train", 4, seed=0)
    turns = [(e.messages[-1]["content"], e.answer) for e in problems[1:]]
    whole = R._render_turns_whole(problems[0], turns, tok)
    assert R.render_turns(problems[0], turns, tok) == whole and sum(whole[1]) > 3 * len(turns)
    tok.eos_token = tok.eos_token + " "  # mispredicted: the fast path's text no longer prefixes the next prompt
    calls, real = [], R._render_turns_whole
    monkeypatch.setattr(R, "_render_turns_whole", lambda *a: calls.append(1) or real(*a))
    assert R.render_turns(problems[0], turns, tok) == whole and calls == [1]


def test_the_prompt_loss_adds_its_share_of_the_other_real_tokens(trained):
    """prompt_weight w: the loss is the answers' mean cross-entropy plus w x the mean over the other real tokens
    (padding and answers excluded); w = 0 leaves the answer loss alone."""
    model = trained["model"]
    ids, mask, real = collate(trained["eval_rows"][:4], trained["pad"])
    task = torch.zeros(len(ids), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
        ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        ans, other = mask[:, 1:], real[:, 1:] & ~mask[:, 1:]
        assert 0 < other.sum() < real.sum() - ans.sum()
        total, _, stats = answer_loss(model, ids, mask, task, real, prompt_weight=0.25)
        alone, _, stats0 = answer_loss(model, ids, mask, task, real, prompt_weight=0.0)
    torch.testing.assert_close(stats["answer"], ce[ans].mean())
    torch.testing.assert_close(stats["prompt"], ce[other].mean())
    torch.testing.assert_close(total, ce[ans].mean() + 0.25 * ce[other].mean())
    torch.testing.assert_close(alone, ce[ans].mean())
    assert "prompt" not in stats0


@pytest.mark.parametrize("field, value, match", [("prompt_loss_weight", -0.5, "prompt_loss_weight"),
                                                 ("prompt_loss_weight", float("nan"), "prompt_loss_weight"),
                                                 ("tokens_per_batch", 100, "tokens_per_batch"),
                                                 ("tokens_per_batch", -1, "tokens_per_batch"),
                                                 ("workers", -2, "workers"), ("max_rows", -1, "max_rows"),
                                                 ("init", "xavier", "init must be one of"),
                                                 ("min_lr_ratio", -0.1, "min_lr_ratio"),
                                                 ("min_lr_ratio", float("nan"), "min_lr_ratio"),
                                                 ("mlp_warmup_frac", 1.0, "mlp_warmup_frac"),
                                                 ("mlp_warmup_frac", -0.1, "mlp_warmup_frac"),
                                                 ("focus_frac", 1.0, "focus_frac"),
                                                 ("focus_max_pairs", 1, "focus_max_pairs"),
                                                 ("focus_max_pairs", 500, "focus_max_pairs"),
                                                 ("focus_recital", "yes", "focus_recital must be one of"),
                                                 ("experts", "loop", "experts must be one of"),
                                                 ("graph_ladder_ratio", float("nan"), "graph_ladder_ratio"),
                                                 ("graph_ladder_ratio", float("inf"), "graph_ladder_ratio"),
                                                 ("graph_ladder_ratio", 0.5, "graph_ladder_ratio")])
def test_a_bad_training_option_is_refused_before_any_work(tmp_path, field, value, match):
    from m3serve.learn.train import run

    tc = TrainConfig(out=str(tmp_path / "m"), device="cpu", tasks=TASKS, train_examples=2, **{field: value})
    with pytest.raises(ValueError, match=match):
        run(tc)
    assert not os.path.exists(os.path.join(tc.out, "model.safetensors"))


def test_a_fresh_target_starts_at_the_fan_in_scale_with_silent_mlps(trained):
    """init 'fan_in': each matrix N(0, 1 / (3 fan_in)), the embedding N(0, 1), the indexer as transformers drew it;
    silent MLPs: every down projection zero. 'transformers' keeps transformers' own draw."""
    cfg = trained["cfg"]
    built = build_target(cfg, torch.device("cpu"), seed=4)
    reference = copy.deepcopy(built.state_dict())
    fresh_init(built, "fan_in", seed=4, silent_mlps=True)
    for name, w in built.named_parameters():
        if ".indexer." in name or w.ndim < 2:
            assert torch.equal(w, reference[name]), name
        elif "down_proj" in name and ".mlp." in name:
            assert not w.any(), name
        else:
            want = 1.0 if "embed_tokens" in name else (3 * w.shape[-1]) ** -0.5
            assert abs(w.std().item() / want - 1) < 0.15, (name, w.std().item(), want)
    assert len(mlp_parameters(built, "down_proj")) == cfg.num_hidden_layers + (cfg.num_hidden_layers - 1)
    kept = build_target(cfg, torch.device("cpu"), seed=4)
    fresh_init(kept, "transformers", seed=4, silent_mlps=False)
    assert all(torch.equal(w, reference[k]) for k, w in kept.state_dict().items())
    with pytest.raises(ValueError, match="init must be one of"):
        fresh_init(kept, "xavier", seed=4, silent_mlps=False)


def test_frozen_mlps_do_not_move_until_their_share_of_the_steps_is_over(trained):
    """MlpWarmup: no MLP parameter takes a gradient before frac x the planned steps; attention learns meanwhile. A
    run that stops inside the warm-up hands its MLPs back trainable."""
    model = build_target(trained["cfg"], torch.device("cpu"), seed=5)
    fresh_init(model, "fan_in", seed=5, silent_mlps=True)
    warm = MlpWarmup(model, 0.5)
    assert warm.frozen and not any(w.requires_grad for w in mlp_parameters(model))
    warm.tick(4, 10, lambda _m: None)
    assert warm.frozen
    warm.tick(5, 10, lambda _m: None)
    assert not warm.frozen and warm.start == 5 and all(w.requires_grad for w in mlp_parameters(model))
    tc = dataclasses.replace(trained["tc"], max_steps=4, mlp_warmup_frac=0.9, profile_steps=0)
    before = copy.deepcopy(model.state_dict())
    out = train_target(model, trained["rows"], tc, torch.device("cpu"), float("inf"), trained["pad"], lambda _m: None)
    assert out["steps"] == 4 and out["mlps_from_step"] is None, out["stopped_by"]
    after = model.state_dict()
    mlp = [k for k in after if ".mlp." in k and "bias" not in k]
    attn = [k for k in after if ".self_attn.q_proj" in k]
    assert mlp and all(torch.equal(after[k], before[k]) for k in mlp)
    assert attn and all(not torch.equal(after[k], before[k]) for k in attn)
    assert all(w.requires_grad for w in mlp_parameters(model))


def _planned(restart_at: int | None, monkeypatch) -> list[int]:
    """A Schedule ticked over 300 steps of 0.1 s (a phase of small batches), then steps of 0.4 s, with a 1,000 s
    deadline: its `total` after each step from 300 on."""
    from m3serve.learn import loop

    now = [0.0]
    monkeypatch.setattr(loop.time, "time", lambda: now[0])
    sched = loop.Schedule(1e-3, 10, 100_000, 0.05)
    totals = []
    for step in range(1200):
        if step == restart_at:
            sched.restart_clock(step)
        sched.tick(step, 1000.0)
        now[0] += 0.1 if step < 300 else 0.4
        if step >= 300:
            totals.append(sched.total)
    return totals


def test_the_schedule_plans_from_the_pace_after_a_restart(monkeypatch):
    """Steps after the retrieval-first phase are slower than the phase's: planned from the mean since step 5, the
    decay would be planned for far more steps than the deadline allows; from the steps after the restart, the plan
    is what the deadline holds at the new pace (30 s for the phase, then 0.4 s a step: 300 + 970 / 0.4)."""
    restarted, kept = _planned(300, monkeypatch), _planned(None, monkeypatch)
    assert restarted[20] == restarted[-1] == 300 + int(970 / 0.4)  # planned 20 steps after the restart, then kept
    assert restarted[19] != restarted[20]
    assert kept[-1] > restarted[-1] + 300  # the old mean still holds the fast steps
