"""The fused greedy Markov kernels (interpreter here, compiled in tests/gpu/test_markov_gpu.py) draft exactly the
tokens of the proposer's torch loop: with and without a draft vocabulary, ties planted inside a tile and across
tiles (the smallest column wins), NaN and -inf base logits (as torch.argmax), column counts that are a multiple of
nothing (a last tile partly empty), ranks below one dot chunk, batches below and above one sequence group's 16.
`sample_block` on the fused path (forced here: it is CUDA-only) returns the loop's drafts and confidences."""
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from m3serve.executor.speculative import proposer
from m3serve.executor.speculative.proposer import fused_markov
from m3serve.kernels.markov import markov_greedy, markov_greedy_ref
from m3serve.model.dspark_heads import MarkovHead
from support.compiled import run_uninterpreted
from support.markov import check_markov


@pytest.fixture(autouse=True)
def _fused_everywhere(monkeypatch):
    monkeypatch.setattr(proposer, "fused_markov", lambda *a: True)


@pytest.mark.parametrize("s,k,n,r,vocab,period,specials,block_n,splits", [
    (1, 7, 200, 32, False, None, False, 64, None),
    (3, 4, 331, 48, True, None, True, 64, None),
    (5, 4, 600, 32, True, 37, False, 64, None),
    (2, 3, 64, 16, False, None, True, 16, None),
    (4, 2, 257, 40, False, 13, False, 32, None),
    (20, 2, 97, 24, True, None, False, 32, None),
    (3, 3, 600, 32, True, 37, False, 32, 3),  # ties across a program's column blocks and across splits
    (2, 4, 331, 16, False, None, True, 16, 4),  # NaN, -inf: the previous draft picked inside the next launch
    (66, 2, 32, 16, True, 5, False, 16, 2),  # two sequence groups
])
def test_markov_kernel_matches_the_loop(s, k, n, r, vocab, period, specials, block_n, splits):
    check_markov(s, k, n, r, v=700, vocab=vocab, period=period, specials=specials, block_n=block_n, splits=splits)


def test_bias_rounds_to_the_weights_dtype():
    """Two columns with equal U whose exact biases are 256 and 257: in bf16 (what nn.Linear returns) both are 256, a
    tie the first column wins; kept in fp32 the second would."""
    r, n = 32, 40
    w1 = torch.zeros(3, r, dtype=torch.bfloat16)
    w1[1] = 1.0
    w2 = torch.zeros(n, r, dtype=torch.bfloat16)
    w2[20, :8] = 32.0
    w2[30, :8] = 32.0
    w2[30, 8] = 1.0
    u = torch.zeros(1, 1, n)
    anchors = torch.tensor([1])
    assert int(markov_greedy_ref(w1, w2, u, anchors)) == 20
    assert int(markov_greedy(w1, w2, u, anchors, block_n=16)) == 20
    assert int((u[0, 0] + w1[1].float() @ w2.float().T).argmax()) == 30  # fp32 bias: the other column


def test_w2_must_match_the_columns():
    with pytest.raises(ValueError, match="W2"):
        markov_greedy(torch.zeros(5, 16), torch.zeros(7, 16), torch.zeros(1, 1, 8), torch.zeros(1, dtype=torch.long))


def test_fused_path_only_where_it_applies(monkeypatch):
    """A GPU (CUDA or ROCm: the kernel is portable Triton), greedy, vanilla head, no logits kept, not switched off, not
    the interpreter: every other case keeps the loop."""
    monkeypatch.undo()  # the real gate
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    vanilla, gated = (MarkovHead(kind, 50, 16, 8, torch.float32) for kind in ("vanilla", "gated"))
    assert fused_markov(vanilla, "greedy", False, cuda)
    monkeypatch.setattr(torch.version, "hip", "7.2", raising=False)
    assert fused_markov(vanilla, "greedy", False, cuda)  # ROCm too
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fused_markov(vanilla, "greedy", False, cuda)
    monkeypatch.delenv("TRITON_INTERPRET")
    for head, method, keep, dev in [(vanilla, "greedy", False, cpu), (vanilla, "probabilistic", False, cuda),
                                    (vanilla, "greedy", True, cuda), (gated, "greedy", False, cuda),
                                    (None, "greedy", False, cuda)]:
        assert not fused_markov(head, method, keep, dev), (head and head.kind, method, keep, dev)
    monkeypatch.setenv("M3SERVE_MARKOV_KERNEL", "0")
    assert not fused_markov(vanilla, "greedy", False, cuda)


