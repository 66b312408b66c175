"""One training step of the learned target and what it carries (train.py runs the loop, graphed_step.py captures
the step as CUDA graphs): the dense warm-up's unmasked attention, the indexer's distillation, the routers'
balancing, the answer loss, the optimizer's parameter groups, and the step itself (`step_body`: its device work,
no host sync) with its log record."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from m3serve.learn.loop import autocast
from m3serve.learn.tasks import TASKS


def sparse_attentions(model) -> list:
    return [layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is not None]


class DenseAttention:
    """Within the context the MSA layers select every block: the main attention is unmasked (dense warm-up)."""

    def __init__(self, model, on: bool = True):
        self.indexers = [a.indexer for a in sparse_attentions(model)]
        self.on = on

    def __enter__(self):
        self.saved = [i.topk_blocks for i in self.indexers]
        if self.on:
            for i in self.indexers:
                i.topk_blocks = 1 << 30
        return self

    def __exit__(self, *exc):
        for i, k in zip(self.indexers, self.saved):
            i.topk_blocks = k


class IndexerDistill:
    """Forward hooks on the MSA layers: the indexer's KL to the main attention (train.py's docstring, item 3).

    The indexer hook recomputes the index scores with gradients (from its detached input) and keeps the block
    selection it returned; the attention hands over the teacher, the main attention's probabilities on the same rows
    (`fast_paths.attention` calls `teacher_sink`; under transformers' eager attention the hook takes the probabilities
    it returns). `take(real)` returns the mean KL over index heads and real query positions of every MSA layer of the
    last forward. With `rows` > 0 the KL covers that many rows of each batch (the same rows in every layer), drawn
    at random per batch by `select` among the rows that hold a real token: its [B, H, S, S] tensors would be a large
    share of a step, and the indexer is small. A ShapeLadder's batch (`--cuda-graphs`) is filled with padding rows;
    drawn from every row, a part-filled batch's sample was all padding often enough (no real position: 0 / 0) that
    run 15's indexer KL went NaN at step ~260 and the NaN gradients emptied the indexer for the rest of the run."""

    def __init__(self, model, rows: int = 0, seed: int = 0):
        if rows < 0:
            raise ValueError(f"distill_rows must be 0 (every row) or more, got {rows}")
        self.rows, self.gen = rows, torch.Generator().manual_seed(seed)
        self.sel: torch.Tensor | None = None  # the rows of the current forward (None: all)
        self.last_rows: torch.Tensor | None = None  # those of the last `take`
        self.enabled = False
        self.kls: list[torch.Tensor] = []
        self.pending: dict[int, tuple] = {}
        self.teachers: dict[int, torch.Tensor] = {}
        self.handles = []
        self.attentions = sparse_attentions(model)
        for attn in self.attentions:
            self.handles.append(attn.indexer.register_forward_hook(self._on_indexer))
            self.handles.append(attn.register_forward_hook(self._on_attention))
            attn.teacher_sink = self._on_teacher

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for attn in self.attentions:
            del attn.teacher_sink

    def reset(self) -> None:
        """Drop what a forward that failed half-way left (a step retried eagerly starts clean)."""
        self.kls, self.sel = [], None
        self.pending.clear()
        self.teachers.clear()

    def draw(self, real: torch.Tensor) -> torch.Tensor:
        """The `rows` rows (sorted, on the host) the KL covers in a batch of more rows, from its host real-token mask
        [B, S]: the rows with a real token first, in random order, then padding rows where there are fewer (they
        weigh nothing in `take`; a captured step's index has a fixed length). A captured step (graphed_step.py)
        copies a new draw into the index tensor it was captured with before each replay."""
        order = torch.randperm(real.shape[0], generator=self.gen)
        has = real.any(1)[order]
        return torch.cat([order[has], order[~has]])[:self.rows].sort().values

    def select(self, real: torch.Tensor, device: torch.device) -> None:
        """Before an eager forward: draw its rows (none where `rows` is 0 or the batch has no more: every row)."""
        self.sel = self.draw(real).to(device) if self.rows and real.shape[0] > self.rows else None

    def _on_indexer(self, indexer, args, block_indices):
        if not self.enabled:
            return
        hidden, (cos, sin), _cache, position_ids = args
        b = hidden.shape[0]
        if self.sel is not None:
            hidden, block_indices = hidden[self.sel], block_indices[self.sel]
            cos, sin = (t[self.sel] if t.shape[0] == b else t for t in (cos, sin))
            position_ids = position_ids[self.sel] if position_ids.shape[0] == b else position_ids
        from m3serve.learn.fast_paths import qk_of

        q, k = qk_of(indexer, hidden.detach(), cos, sin)  # with gradients: the indexer's weights learn from these
        self.pending[id(indexer)] = (q, k, block_indices, position_ids)

    def _on_teacher(self, attn, query, key, block_indices, scaling: float) -> None:
        if self.enabled:
            from m3serve.learn.fast_paths import teacher_probs

            self.teachers[id(attn)] = teacher_probs(attn, query, key, block_indices, scaling, self.sel)

    def _on_attention(self, attn, args, out):
        if not self.enabled:
            return
        from m3serve.learn.fast_paths import run

        q, k, block_indices, position_ids = self.pending.pop(id(attn.indexer))
        teacher = self.teachers.pop(id(attn), None)
        h_idx = q.shape[1]
        if teacher is None:  # transformers' eager attention: its probabilities, zero outside the selected blocks
            weights = out[1].detach()  # [B, H_q, S, S]
            weights = (weights if self.sel is None else weights[self.sel]).float()
            teacher = weights.unflatten(1, (h_idx, -1)).mean(2)
        ix = attn.indexer
        self.kls.append(run("indexer_kl", ix, q, k, teacher, block_indices, position_ids.expand(q.shape[0], -1),
                            ix.block_size, ix.head_dim ** -0.5))  # [B, H_idx, S]

    def take(self, real: torch.Tensor) -> torch.Tensor:
        """Mean KL over the MSA layers, index heads and real query positions (real: bool [B, S])."""
        kls, self.kls = self.kls, []
        self.last_rows, self.sel = self.sel, None
        if not kls:
            return torch.zeros((), device=real.device)
        w = (real if self.last_rows is None else real[self.last_rows])[:, None, :].float()
        n = w.sum().clamp_min(1.0) * kls[0].shape[1]  # no real position (a batch of padding): 0, not 0 / 0
        return sum((kl * w).sum() / n for kl in kls) / len(kls)


