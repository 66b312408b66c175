"""Does the retrieval-first phase (learn/train.py `RetrievalFirst`) form the in-context lookup on the learned config
with the real word-retrieval task? Trains a fresh target (the trainer's init: fan_in, silent MLPs frozen for the
first quarter) on 2-16-pair retrieval rows alone through `train_target`, keeps the weights every 100 steps, then
scores each by teacher-forced exact match on 100 held-out prompts of 16 pairs and of RETRIEVAL_PAIRS (the eval's
length). The held-out prompts are question turns whatever the training rows (--recital: plain recitals by default, as
the trainer's phase; chat: in the template; none: question turns), plus 100 recitals of 8 pairs in the training rows'
form (chat where they are question turns; exact match: every recited value right). docs/quality.md ("The
retrieval-first phase on the CPU" and after) has its runs:
    python benchmarks/retrieval_first.py --threads 2 --budget-s 2400 --planned-steps 1200 --tokens-per-batch 6144
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

import m3serve.learn.tasks as tasks
from m3serve.learn.config import learned_config
from m3serve.learn.data import RECITALS, make_rows
from m3serve.learn.render import recital_row, render
from m3serve.learn.tokenizer import build_tokenizer
from m3serve.learn.train import TrainConfig, build_target, exact_match, fresh_init, train_target
from m3serve.text.tokenizer import Tokenizer


def eval_rows(tok, pairs: int, n: int, recital: str = "none") -> list:
    """n held-out retrieval rows whose contexts hold `pairs` pairs: question turns, or (`recital` "chat" or "plain")
    recitals, whose exact match needs every recited value right (chance (1 / pairs) ** pairs without a lookup)."""
    retrieval = tasks.TASKS.index("retrieval")
    examples = tasks.make_examples("retrieval", "eval", n, seed=1, pairs=pairs)
    if recital != "none":
        rng = random.Random(1)
        return [(*recital_row(ex, rng, tok, plain=recital == "plain"), retrieval) for ex in examples]
    return [(*render(ex, tok), retrieval) for ex in examples]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=4200)
    p.add_argument("--tokens-per-batch", type=int, default=6144)
    p.add_argument("--rows", type=int, default=12000)
    p.add_argument("--max-pairs", type=int, default=16)
    p.add_argument("--planned-steps", type=int, default=1600, help="the cosine schedule's length")
    p.add_argument("--min-lr-ratio", type=float, default=TrainConfig.min_lr_ratio,
                   help="where the cosine decay ends (1: a constant rate after the warm-up, as the trainer's phase has "
                   "near the start of a long run; the trainer's default decays within --planned-steps)")
    p.add_argument("--prompt-loss-weight", type=float, default=TrainConfig.prompt_loss_weight,
                   help="the context tokens' cross-entropy, this much of it added (the trainer's default)")
    p.add_argument("--recital", choices=RECITALS, default=TrainConfig.focus_recital,
                   help="recital rows, plain or in the chat template (as the trainer's focus_recital), or none: "
                   "question turns")
    p.add_argument("--out", help="JSON of the curve and the scores")
    a = p.parse_args()
    if not 0 <= a.min_lr_ratio <= 1:  # NaN too
        p.error(f"--min-lr-ratio must be in [0, 1], got {a.min_lr_ratio}")
    torch.set_num_threads(a.threads)
    cpu = torch.device("cpu")
    tok_dir = tempfile.mkdtemp(prefix="m3-retrieval-first-")
    tok = build_tokenizer(tok_dir, seed=0)
    cfg = learned_config(-(-tok["vocab_size"] // 64) * 64, tok["bos_token_id"], tok["eos_token_id"])
    pad = tok["pad_token_id"] if tok.get("pad_token_id") is not None else tok["eos_token_id"]
    rows = make_rows(tok_dir, ("retrieval",), "train", a.rows, 3, workers=a.threads, packed={"retrieval": 32},
                     max_pairs=a.max_pairs, recital=a.recital)
    text_tok = Tokenizer.from_pretrained(tok_dir)
    evals = {f"{pairs}_pairs": eval_rows(text_tok, pairs, 100) for pairs in (16, tasks.RETRIEVAL_PAIRS)}
    evals["8_pairs_recital"] = eval_rows(text_tok, 8, 100, recital="chat" if a.recital == "none" else a.recital)
    model = build_target(cfg, cpu, 0)
    fresh_init(model, "fan_in", 0, True)
    tc = TrainConfig(out=os.path.join(tok_dir, "m"), device="cpu", tokens_per_batch=a.tokens_per_batch,
                     max_steps=a.planned_steps, log_every=25, prompt_loss_weight=a.prompt_loss_weight,
                     min_lr_ratio=a.min_lr_ratio)
    kept, curve = {}, []

    def log(msg: str) -> None:
        print(msg, flush=True)
        if msg.startswith("target {"):
            rec = json.loads(msg[len("target "):])
            curve.append(rec)
            if rec["step"] % 100 == 0:
                kept[rec["step"]] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    res = train_target(model, rows, tc, cpu, time.time() + a.budget_s, pad, log)
    kept[res["steps"]] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    scores = []
    for step in sorted(kept):
        model.load_state_dict(kept[step])
        row = {"step": step, **{name: exact_match(model, ev, cpu, pad, 8192)["retrieval"] for name, ev in evals.items()}}
        scores.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "steps": res["steps"], "curve": curve, "scores": scores}, f, indent=1)


if __name__ == "__main__":
    main()
