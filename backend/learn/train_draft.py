"""Train the learned model's DSpark draft (design/dspark.md section 6) on the frozen target, and save it where the
engine looks for it (`<model>/dspark/`, the DeepSeek format backend/model/dspark_loader.py reads).

The draft is the engine's own `DSparkDraft` (backend/model/dspark.py) with gradients switched on: 2 layers of the
target's widths, tapped target layers evenly spread below the last one, a vanilla Markov head (rank
`--draft-markov-rank`), a confidence head with Markov features, blocks of 7 drafted tokens from the anchor
(sample-from-anchor), the target's frozen embedding and lm_head, and a reserved token as the mask token.

One training step: the target (no gradients, its MSA mask on) runs on a batch and its tapped hidden states become the
draft's context rows; `draft_anchors` random anchors per sequence are drawn among the answer tokens (an anchor is a
token the target generated, and the block after it must still be answer); all blocks of all anchors go through
the draft in one forward, each block's rows seeing the context rows before its anchor and its own block
(bidirectional), never another block. Loss per drafted position k (1-based) = 0.1 CE (the data token, which the
trained target reproduces) + 0.9 TV (sum |p_draft - p_target|) + 1.0 BCE (confidence vs 1 - TV / 2), weighted
exp(-(k - 1) / 4); the Markov bias reads the true previous tokens (teacher forcing).
"""
from __future__ import annotations

import json
import math
import random
import time

import torch
import torch.nn.functional as F

from m3serve.learn.graphed_step import CapturedSteps, adamw
from m3serve.learn.loop import Schedule, ShapeLadder, autocast, batches, collate, prefetch
from m3serve.learn.step import set_lr
from m3serve.learn.tasks import TASKS
from m3serve.model.dspark import DSparkDraft, SharedTargetParts
from m3serve.model.dspark_taps import TapRecorder
from m3serve.model.dspark_tiny import tiny_dspark_config, write_dspark

MASK_TOKEN = "]<]video[>["  # a reserved M3 special token that no chat in the tasks contains
CE_W, TV_W, BCE_W, POSITION_DECAY = 0.1, 0.9, 1.0, 4.0


def tap_layers(num_layers: int, m: int = 3) -> list[int]:
    """m target layers evenly spread over 1 .. num_layers - 2 (HF ids; the last layer's output is post-norm)."""
    ids = list(range(1, num_layers - 1)) or [-1]
    if len(ids) <= m:
        return ids
    return sorted({ids[round(i * (len(ids) - 1) / (m - 1))] for i in range(m)})


def build_draft(target, cfg, tc, mask_token_id: int, device: torch.device) -> DSparkDraft:
    dcfg = tiny_dspark_config(cfg, num_hidden_layers=tc.draft_layers, mask_token_id=mask_token_id,
                              target_layer_ids=tap_layers(cfg.num_hidden_layers), markov_rank=tc.draft_markov_rank)
    torch.manual_seed(tc.seed + 17)
    draft = DSparkDraft(dcfg, SharedTargetParts(target.model.embed_tokens, target.lm_head), torch.float32)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                continue  # Qwen3-style scales, initialised to 1
            if "markov_w2" in name or "confidence_head" in name:
                p.zero_()  # no Markov bias and a 0.5 confidence to start from
            else:
                p.normal_(0.0, 0.02)
    return draft.to(device).requires_grad_(True)


