"""Expert parallelism against tensor parallelism and one rank, over gloo, through the fused MoE kernel (the CUDA
method, run here in the Triton interpreter; the engine's CPU ranks take the torch method, so the TP / EP parity
tests in tests/reference do not reach it): every rank is a process of its own that loads its shard, runs its
experts and its slice of the shared expert, and all-reduces. Both sums equal the unsharded layer; an EP rank's
shared expert is the same TP slice as a TP rank's, laid out at its own width (not padded to the whole experts')."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from m3serve.distributed import parallel as par
from m3serve.model.layers.moe import TorchMoE
from m3serve.model.loader import load_model
from m3serve.model.tiny import make_tiny
from support.moe import rel_err
from support.moe_ranks import moe_rank

pytestmark = pytest.mark.timeout(600)
RANKS, LAYER = 2, 1  # the first MoE layer


def _run_group(d: str, ep: bool, x_path: str, tmp_path) -> list[dict]:
    store = par.create_store(RANKS, 120.0)
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"{'ep' if ep else 'tp'}{r}.pt") for r in range(RANKS)]
    procs = [ctx.Process(target=moe_rank, args=(d, LAYER, r, RANKS, ep, store.port, x_path, outs[r]))
             for r in range(RANKS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(540)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * RANKS, codes
    return [torch.load(o) for o in outs]


def test_ep_and_tp_ranks_run_the_fused_kernel_and_sum_to_the_layer(tmp_path):
    # whole experts of 256 at EP 2 against a shared expert's slice of 128: the widths differ
    d = str(tmp_path / "m")
    make_tiny(d, seed=5, dspark=False, intermediate_size=256, shared_intermediate_size=256)
    full, _ = load_model(d, "cpu", torch.float32, progress=False)
    moe = full.model.layers[LAYER].mlp
    x = torch.randn(7, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x_path = str(tmp_path / "x.pt")
    torch.save(x, x_path)
    want = TorchMoE().apply(moe, x)  # TP 1
    tp, ep = _run_group(d, False, x_path, tmp_path), _run_group(d, True, x_path, tmp_path)
    for rank in tp + ep:
        assert rel_err(rank["y"], want) < 1e-5  # every rank holds the all-reduced layer
    assert torch.equal(tp[0]["y"], tp[1]["y"]) and torch.equal(ep[0]["y"], ep[1]["y"])
    assert [r["experts"] for r in tp] == [8, 8] and [r["experts"] for r in ep] == [4, 4]
    assert [(r["inter_pad"], r["shared_inter_pad"], r["rides"]) for r in tp] == [(128, 128, True)] * RANKS
    assert [(r["inter_pad"], r["shared_inter_pad"], r["rides"]) for r in ep] == [(256, 128, False)] * RANKS
    assert [r["shared_bytes"] for r in ep] == [r["shared_bytes"] for r in tp]  # padded to 256: twice as many