class RouterBalance:
    """Auxiliary-loss-free MoE balancing: count each router's expert loads in the forward, then move its
    `e_score_correction_bias` by `rate` toward the mean load (down for overloaded experts). The router's top-k
    choice comes from a forward hook where the router module runs, or from its `load_sink`, which a compiled MoE
    block (fast_paths.CompiledPieces) calls instead."""

    def __init__(self, model, rate: float):
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLTopKRouter

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, MiniMaxM3VLTopKRouter)]
        self.loads: dict[int, torch.Tensor] = {}
        self.enabled = False
        self.handles = [r.register_forward_hook(self._on_router) for r in self.routers]
        for r in self.routers:
            r.load_sink = functools.partial(self._count, r)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for r in self.routers:
            del r.load_sink

    def _on_router(self, router, args, out):
        self._count(router, out[2])

    def _count(self, router, top_k_index: torch.Tensor) -> None:
        if self.enabled:  # a scatter, not bincount: no host sync for the output size on CUDA
            idx = top_k_index.flatten()
            self.loads[id(router)] = torch.zeros(router.num_experts, device=idx.device).index_add_(
                0, idx, torch.ones(idx.shape, device=idx.device))

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias steps; return the worst max/mean load ratio seen (1.0 = balanced), as a device tensor (no
        host sync per router)."""
        # made on the routers' device: a captured step (graphed_step.py) may not copy from the host
        worst = torch.ones((), device=self.routers[0].e_score_correction_bias.device if self.routers else None)
        for r in self.routers:
            load = self.loads.pop(id(r), None)
            if load is None:
                continue
            r.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = torch.maximum(worst, load.max() / load.mean().clamp_min(1e-6))
        return worst


def answer_loss(model, ids: torch.Tensor, mask: torch.Tensor, task: torch.Tensor | None = None,
                real: torch.Tensor | None = None, prompt_weight: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy of the answer tokens (position t predicts token t + 1); also their argmax hits (bool [B, S - 1],
    False off the answers); with `task` (each row's task index) also the answer tokens' loss sum and count per task
    index, detached. With
    `prompt_weight` > 0 the loss adds that share of the mean cross-entropy of the other real tokens (`real`): the
    prompts' keys, arguments and facts that recur in the row teach the model to copy from its context (an answer-only
    loss left every copying task flat on the H200 runs of 2026-12-04); the answer loss alone is in "answer"."""
    hidden = model.model(input_ids=ids).last_hidden_state
    # every position's logits and cross-entropy, then masked sums: a boolean index (hidden[sel]) would sync the host
    # with the device twice a step (its output size), and the step is host-bound
    logits = model.lm_head(hidden[:, :-1]).float()
    gold = ids[:, 1:]
    losses = F.cross_entropy(logits.transpose(1, 2), gold, reduction="none")  # [B, S - 1]
    sel = mask[:, 1:].to(losses.dtype)
    total = (losses * sel).sum() / sel.sum().clamp_min(1.0)
    hits = (logits.argmax(-1) == gold) & mask[:, 1:]  # [B, S - 1]: answer tokens predicted right
    if task is None:
        return total, hits
    n = len(TASKS)  # per-task sums by scatter: no host sync (the step's log record reads them only when it logs)
    row_task = task.to(ids.device)
    sums = torch.zeros(n, device=ids.device).index_add_(0, row_task, (losses * sel).sum(1).detach())
    counts = torch.zeros(n, device=ids.device).index_add_(0, row_task, sel.sum(1))
    stats = {"sum": sums, "count": counts, "answer": total.detach()}
    if prompt_weight > 0 and real is not None:
        other = (real[:, 1:] & ~mask[:, 1:]).to(losses.dtype)
        prompt = (losses * other).sum() / other.sum().clamp_min(1.0)
        stats["prompt"] = prompt.detach()
        total = total + prompt_weight * prompt
    return total, hits, stats


