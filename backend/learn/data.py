"""The learned model's training rows (issue 27): task examples rendered through the chat template and tokenized, in
worker processes, before training (`make_rows`) and while it runs (`FreshRows`).

A row is (input_ids, loss_mask, task index): one chat, the loss on its answers and their end-of-turn tokens. Rows of
the tasks in `packed` hold several problems as one chat's turns (`_render_chunk`).

Why rows keep coming: a device call's run sees its first pool of rows dozens of times (on the H200, 2026-12-04, run 5
made ~12 passes over 40,096 rows; at 256K tokens a step a run makes ~50), and a small model that sees the same
problems that often learns them rather than the task. Rendering all the rows a run can use before it starts would
spend a large share of the call on data; so `FreshRows` renders more rows with new seeds in the same worker pool
while the target trains, and `loop.batches` takes in what has arrived at each pass over the rows.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from m3serve.learn.tasks import TASKS

Row = tuple[list[int], list[int], int]
RECITALS = ("none", "chat", "plain")  # retrieval rows: question turns, or recitals in the chat template or plain (Job)


class Job(NamedTuple):
    """One worker's share: `examples` problems of `task`'s `split` drawn with `seed`, `per_row` problems per row;
    `max_pairs` caps retrieval's training contexts (0: the task's own range); `recital` (retrieval) "chat" or "plain"
    makes recital rows (render.recital_row: the reply recites pairs drawn with replacement, the loss on the values;
    in the chat template, or plain text after BOS) instead of question turns ("none")."""
    task: str
    split: str
    examples: int
    seed: int
    tok_dir: str
    per_row: int
    max_pairs: int = 0
    recital: str = "none"


_WORKER_TOKENIZER: dict[str, Any] = {}


def _render_chunk(job: Job) -> list[Row]:
    """A job's rows [(input_ids, loss_mask, task index)]; runs in a worker."""
    from m3serve.learn.render import recital_row, render, render_turns
    from m3serve.learn.tasks import make_examples, retrieval_follow_ups
    from m3serve.text.tokenizer import Tokenizer

    task, split, n, seed, tok_dir, per_row, max_pairs, recital = job
    tok = _WORKER_TOKENIZER.get(tok_dir)
    if tok is None:
        tok = _WORKER_TOKENIZER[tok_dir] = Tokenizer.from_pretrained(tok_dir)
    ti = TASKS.index(task)
    examples = make_examples(task, split, n, seed=seed, max_pairs=max_pairs)
    if recital != "none":
        rng = random.Random(seed)
        return [(*recital_row(ex, rng, tok, plain=recital == "plain"), ti) for ex in examples]
    if per_row <= 1:
        return [(*render(ex, tok), ti) for ex in examples]
    if task == "retrieval":  # one context, several of its keys asked in turn
        rng = random.Random(seed)
        return [(*render_turns(ex, retrieval_follow_ups(ex, per_row - 1, rng), tok), ti) for ex in examples]
    groups = [examples[i:i + per_row] for i in range(0, len(examples), per_row)]  # several problems, one chat
    return [(*render_turns(g[0], [(ex.messages[-1]["content"], ex.answer) for ex in g[1:]], tok), ti)
            for g in groups]