def test_the_check_sees_a_wrong_kernel(monkeypatch):
    """The shared check fails on a kernel that takes the last of tied columns (the planted ties reach it)."""
    import support.markov as support

    def last_of_ties(w1, w2, u, anchors, ids=None, block_n=64, splits=None):
        prev, out = anchors, []
        for k in range(u.shape[1]):
            z = u[:, k] + F.linear(w1[prev], w2).float()
            prev = z.shape[-1] - 1 - z.flip(-1).argmax(-1)
            out.append(prev)
        return torch.stack(out, 1)

    monkeypatch.setattr(support, "markov_greedy", last_of_ties)
    with pytest.raises(AssertionError):
        check_markov(2, 3, 80, 16, v=100, period=7)


def test_bench_markov_smoke(tmp_path):
    """benchmarks/bench_markov.py's code path on CPU (tiny shapes): both variants timed, the drafts alike."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_markov.py")
    spec = importlib.util.spec_from_file_location("bench_markov", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path / "m.json")]) == 0
    rows = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert [(r["cols"], r["batch"]) for r in rows] == [(40, 2), (33, 2)]
    assert all(r["loop_ms"] > 0 and r["fused_ms"] > 0 and r["pick_ms"] > 0 for r in rows)
    assert all(r["agree"] == r["agree_pick"] == 1.0 for r in rows)


def _compile_sm90(ptx_path: str) -> None:
    """Both kernels compiled for sm_90 as a bf16 draft launches them (run in a child process without
    TRITON_INTERPRET, which patches the language functions); stage 1's PTX (both modes) written to ``ptx_path``."""
    import triton.language as tl
    from m3serve.kernels import markov
    from support.compiled import compile_sm90

    def build(kernel, sig, cx):
        return compile_sm90(kernel, sig, cx, num_warps=4).asm["ptx"]

    i = "i32"
    ptx = [build(markov._markov_tile_kernel,
                 dict(prev_ptr="*i64", prev_stride=i, prev_part_ptr="*fp32", prev_part_i_ptr="*i32", ids_ptr="*i64",
                      tok_ptr="*i64", tok_stride=i, w1_ptr="*bf16", w1_stride=i, w2_ptr="*bf16", w2_stride=i,
                      u_ptr="*fp32", u_stride=i, part_ptr="*fp32", part_i_ptr="*i32", S=i, N=i, T=i, CHUNK=i),
                 dict(R=256, BS=16, BN=64, BR=64, CT=64, DOT_T=tl.bfloat16, PREC=None, PICK_PREV=pick, HAS_IDS=True))
           for pick in (False, True)]
    build(markov._markov_pick_kernel, dict(part_ptr="*fp32", part_i_ptr="*i32", ids_ptr="*i64", tok_ptr="*i64",
                                           tok_stride=i, T=i), dict(CT=1024, HAS_IDS=True))
    Path(ptx_path).write_text("\n".join(ptx))


def test_markov_kernels_compile_for_sm90(tmp_path):
    """What the CPU can check of the compiled path (its numbers: tests/gpu/test_markov_gpu.py): both kernels compile
    for the H200 with a bf16 draft's arguments (stage 1 in both modes), the bias on the tensor cores (mma in the
    PTX)."""
    ptx = tmp_path / "tile.ptx"
    run_uninterpreted(__file__, f"t._compile_sm90({str(ptx)!r})")
    assert ptx.read_text().count("mma.sync") >= 2
