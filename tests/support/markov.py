"""The fused greedy Markov check shared by the interpreter tests (tests/kernels) and the GPU tests (tests/gpu).

Weights and base logits are small multiples of powers of two, so every product and every fp32 sum of the bias is
exact whatever the order of the additions (the kernel's tl.dot and the reference's GEMM add in different orders):
the bias, z and the drafts must then be equal, not close. The bias still rounds to bf16 (sums reach 11 bits)."""
import torch
from torch import nn

from m3serve.executor.speculative.proposer import fused_markov, sample_block
from m3serve.kernels.markov import markov_greedy, markov_greedy_ref
from m3serve.model.dspark_heads import ConfidenceHead, MarkovHead

HIDDEN = 32


def markov_inputs(s, k, n, r, v, device, vocab=False, period=None, seed=0):
    """(W1 bf16 [v, r], W2 bf16 [n, r], U fp32 [s, k, n], anchors [s], vocab_ids [n] or None). ``period`` P: column
    c >= P repeats column c % P (its W2 row and its U), so every maximum of z is tied N / P ways and the draft's
    column must be < P (the smallest)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randint(-2, 3, (v, r), generator=g, device=device).to(torch.bfloat16)
    w2 = (torch.randint(-2, 3, (n, r), generator=g, device=device) / 16).to(torch.bfloat16)
    u = torch.randint(-8, 8, (s, k, n), generator=g, device=device).float() / 4
    if period is not None:
        src = torch.arange(n, device=device) % period
        w2, u = w2[src].contiguous(), u[..., src].contiguous()
    ids = torch.randperm(v, generator=g, device=device)[:n].sort().values if vocab else None
    return w1, w2, u, torch.randint(0, v, (s,), generator=g, device=device), ids


def plant_specials(u):
    """Sequence 0, position 0: NaN at two columns (the first wins, as in torch.argmax); sequence 1, position 1: -inf
    everywhere (column 0 wins)."""
    s, k, n = u.shape
    u[0, 0, n - 1] = u[0, 0, n // 3] = float("nan")
    if s > 1 and k > 1:
        u[1, 1] = float("-inf")


def heads(w1, w2, v, r, device, seed=0):
    """A vanilla Markov head holding W1 and W2 (W2 of a draft vocabulary: its N rows, as `use_draft_vocab`), and a
    confidence head reading [h ; W1[x_{k-1}]]."""
    with torch.device(device):  # made where they run (the real vocabulary's W1 and W2 hold 51M entries each)
        markov, conf = MarkovHead("vanilla", v, r, HIDDEN, torch.bfloat16), ConfidenceHead(HIDDEN, r)
    markov.markov_w1.weight = nn.Parameter(w1, requires_grad=False)
    markov.markov_w2.weight = nn.Parameter(w2, requires_grad=False)
    with torch.no_grad():
        conf.proj.weight.copy_(torch.randn(conf.proj.weight.shape, generator=torch.Generator().manual_seed(seed)) / 8)
    return markov, conf


def check_markov(s, k, n, r, v, device="cpu", vocab=False, period=None, specials=False, block_n=64, splits=None):
    """The kernels' drafts (``block_n``, ``splits``: `markov_greedy`'s) equal the reference's and the proposer's
    torch loop's exactly; `sample_block` without kept logits (the fused path where `fused_markov` allows it) gives
    the loop's drafts and confidences."""
    device = torch.device(device)
    w1, w2, u, anchors, ids = markov_inputs(s, k, n, r, v, device, vocab, period)
    if specials:
        plant_specials(u)
    got = markov_greedy(w1, w2, u, anchors, ids, block_n=block_n, splits=splits)
    ref = markov_greedy_ref(w1, w2, u, anchors, ids)
    markov, conf = heads(w1, w2, v, r, device)
    h = torch.randn(s, k, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
    loop = sample_block(markov, conf, h, u, anchors, "greedy", keep_logits=True, vocab_ids=ids)  # the torch loop
    assert torch.equal(ref, loop.tokens), (ref, loop.tokens)
    assert torch.equal(got, ref), (got, ref)
    cols = got if ids is None else torch.searchsorted(ids, got)
    if period is not None:
        assert bool((cols < period).all()), cols  # ties went to the smallest column
    if specials:
        assert int(cols[0, 0]) == n // 3 and (s < 2 or k < 2 or int(cols[1, 1]) == 0), cols
    fused = sample_block(markov, conf, h, u, anchors, "greedy", keep_logits=False, vocab_ids=ids)
    assert torch.equal(fused.tokens, got)
    torch.testing.assert_close(fused.confidence, loop.confidence)
    return fused_markov(markov, "greedy", False, device)
