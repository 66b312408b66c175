"""The target's training step captured as CUDA graphs (train-learned `--cuda-graphs`; issue 27).

The learned model's step is host-bound (docs/quality.md): a 128K-token step of run 8 (H200) took 217 ms of wall time
and 158 ms of device time, and run 14's (H100) took 320 ms on average; the rest is the host launching ~10,000 small
ops. A CUDA graph replays a captured step's kernels with one launch, so the host's share goes. A graph replays one
shape only, so the batches come in a ShapeLadder's few shapes (learn/loop.py), and `GraphedSteps` keeps one graph
per (shape, dense or sparse mask), all in one memory pool:

- a shape's first step runs eagerly (it also makes the optimizer's state, outside the pool: a capture that would make
  some is refused; and it compiles the `--compile` pieces for the shape, under the capture's autocast state); its
  next one captures `step.step_body` (forward, backward, clipping, the fused AdamW with its learning rate as a device
  tensor, the routers' bias) and every later one copies the batch into the graph's input tensors and replays;
- the batch-prefetch thread pins no memory while a capture runs (`loop.PIN_LOCK`), and the capture is thread-local;
- what a replay reads is either written earlier in the same replay (activations, gradients) or lives outside the pool
  (weights, optimizer state, the routers' biases, the input tensors, the learning rate, the distilled rows' index),
  so the graphs can share the pool: none runs while another does, and a record's tensors are read (`log_record`)
  before the next step;
- the indexer distillation's random rows are a device index tensor the capture read from: each replay copies a new
  draw into it first;
- when the trainable parameters change (the MLPs released after their warm-up) or batches shrink after running out
  of memory, the graphs are dropped and the shapes start again from an eager step, capturing into a new pool;
- a capture that fails (an op that syncs with the host, say) turns graphs off for the run: every later step is eager,
  and the reason is in the run's log and `train_log.json`.
"""
from __future__ import annotations

import dataclasses

import torch

from m3serve.learn.loop import PIN_LOCK
from m3serve.learn.step import set_lr, step_body, step_record, target_step


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # ids, mask, real, task on the device (outside the pool)
    rows: torch.Tensor | None  # the distilled rows' index the capture read (None: every row)
    out: dict  # step_body's tensors, rewritten by every replay


class GraphedSteps:
    """`step(batch, lr, dense)` as `step.target_step` computes it, from one CUDA graph per batch shape and mask."""

    def __init__(self, model, opt, groups, distill, balance, device: torch.device, prompt_weight: float, log):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        for g in opt.param_groups:
            if not (isinstance(g["lr"], torch.Tensor) and g["lr"].device.type == "cuda" and g.get("capturable")):
                raise ValueError("a captured step needs a capturable optimizer with its lr a CUDA tensor")
        self.model, self.opt, self.groups, self.distill, self.balance = model, opt, groups, distill, balance
        self.device, self.prompt_weight, self.log = device, prompt_weight, log
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: set[tuple] = set()  # shapes whose eager step has run since the last reset
        self.off: str | None = None  # why graphs were turned off, if they were
        self.counts = {"eager": 0, "captures": 0, "replays": 0, "resets": 0}

    def reset(self, why: str) -> None:
        """Drop every graph: the next step of each shape is eager again."""
        if self.graphs or self.seen:
            self.counts["resets"] += 1
            self.log(f"target: CUDA graphs dropped ({why}); each shape captures again")
        self.graphs.clear()
        self.seen.clear()
        self.opt.zero_grad(set_to_none=True)
        # a new pool: the dropped graphs' pool lives on with no graph using it until the allocator frees it, and a
        # capture into it fails (torch 2.11, run 15 on the H100 when the MLPs were released: "it->second->use_count
        # > 0 INTERNAL ASSERT FAILED" in CUDACachingAllocator), which turned graphs off for the rest of the run
        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()  # the dead pool's cached blocks go back

    def summary(self) -> dict:
        return {**self.counts, "graphs": len(self.graphs), "off": self.off}

    def step(self, batch, lr: float, dense: bool) -> dict:
        key = (tuple(batch[0].shape), dense)
        cap = self.graphs.get(key)
        if cap is None and self.off is None and key in self.seen:
            cap = self._capture(key, batch, dense)
        if cap is None:
            self.seen.add(key)
            self.counts["eager"] += 1
            return target_step(self.model, self.opt, self.groups, self.distill, self.balance, batch, lr, dense,
                               self.device, self.prompt_weight, cache=False)
        set_lr(self.opt, lr)
        for dst, src in zip(cap.inputs, batch):
            dst.copy_(src, non_blocking=True)
        if cap.rows is not None:
            cap.rows.copy_(self.distill.draw(batch[2]))
        cap.graph.replay()
        self.counts["replays"] += 1
        return step_record(cap.out, batch, lr, dense)

    def _capture(self, key: tuple, batch, dense: bool) -> _Captured | None:
        inputs = tuple(t.to(self.device) for t in batch)
        b = batch[0].shape[0]
        rows = None
        if self.distill.rows and b > self.distill.rows:  # each replay draws its rows into this (as eager steps do)
            rows = torch.arange(self.distill.rows, device=self.device)
        torch.cuda.synchronize(self.device)
        self.opt.zero_grad(set_to_none=True)  # the capture allocates its gradients in the pool
        states = len(self.opt.state)
        graph = torch.cuda.CUDAGraph()
        try:
            self.distill.sel = rows
            # thread_local: the batch-prefetch thread is not this capture's (and pins nothing meanwhile: PIN_LOCK)
            with PIN_LOCK, torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = step_body(self.model, self.opt, self.groups, self.distill, self.balance, *inputs, dense,
                                self.device, self.prompt_weight, cache=False)
            if len(self.opt.state) != states:  # its memory is the pool's, which other replays reuse
                raise RuntimeError("the optimizer made a parameter's state inside the capture (no eager step "
                                   "had given it a gradient since the trainable parameters changed)")
        except Exception as e:  # noqa: BLE001 - out of memory: the trainer's (smaller batches); else eager from here on
            self.opt.zero_grad(set_to_none=True)
            self.distill.reset()
            self.balance.loads.clear()
            self.graphs.clear()
            if isinstance(e, torch.OutOfMemoryError):
                raise
            self.off = f"capture of {key}: {type(e).__name__}: {e}"
            self.log(f"target: CUDA graph capture failed ({self.off}); eager steps from here")
            torch.cuda.synchronize(self.device)
            return None
        finally:
            self.distill.sel = None
        self.counts["captures"] += 1
        cap = _Captured(graph, inputs, rows, out)
        self.graphs[key] = cap
        return cap
