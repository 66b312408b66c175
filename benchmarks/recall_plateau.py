"""How fast a model learns in-context associative recall (issue 27: the learned model's retrieval stayed at chance).

Synthetic token ids, no tokenizer: each row is P (key, value) pairs (keys from 256 ids, values from 200), a separator,
then the same keys asked again in a random order, each followed by its value; the loss is on those values alone. A
model that only learned to pick some value of the context scores 1/P; one with an induction head scores 1. The models:

- `m3`: the learned model's architecture at micro size (transformers' MiniMaxM3VLForCausalLM through
  `learn.train.build_target`: QK-norm, partial RoPE, MSA layers, MoE), with transformers' own init; --mlp dense,
  --kv-heads 4, --all-full and --qk-scale change one trait;
- `plain`: a pre-LayerNorm GPT with full RoPE, no QK-norm and PyTorch's default init (the control); --qk-norm,
  --rotary-fraction 0.5, --norm rms and --plain-mlp swiglu add one M3 trait at a time (--plain-mlp swiglu-oai: M3's
  own activation; swiglu-noclamp, swiglu-plus1, swiglu-alpha: its parts).
Either: --init-std re-draws every matrix (or those --init-only names), then --embed-std the token embedding; --zero
zeroes parameters by name; --mlp-frozen-steps keeps the MLPs' learning rate at 0 for the first steps. `m3` also takes
--train-init (learn/train.py's `fresh_init`, the trainer's own recipe) and --learned-size (the learned model's config).
The rows: --colon puts a separator token between each key and its value (as the old ` key:value` lines did);
--question asks each key as a retrieval turn does (a question holding the key, a reply prefix, then key and value),
from step --question-from on (plain asked lines before it); the held-out score always uses --question's rows;
--pairs-to draws each step's P log-uniform over --pairs..--pairs-to and also scores a held-out batch at the longest.
--newline, --values, --preamble and --replacement make the rows more like the learned model's (a newline after each
line, 45 values, the chat template's fixed opening, a recital drawn with replacement).

    python benchmarks/recall_plateau.py --arch m3 --pairs 4 --steps 1000 --out /tmp/recall.json

One thread; about 0.1 s a step for `m3` at 4 pairs on the project's CPU machine. Findings: docs/quality.md.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from m3serve.learn.fast_paths import swiglu

VOCAB = 512
KEYS, VALUES = (10, 266), (300, 500)  # id ranges
SEPARATOR = 3
COLON = 4  # --colon: between each key and its value, as the learned model's " key:value" lines
QUESTION, QUESTION_END, REPLY = 5, 6, 7  # --question: each asked key as "Q key ? R key value", as a retrieval turn
NEWLINE = 8  # --newline: after each line, as the learned model's list and recital put one
PREAMBLE = (266, 300)  # --preamble N: the same N tokens (these ids in turn) open every row, as the chat template does
HIDDEN, LAYERS, HEADS = 128, 4, 4


class PlainGPT(nn.Module):
    """Pre-LayerNorm decoder: RoPE on the first `rotary_fraction` of each head, optional RMS QK-norm, GELU MLP."""

    def __init__(self, qk_norm: bool = False, rotary_fraction: float = 1.0, norm: str = "layer", mlp: str = "gelu"):
        super().__init__()
        norm_of = (lambda: nn.LayerNorm(HIDDEN)) if norm == "layer" else (lambda: nn.RMSNorm(HIDDEN))
        self.mlp = mlp
        self.swiglu = mlp.startswith("swiglu")
        self.head_dim = HIDDEN // HEADS
        self.rot = int(self.head_dim * rotary_fraction) // 2 * 2
        self.qk_norm = qk_norm
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            ln1=norm_of(), qkv=nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), out=nn.Linear(HIDDEN, HIDDEN, bias=False),
            ln2=norm_of(), up=nn.Linear(HIDDEN, (8 if self.swiglu else 4) * HIDDEN),
            down=nn.Linear(4 * HIDDEN, HIDDEN))) for _ in range(LAYERS))
        self.norm = norm_of()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.rot, 2).float() / max(self.rot, 1)))

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        ang = torch.outer(torch.arange(x.shape[2], dtype=torch.float32), self.inv_freq)
        cos, sin = ang.cos(), ang.sin()
        a, b = x[..., :self.rot:2], x[..., 1:self.rot:2]
        return torch.cat([torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2), x[..., self.rot:]], -1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, _ = x.shape
        for layer in self.layers:
            q, k, v = layer["qkv"](layer["ln1"](x)).view(b, s, 3, HEADS, self.head_dim).permute(2, 0, 3, 1, 4)
            if self.qk_norm:
                q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
            a = F.scaled_dot_product_attention(self._rope(q), self._rope(k), v, is_causal=True)
            x = x + layer["out"](a.transpose(1, 2).reshape(b, s, HIDDEN))
            h = layer["up"](layer["ln2"](x))
            if self.mlp == "swiglu-oai":  # M3's: clamped, sigmoid(1.702 gate), up + 1
                h = swiglu(h, 1.702, 7.0)
            elif self.mlp == "swiglu-noclamp":  # M3's without its clamps
                h = swiglu(h, 1.702, float("inf"))
            elif self.mlp == "swiglu-plus1":  # M3's up + 1 alone
                gate, up = h.chunk(2, -1)
                h = F.silu(gate) * (up + 1.0)
            elif self.mlp == "swiglu-alpha":  # M3's sigmoid(1.702 gate) alone
                gate, up = h.chunk(2, -1)
                h = gate * torch.sigmoid(1.702 * gate) * up
            else:
                h = F.silu(h[..., ::2]) * h[..., 1::2] if self.swiglu else F.gelu(h)
            x = x + layer["down"](h)
        return self.head(self.norm(x))


def m3_model(mlp: str, kv_heads: int, seed: int, all_full: bool = False, fast: bool = True, learned: bool = False):
    """The micro model, or (`learned`) the learned model's own config (learn/config.py) over this vocabulary."""
    from m3serve.config import FULL, SPARSE
    from m3serve.learn.config import learned_config
    from m3serve.learn.train import build_target

    if learned:
        model = build_target(learned_config(VOCAB, 0, 1), torch.device("cpu"), seed, fast)
        return model, lambda ids: model(input_ids=ids).logits

    layers = [FULL] * LAYERS if all_full else [FULL, SPARSE] * (LAYERS // 2)
    mlps = ["dense"] * LAYERS if mlp == "dense" else ["dense"] + ["sparse"] * (LAYERS - 1)
    cfg = learned_config(VOCAB, 0, 1, hidden_size=HIDDEN, head_dim=HIDDEN // HEADS, index_head_dim=32,
                         num_attention_heads=HEADS, num_key_value_heads=kv_heads, index_n_heads=kv_heads,
                         intermediate_size=128, dense_intermediate_size=256, shared_intermediate_size=128,
                         num_hidden_layers=LAYERS, layer_types=layers, mlp_layer_types=mlps,
                         num_local_experts=4, index_block_size=32, index_topk_blocks=4)
    model = build_target(cfg, torch.device("cpu"), seed, fast)
    return model, lambda ids: model(input_ids=ids).logits


def batch(pairs: int, rows: int, g: torch.Generator, colon: bool = False, question: bool = False, *,
          newline: bool = False, n_values: int = VALUES[1] - VALUES[0], preamble: int = 0, replacement: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [rows, 4P + 1] (6P + 1 with `colon`: key, COLON, value) and the bool mask of the answered values. With
    `question` each asked pair is QUESTION key QUESTION_END REPLY key value (the learned model's retrieval turn: "What
    is the code for key?", the template's reply prefix, then " key value"), so the asked key occurs once more before
    the answer, followed by QUESTION_END instead of its value. The learned model's rows differ in more ways, each an
    option: `newline` ends every line with NEWLINE; `n_values` draws the values from that many ids (its words: 45);
    `preamble` opens each row with that many fixed tokens; `replacement` asks keys drawn with replacement (a
    recital: no value can be had by elimination)."""
    keys = torch.stack([torch.randperm(KEYS[1] - KEYS[0], generator=g)[:pairs] + KEYS[0] for _ in range(rows)])
    values = torch.randint(VALUES[0], VALUES[0] + n_values, (rows, pairs), generator=g)
    order = (torch.randint(0, pairs, (rows, pairs), generator=g) if replacement
             else torch.stack([torch.randperm(pairs, generator=g) for _ in range(rows)]))

    def lines(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        parts = [k, torch.full_like(k, COLON), v] if colon else [k, v]
        return torch.stack(parts + ([torch.full_like(k, NEWLINE)] if newline else []), 2).flatten(1)

    context, asked = lines(keys, values), lines(keys.gather(1, order), values.gather(1, order))
    width = (3 if colon else 2) + newline
    if question:
        k = keys.gather(1, order)
        marks = [torch.full_like(k, t) for t in (QUESTION, QUESTION_END, REPLY)]
        asked = torch.cat([torch.stack([marks[0], k, marks[1], marks[2]], 2), asked.unflatten(1, (pairs, width))],
                          2).flatten(1)
        width += 4
    opening = torch.arange(preamble) % (PREAMBLE[1] - PREAMBLE[0]) + PREAMBLE[0]
    ids = torch.cat([opening.expand(rows, preamble), context, torch.full((rows, 1), SEPARATOR), asked], 1)
    answered = torch.zeros_like(ids, dtype=torch.bool)
    answered[:, preamble + context.shape[1] + width - newline::width] = True  # each asked line's value
    return ids, answered


def _std(text: str) -> float | str:
    if text == "fan-in":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a standard deviation or 'fan-in', got {text!r}") from None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=["m3", "plain"], default="m3")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--colon", action="store_true", help="a separator token between each key and its value")
    p.add_argument("--question", action="store_true", help="each asked key as a retrieval turn: Q key ? R key value")
    p.add_argument("--question-from", type=int, default=0, help="with --question: plain asked lines before this step")
    p.add_argument("--newline", action="store_true", help="a NEWLINE token ends every line (context and asked)")
    p.add_argument("--values", type=int, default=VALUES[1] - VALUES[0], help="value ids to draw from (words: 45)")
    p.add_argument("--preamble", type=int, default=0, help="this many fixed tokens open every row (the template's)")
    p.add_argument("--replacement", action="store_true", help="asked keys drawn with replacement (a recital)")
    p.add_argument("--pairs-to", type=int, help="each step's P log-uniform over --pairs..this; also scored at this P")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--rows", type=int, default=32, help="rows per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's, on the matrices but the embedding")
    p.add_argument("--train-init", choices=["fan_in", "transformers"],
                   help="m3: learn/train.py's fresh_init (with --mlp-frozen-steps: the MLPs' down projections zeroed)")
    p.add_argument("--init-std", type=_std, help="re-draw every matrix (not the indexer's) from N(0, std); "
                   "'fan-in': each from N(0, 1/fan_in), fan_in its last dimension")
    p.add_argument("--init-only", help="with --init-std: only the matrices whose names hold one of these "
                   "comma-separated parts (plain: embed, qkv, out, up, down, head)")
    p.add_argument("--embed-std", type=float, help="then re-draw the token embedding from N(0, std)")
    p.add_argument("--zero", help="then zero the parameters whose names hold one of these comma-separated parts "
                   "(e.g. m3: down_proj; plain: down.weight)")
    p.add_argument("--mlp-frozen-steps", type=int, default=0, help="the MLPs' learning rate 0 for this many steps")
    p.add_argument("--mlp", choices=["moe", "dense"], default="moe", help="m3: MoE layers after the first, or none")
    p.add_argument("--kv-heads", type=int, default=2, help="m3")
    p.add_argument("--all-full", action="store_true", help="m3: every layer full attention (no MSA layer)")
    p.add_argument("--learned-size", action="store_true", help="m3: the learned model's config (6 layers, hidden "
                   "256), not the micro one (--mlp, --kv-heads, --all-full do not apply)")
    p.add_argument("--cosine", action="store_true", help="the learning rate decays to 5%% by --steps (cosine), "
                   "as learn/train.py's schedule does")
    p.add_argument("--eager", action="store_true", help="m3: transformers' own forward (not learn/fast_paths.py)")
    p.add_argument("--qk-scale", type=float, help="m3: start the attention QK-norm scales (1 + weight) here")
    p.add_argument("--qk-norm", action="store_true", help="plain")
    p.add_argument("--rotary-fraction", type=float, default=1.0, help="plain")
    p.add_argument("--norm", choices=["layer", "rms"], default="layer", help="plain: LayerNorm or RMSNorm")
    p.add_argument("--plain-mlp", choices=["gelu", "swiglu", "swiglu-oai", "swiglu-noclamp", "swiglu-plus1", "swiglu-alpha"], default="gelu", help="plain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out")
    a = p.parse_args(argv)
    for name in ("pairs", "pairs_to"):
        n = getattr(a, name)
        if n is not None and not 1 <= n <= KEYS[1] - KEYS[0]:
            p.error(f"--{name.replace('_', '-')} must be 1..{KEYS[1] - KEYS[0]} (the key ids), got {n}")
    if a.pairs_to is not None and a.pairs_to < a.pairs:
        p.error(f"--pairs-to must be at least --pairs ({a.pairs}), got {a.pairs_to}")
    for name in ("steps", "rows", "log_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(a, name)}")
    if not 0 <= a.rotary_fraction <= 1:
        p.error(f"--rotary-fraction must be 0..1, got {a.rotary_fraction}")
    if a.train_init and a.arch != "m3":
        p.error("--train-init is the learned model's (--arch m3)")
    if a.init_only and a.init_std is None:
        p.error("--init-only needs --init-std")
    if not 1 <= a.values <= VALUES[1] - VALUES[0]:
        p.error(f"--values must be 1..{VALUES[1] - VALUES[0]}, got {a.values}")
    if not 0 <= a.preamble <= 1000:
        p.error(f"--preamble must be 0..1000, got {a.preamble}")
    shape = {"newline": a.newline, "n_values": a.values, "preamble": a.preamble, "replacement": a.replacement}
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    if a.arch == "m3":
        model, logits_of = m3_model(a.mlp, a.kv_heads, a.seed, a.all_full, not a.eager, a.learned_size)
    else:
        model = PlainGPT(a.qk_norm, a.rotary_fraction, a.norm, a.plain_mlp)
        logits_of = model
    if a.train_init:
        from m3serve.learn.train import fresh_init

        fresh_init(model, a.train_init, a.seed, silent_mlps=a.mlp_frozen_steps > 0)
    if a.init_std is not None:
        parts = a.init_only.split(",") if a.init_only else [""]
        with torch.no_grad():
            for name, w in model.named_parameters():
                if w.ndim >= 2 and ".indexer." not in name and any(x in name for x in parts):
                    w.normal_(0.0, w.shape[-1] ** -0.5 if a.init_std == "fan-in" else a.init_std)
    if a.embed_std is not None:
        with torch.no_grad():
            (model.model.embed_tokens if a.arch == "m3" else model.embed).weight.normal_(0.0, a.embed_std)
    if a.zero:
        with torch.no_grad():
            for name, w in model.named_parameters():
                if any(x in name for x in a.zero.split(",")):
                    w.zero_()
    if a.qk_scale is not None and a.arch == "m3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.fill_(a.qk_scale - 1.0)
                layer.self_attn.k_norm.weight.fill_(a.qk_scale - 1.0)
    embed = model.model.embed_tokens.weight if a.arch == "m3" else model.embed.weight
    mlp_parts = (".mlp.",) if a.arch == "m3" else (".up.", ".down.")
    groups = {}
    for name, w in model.named_parameters():
        decay = w.ndim >= 2 and w is not embed
        groups.setdefault((decay, any(x in name for x in mlp_parts)), []).append(w)
    opt = torch.optim.AdamW([{"params": ws, "weight_decay": a.weight_decay if decay else 0.0, "mlp": mlp}
                             for (decay, mlp), ws in groups.items()], lr=a.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(a.seed + 1)
    held_out = torch.Generator().manual_seed(a.seed + 2)
    curve, t0 = [], time.time()
    for step in range(1, a.steps + 1):
        for group in opt.param_groups:
            frozen = group["mlp"] and step <= a.mlp_frozen_steps
            decay = 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / a.steps)) if a.cosine else 1.0
            group["lr"] = 0.0 if frozen else a.lr * min(1.0, step / 30) * decay
        pairs = a.pairs
        if a.pairs_to:  # this step's P log-uniform over pairs..pairs_to (the learned model's training contexts)
            pairs = min(a.pairs_to, int(math.exp(random.Random(a.seed * 100_003 + step).uniform(
                math.log(a.pairs), math.log(a.pairs_to + 1)))))
        ids, answered = batch(pairs, a.rows, g, a.colon, a.question and step >= a.question_from, **shape)
        logits = logits_of(ids)[:, :-1].float()
        sel, gold = answered[:, 1:], ids[:, 1:]
        loss = F.cross_entropy(logits[sel], gold[sel])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % a.log_every == 0 or step == a.steps:
            acc = (logits.argmax(-1)[sel] == gold[sel]).float().mean().item()
            curve.append({"step": step, "loss": round(loss.item(), 4), "acc": round(acc, 4)})
            if a.pairs_to:  # and on a held-out batch of the longest contexts
                with torch.no_grad():
                    ids, answered = batch(a.pairs_to, a.rows, held_out, a.colon, a.question, **shape)
                    hits = logits_of(ids)[:, :-1].argmax(-1)[answered[:, 1:]] == ids[:, 1:][answered[:, 1:]]
                curve[-1] |= {"pairs": pairs, f"acc_at_{a.pairs_to}": round(hits.float().mean().item(), 4)}
            print(json.dumps(curve[-1] | {"s": round(time.time() - t0, 1)}), flush=True)
    result = {"args": vars(a), "chance_from_context": 1 / a.pairs, "curve": curve}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
