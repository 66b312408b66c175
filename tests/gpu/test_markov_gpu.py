"""The fused greedy Markov kernels compiled on the GPU (bf16 tl.dot) at real sizes: r = 256, K = 7, the whole
vocabulary (N = V = 200,064) and a draft vocabulary of 32,768 of it, batches 1, 8 and 32: drafts equal to the
proposer's torch loop (cuBLAS) exactly, `sample_block` takes the fused path and gives the loop's confidences; ties
and NaN at a real size; both modes of `markov_greedy` (2K launches; K + 1 with two column splits per SM); one CUDA
graph replayed on new inputs."""
import pytest
import torch

from m3serve.kernels import platform
from m3serve.kernels.markov import markov_greedy, markov_greedy_ref
from m3serve.kernels.platform import interpreting
from support.markov import check_markov, markov_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET is set: these test compiled kernels")]

V, R, K = 200064, 256, 7


def _splits(mode):
    return None if mode == "2k" else 2 * platform.num_sms(torch.device("cuda"))


@pytest.mark.parametrize("mode", ["2k", "k+1"])
@pytest.mark.parametrize("s", [1, 8, 32])
@pytest.mark.parametrize("n", [V, 32768])
def test_markov_kernel_real_size(s, n, mode):
    assert check_markov(s, K, n, R, V, device="cuda", vocab=n < V, splits=_splits(mode))  # True: fused path taken


@pytest.mark.parametrize("mode", ["2k", "k+1"])
@pytest.mark.parametrize("s,n,period", [(8, V, 4099), (3, 32768, 1000)])
def test_markov_kernel_ties_and_nan_real_size(s, n, period, mode):
    check_markov(s, K, n, R, V, device="cuda", vocab=n < V, period=period, splits=_splits(mode))
    check_markov(s, K, n, R, V, device="cuda", vocab=n < V, specials=True, splits=_splits(mode))


@pytest.mark.cuda_graph
def test_markov_kernel_in_a_cuda_graph():
    """Captured once, replayed on other base logits and anchors copied into the captured inputs: the new drafts."""
    w1, w2, u, anchors, ids = markov_inputs(8, K, 32768, R, V, "cuda", vocab=True, seed=1)
    first = markov_greedy(w1, w2, u, anchors, ids)  # compiled before the capture
    markov_greedy(w1, w2, u, anchors, ids, splits=_splits("k+1"))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = markov_greedy(w1, w2, u, anchors, ids)
        out_pick = markov_greedy(w1, w2, u, anchors, ids, splits=_splits("k+1"))
    _, _, u2, anchors2, _ = markov_inputs(8, K, 32768, R, V, "cuda", vocab=True, seed=2)
    u.copy_(u2)
    anchors.copy_(anchors2)
    g.replay()
    torch.cuda.synchronize()
    ref = markov_greedy_ref(w1, w2, u2, anchors2, ids)
    assert torch.equal(out, ref) and torch.equal(out_pick, ref) and not torch.equal(ref, first)
