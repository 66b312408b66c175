"""How much do neighbouring query tokens' MSA block selections overlap in a trained model? The MSA prefill kernel
(`msa_attention._msa_prefill_kernel`) takes a tile of several consecutive query tokens x the query heads of one KV
head, and visits every block that any token of the tile selected, for all the tile's rows: the blocks it computes per
block a token needs is the tile's union over a token's own count. bench_msa draws random index queries, so its tokens'
selections are unrelated; this measures the same ratio on the learned model (models/m3-tiny-learned, the CPU
reference attention) over held-out prompts, beside the same tokens' selections redrawn at random (each token keeps its
local block and draws the rest uniformly from the blocks it may see), and writes a table + JSON.

Counted: prompt tokens that can see more than twice `index_topk_blocks` blocks (fewer, and every block is selected
whatever the queries), per sparse layer and index head.
    python benchmarks/selection_overlap.py --model models/m3-tiny-learned --n 40 --out /tmp/overlap.json
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys

import torch

import m3serve.model.layers.attention as attention
from m3serve import LLM, SamplingParams
from m3serve.learn.evaluate import eval_sets
from m3serve.learn.render import prompt_ids

TILES = (1, 2, 4, 8)


def capture(model: str, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(block ids [H, T, topk], positions [T], block size) of every prefill the reference indexer ran."""
    seen = []
    real = attention.indexer_topk_ref

    def spy(iq, ik, pos, block_size, topk, local_blocks=1):
        ids = real(iq, ik, pos, block_size, topk, local_blocks)
        if ids.shape[1] > 1:  # prefill chunks: decode steps have one query
            seen.append((ids.clone(), pos.clone(), block_size))
        return ids

    attention.indexer_topk_ref = spy
    try:
        with LLM(model=model, device="cpu", dtype="float32", max_model_len=4096, max_num_batched_tokens=4096,
                 seed=0) as llm:
            for p in prompts:
                llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        attention.indexer_topk_ref = real
    return seen


def _random_like(ids: torch.Tensor, pos: torch.Tensor, block_size: int, rng: random.Random) -> torch.Tensor:
    """Each token's selection redrawn: its own block, the rest uniformly among the blocks it may see."""
    out = torch.full_like(ids, -1)
    H, T, k = ids.shape
    for t in range(T):
        own = int(pos[t]) // block_size
        for h in range(H):
            n = int((ids[h, t] >= 0).sum())
            rest = rng.sample(range(own), min(n - 1, own))
            out[h, t, :1 + len(rest)] = torch.tensor([own] + rest, dtype=ids.dtype)
    return out


def ratios(ids: torch.Tensor, pos: torch.Tensor, block_size: int, topk: int) -> dict[int, tuple[float, int]]:
    """Per tile size: blocks a tile visits over the blocks a token needs (summed over the counted tiles), and the
    tiles counted (those whose first token can see more than 2 topk blocks)."""
    H, T, _ = ids.shape
    out = {}
    for tile in TILES:
        visited = needed = tiles = 0
        for h in range(H):
            for t0 in range(0, T - tile + 1, tile):
                if int(pos[t0]) // block_size + 1 <= 2 * topk:
                    continue
                sel = ids[h, t0:t0 + tile]
                valid = sel[sel >= 0]
                visited += len(set(valid.tolist()))
                needed += len(valid) / tile
                tiles += 1
        out[tile] = (visited / needed if needed else float("nan"), tiles)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/m3-tiny-learned")
    ap.add_argument("--n", type=int, default=40, help="held-out prompts per task")
    ap.add_argument("--tasks", default="retrieval", help="tasks whose prompts are long enough (the others: none)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from m3serve.text.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(a.model)
    with open(f"{a.model}/config.json") as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    topk = cfg["index_topk_blocks"]
    rows = []
    rng = random.Random(0)
    for task in a.tasks.split(","):
        sets = eval_sets(a.n, tasks=(task,))
        prompts = [prompt_ids(ex, tok) for ex in sets[task]]
        seen = capture(a.model, prompts)
        for kind in ("learned", "random"):
            tot = {t: [0.0, 0] for t in TILES}
            for ids, pos, bs in seen:
                sel = ids if kind == "learned" else _random_like(ids, pos, bs, rng)
                for t, (r, n) in ratios(sel, pos, bs, topk).items():
                    if n:
                        tot[t][0] += r * n
                        tot[t][1] += n
            rows.append({"task": task, "selections": kind, "prompt_tokens": sum(len(p) for p in prompts),
                         **{f"tile{t}": (tot[t][0] / tot[t][1] if tot[t][1] else None) for t in TILES},
                         "tiles_counted": {t: tot[t][1] for t in TILES}})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"model": a.model, "n": a.n, "topk": topk, "block_size": cfg["index_block_size"], "commit": commit,
           "rows": rows}
    print(f"blocks a tile visits per block a token needs ({a.model}, top-{topk} blocks of "
          f"{cfg['index_block_size']} tokens, {a.n} prompts per task, commit {commit})")
    print("| task | selections | " + " | ".join(f"{t}-token tiles" for t in TILES) + " |")
    print("|---|---|" + "---|" * len(TILES))
    for r in rows:
        print(f"| {r['task']} | {r['selections']} | "
              + " | ".join("-" if r[f"tile{t}"] is None else f"{r[f'tile{t}']:.2f}" for t in TILES) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