def sample_anchors(mask: torch.Tensor, n: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n anchors per row among the answer tokens t whose next token is answer too ([B, n] positions, valid), on
    `mask`'s device (the trainer passes the batch's host copy)."""
    cand = (mask[:, :-1] & mask[:, 1:]).cpu()
    b = mask.shape[0]
    anchors = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    for r in range(b):
        pos = cand[r].nonzero().flatten().tolist()
        pick = sorted(rng.sample(pos, min(n, len(pos))))
        anchors[r, :len(pick)] = torch.tensor(pick, dtype=torch.long)
        valid[r, :len(pick)] = True
    return anchors.to(mask.device), valid.to(mask.device)


def block_hidden(draft: DSparkDraft, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The draft's block hidden states for many anchors per sequence in one forward (with gradients).

    feats [B, S, m*H] tapped target rows, ids [B, S], anchors [B, A] -> h [B, A, gamma, H]. Block a of row b
    sits at positions t..t+gamma-1 (t = anchors[b, a]) and sees context rows j < t and its own gamma rows."""
    cfg, g = draft.config, draft.config.block_size
    b, s = ids.shape
    a = anchors.shape[1]
    dev = ids.device
    c = draft.hidden_norm(draft.fc(feats.to(draft.dtype))).reshape(b * s, -1)
    cos_c, sin_c = draft.rotary(torch.arange(s, device=dev).repeat(b), c.dtype)
    block_ids = torch.full((b, a, g), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    x = draft.shared.embed_tokens(block_ids).reshape(b, a * g, -1).to(draft.dtype)
    positions = (anchors[:, :, None] + torch.arange(g, device=dev)).reshape(-1)
    cos_b, sin_b = draft.rotary(positions, c.dtype)
    row_anchor = anchors.repeat_interleave(g, dim=1)  # [B, A*g]
    ctx = torch.arange(s, device=dev)[None, None, :] < row_anchor[:, :, None]
    block_of = torch.arange(a, device=dev).repeat_interleave(g)
    own = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    mask = torch.cat([ctx, own], -1)
    for layer in draft.layers:
        k, v = layer.self_attn.kv(c, cos_c, sin_c)
        x = layer(x, cos_b, sin_b, (k.view(b, s, *k.shape[1:]), v.view(b, s, *v.shape[1:])), mask)
    return draft.norm(x).view(b, a, g, -1)


def draft_step_losses(draft: DSparkDraft, target, ids: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor,
                      valid: torch.Tensor, autocast) -> dict[str, torch.Tensor]:
    """The section-6 losses of one batch (and the greedy per-position match, for the acceptance estimate)."""
    g = draft.block_size
    b, s = ids.shape
    with torch.no_grad(), autocast, TapRecorder(target, draft.tap_layers) as taps:
        last = target.model(input_ids=ids).last_hidden_state
        feats = taps.take().float()
        pos = anchors[:, :, None] + torch.arange(g, device=ids.device)  # row k predicts token pos + 1
        nxt = (pos + 1).clamp(max=s - 1)
        p_t = torch.softmax(target.lm_head(last.gather(1, pos.clamp(max=s - 1).reshape(b, -1, 1).expand(
            -1, -1, last.shape[-1]))).float(), -1).view(b, *pos.shape[1:], -1)
    ok = valid[:, :, None] & (pos + 1 < s) & mask.gather(1, nxt.reshape(b, -1)).view_as(pos)
    gold = ids.gather(1, nxt.reshape(b, -1)).view_as(pos)
    prev = torch.cat([ids.gather(1, anchors)[:, :, None], gold[:, :, :-1]], -1)
    h = block_hidden(draft, feats, ids, anchors)
    z = draft.shared.lm_head(h).float() + draft.markov_head.block(h.flatten(0, 1), prev.flatten(0, 1)).view(
        *h.shape[:3], -1)
    logp = torch.log_softmax(z, -1)
    ce = -logp.gather(-1, gold[..., None])[..., 0]
    tv = (logp.exp() - p_t).abs().sum(-1)
    conf = draft.confidence_head(h, draft.markov_head.prev_embedding(prev))
    bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), (1 - 0.5 * tv.detach()).clamp(0, 1), reduction="none")
    w = torch.exp(-torch.arange(g, device=ids.device, dtype=torch.float32) / POSITION_DECAY) * ok
    denom = w.sum().clamp_min(1e-9)
    out = {name: (w * v).sum() / denom for name, v in (("ce", ce), ("tv", tv), ("bce", bce))}
    out["loss"] = CE_W * out["ce"] + TV_W * out["tv"] + BCE_W * out["bce"]
    out["match"] = (z.argmax(-1) == p_t.argmax(-1)) & ok  # greedy draft token = greedy target token
    out["ok"] = ok
    return out


