"""The target's and the draft's training steps captured as CUDA graphs (train-learned `--cuda-graphs`; issue 27).

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

`CapturedSteps` is that machinery for any step (one graph per key, the pool, eager first, capture, replay, reset,
fail to eager); `GraphedSteps` is the target's step on it, and train_draft.py's `DraftSteps` the draft's (its step
was as host-bound: run 15's 16K-token draft steps took 128 ms each).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from m3serve.learn.loop import PIN_LOCK
from m3serve.learn.step import set_lr, step_body, step_record, target_step


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # the batch's tensors on the device (outside the pool)
    extra: torch.Tensor | None  # a device tensor the capture read that each replay refreshes (`refresh`), or None
    out: dict  # the body's tensors, rewritten by every replay


def adamw(params, lr: float, device: torch.device, graphed: bool, **kw) -> torch.optim.AdamW:
    """The trainers' AdamW (fused on CUDA). `graphed`: the one `CapturedSteps` needs, capturable, its learning rate a
    device tensor (`step.set_lr` fills it) and its step count kept there."""
    return torch.optim.AdamW(params, lr=torch.tensor(lr, device=device) if graphed else lr, betas=(0.9, 0.95),
                             fused=device.type == "cuda", capturable=graphed, **kw)


class CapturedSteps:
    """One CUDA graph per key (a batch shape, and what else changes the step's work), all in one memory pool: a key's
    first step runs `eager`, its second captures `body` on device copies of the batch, every later one copies the
    batch in and replays. Subclasses say what a step is: `eager`, `body`, `record`, and, where the step reads a
    device tensor the host redraws per step, `extra` / `refresh` / `capturing`, and `discard` (what a failed capture
    leaves)."""

    what = "step"  # the log's name for the steps

    def __init__(self, opt, device: torch.device, log):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        for g in opt.param_groups:
            if not (isinstance(g["lr"], torch.Tensor) and g["lr"].device.type == "cuda" and g.get("capturable")):
                raise ValueError("a captured step needs a capturable optimizer with its lr a CUDA tensor")
        self.opt, self.device, self.log = opt, device, log
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: set[tuple] = set()  # keys whose eager step has run since the last reset
        self.off: str | None = None  # why graphs were turned off, if they were
        self.counts = {"eager": 0, "captures": 0, "replays": 0, "resets": 0}

    def eager(self, batch, lr: float, key: tuple) -> dict:
        raise NotImplementedError

    def body(self, inputs: tuple[torch.Tensor, ...], key: tuple) -> dict:
        raise NotImplementedError

    def record(self, out: dict, batch, lr: float, key: tuple) -> dict:
        return out

    def extra(self, batch) -> torch.Tensor | None:
        return None

    def refresh(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def capturing(self, extra: torch.Tensor | None):
        return contextlib.nullcontext()

    def discard(self) -> None:
        pass

    def reset(self, why: str) -> None:
        """Drop every graph: the next step of each key is eager again."""
        if self.graphs or self.seen:
            self.counts["resets"] += 1
            self.log(f"{self.what}: CUDA graphs dropped ({why}); each shape captures again")
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

    def run(self, key: tuple, batch, lr: float) -> dict:
        cap = self.graphs.get(key)
        if cap is None and self.off is None and key in self.seen:
            cap = self._capture(key, batch)
        if cap is None:
            self.seen.add(key)
            self.counts["eager"] += 1
            return self.eager(batch, lr, key)
        set_lr(self.opt, lr)
        for dst, src in zip(cap.inputs, batch):
            dst.copy_(src, non_blocking=True)
        if cap.extra is not None:
            cap.extra.copy_(self.refresh(batch))
        cap.graph.replay()
        self.counts["replays"] += 1
        return self.record(cap.out, batch, lr, key)

    def _capture(self, key: tuple, batch) -> _Captured | None:
        inputs = tuple(t.to(self.device) for t in batch)
        extra = self.extra(batch)
        torch.cuda.synchronize(self.device)
        self.opt.zero_grad(set_to_none=True)  # the capture allocates its gradients in the pool
        states = len(self.opt.state)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the batch-prefetch thread is not this capture's (and pins nothing meanwhile: PIN_LOCK)
            with self.capturing(extra), PIN_LOCK, torch.cuda.graph(graph, pool=self.pool,
                                                                   capture_error_mode="thread_local"):
                out = self.body(inputs, key)
            if len(self.opt.state) != states:  # its memory is the pool's, which other replays reuse
                raise RuntimeError("the optimizer made a parameter's state inside the capture (no eager step "
                                   "had given it a gradient since the trainable parameters changed)")
        except Exception as e:  # noqa: BLE001 - out of memory: the trainer's (smaller batches); else eager from here on
            self.opt.zero_grad(set_to_none=True)
            self.discard()
            self.graphs.clear()
            if isinstance(e, torch.OutOfMemoryError):
                raise
            self.off = f"capture of {key}: {type(e).__name__}: {e}"
            self.log(f"{self.what}: CUDA graph capture failed ({self.off}); eager steps from here")
            torch.cuda.synchronize(self.device)
            return None
        self.counts["captures"] += 1
        cap = _Captured(graph, inputs, extra, out)
        self.graphs[key] = cap
        return cap


class GraphedSteps(CapturedSteps):
    """`step(batch, lr, dense)` as `step.target_step` computes it, from one CUDA graph per batch shape and mask."""

    what = "target"

    def __init__(self, model, opt, groups, distill, balance, device: torch.device, prompt_weight: float, log):
        super().__init__(opt, device, log)
        self.model, self.groups, self.distill, self.balance = model, groups, distill, balance
        self.prompt_weight = prompt_weight

    def step(self, batch, lr: float, dense: bool) -> dict:
        return self.run((tuple(batch[0].shape), dense), batch, lr)

    def eager(self, batch, lr: float, key: tuple) -> dict:
        return target_step(self.model, self.opt, self.groups, self.distill, self.balance, batch, lr, key[1],
                           self.device, self.prompt_weight, cache=False)

    def body(self, inputs, key: tuple) -> dict:
        return step_body(self.model, self.opt, self.groups, self.distill, self.balance, *inputs, key[1], self.device,
                         self.prompt_weight, cache=False)

    def record(self, out: dict, batch, lr: float, key: tuple) -> dict:
        return step_record(out, batch, lr, key[1])

    def extra(self, batch) -> torch.Tensor | None:
        """The distilled rows' index (each replay draws its rows into it, as eager steps do); None: every row."""
        b = batch[0].shape[0]
        return torch.arange(self.distill.rows, device=self.device) if self.distill.rows and b > self.distill.rows \
            else None

    def refresh(self, batch) -> torch.Tensor:
        return self.distill.draw(batch[2])

    @contextlib.contextmanager
    def capturing(self, extra: torch.Tensor | None):
        self.distill.sel = extra
        try:
            yield
        finally:
            self.distill.sel = None

    def discard(self) -> None:
        self.distill.reset()
        self.balance.loads.clear()