def param_groups(model, weight_decay: float) -> list[dict]:
    decay, no_decay, indexer = [], [], []
    for name, p in model.named_parameters():
        if ".indexer." in name:
            indexer.append(p)
        elif p.ndim < 2 or "norm" in name or "embed_tokens" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0},
            {"params": indexer, "weight_decay": 0.0}]


def set_lr(opt, lr: float) -> None:
    """The step's learning rate; in place where it is a device tensor (a captured step reads it there)."""
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def step_body(model, opt, groups, distill, balance, ids, mask, real, task, dense: bool, device,
              prompt_weight: float, cache: bool = True) -> dict:
    """A step's device work on batch tensors already on `device`: forward (the main attention unmasked if `dense`),
    loss, backward, clipping, the optimizer, the routers' bias; no host sync, so graphed_step.py can capture it.
    Returns the log record's device tensors."""
    with DenseAttention(model, dense), autocast(device, cache):
        lm, hits, per_task = answer_loss(model, ids, mask, task, real, prompt_weight)
    kl = distill.take(real)
    (lm + kl).backward()
    gnorm = torch.nn.utils.clip_grad_norm_(groups[0]["params"] + groups[1]["params"], 1.0)
    torch.nn.utils.clip_grad_norm_(groups[2]["params"], 1.0)
    opt.step()
    worst_load = balance.update()
    return {"loss": lm.detach(), "task_loss": per_task,
            "answer_token_acc": hits.sum() / mask[:, 1:].sum().clamp_min(1), "indexer_kl": kl.detach(),
            "grad_norm": gnorm, "max_expert_load_ratio": worst_load}


def step_record(body: dict, batch, lr: float, dense: bool) -> dict:
    """A step's log record: `step_body`'s tensors (`log_record` reads them: the host syncs only on the steps that
    log) and the host's facts of the batch."""
    return {"phase": "dense" if dense else "sparse", **body, "lr": lr, "padded_tokens": batch[0].numel(),
            "real_tokens": int(batch[2].sum())}  # on the host copy


def target_step(model, opt, groups, distill, balance, batch, lr: float, dense: bool, device,
                prompt_weight: float = 0.0, cache: bool = True) -> dict:
    """One eager optimizer step on `batch`; returns its log record. `cache`: autocast's weight-cast cache (off
    beside captured steps, so that compiled pieces see the autocast state the capture has)."""
    distill.select(batch[2], device)
    ids, mask, real, task = (t.to(device, non_blocking=True) for t in batch)
    set_lr(opt, lr)
    opt.zero_grad(set_to_none=True)  # a captured step (graphed_step.py) leaves its gradients in its graph's memory
    body = step_body(model, opt, groups, distill, balance, ids, mask, real, task, dense, device, prompt_weight, cache)
    opt.zero_grad(set_to_none=True)
    return step_record(body, batch, lr, dense)


def log_record(rec: dict) -> dict:
    """A step record's device tensors as rounded numbers (one host sync)."""
    per_task = rec["task_loss"]
    sums, counts = per_task["sum"].tolist(), per_task["count"].tolist()
    prompt = {"prompt_loss": round(float(per_task["prompt"]), 4)} if "prompt" in per_task else {}
    return {**rec, **prompt, "loss": round(float(per_task.get("answer", rec["loss"])), 4),
            "task_loss": {TASKS[t]: round(sums[t] / counts[t], 4) for t in range(len(TASKS)) if counts[t]},
            "answer_token_acc": round(float(rec["answer_token_acc"]), 4),
            "indexer_kl": round(float(rec["indexer_kl"]), 4),
            "lr": round(rec["lr"], 6), "grad_norm": round(float(rec["grad_norm"]), 3),
            "max_expert_load_ratio": round(float(rec["max_expert_load_ratio"]), 2)}
