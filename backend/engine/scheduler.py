"""In-flight batching: every step picks which sequences run and how many of their tokens.

Per step, under `max_num_batched_tokens` tokens and `max_num_seqs` running sequences:
1. decodes (one token each), oldest first; a decode that needs a new page and finds none preempts the
   newest running sequence not yet scheduled this step (possibly itself): its pages are freed and it goes
   back to the waiting queue in arrival order, to be recomputed (prefix-cache hits make that cheap);
2. sequences in the middle of a chunked prefill, oldest first, get the next chunk;
3. waiting sequences are admitted strictly first-come-first-served (the head blocks those behind it,
   so nothing starves) while pages, sequence slots and tokens remain; none in a step that preempted.
An admitted sequence gets pages for all its tokens at once, so a prefill never has to preempt.

Speculative decoding (`num_lookahead`, engine/speculative_scheduling.py): a decode that drafts k tokens takes 1 + k
tokens of the budget (it waits for a later step when they do not fit) and slots for k positions past its last
token (preempting as a plain decode does). After the step `update` counts only the anchor and the accepted drafts
as computed and returns the lookahead pages left empty (`BlockManager.trim`; not while a step queued ahead of the
result, async scheduling, may still write there). A preempted sequence is recomputed
up to its last token only, which the next step feeds as a decode again (`resume_as_decode`): it speculates from
the same anchor as it would have without the preemption, so it draws the same tokens.

Gathering arrivals (`max_waiting_steps` > 0, off by default; TGI's max_waiting_tokens / waiting_served_ratio): while
decodes run, new requests are not admitted one by one as they arrive but held until `waiting_served_ratio` x the
running ones wait, or the first has waited `max_waiting_steps` steps; a preempted sequence is never held. A step
that admits prompts runs eagerly (decode steps replay CUDA graphs) and, on an MoE model, reads most experts'
weights, so prompts admitted together cost one such step where arrivals a few milliseconds apart cost one each.
The price is up to `max_waiting_steps` steps of TTFT for a request that arrives alone.

Prefill beside decodes (`max_prefill_tokens_with_decodes` > 0, off by default): a step that decodes takes at most that
many prompt tokens (chunks and admissions together); a step with nothing decoding still takes the whole
`max_num_batched_tokens`. A long prompt admitted beside decoding streams then lengthens each of their steps by a
small chunk's work, not a full one's (their ITL), and a prompt that arrives alone keeps the large chunks (its TTFT).

`prefill_apart` (speculative_config.prefill_apart, on by default): a step whose decodes draft takes no prefill
work; the prefill chunks and admissions it left go in the next step, without the decodes (which then take the step
after; with async scheduling that step is queued while the drafting one runs, `prefill_turn_ahead`). A step that
holds only speculating decodes replays the speculative CUDA graphs, where a mixed step runs every phase eagerly
(executor/speculative/decoder.py). The tokens are the same either way; only which step runs what changes.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from m3serve.engine.block_manager import BlockManager
from m3serve.engine.sequence import Sequence, SequenceStatus


STEP_KINDS = ("decode", "speculative", "prefill", "decode+prefill", "speculative+prefill")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence, this step
    num_draft_tokens: list[int] = field(default_factory=list)  # per sequence: drafts it verifies (0: none)
    preempted: list[Sequence] = field(default_factory=list)
    num_decodes: int = 0  # the first this many of `seqs` are decodes; the rest prefill chunks
    # per sequence, its prompt tokens that a step still running computes before this one (async scheduling: a step
    # launched ahead of a prompt's chunk, `Scheduler.schedule_ahead`); empty: none
    num_pending: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, drafts: int = 0) -> None:
        """A row: `seq` computes `n` tokens this step, `drafts` of them drafts it verifies."""
        self.seqs.append(seq), self.num_new_tokens.append(n), self.num_draft_tokens.append(drafts)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def kind(self) -> str:
        """What the step runs (STEP_KINDS): "decode", "speculative" (decodes, some with drafts), "prefill" (prefill
        chunks alone), or either kind of decodes beside prefill chunks (a mixed step: "decode+prefill",
        "speculative+prefill")."""
        decodes = "speculative" if any(self.num_draft_tokens) else "decode" if self.num_decodes else ""
        prefill = "prefill" if len(self.seqs) > self.num_decodes else ""
        return "+".join(k for k in (decodes, prefill) if k)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, num_lookahead: Callable[[Sequence], int] | None = None,
                 prefill_apart: bool = False, max_waiting_steps: int = 0, waiting_served_ratio: float = 1.2,
                 max_prefill_tokens_with_decodes: int = 0):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_lookahead = num_lookahead  # decoding sequence -> drafts it verifies next (speculative decoding)
        self.resume_as_decode = num_lookahead is not None
        self.prefill_apart = prefill_apart  # speculating decodes and prefill work in separate steps (docstring)
        self._prefill_turn = False  # the last step left prefill work for this one (prefill_apart)
        self.max_waiting_steps, self.waiting_served_ratio = max_waiting_steps, waiting_served_ratio  # gathering
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes  # 0: the whole step budget
        self._num_schedules = 0
        self._queued_at: dict[str, int] = {}  # request id -> the schedule() count when it was added
        self.num_held_steps = 0  # steps that held arrivals back to gather them
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prefill chunks that did not finish their prompt
        self.num_mixed_steps = 0  # steps with decodes and prefill tokens together
        self.max_running = 0

    @staticmethod
    def _arrival(seq: Sequence) -> int:
        return seq.arrival

    def add(self, seq: Sequence) -> None:
        assert seq.request_id not in self.requests, seq.request_id
        self.requests[seq.request_id] = seq
        self._queued_at[seq.request_id] = self._num_schedules
        bisect.insort(self.waiting, seq, key=self._arrival)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished (or aborted): release its pages at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.bm.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.requests.pop(seq.request_id, None)
        self._queued_at.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=self._arrival)

    def _prefill_todo(self, seq: Sequence) -> int:
        """Tokens the sequence's prefill computes: all uncomputed ones, or all but the last for a recomputed
        sequence under `resume_as_decode` (that one is fed by its next decode step)."""
        return seq.num_uncomputed_tokens - (1 if self.resume_as_decode and seq.num_output_tokens else 0)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        todo = self._prefill_todo(seq)
        n = min(todo, budget)
        if n < todo and not self.enable_chunked_prefill:
            return 0
        return n

    def _has_prefill_work(self) -> bool:
        return (any(s.num_uncomputed_tokens > 1 for s in self.running)
                or bool(self.waiting) and len(self.running) < self.max_num_seqs)

    def _hold_arrivals(self, num_decodes: int) -> bool:
        """Gathering (module docstring): whether this step admits no waiting request."""
        if not self.max_waiting_steps or not num_decodes or not self.waiting:
            return False
        head = self.waiting[0]
        if head.num_preemptions or len(self.waiting) >= self.waiting_served_ratio * len(self.running):
            return False
        return self._num_schedules - self._queued_at.get(head.request_id, 0) <= self.max_waiting_steps

    def schedule(self) -> ScheduledBatch:
        self._num_schedules += 1
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        num_decodes = 0

        def take(seq: Sequence, n: int, drafts: int = 0) -> None:
            nonlocal budget
            out.add(seq, n, drafts)
            scheduled.add(id(seq))
            budget -= n

        def decodes() -> None:  # 1. decodes (speculative ones with their drafts)
            nonlocal num_decodes
            for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:
                if budget == 0:
                    break
                if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                    continue
                k = self.num_lookahead(seq) if self.num_lookahead is not None else 0
                if 1 + k > budget:
                    continue  # its drafts never shrink to fit (see the module docstring): a later step runs it
                while not self.bm.can_append_slot(seq, k):
                    victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status == SequenceStatus.RUNNING:
                    self.bm.append_slot(seq, k)
                    take(seq, 1 + k, k)
                    num_decodes += 1

        def prefills() -> None:
            nonlocal budget
            hold = self._hold_arrivals(num_decodes)
            self.num_held_steps += hold
            budget -= self._take_prompts(out, self._prompt_budget(budget, num_decodes), scheduled, admit=not hold)

        prefill_turn, self._prefill_turn = self._prefill_turn, False
        if not prefill_turn:
            decodes()
        if self.prefill_apart and any(out.num_draft_tokens):
            self._prefill_turn = self._has_prefill_work()  # the next step runs it, without these decodes
        else:
            prefills()
            if prefill_turn and not out.seqs:  # nothing to prefill after all (no pages): the decodes
                decodes()
        out.num_decodes = num_decodes
        self.count(out)
        return out

    def count(self, batch: ScheduledBatch) -> None:
        """The statistics of a step about to run, scheduled here or launched ahead."""
        pending = batch.num_pending or [0] * len(batch.seqs)
        self.num_chunked_prefills += sum(
            1 for s, n, k, p in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens, pending)
            if not k and n < self._prefill_todo(s) - p)
        if batch.kind.endswith("+prefill"):  # decodes beside prefill chunks
            self.num_mixed_steps += 1
        self.max_running = max(self.max_running, len(self.running))

    def _prompt_budget(self, budget: int, num_decodes: int) -> int:
        """Prompt tokens a step may take with `budget` tokens left after its `num_decodes` decodes."""
        cap = self.max_prefill_tokens_with_decodes if num_decodes else 0
        return budget if not cap else min(budget, cap)

    def _take_prompts(self, out: ScheduledBatch, left: int, skip: set[int], admit: bool = True,
                      ahead: bool = False) -> int:
        """2. the next chunk of each prompt in progress (running, not in `skip`), oldest first, then (`admit`, and
        no preemption in `out`) 3. admissions, in `left` prompt tokens: appended to `out`; the tokens taken."""
        work, taken = [], 0
        for seq in self.running:
            if taken == left:
                break
            if id(seq) not in skip and seq.num_uncomputed_tokens > 1:
                n = self._chunk(seq, left - taken)
                if n:
                    work.append((seq, n))
                    taken += n
        if admit and not out.preempted:
            work += self._admit(left - taken, ahead)
        for seq, n in work:
            out.add(seq, n)
        return sum(n for _, n in work)

    def _admit(self, left: int, ahead: bool = False) -> list[tuple[Sequence, int]]:
        """3. admissions, FCFS, while pages, sequence slots and `left` prompt tokens remain: each admitted sequence
        is running with pages for all its tokens; (sequence, its chunk) for those with prompt work this step.
        `ahead` (a step queued behind one still running): not while the head's first block is in flight."""
        admitted = []
        while self.waiting and left > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.can_allocate(seq, use_watermark=bool(self.running)):
                break
            if ahead and self._prefix_in_flight(seq):
                break
            if not self.enable_chunked_prefill and seq.num_tokens > left:
                break  # the whole prefill must fit one step
            self.bm.allocate(seq)
            n = self._chunk(seq, left)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._arrival)
            if n:  # 0: a resumed sequence whose cached prefix left only its last token (next step's decode)
                admitted.append((seq, n))
                left -= n
        return admitted

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Prefix caching: `seq` begins with the first block of a running sequence that has not computed it (a step
        still running or queued writes it; its hash is registered once that step is back). Admitted now, `seq` would
        compute the block again; admitted a step or two later, it takes the block from the cache."""
        bs = self.bm.block_size
        if not self.bm.enable_prefix_caching or seq.num_tokens <= bs:
            return False
        first = seq.block_token_ids(0, bs)
        return any(s.num_computed_tokens < bs < s.num_tokens and s.block_token_ids(0, bs) == first
                   for s in self.running)

    def prefill_turn_ahead(self) -> ScheduledBatch | None:
        """`prefill_apart`, async scheduling: the prefill turn `schedule` gives the step after one of drafting decodes
        (the next chunks of prompts in progress, then admissions; no decode), queued behind that step while it runs
        (`LLMEngine._launch_ahead`): it reads nothing of that step's result. None: no prefill work, or none fits
        (then the step after is scheduled when the running one is back)."""
        if self.max_waiting_steps or not self._has_prefill_work():
            return None
        out = ScheduledBatch()
        self._take_prompts(out, self.max_num_batched_tokens, set(), ahead=True)
        if not out.seqs:
            return None
        self._prefill_turn = False  # taken here: the step after this one decodes
        self.count(out)
        return out

    def schedule_ahead(self, seqs: list[Sequence], num_done: list[int], num_decode_tokens: int,
                       num_decodes: int) -> list[tuple[Sequence, int, int]]:
        """Async scheduling: the prompt work of the step after one still running, beside `num_decodes` decodes of
        `num_decode_tokens` tokens (`LLMEngine._launch_ahead`), as `schedule` gives it once the running step is
        back: first the next chunk of each of `seqs` (in the middle of their prompts, in arrival order; the running
        step computes `num_done[i]` more of its prompt), then the waiting requests admitted FCFS in what is left.
        Admission counts the sequences the running step may end as running and their pages as taken, so it may
        take fewer than `schedule` would then (never more: the step would not fit), and waits while the head
        request's first block is being computed for another (`_prefix_in_flight`: its prefix-cache hit comes once
        that block is back, as it would in `schedule`).
        [(sequence, prompt tokens the running step computes before this one, its chunk here)]."""
        left = self._prompt_budget(self.max_num_batched_tokens - num_decode_tokens, num_decodes)
        work = []
        for seq, done in zip(seqs, num_done):
            n = min(self._prefill_todo(seq) - done, left)
            if n:
                work.append((seq, done, n))
                left -= n
        return work + [(seq, 0, n) for seq, n in self._admit(left, ahead=True)]

    def update(self, batch: ScheduledBatch, num_rejected: list[int] | None = None,
               keep_lookahead=()) -> None:
        """After the forward, with the step's new tokens appended to the sequences: the scheduled tokens are in the
        cache, less the `num_rejected` rejected drafts per sequence (their rows are garbage, overwritten later);
        register full blocks, return lookahead pages left empty, except those of the sequences `keep_lookahead`
        (a step queued behind this one writes there: async scheduling). Sequences that ended meanwhile are
        skipped."""
        keep = {id(s) for s in keep_lookahead}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.is_finished:  # ended (or aborted) while the step ran: its pages are gone
                continue
            seq.num_computed_tokens += n - (num_rejected[i] if num_rejected else 0)
            self.bm.mark_computed(seq)
            if id(seq) not in keep:
                self.bm.trim(seq)
