r"""`m3serve train-learned`: train the learned tiny M3.1-Flash and its DSpark draft in one run (issue 27).

One process does it all, within a wall-clock budget (`--budget-s`), so that it fits one device call:
1. data (learn/data.py): the tokenizer (m3serve.learn.tokenizer; with `--init-from`, that checkpoint's), then a pool
   of rendered training rows from every task's train split and the eval split's rows, rendered in worker processes
   that go on rendering rows with new seeds while the target trains;
2. the target: transformers 5.25 `MiniMaxM3VLForCausalLM` (the numerical reference the engine equals) built from
   `learned_config`, random init, AdamW, bf16 autocast on CUDA, linear warm-up then cosine decay, cross-entropy on
   the answer tokens only. Batches are length-bucketed and right-padded (right padding leaves MSA's block
   boundaries where an unpadded run has them). A retrieval-first phase comes first (`RetrievalFirst`: short
   retrieval contexts recited as plain text, the loss on the values, until the in-context lookup forms, at most
   `--focus-frac` of the steps; 0: none). The MoE routers are balanced without an auxiliary loss: after each
   step every router's `e_score_correction_bias` moves by `--bias-rate` toward the mean load (DeepSeek-V3's
   auxiliary-loss-free balancing; M3 checkpoints carry that bias). The experts run through transformers'
   grouped-GEMM path where the device has it (no host syncs), else its per-expert loop (tried on the first batch).
   One step (learn/step.py) runs eagerly, or captured once per batch shape as a CUDA graph and replayed
   (`--cuda-graphs`, learn/graphed_step.py: the step is host-bound; the draft's steps too, learn/train_draft.py).
3. the lightning indexer (MSA layers): top-k block selection is not differentiable, so the indexer learns by
   distillation, with its input detached (the language-model loss never reaches it, and the KL never reaches the
   backbone). The recipe is the one MiniMax published with MSA (github.com/MiniMax-AI/MSA, training/msa_v1/kl):
   per query and index head, KL(teacher || student) where the teacher is the main attention's probability over
   keys, averaged over the query heads of that GQA group (detached), and the student is softmax(q_idx . k_idx /
   sqrt(d_idx)) over the same keys. It runs in two phases, as DeepSeek-V3.2 trained its indexer: a dense warm-up
   (`--dense-frac` of the steps; the main attention unmasked: every block selected, the KL over all causal keys),
   then the sparse phase (the real top-k mask on; the main attention and the KL both over the selected blocks
   only, as MSA's sparse KL does). The switch is a ramp (`SparseRamp`: the share of sparse steps rises from 0 to 1
   over `--sparse-ramp-frac` of the steps), and the dense phase's final weights are kept if they answer better with
   the mask on than the final ones (`keep_better`).
4. the DSpark draft (train_draft.py), on the frozen target's tapped hidden states;
5. checks on the eval split: teacher-forced exact match per task (every answer token argmax-correct given the
   prompt, which is exactly what greedy decoding produces), for the target with its sparse mask (and, as a check
   of the indexer, retrieval with the mask off), and the draft's per-position acceptance;
6. output: `--out` holds the checkpoint (transformers layout, bf16, tokenizer + chat template,
   generation_config.json, `dspark/`); `--pack DIR` also writes it as a tar split into 15 MB parts
   (`part-aa`, ...) plus `train_log.json` (loss curves, eval, timings), for a device call's $OUT.

Reassemble a packed checkpoint with `cat DIR/part-* | tar -x -C models/`. On a GPU machine where m3serve is not
installed (the lent H200: torch and triton, no transformers), lay the package out as benchmarks/device_run.sh does and
carry transformers 5.25's wheels:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && mkdir -p /tmp/p/m3serve &&
    cp -r backend/. /tmp/p/m3serve/ && cp -r kernels /tmp/p/m3serve/kernels &&
    PYTHONPATH=/tmp/p:/tmp/site USE_HUB_KERNELS=0 python3 -m m3serve.cli train-learned --out /tmp/m3-tiny-learned \
        --pack $OUT
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import tarfile
import time
import traceback
from typing import Any

import torch

from m3serve.learn.data import RECITALS, FreshRows, make_rows, row_jobs
from m3serve.learn.fast_paths import check_experts
from m3serve.learn.graphed_step import GraphedSteps, adamw
from m3serve.learn.loop import Schedule, ShapeLadder, autocast, batches, collate, prefetch
from m3serve.learn.step import (DenseAttention, IndexerDistill, RouterBalance, answer_loss, log_record, param_groups,
                                target_step)
from m3serve.learn.tasks import RETRIEVAL_PAIRS, RETRIEVAL_TRAIN_MIN_PAIRS, TASKS

PART_BYTES = 15 << 20
MIN_TOKENS_PER_BATCH = 4096  # out of memory, a batch is halved down to this
DRAFT_DIR = "dspark"


@dataclasses.dataclass
class TrainConfig:
    out: str
    pack: str | None = None  # also write part-aa.. + train_log.json here
    device: str = "auto"
    seed: int = 0
    budget_s: float = 420.0  # wall clock for the whole run, data to packing
    reserve_s: float = 40.0  # kept for the checks, saving and packing
    tasks: tuple[str, ...] = TASKS
    train_examples: int = 16000  # per task (the pool is cycled through), times the task's weight
    # arithmetic rows pack 8 problems, so weight 12 gives it as many rows as a task of weight 1.5 unpacked;
    # retrieval rows are long and ask ~30 questions each, and rendering one costs ~30 chat-template passes (the
    # data step's largest share), so half the rows do
    task_weights: dict[str, float] = dataclasses.field(default_factory=lambda: {"arithmetic": 12.0, "retrieval": 0.5})
    # training rows of these tasks hold several problems as one chat's turns (eval rows hold one): their prompts are
    # mostly the template's preamble (arithmetic) or one long context (retrieval), so such a row teaches several
    # answers for little more than one row's tokens
    # (a step's cost grows with tokens x row length: the eager attention's and the indexer's [B, H, S, S] tensors,
    # so arithmetic, whose answers are short, packs fewer than retrieval, whose one context is long anyway)
    packed_turns: dict[str, int] = dataclasses.field(default_factory=lambda: {"arithmetic": 8, "retrieval": 32})
    # render more rows with new seeds while the target trains (data.FreshRows), up to max_rows in all
    fresh_rows: bool = True
    max_rows: int = 600_000
    init_from: str | None = None  # start from this checkpoint's weights (a run that goes on in another device call)
    # a fresh target's init (not with init_from; docs/quality.md, "Why retrieval stays at chance"): "fan_in" every
    # matrix but the indexer's from N(0, 1 / (3 fan_in)) (PyTorch's Linear scale) and the token embedding from
    # N(0, 1); "transformers" its own (every matrix and the embedding N(0, 0.02))
    init: str = "fan_in"
    # of the planned steps: the MLPs (dense, router, experts, shared expert) start silent (their down projections
    # zero) and frozen for this share, so that attention forms its context lookups first (fresh targets only)
    mlp_warmup_frac: float = 0.25
    # the retrieval-first phase (RetrievalFirst): at most this share of the planned steps trains on short retrieval
    # contexts alone (2-focus_max_pairs pairs, focus_examples of them rendered up front, focus_tokens_per_batch a
    # step), until the answer-token accuracy of its batches reaches focus_until_acc; then every task (0: no phase).
    # On an H100 (2026-12-05, run 11) plain recitals formed the word lookup in 300 steps (34 s) and retrieval scored
    # 1.0 at the eval's 256 pairs; no run without the phase learned it (docs/quality.md)
    focus_frac: float = 0.3
    focus_max_pairs: int = 16
    focus_examples: int = 30000
    focus_tokens_per_batch: int = 32768
    focus_until_acc: float = 0.95
    # the phase's rows are recitals (the reply recites the context's pairs, the loss on the values; render.
    # recital_row) rather than question turns ("none"), whose second occurrence of the asked key kept the lookup from
    # forming on the CPU (docs/quality.md, "The question is what stalls it"); "plain": BOS, the list, the recital, no
    # chat template, whose fixed opening had kept a micro model's lookup from forming by step 800 ("chat": in it)
    focus_recital: str = "plain"
    eval_examples: int = 200  # per task
    workers: int = 0  # data-generation processes (0: one per CPU core, at most 16)
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    # target
    # padded tokens per step: on the H200 a step took the same ~274 ms at 64K and 128K tokens (host-bound), so
    # more tokens per step come almost free; out of memory, batches are halved and the step is run again
    tokens_per_batch: int = 262144
    max_steps: int = 6000
    warmup_steps: int = 50
    # 2e-3 (runs 1-8) left the learned config's in-context lookup at 0.16 after 1,500 synthetic steps; 1e-3 learned it
    # by step 600 (benchmarks/recall_plateau.py --learned-size, docs/quality.md)
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.1
    dense_frac: float = 0.45  # of the planned steps: the dense warm-up
    sparse_ramp_frac: float = 0.15  # then the share of steps run sparse rises from 0 to 1 over this many steps
    bias_rate: float = 1e-2  # router bias step per training step
    distill_rows: int = 16  # rows of each batch the indexer's KL covers (0: all)
    prompt_loss_weight: float = 0.25  # the other real tokens' cross-entropy, this much of it added (answer_loss)
    # draft (train_draft.py)
    draft_frac: float = 0.16  # of the training time
    draft_max_steps: int = 3000
    draft_lr: float = 1e-3
    draft_layers: int = 2
    draft_markov_rank: int = 64
    draft_anchors: int = 32  # anchors per sequence
    draft_tokens_per_batch: int = 16384
    log_every: int = 25
    profile_steps: int = 0  # profile this many target steps from step `profile_from`: top ops in the log
    profile_from: int = 10  # (under --cuda-graphs pick a step after the MLPs' release: replays of the full step)
    # torch.compile the target step's small-op pieces (fast_paths.CompiledPieces); any compiler error: eager again
    compile: bool = False
    compile_backend: str = "inductor"
    # each batch shape's target step, and then draft step, captured once as a CUDA graph and replayed
    # (learn/graphed_step.py): both are host-bound; batches come in the shapes of a ShapeLadder (32-token rungs about
    # graph_ladder_ratio apart). Off the GPU, or once a capture fails, steps run eagerly
    cuda_graphs: bool = False
    graph_ladder_ratio: float = 1.25
    # the MoE experts in training (fast_paths.EXPERTS): "all" runs every expert router-weighted (4x the top-2 work, no
    # sort); "grouped" only the picked ones, sorted by expert, through torch's grouped GEMM
    experts: str = "all"


# ---------------------------------------------------------------------------------------------- the target

def build_target(cfg, device: torch.device, seed: int, fast: bool = True, experts: str = "all"):
    """transformers' MiniMaxM3VLForCausalLM from our ModelConfig (`to_hf_dict` is the config.json transformers
    reads), seeded random init (transformers' own init), fp32 master weights; with `fast` its attention, experts (as
    fast_paths.EXPERTS[`experts`] runs them) and indexer selection swapped for the same math at a fraction of the time
    (learn/fast_paths.py), else transformers' eager path as it is."""
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    from m3serve.learn.fast_paths import install

    hf_cfg = MiniMaxM3VLTextConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(hf_cfg).to(device)
    if fast:
        install(model, experts)
    return model