def row_jobs(tok_dir: str, tasks, split: str, n_per_task: int, seed: int, chunk: int = 500,
             weights: dict[str, float] | None = None, packed: dict[str, int] | None = None,
             max_pairs: int = 0, recital: str = "none") -> list[Job]:
    """The jobs that make `n_per_task` examples per task (times `weights[task]`, default 1; `packed[task]` problems
    per row, default 1): a task's examples in chunks of `chunk` (a fifth of it for rows of over 8 problems, which
    cost ~30 chat-template passes each: more jobs to spread), chunk c drawn with seed `seed * 1000 + c` (so the rows
    do not depend on the number of workers); the costliest jobs (most problems per row) first, so that no straggler
    is left at the end. `max_pairs` (retrieval only): its training contexts hold at most that many pairs; `recital`
    (retrieval only): recital rows (Job)."""
    if recital not in RECITALS:
        raise ValueError(f"recital must be one of {list(RECITALS)}, got {recital!r}")
    if recital != "none" and set(tasks) != {"retrieval"}:
        raise ValueError(f"recital rows are retrieval's, not {sorted(set(tasks) - {'retrieval'})}")
    counts = {t: max(1, round(n_per_task * (weights or {}).get(t, 1.0))) for t in tasks}
    per_job = {t: max(1, chunk // 5) if (packed or {}).get(t, 1) > 8 else chunk for t in tasks}
    jobs = [Job(t, split, min(per_job[t], counts[t] - c0), seed * 1000 + c0 // per_job[t], tok_dir,
                (packed or {}).get(t, 1), max_pairs, recital)
            for t in tasks for c0 in range(0, counts[t], per_job[t])]
    jobs.sort(key=lambda j: -j.per_row)
    return jobs


def _worker_count(workers: int) -> int:
    return workers or min(16, os.cpu_count() or 1)


def _lower_priority() -> None:
    """In a worker of `FreshRows`' pool: the training process's own thread comes first (the step is host-bound)."""
    try:
        os.nice(10)
    except OSError:
        pass


def make_rows(tok_dir: str, tasks, split: str, n_per_task: int, seed: int, workers: int = 0,
              chunk: int = 500, weights: dict[str, float] | None = None, packed: dict[str, int] | None = None,
              pool=None, max_pairs: int = 0, recital: str = "none") -> list[Row]:
    """Rendered rows of `row_jobs(...)`, in worker processes (`pool`, else a pool of `workers` made for the call;
    one worker: in this process)."""
    jobs = row_jobs(tok_dir, tasks, split, n_per_task, seed, chunk, weights, packed, max_pairs, recital)
    if pool is not None:
        parts = pool.map(_render_chunk, jobs, chunksize=1)
    elif _worker_count(workers) <= 1 or len(jobs) == 1:
        parts = [_render_chunk(j) for j in jobs]
    else:
        with multiprocessing.get_context("fork").Pool(min(_worker_count(workers), len(jobs))) as own:
            parts = own.map(_render_chunk, jobs, chunksize=1)
    return [row for part in parts for row in part]


class FreshRows:
    """More training rows while the target trains (module docstring): `jobs(r)` gives round r's jobs (r = 1, 2,
    ...: new seeds each round), rendered in a pool of `workers` processes at a lower CPU priority; a thread appends
    each finished chunk to `rows` until it holds `max_rows` or `stop()`. The pool is made here, so create this
    before CUDA is first touched (its workers are forked). `make_rows(..., pool=fresh.pool)` uses the same workers
    for the first rows; `start()` begins the stream."""

    def __init__(self, rows: list[Row], jobs: Callable[[int], list[Job]], workers: int = 0,
                 max_rows: int = 1_000_000):
        self.rows, self.jobs, self.max_rows = rows, jobs, max_rows
        self.pool = multiprocessing.get_context("fork").Pool(_worker_count(workers), initializer=_lower_priority)
        self.added = 0
        self.rounds = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._feed, daemon=True, name="fresh-rows")
        self._thread.start()

    def _feed(self) -> None:
        r = 0
        try:
            while not self._stop.is_set():
                r += 1
                it = self.pool.imap_unordered(_render_chunk, self.jobs(r), chunksize=1)
                while not self._stop.is_set():
                    try:
                        part = it.next(timeout=0.2)
                    except multiprocessing.TimeoutError:
                        continue
                    except StopIteration:
                        break
                    if len(self.rows) + len(part) > self.max_rows:
                        return
                    self.rows.extend(part)  # one list operation: batches() reads the rows from another thread
                    self.added += len(part)
                self.rounds = r
        except Exception as e:  # noqa: BLE001 - training goes on with the rows it has; the log says why
            self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> dict:
        """End the stream and the pool; returns what it added."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.pool.terminate()
        self.pool.join()
        return {"rows_added": self.added, "rounds_done": self.rounds, "error": self.error}
