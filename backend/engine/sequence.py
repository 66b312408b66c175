"""Request state: tokens, pages, progress through the prompt, sampling options and the text state
(incremental detokenizer, stop strings, reasoning parser) that turns new tokens into text deltas."""
from __future__ import annotations

import enum

import numpy as np

from m3serve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SequenceText:
    """New token ids -> (content delta, reasoning delta, stopped on a stop string); and the text a request asked for
    besides (`TextOptions`): its prompt decoded (`prompt_text`, decoded at `prepare`), its logprobs' tokens."""

    def __init__(self, tokenizer, prompt_ids: list[int], sp: SamplingParams, reasoning_parser=None,
                 prompt_text: str | None = None, logprob_tokens: bool = False):
        from m3serve.text.detokenizer import IncrementalDetokenizer
        from m3serve.text.stop_strings import StopStringMatcher

        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, sp.skip_special_tokens)
        self.stops = StopStringMatcher(sp.stop, sp.include_stop_str_in_output) if sp.stop else None
        self.reasoning = reasoning_parser
        self.min_tokens = sp.min_tokens
        self.stopped = False
        self.prompt_text = prompt_text
        self.logprob_tokens = logprob_tokens

    def token_texts(self, tops: list[dict[int, float]]) -> list[dict[int, str]] | None:
        """The text of each token of each logprobs entry (special tokens included), if the request asked for it."""
        if not self.logprob_tokens:
            return None
        decode = self.detok.tokenizer.decode
        return [{t: decode([t], skip_special_tokens=False) for t in top} for top in tops]

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return text, ""
        r, c = self.reasoning.feed(text)
        if final:
            r2, c2 = self.reasoning.flush()
            r, c = r + r2, c + c2
        return c, r

    def feed(self, token_ids: list[int], num_output_tokens: int, final: bool = False) -> tuple[str, str]:
        """Text of `token_ids`; `num_output_tokens` counts outputs including these (stop strings are
        only looked for once min_tokens is reached)."""
        text = self.detok.add(token_ids) if token_ids else ""
        if final:
            text += self.detok.flush()
        if self.stops is not None and num_output_tokens >= self.min_tokens:
            text, self.stopped = self.stops.feed(text)
            if self.stopped:
                final = True
            elif final:
                text += self.stops.flush()
        return self._split(text, final)


class PageTable:
    """A sequence's page ids in order: its row of the block table. The ids live in a growing int32 array, so a step's
    block table is one row copy per sequence (`array`), not a conversion of Python lists: at 64 sequences x 1,025
    pages (128K tokens) that conversion took about 12 ms on a 2-core host and left the GPU idle a third of the
    decode step on the H200 (docs/performance.md, engine run 3). The block manager changes it
    only by `append`, `truncate` and reassignment (`Sequence.pages = []`); reading works as on a list of ints."""

    __slots__ = ("_ids", "_n")

    def __init__(self, page_ids=()):
        page_ids = list(page_ids)
        self._ids = np.empty(max(16, 2 * len(page_ids)), dtype=np.int32)
        self._ids[:len(page_ids)] = page_ids
        self._n = len(page_ids)

    @property
    def array(self) -> np.ndarray:
        """The ids as int32 (a view: valid until the next change)."""
        return self._ids[:self._n]

    def append(self, page_id: int) -> None:
        if self._n == len(self._ids):
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
        self._ids[self._n] = page_id
        self._n += 1

    def truncate(self, n: int) -> None:
        """Keep the first `n` ids."""
        self._n = max(0, min(n, self._n))

    def tolist(self) -> list[int]:
        return self._ids[:self._n].tolist()

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.tolist()[i]
        if not -self._n <= i < self._n:
            raise IndexError(f"page {i} of a {self._n}-page table")
        return int(self._ids[i % self._n])

    def __iter__(self):
        return iter(self.tolist())

    def __reversed__(self):
        return reversed(self.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, PageTable):
            other = other.tolist()
        return isinstance(other, list) and self.tolist() == other

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"PageTable({self.tolist()})"


class Sequence:
    def __init__(self, request_id: str, arrival: int, prompt_token_ids: list[int], sp: SamplingParams,
                 max_tokens: int, seed: int = 0, text: SequenceText | None = None):
        self.request_id = request_id
        self.arrival = arrival  # FCFS order (monotone per engine)
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sp
        self.max_tokens = max_tokens
        self.seed = seed  # in [0, 2^64): the request's, or drawn by the engine (keys the sampler's generator)
        self.text = text
        self.status = SequenceStatus.WAITING
        self.pages = PageTable()  # page ids, the sequence's block table
        self.block_hashes: list[int] = []  # chained hashes of the leading full, computed blocks
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache at the latest admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.cumulative_logprob = 0.0
        self.first_output_sent = False
        self.draft_confidence: list[float] = []  # DSpark: its drafts' confidence scores in its last speculative step
        # DSpark draft backoff (speculative_scheduling.after_speculative_step): speculative steps in a row that
        # accepted no draft, and the output count from which it drafts again
        self.draft_misses, self.draft_resume_at = 0, 0

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pages={len(self.pages)})")

    @property
    def pages(self) -> PageTable:
        return self._pages

    @pages.setter
    def pages(self, page_ids) -> None:
        self._pages = page_ids if isinstance(page_ids, PageTable) else PageTable(page_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_token_ids(self, i: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[i * block_size:(i + 1) * block_size])