INITS = ("fan_in", "transformers")


def fresh_init(model, init: str, seed: int, silent_mlps: bool) -> None:
    """A fresh target's init (TrainConfig.init), then, with `silent_mlps`, every MLP's down projection zeroed (the
    MLPs add nothing to the residual stream until they learn). The indexer keeps transformers' init."""
    if init not in INITS:
        raise ValueError(f"init must be one of {list(INITS)}, got {init!r}")
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        if init == "fan_in":
            for name, w in model.named_parameters():
                if w.ndim >= 2 and ".indexer." not in name:
                    std = 1.0 if "embed_tokens" in name else (3 * w.shape[-1]) ** -0.5
                    w.copy_(torch.randn(w.shape, generator=g) * std)
        if silent_mlps:
            for w in mlp_parameters(model, "down_proj"):
                w.zero_()


def mlp_parameters(model, part: str = "") -> list[torch.nn.Parameter]:
    """The parameters of every layer's MLP (dense MLP, router, experts, shared expert) whose names hold `part`."""
    return [w for name, w in model.named_parameters() if ".mlp." in name and part in name]


def load_weights(model, init_from: str, tokenizer_dir: str) -> None:
    """An earlier run's weights into `model` (same shapes, and the same tokenizer: the ids must mean the same; `run`
    copies the checkpoint's tokenizer into the run's directory, `learn.tokenizer.copy_tokenizer`)."""
    from transformers import MiniMaxM3VLForCausalLM

    with open(os.path.join(init_from, "tokenizer.json")) as a, open(os.path.join(tokenizer_dir, "tokenizer.json")) as b:
        if json.load(a) != json.load(b):
            raise ValueError(f"--init-from {init_from}: its tokenizer differs from the run's")
    done = MiniMaxM3VLForCausalLM.from_pretrained(init_from, dtype=torch.float32)
    model.load_state_dict(done.state_dict())


