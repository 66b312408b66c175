"""DSpark's greedy Markov phase (K positions of a vanilla head, r = 256): the fused kernels of kernels/markov.py in
both modes ("fused": 2K launches, tile widths swept; "pick": K + 1 launches, splits per SM swept) against the torch
loop (`markov_greedy_ref`, the proposer's math: about six launches per position), each captured in one CUDA graph
and replayed with L2 flushed before each replay, at batch 1, 8, 32, over the whole vocabulary (N = V = 200,064)
and a draft vocabulary of 32,768 ids. The bytes the phase must read (K times: W2 [N, r], U's [S, N] slice, the W1
rows) over the copy bandwidth measured in the same run give its floor; `frac_copy` = that floor / the faster
mode's time. `agree` / `agree_pick`: the share of drafts each mode gives as the loop does on random bf16 weights
(the bias summed in another order may round differently: only near-ties can move).

    python benchmarks/bench_markov.py --out /tmp/bench_markov.json     (one device call; prints a table)
    python benchmarks/bench_markov.py --smoke                          (CPU interpreter: tiny shapes, checks it runs)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from m3serve.kernels import platform  # noqa: E402
from m3serve.kernels.markov import markov_greedy, markov_greedy_ref  # noqa: E402


def inputs(s, k, n, r, v, device, seed=0):
    """Random bf16 weights of a trained head's order of magnitude, fp32 base logits, anchors, the draft vocabulary's
    ids (None when N = V)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w1 = (torch.randn(v, r, generator=g, device=device) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(n, r, generator=g, device=device) * 0.05).to(torch.bfloat16)
    u = torch.randn(s, k, n, generator=g, device=device) * 2
    ids = torch.randperm(v, generator=g, device=device)[:n].sort().values if n < v else None
    return w1, w2, u, torch.randint(0, v, (s,), generator=g, device=device), ids


def _best(row, prefix, variants):
    """The fastest of the timed variants {label: ms} under ``prefix``: (its label, its ms), or (None, None)."""
    timed = {lab: ms for lab, ms in variants.items() if ms is not None}
    row.update({f"{prefix}_{lab}_ms": ms for lab, ms in variants.items()})
    return min(timed.items(), key=lambda kv: kv[1]) if timed else (None, None)


def bench_one(s, k, n, r, v, block_ns, split_factors, device, timer, copy_bw):
    w1, w2, u, anchors, ids = inputs(s, k, n, r, v, device)
    row = {"cols": n, "batch": s, "K": k, "rank": r,
           "loop_ms": timer(lambda: markov_greedy_ref(w1, w2, u, anchors, ids))}
    sms = platform.num_sms(u.device)
    two = {f"bn{bn}": timer(lambda: markov_greedy(w1, w2, u, anchors, ids, block_n=bn)) for bn in block_ns}
    one = {f"bn{bn}_p{f * sms}": timer(lambda: markov_greedy(w1, w2, u, anchors, ids, block_n=bn, splits=f * sms))
           for bn in block_ns for f in split_factors}
    row["fused_cfg"], row["fused_ms"] = _best(row, "fused", two)  # 2K launches
    row["pick_cfg"], row["pick_ms"] = _best(row, "pick", one)  # K + 1 launches
    for key in ("fused", "pick"):
        if row[f"{key}_ms"] and row["loop_ms"]:
            row[f"{key}_speedup"] = row["loop_ms"] / row[f"{key}_ms"]
    ref = markov_greedy_ref(w1, w2, u, anchors, ids)
    row["agree"] = float((markov_greedy(w1, w2, u, anchors, ids, block_n=block_ns[0]) == ref).float().mean())
    row["agree_pick"] = float((markov_greedy(w1, w2, u, anchors, ids, block_n=block_ns[0], splits=sms) == ref)
                              .float().mean())
    row["bytes"] = k * (n * r * w2.element_size() + s * n * u.element_size() + s * r * w1.element_size())
    if copy_bw:
        row["floor_ms"] = row["bytes"] / copy_bw * 1e3
        best = min((x for x in (row["fused_ms"], row["pick_ms"]) if x), default=None)
        if best:
            row["frac_copy"] = row["floor_ms"] / best
    return row


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_msa import fmt_table, t_cpu, t_graph
    from ceilings import copy_bandwidth

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--cols", default="200064,32768", help="N: the columns of U and W2 (N < vocab: a draft vocabulary)")
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--block-n", default="64,128,256", help="stage-1 tile widths to time (the best is reported)")
    ap.add_argument("--splits", default="1,2,4", help="the K + 1 launch mode: column splits per SM to time")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    timer = t_cpu if args.smoke else t_graph
    batches = [2] if args.smoke else [int(x) for x in args.batches.split(",")]
    cols = [40, 33] if args.smoke else [int(x) for x in args.cols.split(",")]
    vocab, rank, k = (40, 16, 3) if args.smoke else (args.vocab, args.rank, args.k)
    block_ns = [16] if args.smoke else [int(x) for x in args.block_n.split(",")]
    split_factors = [1] if args.smoke else [int(x) for x in args.splits.split(",")]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
    copy_bw = None if args.smoke else copy_bandwidth(device)
    meta["copy_bw_TBps"] = copy_bw and copy_bw / 1e12
    print(json.dumps(meta), flush=True)
    rows = []
    for n in cols:
        for s in batches:
            rows.append(bench_one(s, k, n, rank, vocab, block_ns, split_factors, device, timer, copy_bw))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(fmt_table(rows, [("cols", "{}"), ("batch", "{}"), ("loop_ms", "{:.4f}"), ("fused_ms", "{:.4f}"),
                           ("fused_cfg", "{}"), ("fused_speedup", "{:.2f}x"), ("pick_ms", "{:.4f}"),
                           ("pick_cfg", "{}"), ("pick_speedup", "{:.2f}x"), ("floor_ms", "{:.4f}"),
                           ("frac_copy", "{:.0%}"), ("agree", "{:.4f}"), ("agree_pick", "{:.4f}")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