def with_anchors(it, n: int, rng: random.Random):
    """`batches`' (ids, mask, real, task) as (ids, mask, anchors, valid): the anchors drawn on the host, in the
    batch-prefetch thread."""
    for ids, mask, _real, _task in it:
        yield (ids, mask, *sample_anchors(mask, n, rng))


def draft_step_body(draft, target, params, opt, batch, autocast) -> dict:
    """One draft update on a batch already on the device (ids, mask, anchors, valid): the losses, backward,
    clipping, the optimizer; no host sync, so `DraftSteps` can capture it. Returns the losses' tensors."""
    out = draft_step_losses(draft, target, *batch, autocast)
    out["loss"].backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return {k: v.detach() for k, v in out.items()}


class DraftSteps(CapturedSteps):
    """The draft's update from one CUDA graph per batch shape (train-learned `--cuda-graphs`; graphed_step.py): the
    frozen target's forward, the draft's forward and backward, clipping and the fused AdamW in one replay."""

    what = "draft"

    def __init__(self, draft, target, params, opt, device: torch.device, log):
        super().__init__(opt, device, log)
        self.draft, self.target, self.params = draft, target, params

    def step(self, batch, lr: float) -> dict:
        return self.run(tuple(batch[0].shape), batch, lr)

    def eager(self, batch, lr: float, key: tuple) -> dict:
        return draft_step(self.draft, self.target, self.params, self.opt, batch, lr, self.device, cache=False)

    def body(self, inputs, key: tuple) -> dict:
        return draft_step_body(self.draft, self.target, self.params, self.opt, inputs, autocast(self.device, False))


def draft_step(draft, target, params, opt, batch, lr: float, device: torch.device, cache: bool = True) -> dict:
    """One eager draft update on a host batch; `cache`: autocast's weight-cast cache (off beside captured steps)."""
    batch = tuple(t.to(device, non_blocking=True) for t in batch)
    set_lr(opt, lr)
    opt.zero_grad(set_to_none=True)  # a captured step leaves its gradients in its graph's memory
    out = draft_step_body(draft, target, params, opt, batch, autocast(device, cache))
    opt.zero_grad(set_to_none=True)
    return out


class Acceptance:
    """Per-position conditional acceptance of greedy drafts: alpha_k = P(draft k accepted | drafts < k accepted),
    over blocks whose position k is still answer; E[accepted] = sum_k prod_{i<=k} alpha_i."""

    def __init__(self, gamma: int):
        self.hit = torch.zeros(gamma)
        self.tried = torch.zeros(gamma)

    def add(self, match: torch.Tensor, ok: torch.Tensor) -> None:
        before = torch.cumprod(torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], -1).float(), -1)
        self.tried += (before * ok).flatten(0, -2).sum(0).cpu()
        self.hit += (before * match).flatten(0, -2).sum(0).cpu()

    def report(self) -> dict:
        """alpha per position (None where no block reached it), blocks, E[accepted] over the positions reached."""
        alpha = [round(float(h / t), 4) if t > 0 else None for h, t in zip(self.hit, self.tried)]
        reached = [a for a in alpha if a is not None]
        return {"alpha": alpha, "blocks": int(self.tried[0]),
                "expected_accepted": round(sum(math.prod(reached[:k + 1]) for k in range(len(reached))), 3)}


