"""The training loop's pieces that the target's and the draft's training share (train.py, train_draft.py):
length-bucketed batches (optionally in a ladder's few shapes, for captured steps), the planned learning-rate
schedule, bf16 autocast."""
from __future__ import annotations

import dataclasses
import math
import queue
import random
import threading
import time
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class ShapeLadder:
    """The few batch shapes a captured training step comes in (train-learned `--cuda-graphs`, learn/graphed_step.py):
    a batch's length is its longest row's rounded up to a rung (multiples of `align`, each rung about `ratio` times
    the one below), and it holds `tokens_per_batch // length` rows, padding rows (no real token) where the rows run
    out. A captured step replays only at the shape it was captured at, so the ladder trades padding (up to about
    `ratio` - 1 of a batch's length, more on the short rungs, one `align` apart) for the number of captures."""

    align: int = 32
    ratio: float = 1.25

    def length(self, n: int) -> int:
        v = self.align
        while v < n:
            v = max(v + self.align, -(-int(v * self.ratio) // self.align) * self.align)
        return v

    def rows(self, length: int, tokens_per_batch: int) -> int:
        return max(1, tokens_per_batch // length)


def batches(rows, tokens_per_batch: int, rng: random.Random, pad_id: int, group_batches: int = 16,
            ladder: ShapeLadder | None = None
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless length-bucketed batches (ids [B, S], loss mask [B, S], real-token mask [B, S], task index [B]),
    right-padded, B * S <= tokens_per_batch (one over-long row makes a batch of its own). Rows are sorted by length
    within groups of about `group_batches` batches' tokens, so a group's last, part-filled batch is at most one in
    that many (groups of a fixed 256 rows, at 128K-token batches, left most groups' few long retrieval rows a batch of
    their own: about half the logged steps of runs 11-13, docs/quality.md). Each pass takes every row `rows` holds
    when it begins: rows appended meanwhile (data.FreshRows) join the next pass (until 2026-12-05 the first pass's
    row count was kept, so no run trained on a fresh row). With a `ladder`, every batch has one of its shapes (a
    batch's rows are cut by their rung's length, and padding rows, task 0, fill it)."""
    group_tokens = group_batches * tokens_per_batch
    size = (lambda n: n) if ladder is None else ladder.length
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        cut: list[list[int]] = []
        for group in _token_groups(order, rows, group_tokens):
            chunk = sorted(group, key=lambda i: len(rows[i][0]))
            cur: list[int] = []
            for i in chunk:  # ascending lengths: row i is the longest so far
                if cur and size(len(rows[i][0])) * (len(cur) + 1) > tokens_per_batch:
                    cut.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                cut.append(cur)
        rng.shuffle(cut)
        for idx in cut:
            length = n_rows = None
            if ladder is not None:
                length = size(max(len(rows[i][0]) for i in idx))
                n_rows = max(len(idx), ladder.rows(length, tokens_per_batch))
            task = torch.zeros(n_rows or len(idx), dtype=torch.long)
            task[:len(idx)] = torch.tensor([rows[i][2] for i in idx])
            yield (*collate([rows[i] for i in idx], pad_id, length, n_rows), task)


def _token_groups(order: list[int], rows, group_tokens: int) -> Iterator[list[int]]:
    """`order` cut into consecutive groups, each closed by the row that brings its tokens to `group_tokens` (the
    last group may hold fewer)."""
    group: list[int] = []
    size = 0
    for i in order:
        group.append(i)
        size += len(rows[i][0])
        if size >= group_tokens:
            yield group
            group, size = [], 0
    if group:
        yield group


# held while a CUDA graph is captured (learn/graphed_step.py): the prefetch threads pin no memory then (pinning
# allocates page-locked memory and queries CUDA events, which a capture in progress may refuse or be spoiled by)
PIN_LOCK = threading.Lock()


def pinned(item: tuple) -> tuple:
    with PIN_LOCK:
        return tuple(t.pin_memory() for t in item)


def prefetch(it: Iterator, depth: int = 4, pin: bool = False) -> Iterator:
    """`it`'s items made ahead in a daemon thread (`depth` at most waiting; tensors pinned if `pin`, so that the
    step's non-blocking copies overlap): the host builds the next batches while the device runs this one. An error
    in `it` is raised here, at the item where it happened."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()  # set when the consumer closes this generator: the thread ends

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fill():
        try:
            for item in it:
                if not put((True, pinned(item) if pin else item)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((False, e))

    thread = threading.Thread(target=fill, daemon=True, name="batch-prefetch")
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            yield item
    finally:
        stop.set()


def collate(rows, pad_id: int, length: int | None = None, n_rows: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, loss mask and real-token mask [n_rows, length] (default: the rows', right-padded to the longest)."""
    s = length or max(len(r[0]) for r in rows)
    shape = (n_rows or len(rows), s)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.bool)
    real = torch.zeros(shape, dtype=torch.bool)
    for b, r in enumerate(rows):
        n = len(r[0])
        ids[b, :n] = torch.tensor(r[0])
        mask[b, :n] = torch.tensor(r[1], dtype=torch.bool)
        real[b, :n] = True
    return ids, mask, real


class Schedule:
    """Linear warm-up, then cosine decay to `min_ratio` at `total` steps. `tick(step, deadline)` before each step
    re-plans `total` (at most `cap`) at step `first_plan` and every `every` steps while under 60% of the way, from
    the mean step time since step 5 (past the first steps' one-off costs), so that the decay ends when the phase's
    time is up whatever the device's speed. `restart_clock(step)` times only the steps from `step` on (the steps
    before ran at another pace: the retrieval-first phase's smaller batches), with a plan `first_plan - 5` steps
    later."""

    MARK = 5

    def __init__(self, base: float, warmup: int, cap: int, min_ratio: float, first_plan: int = 25, every: int = 100):
        self.base, self.min_ratio, self.cap, self.first_plan, self.every = base, min_ratio, cap, first_plan, every
        self.total = cap
        self.warmup = max(1, min(warmup, cap // 10))
        self.mark: tuple[int, float] | None = None  # (step, time) the step time is measured from
        self.next_plan = first_plan

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.base * (step + 1) / self.warmup
        p = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.base * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))

    def restart_clock(self, step: int) -> None:
        self.mark = (step, time.time())
        self.next_plan = step + self.first_plan - self.MARK

    def tick(self, step: int, deadline: float) -> None:
        if step == self.MARK and self.mark is None:
            self.mark = (step, time.time())
        elif self.mark is not None and self.next_plan <= step < 0.6 * self.total:
            rate = (time.time() - self.mark[1]) / (step - self.mark[0])
            left = deadline - time.time()
            fit = self.cap if math.isinf(left) else step + int(left / rate)
            self.total = max(step + 1, min(self.cap, fit))
            self.next_plan = (step // self.every + 1) * self.every


def autocast(device: torch.device, cache: bool = True):
    """bf16 autocast on CUDA (off elsewhere); `cache=False` inside a CUDA graph capture (its weight casts are redone in
    every replay instead of being kept from the capture)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda", cache_enabled=cache)