def pick_experts_implementation(model, ids: torch.Tensor, mask: torch.Tensor, device: torch.device, log) -> str:
    """How the MoE experts train, tried on a forward and backward of two rows (every parameter's gradient asked for,
    frozen MLPs included: a path must also hold when they are released); on any error the path that runs everywhere.
    With the fast paths (learn/fast_paths.py): "grouped" (torch's grouped GEMM) falls back to "all"; without them,
    transformers' "grouped_mm" (its default where torch has it: no host syncs) to its per-expert loop ("eager")."""
    from m3serve.learn.fast_paths import ATTENTION, experts_path, set_experts

    fast = model.config._attn_implementation == ATTENTION
    impl, plain = (experts_path(model), "all") if fast else (model.config._experts_implementation, "eager")
    if impl != plain:
        frozen = [p for p in model.parameters() if not p.requires_grad]
        try:
            for p in frozen:
                p.requires_grad_(True)
            with autocast(device):
                answer_loss(model, ids[:2], mask[:2])[0].backward()
        except Exception as e:  # noqa: BLE001 - any failure of the fast path means: use the one that runs everywhere
            log(f"target: experts implementation {impl!r} failed ({type(e).__name__}: {e}); using {plain!r}")
            if fast:
                set_experts(model, plain)
            else:
                model.set_experts_implementation(plain)
            impl = plain
        finally:
            for p in frozen:
                p.requires_grad_(False)
        model.zero_grad(set_to_none=True)
    return f"fast_paths {impl!r}" if fast else impl