def train_and_save_draft(target, cfg, rows, eval_rows, tc, device: torch.device, deadline: float, pad_id: int,
                         out_dir: str, log) -> dict:
    from m3serve.text.tokenizer import Tokenizer

    t0 = time.time()
    target.requires_grad_(False)
    mask_id = Tokenizer.from_pretrained(tc.out).token_id(MASK_TOKEN)
    draft = build_draft(target, cfg, tc, mask_id, device)
    params = [p for p in draft.parameters()]
    graphed = tc.cuda_graphs and device.type == "cuda"
    opt = adamw(params, tc.draft_lr, device, graphed, weight_decay=0.0)
    graphs = DraftSteps(draft, target, params, opt, device, log) if graphed else None
    sched = Schedule(tc.draft_lr, 20, tc.draft_max_steps, 0.1, first_plan=20, every=50)
    train_rows = [r for r in rows if sum(r[1]) >= 2]
    ladder = ShapeLadder(ratio=tc.graph_ladder_ratio) if graphed else None
    data = prefetch(with_anchors(batches(train_rows, tc.draft_tokens_per_batch, random.Random(tc.seed + 2), pad_id,
                                         ladder=ladder), tc.draft_anchors, random.Random(tc.seed + 1)),
                    pin=device.type == "cuda")
    curve, step = [], 0
    log(f"draft: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters, taps {draft.tap_layers}, "
        f"block {draft.block_size}, mask token {mask_id}")
    while step < sched.total and time.time() < deadline:
        sched.tick(step, deadline)
        batch = next(data)
        out = (graphs.step(batch, sched.lr(step)) if graphs is not None else
               draft_step(draft, target, params, opt, batch, sched.lr(step), device))
        step += 1
        if step % tc.log_every == 0 or step == 1:
            acc = Acceptance(draft.block_size)
            acc.add(out["match"], out["ok"])
            rec = {"step": step, **{k: round(float(out[k]), 4) for k in ("loss", "ce", "tv", "bce")},
                   "alpha_1": acc.report()["alpha"][0], "elapsed_s": round(time.time() - t0, 1),
                   "planned_steps": sched.total}
            curve.append(rec)
            log("draft " + json.dumps(rec))
    data.close()
    draft.eval()
    result = {"steps": step, "planned_steps": sched.total, "wall_s": round(time.time() - t0, 1), "curve": curve,
              "config": draft.config.to_dict(), "cuda_graphs": graphs.summary() if graphs is not None else None}
    del graphs
    save_draft(draft, target, out_dir)
    result["eval"] = evaluate_draft(draft, target, eval_rows, device, pad_id, tc, collate, autocast)
    log("eval draft (greedy acceptance, teacher-forced) " + json.dumps(result["eval"]["all"]))
    return result


@torch.no_grad()
def evaluate_draft(draft, target, eval_rows, device, pad_id: int, tc, collate, autocast) -> dict:
    """Greedy acceptance per position on the eval rows: every answer position is an anchor."""
    per_task = {t: Acceptance(draft.block_size) for t in TASKS}
    overall = Acceptance(draft.block_size)
    rows = sorted((r for r in eval_rows if sum(r[1]) >= 2), key=lambda r: len(r[0]))
    n = max(1, tc.draft_tokens_per_batch // max(1, len(rows[-1][0]) if rows else 1))
    for i in range(0, len(rows), n):
        chunk = rows[i:i + n]
        ids, mask, _ = (t.to(device) for t in collate(chunk, pad_id))
        longest = int((mask[:, :-1] & mask[:, 1:]).sum(-1).max())
        anchors, valid = sample_anchors(mask, max(1, longest), random.Random(0))
        out = draft_step_losses(draft, target, ids, mask, anchors, valid, autocast(device))
        overall.add(out["match"], out["ok"])
        for r, row in enumerate(chunk):
            per_task[TASKS[row[2]]].add(out["match"][r], out["ok"][r])
    return {"all": overall.report(), **{t: a.report() for t, a in per_task.items() if a.tried[0] > 0}}


def save_draft(draft: DSparkDraft, target, out_dir: str, draft_vocab_ids=None) -> None:
    """bf16 tensors under the DeepSeek names, with copies of the target's embedding and lm_head (as DeepSeek's
    checkpoints carry them; the loader checks them against the target); `draft_vocab_ids` (most frequent first): a
    draft vocabulary stored with it (`speculative_config.draft_vocab_size` uses it; the draft trains on all of V)."""
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in draft.state_dict().items()}
    state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().to(torch.bfloat16).cpu()
    state["lm_head.weight"] = target.lm_head.weight.detach().to(torch.bfloat16).cpu()
    write_dspark(out_dir, draft.config, state, draft_vocab_ids)
