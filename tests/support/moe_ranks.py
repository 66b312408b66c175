"""One rank of a gloo group running one MoE layer of a checkpoint through the fused kernel (`KernelMoE`, in the
Triton interpreter on CPU) and the layer's all-reduce; started in a process of its own per rank
(tests/parallel/test_ep_gloo.py). Nothing from m3serve or triton is imported before the interpreter is set."""
from __future__ import annotations

import os


def moe_rank(model_dir: str, layer: int, rank: int, size: int, ep: bool, port: int, x_path: str,
             out_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors: the kernels run in the interpreter, on a GPU host too
    import torch

    torch.set_num_threads(1)
    from m3serve.distributed import parallel as par
    from m3serve.model.layers.moe import KernelMoE
    from m3serve.model.loader import load_model

    p = par.Parallel(rank, size, ep)
    model, _ = load_model(model_dir, "cpu", torch.float32, progress=False, parallel=p)
    moe = model.model.layers[layer].mlp
    moe.method = KernelMoE(moe)
    w = moe.method.weights
    par.join_group(p, par.connect_store(port, size, 120.0), torch.device("cpu"), 120.0)
    try:
        y = moe(torch.load(x_path))
    finally:
        par.destroy_group()
    torch.save(dict(y=y, experts=w.n_experts, inter_pad=w.inter_pad, shared_inter_pad=w.shared_inter_pad,
                    shared_bytes=w.shared_bytes(), rides=w.shared_rides), out_path)