class StepProfile:
    """torch.profiler over `n` training steps from step `first`: where a step's time goes (the first H200 runs were
    at 127-212K padded tokens/s, far below the device, and the cause was not measured). `result()` lists the ops by
    self device time (CPU time without CUDA), with their call counts."""

    def __init__(self, n: int, device: torch.device, first: int = 10):
        self.n, self.first, self.cuda = n, first, device.type == "cuda"
        self.prof = None
        self.table: list[dict] = []
        self.step_ms: dict[str, float] = {}

    def tick(self, step: int) -> None:
        if self.n <= 0:
            return
        if step == self.first:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif step == self.first + self.n and self.prof is not None:
            self._stop()

    def _stop(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        attr = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        events = sorted(self.prof.key_averages(), key=lambda e: getattr(e, attr, 0.0), reverse=True)
        total = sum(getattr(e, attr, 0.0) for e in events) or 1.0
        # busy time per step against the wall's: far below it, the device waits on the host (launches, syncs)
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        busy = sum(getattr(e, attr, 0.0) for e in kernels) if kernels else total
        self.step_ms = {"wall": round(wall * 1e3 / self.n, 2), "busy": round(busy / 1e3 / self.n, 2)}
        self.table = [{"op": e.key, "calls": e.count, "ms_per_step": round(getattr(e, attr, 0.0) / 1e3 / self.n, 3),
                       "share": round(getattr(e, attr, 0.0) / total, 4)} for e in events[:40]]
        self.prof = None

    def result(self) -> list[dict]:
        if self.prof is not None:  # the run ended inside the window
            self._stop()
        return self.table


class SparseRamp:
    """When the MSA layers run their top-k mask. A hard switch from the dense warm-up to the sparse mask cut off
    blocks the model had learned to read, and on the H200 (2026-12-04) it did not recover (docs/quality.md). So the
    switch is a ramp: from `begin`'s step the chance that a step runs sparse rises linearly from 0 to 1 over
    `sparse_ramp_frac` of the planned steps (a seeded draw per step), then every step is sparse."""

    def __init__(self, tc: TrainConfig, rng: random.Random):
        self.tc, self.rng = tc, rng
        self.start: int | None = None
        self.full: int | None = None
        self.snapshot: dict[str, torch.Tensor] | None = None

    def begin(self, step: int, total: int) -> None:
        self.start = step
        self.full = step + max(1, round(self.tc.sparse_ramp_frac * total))

    def dense(self, step: int) -> bool:
        if self.start is None:
            return True
        if step >= self.full:
            return False
        return self.rng.random() >= (step - self.start + 1) / (self.full - self.start)


class MlpWarmup:
    """The MLPs frozen (no gradients: the optimizer skips them) for the first `frac` of the planned steps."""

    def __init__(self, model, frac: float):
        self.frac, self.params = frac, mlp_parameters(model) if frac > 0 else []
        self.frozen, self.start = bool(self.params), 0
        for w in self.params:
            w.requires_grad_(False)

    def tick(self, step: int, total: int, log) -> None:
        if self.frozen and step >= self.frac * total:
            self.release()
            self.start = step
            log(f"target: the MLPs learn from step {step}")

    def release(self) -> None:
        for w in self.params:
            w.requires_grad_(True)
        self.frozen = False


class RetrievalFirst:
    """The retrieval-first phase: the first steps train on short retrieval contexts alone, until the lookup forms.

    Why: an in-context lookup (an induction circuit: one head marks each token with the one before it, a second
    matches on that mark) forms suddenly, after some hundreds of steps of a strong, steady signal
    (benchmarks/recall_plateau.py: the learned config learns 2-16-pair recall by step ~600 on recall alone). In the
    mixed batches of runs 1-9 the retrieval answers were a small share of every step's gradient, and the lookup had
    not formed when the rate had decayed (run 9: the short contexts' answer loss began to fall at step 1,100 of 1,579,
    the long ones' never). So for at most `focus_frac` of the planned steps every batch is retrieval rows of 2 to
    `focus_max_pairs` pairs: recitals of the context's pairs drawn with replacement, the loss on the values, plain
    or in the chat template (`focus_recital`; copying any value of the context scores 1/n of n pairs), or each key
    asked in turn (2/3 without a lookup: the key and the end of turn are easy); the phase ends early once a logged
    step's answer-token accuracy reaches `focus_until_acc`."""

    def __init__(self, tc: TrainConfig, rows: list):
        self.rows, self.max_frac, self.until_acc = rows, tc.focus_frac, tc.focus_until_acc
        self.on = bool(rows) and tc.focus_frac > 0
        self.ended: dict[str, Any] | None = None

    def active(self, step: int, total: int) -> bool:
        if self.on and step >= self.max_frac * total:
            self.end(step, "steps")
        return self.on

    def observe(self, step: int, answer_token_acc: float) -> None:
        """A logged step's accuracy (of a retrieval batch while the phase is on)."""
        if self.on and answer_token_acc >= self.until_acc:
            self.end(step, "accuracy")

    def end(self, step: int, why: str) -> None:
        self.on = False
        self.ended = {"step": step, "by": why}


def keep_better(model, eval_rows, device: torch.device, pad_id: int, tokens_per_batch: int, log) -> dict:
    """The final weights or the dense phase's (set aside when the ramp began), whichever has the higher mean
    teacher-forced exact match with the sparse mask on (the mask the engine runs), so that a sparse phase that went
    wrong cannot lose what the dense phase learned. Returns both scores and the choice."""
    snapshot = getattr(model, "dense_snapshot", None)
    final = exact_match(model, eval_rows, device, pad_id, tokens_per_batch)
    out = {"final": final, "kept": "final"}
    if snapshot is not None:
        current = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        model.load_state_dict(snapshot)
        dense_end = exact_match(model, eval_rows, device, pad_id, tokens_per_batch)
        out["dense_phase_end"] = dense_end
        if sum(dense_end.values()) > sum(final.values()):
            out["kept"] = "dense_phase_end"
        else:
            model.load_state_dict(current)
        log(f"target: sparse-mask exact match at the end {final}, at the end of the dense phase {dense_end}; "
            f"keeping {out['kept']}")
    model.dense_snapshot = None
    return out


def train_target(model, rows, tc: TrainConfig, device: torch.device, deadline: float, pad_id: int,
                 log, focus_rows: list | None = None, probe=None) -> dict:
    """Train the target on `rows` (after the retrieval-first phase on `focus_rows`, RetrievalFirst); `probe()`, if
    given, is called when that phase ends and its result logged (what the lookup does at the eval's length)."""
    graphed = tc.cuda_graphs and device.type == "cuda"
    if tc.cuda_graphs and not graphed:
        log(f"target: --cuda-graphs needs a CUDA device ({device}): eager steps")
    ladder = ShapeLadder(ratio=tc.graph_ladder_ratio) if graphed else None

    def feed(pool, tokens_per_batch: int, seed: int):
        return prefetch(batches(pool, tokens_per_batch, random.Random(seed), pad_id, ladder=ladder),
                        pin=device.type == "cuda")

    per_batch = tc.tokens_per_batch
    data = feed(rows, per_batch, tc.seed)
    first = RetrievalFirst(tc, focus_rows or [])
    focus_batch = tc.focus_tokens_per_batch
    focus_data = feed(first.rows, focus_batch, tc.seed + 5) if first.on else None
    ids, mask, _, _ = next(focus_data or data)
    experts = pick_experts_implementation(model, ids.to(device), mask.to(device), device, log)
    groups = param_groups(model, tc.weight_decay)
    opt = adamw(groups, tc.lr, device, graphed, eps=1e-8)
    sched = Schedule(tc.lr, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    distill, balance = IndexerDistill(model, tc.distill_rows, tc.seed + 11), RouterBalance(model, tc.bias_rate)
    distill.enabled = balance.enabled = True
    graphs = GraphedSteps(model, opt, groups, distill, balance, device, tc.prompt_loss_weight, log) if graphed else None
    pieces, compiling = None, {}
    if tc.compile:
        from m3serve.learn.fast_paths import CompiledPieces

        pieces = CompiledPieces(model, tc.compile_backend)
        compiling = {"backend": tc.compile_backend, "pieces": len(pieces.modules), "fallback": None}

    def one_step(batch, dense: bool) -> dict:
        if graphs is not None:
            return graphs.step(batch, sched.lr(step), dense)
        return target_step(model, opt, groups, distill, balance, batch, sched.lr(step), dense, device,
                           tc.prompt_loss_weight)

    def discard_step() -> None:
        """Drop what a step that raised half-way left: gradients, the distillation's and the balance's records."""
        opt.zero_grad(set_to_none=True)
        distill.reset()
        balance.loads.clear()

    def step_or_eager(batch, dense: bool) -> dict:
        """The step; compiled, a failure other than memory puts the eager forwards back and runs it again."""
        nonlocal pieces
        try:
            return one_step(batch, dense)
        except torch.OutOfMemoryError:
            raise  # not the compiler's fault: smaller batches (train loop)
        except Exception as e:  # noqa: BLE001 - compiled: the compiler may be at fault; the step again, eager
            if pieces is None:
                raise
            compiling["fallback"] = f"step {step}: {type(e).__name__}: {e}"
            log(f"target: compiled step {step} failed ({type(e).__name__}: {e}); eager from here\n"
                + traceback.format_exc())
            pieces.undo()
            pieces = None
            discard_step()
            if graphs is not None:
                graphs.reset("the compiled pieces undone")
            return one_step(batch, dense)

    curve, t0 = [], time.time()
    ramp = SparseRamp(tc, random.Random(tc.seed + 7))
    mlps = MlpWarmup(model, 0.0 if tc.init_from else tc.mlp_warmup_frac)
    model.train()
    step, tokens, real_tokens = 0, 0, 0
    error = None
    profile = StepProfile(tc.profile_steps, device, first=tc.profile_from)
    while step < sched.total and time.time() < deadline:
        sched.tick(step, deadline)
        profile.tick(step)
        frozen = mlps.frozen
        mlps.tick(step, sched.total, log)
        if graphs is not None and frozen and not mlps.frozen:
            graphs.reset("the MLPs' parameters became trainable")
        if ramp.start is None and step >= tc.dense_frac * sched.total:
            ramp.begin(step, sched.total)
            if step > 0:  # a dense phase ran: its weights are what keep_better weighs the final ones against
                ramp.snapshot = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            log(f"target: sparse ramp from step {step} to {ramp.full} (top-{model.config.index_topk_blocks} "
                "blocks)" + ("; the dense phase's weights are kept aside" if step > 0 else ""))
        dense = ramp.dense(step)
        focus = first.active(step, sched.total)
        if not focus and focus_data is not None:
            focus_data.close()
            focus_data = None
            log(f"target: the retrieval-first phase ended at step {step} (by {first.ended['by']}); every task "
                "from here")
            sched.restart_clock(step)  # the phase's batches were smaller: plan from the steps that follow
            if probe is not None:  # a forward of its own: the distillation and the balance do not see it
                distill.enabled = balance.enabled = False
                first.ended["probe"] = probe()
                distill.enabled = balance.enabled = True
                log(f"target: after the retrieval-first phase {json.dumps(first.ended['probe'])}")
        try:
            t_step = time.time()
            rec = step_or_eager(next(focus_data if focus else data), dense)
            if step == 0 and pieces is not None:
                compiling["first_step_s"] = round(time.time() - t_step, 1)
                log(f"target: the first step, compiling {compiling['pieces']} pieces with "
                    f"{tc.compile_backend}, took {compiling['first_step_s']} s")
        except torch.OutOfMemoryError as e:
            discard_step()
            if (focus_batch if focus else per_batch) // 2 < MIN_TOKENS_PER_BATCH:
                error = f"{type(e).__name__}: {e}"
                log(f"target: step {step} ran out of memory at {focus_batch if focus else per_batch} tokens per "
                    "batch; stopping here")
                break
            if graphs is not None:
                graphs.reset("out of memory")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if focus:  # the step is not counted: the same step again on smaller batches
                focus_batch //= 2
                focus_data.close()
                focus_data = feed(first.rows, focus_batch, tc.seed + step)
            else:
                per_batch //= 2
                data.close()
                data = feed(rows, per_batch, tc.seed + step)
            log(f"target: step {step} ran out of memory; going on with {focus_batch if focus else per_batch} "
                "tokens per batch")
            continue
        except Exception as e:  # noqa: BLE001 - keep the weights of the last good step, then save them
            error = f"{type(e).__name__}: {e}"
            log(f"target: step {step} failed ({error}); stopping here with the last good step's weights\n"
                + traceback.format_exc())
            opt.zero_grad(set_to_none=True)
            break
        tokens += rec.pop("padded_tokens")
        real_tokens += rec.pop("real_tokens")
        step += 1
        if step % tc.log_every == 0 or step == 1:
            rec = {"step": step, **log_record(rec), "elapsed_s": round(time.time() - t0, 1),
                   "planned_steps": sched.total, **({"retrieval_first": True} if focus else {})}
            curve.append(rec)
            log("target " + json.dumps(rec))
            bad = [k for k in ("loss", "indexer_kl", "grad_norm") if not math.isfinite(rec[k])]
            if bad:  # a NaN gradient empties what it reaches (the indexer of run 15): stop, saying so
                error = f"non-finite {', '.join(bad)} at step {step}"
                log(f"target: {error}; stopping here")
                break
            if focus:
                first.observe(step, rec["answer_token_acc"])
    if mlps.frozen:  # stopped before the MLPs' turn: the model leaves trainable as it came
        mlps.release()
        mlps.start = None
    distill.remove()
    balance.remove()
    if pieces is not None:
        pieces.undo()
    model.eval()
    wall = time.time() - t0
    top = profile.result()
    if top:
        log(f"target: profile of steps (ms per step {profile.step_ms}) " + json.dumps(top[:20]))
    model.dense_snapshot = ramp.snapshot  # read (and dropped) by keep_better
    data.close()
    if focus_data is not None:
        focus_data.close()
    return {"steps": step, "planned_steps": sched.total, "mlps_from_step": mlps.start,
            "retrieval_first": first.ended or ({"step": step, "by": "end of training"} if first.on else None),
            "sparse_from_step": ramp.start, "tokens_per_batch": per_batch,
            "sparse_full_from_step": ramp.full, "wall_s": round(wall, 1),
            "experts_implementation": experts, "compile": compiling or None,
            "cuda_graphs": graphs.summary() if graphs is not None else None,
            "padded_tokens": tokens, "real_tokens": real_tokens,
            "padded_tokens_per_s": round(tokens / max(wall, 1e-9)), "curve": curve, "profile": top,
            "profile_step_ms": profile.step_ms,
            "stopped_by": error or ("steps" if step >= sched.total else "time")}


@torch.no_grad()
def exact_match(model, rows, device: torch.device, pad_id: int, tokens_per_batch: int, dense: bool = False
                ) -> dict[str, float]:
    """Teacher-forced exact match per task: every answer token is the argmax given the true prefix (= the
    greedy decode's answer)."""
    hits: dict[int, list[bool]] = {}
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    b0 = 0
    while b0 < len(order):
        n = max(1, tokens_per_batch // len(rows[order[b0]][0]))
        idx = order[b0:b0 + n]
        idx = [i for i in idx if len(rows[i][0]) * len(idx) <= tokens_per_batch] or idx[:1]
        b0 += len(idx)
        ids, mask, _ = (t.to(device) for t in collate([rows[i] for i in idx], pad_id))
        with DenseAttention(model, dense), autocast(device):
            hidden = model.model(input_ids=ids).last_hidden_state
            pred = model.lm_head(hidden[:, :-1]).argmax(-1)
        ok = ((pred == ids[:, 1:]) | ~mask[:, 1:]).all(-1)
        for i, good in zip(idx, ok.tolist()):
            hits.setdefault(rows[i][2], []).append(good)
    return {TASKS[t]: round(sum(v) / len(v), 4) for t, v in sorted(hits.items())}


# ---------------------------------------------------------------------------------------------- output

def save_target(model, cfg, out_dir: str) -> None:
    """The trained weights (transformers names) as the transformers-layout bf16 checkpoint + configs."""
    from m3serve.model import layout as L
    from m3serve.model.tiny import write_model

    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    write_model(out_dir, cfg, state, L.TRANSFORMERS, "bfloat16", max_shard_bytes=16 << 20)


def pack(model_dir: str, dest: str, part_bytes: int = PART_BYTES) -> list[str]:
    """`model_dir` as an uncompressed tar (top folder = its name) split into `part-aa`, `part-ab`, ... in `dest`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(model_dir, arcname=os.path.basename(os.path.normpath(model_dir)))
    data = buf.getvalue()
    os.makedirs(dest, exist_ok=True)
    names = []
    for i, off in enumerate(range(0, len(data), part_bytes)):
        name = "part-" + chr(ord("a") + i // 26) + chr(ord("a") + i % 26)
        with open(os.path.join(dest, name), "wb") as f:
            f.write(data[off:off + part_bytes])
        names.append(name)
    return names


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# ---------------------------------------------------------------------------------------------- the run

def run(tc: TrainConfig) -> dict:
    """Train, check, save (and pack); returns the log that `train_log.json` holds."""
    from m3serve.learn.config import learned_config
    from m3serve.learn.tokenizer import build_tokenizer, copy_tokenizer
    from m3serve.learn.train_draft import train_and_save_draft

    unknown = sorted(set(tc.task_weights) - set(TASKS))
    if unknown:
        raise ValueError(f"task_weights: unknown task(s) {unknown}; tasks are {list(TASKS)}")
    if not tc.prompt_loss_weight >= 0:  # NaN too
        raise ValueError(f"prompt_loss_weight must be 0 or more, got {tc.prompt_loss_weight}")
    if tc.tokens_per_batch < MIN_TOKENS_PER_BATCH:
        raise ValueError(f"tokens_per_batch must be at least {MIN_TOKENS_PER_BATCH}, got {tc.tokens_per_batch}")
    for name in ("workers", "max_rows"):
        if getattr(tc, name) < 0:
            raise ValueError(f"{name} must be 0 or more, got {getattr(tc, name)}")
    if tc.init not in INITS:
        raise ValueError(f"init must be one of {list(INITS)}, got {tc.init!r}")
    if not 0 <= tc.min_lr_ratio <= 1:  # NaN too
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {tc.min_lr_ratio}")
    if not 0 <= tc.focus_frac < 1:
        raise ValueError(f"focus_frac must be in [0, 1), got {tc.focus_frac}")
    if tc.focus_recital not in RECITALS:
        raise ValueError(f"focus_recital must be one of {list(RECITALS)}, got {tc.focus_recital!r}")
    if not RETRIEVAL_TRAIN_MIN_PAIRS <= tc.focus_max_pairs <= RETRIEVAL_PAIRS:
        raise ValueError(f"focus_max_pairs must be in {RETRIEVAL_TRAIN_MIN_PAIRS}-{RETRIEVAL_PAIRS}, "
                         f"got {tc.focus_max_pairs}")
    if not 0 <= tc.mlp_warmup_frac < 1:
        raise ValueError(f"mlp_warmup_frac must be in [0, 1), got {tc.mlp_warmup_frac}")
    check_experts(tc.experts)
    if not 1.0 <= tc.graph_ladder_ratio < float("inf"):  # NaN too
        raise ValueError(f"graph_ladder_ratio must be a finite number >= 1, got {tc.graph_ladder_ratio}")
    t_start = time.time()
    deadline = t_start + tc.budget_s

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    device = torch.device("cuda" if tc.device == "auto" and torch.cuda.is_available()
                          else "cpu" if tc.device == "auto" else tc.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    random.seed(tc.seed)
    torch.manual_seed(tc.seed)
    os.makedirs(tc.out, exist_ok=True)
    result: dict[str, Any] = {"config": dataclasses.asdict(tc), "device": str(device), "torch": torch.__version__}
    import transformers

    result["transformers"] = transformers.__version__

    # a run that goes on from a checkpoint keeps its tokenizer (its ids are what the weights learned)
    tok = copy_tokenizer(tc.init_from, tc.out) if tc.init_from else build_tokenizer(tc.out, seed=tc.seed)
    vocab = -(-tok["vocab_size"] // 64) * 64
    cfg = learned_config(vocab, tok["bos_token_id"], tok["eos_token_id"], **tc.model_overrides)
    pad_id = tok["pad_token_id"] if tok.get("pad_token_id") is not None else tok["eos_token_id"]
    # the worker pool is forked here, before CUDA is first touched; it renders the first rows, then goes on with new
    # seeds while the target trains (data.FreshRows)
    rows: list = []
    fresh = FreshRows(rows, lambda r: row_jobs(tc.out, tc.tasks, "train", tc.train_examples, tc.seed + 7919 * r,
                                               weights=tc.task_weights, packed=tc.packed_turns),
                      tc.workers, tc.max_rows)
    parts = {"setup": round(time.time() - t_start, 1)}  # where the data phase's time goes: imports, BPE, workers
    try:
        mark = time.time()
        rows += make_rows(tc.out, tc.tasks, "train", tc.train_examples, tc.seed, weights=tc.task_weights,
                          packed=tc.packed_turns, pool=fresh.pool)
        parts["train_rows"], mark = round(time.time() - mark, 1), time.time()
        focus_rows = (make_rows(tc.out, ("retrieval",), "train", tc.focus_examples, tc.seed + 3,
                                packed=tc.packed_turns, pool=fresh.pool, max_pairs=tc.focus_max_pairs,
                                recital=tc.focus_recital)
                      if tc.focus_frac > 0 and "retrieval" in tc.tasks else [])
        parts["retrieval_first_rows"], mark = round(time.time() - mark, 1), time.time()
        eval_rows = make_rows(tc.out, tc.tasks, "eval", tc.eval_examples, tc.seed + 1, pool=fresh.pool)
        parts["eval_rows"] = round(time.time() - mark, 1)
        lengths = sorted(len(r[0]) for r in rows)
        result["data"] = {"train_rows": len(rows), "retrieval_first_rows": len(focus_rows),
                          "eval_rows": len(eval_rows),
                          "median_len": lengths[len(lengths) // 2], "max_len": lengths[-1],
                          "answer_tokens": sum(sum(r[1]) for r in rows), "seconds": round(time.time() - t_start, 1),
                          "seconds_by_part": parts}
        log("data " + json.dumps(result["data"]))
        if tc.fresh_rows:
            fresh.start()

        # CUDA is first touched here, after the worker pool was forked
        result["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        model = build_target(cfg, device, tc.seed, experts=tc.experts)
        if tc.init_from:
            load_weights(model, tc.init_from, tc.out)
            log(f"target: weights from {tc.init_from}")
        else:
            fresh_init(model, tc.init, tc.seed, tc.mlp_warmup_frac > 0)
            log(f"target: {tc.init} init; MLPs silent and frozen for {tc.mlp_warmup_frac:.0%} of the steps")
        n_params = sum(p.numel() for p in model.parameters())
        result["target_params"] = n_params
        log(f"target: {n_params / 1e6:.2f}M parameters, layers {cfg.layer_types}, MLPs {cfg.mlp_layer_types}")
        train_time = max(0.0, deadline - tc.reserve_s - time.time())
        target_deadline = time.time() + train_time * (1 - tc.draft_frac)
        eval_retrieval = [r for r in eval_rows if TASKS[r[2]] == "retrieval"]

        def probe() -> dict:  # the lookup at the eval's length, right after the retrieval-first phase
            return {"eval_retrieval": exact_match(model, eval_retrieval, device, pad_id, tc.focus_tokens_per_batch)
                    .get("retrieval")}

        result["target"] = train_target(model, rows, tc, device, target_deadline, pad_id, log, focus_rows, probe)
    finally:
        result.setdefault("data", {})["fresh"] = fresh.stop()
    log(f"data: {result['data']['fresh']['rows_added']} rows rendered while the target trained")
    log(f"target: {result['target']['steps']} steps in {result['target']['wall_s']} s "
        f"({result['target']['padded_tokens_per_s']} padded tokens/s), stopped by {result['target']['stopped_by']}")
    try:
        result["target"]["selection"] = keep_better(model, eval_rows, device, pad_id,
                                                    result["target"]["tokens_per_batch"], log)
    except Exception as e:  # noqa: BLE001 - a failed check must not lose the trained weights
        result["target"]["selection"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"target: choosing the weights failed: {e}\n" + traceback.format_exc())
    save_target(model, cfg, tc.out)
    try:
        selection = result["target"]["selection"]  # keep_better scored the kept weights already
        kept = selection.get(selection.get("kept"))
        per_batch = result["target"]["tokens_per_batch"]
        result["eval_target"] = kept if kept is not None else exact_match(model, eval_rows, device, pad_id,
                                                                          per_batch)
        retrieval = [r for r in eval_rows if TASKS[r[2]] == "retrieval"]
        if retrieval:
            result["eval_target_dense_retrieval"] = exact_match(model, retrieval, device, pad_id, per_batch,
                                                                dense=True)["retrieval"]
        log("eval target (teacher-forced exact match) " + json.dumps(result["eval_target"]) +
            f"; retrieval with the MSA mask off: {result.get('eval_target_dense_retrieval')}")
    except Exception as e:  # noqa: BLE001 - a failed check must not lose the trained weights
        result["eval_target"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"eval target failed: {result['eval_target']['error']}\n" + traceback.format_exc())

    draft_deadline = max(time.time(), deadline - tc.reserve_s)
    try:
        result["draft"] = train_and_save_draft(model, cfg, rows, eval_rows, tc, device, draft_deadline, pad_id,
                                               os.path.join(tc.out, DRAFT_DIR), log)
    except Exception as e:  # noqa: BLE001 - the target is saved already; pack it without a draft
        result["draft"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"draft failed: {result['draft']['error']}\n" + traceback.format_exc())
    result["checkpoint_bytes"] = dir_bytes(tc.out)
    result["wall_s"] = round(time.time() - t_start, 1)
    log(f"checkpoint {tc.out}: {result['checkpoint_bytes'] / 2**20:.1f} MiB; total {result['wall_s']} s")
    with open(os.path.join(tc.out, "train_log.json"), "w") as f:
        json.dump(result, f, indent=1)
    if tc.pack:
        result["parts"] = pack(tc.out, tc.pack)
        with open(os.path.join(tc.pack, "train_log.json"), "w") as f:
            json.dump(result, f, indent=1)
        log(f"packed into {tc.pack}: {result['parts']}")
    return result
