"""Pages of the KV pool: ref counts, a free list with LRU reuse, automatic prefix caching.

A page holds one MSA block (`block_size` tokens). A full block whose K/V have been computed gets a
chained hash (parent block's hash + its token ids) and is registered in the prefix cache; a later
sequence whose prompt starts with the same blocks shares those pages (ref count + 1) instead of
recomputing them. Freed pages keep their hash and go to the tail of the free list, so a cached page is
reused only once every page freed before it has been (LRU); unhashed pages are reused first.
Hashes are registered only once a block is computed, so a sequence never shares a page whose K/V are
still being prefilled by another (chunked prefill).
"""
from __future__ import annotations

from collections import OrderedDict

from m3serve.engine.sequence import Sequence


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class Page:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, page_id: int):
        self.id, self.ref_count, self.hash, self.token_ids = page_id, 0, None, None


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark_pages: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark_pages
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self.cached: dict[int, int] = {}  # hash -> page id
        self.prefix_hit_tokens = 0  # cumulative

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_ids)

    def _pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------
    def _lookup(self, seq: Sequence) -> list[tuple[int, int]]:
        """(page id, hash) of the leading blocks found in the cache. The block holding the last token
        is never taken: its logits must be computed."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_token_ids(i, self.block_size)
            h = chain_hash(parent, tokens)
            pid = self.cached.get(h)
            if pid is None or self.pages[pid].token_ids != tokens:
                break
            hits.append((pid, h))
            parent = h
        return hits

    def _take_free(self) -> int:
        pid, _ = self.free_ids.popitem(last=False)
        page = self.pages[pid]
        if page.hash is not None:  # evict it from the prefix cache
            if self.cached.get(page.hash) == pid:
                del self.cached[page.hash]
            page.hash = page.token_ids = None
        page.ref_count = 1
        return pid

    # ---- admission, growth, release ------------------------------------------------------------
    def can_allocate(self, seq: Sequence, use_watermark: bool = True) -> bool:
        """Enough free pages for `seq` (keeping `watermark` pages spare for running decodes)."""
        hits = self._lookup(seq)
        from_free = sum(1 for pid, _ in hits if pid in self.free_ids)
        need = self._pages_needed(seq.num_tokens) - len(hits) + from_free
        return need <= self.num_free_pages - (self.watermark if use_watermark else 0)

    def allocate(self, seq: Sequence) -> None:
        """Pages for all of `seq`'s tokens, the leading ones from the prefix cache where possible."""
        assert not seq.pages, f"{seq} already has pages"
        hits = self._lookup(seq)
        for pid, h in hits:
            page = self.pages[pid]
            if page.ref_count == 0:
                del self.free_ids[pid]
            page.ref_count += 1
            seq.pages.append(pid)
            seq.block_hashes.append(h)
        for _ in range(self._pages_needed(seq.num_tokens) - len(hits)):
            seq.pages.append(self._take_free())
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.prefix_hit_tokens += seq.num_cached_tokens

    def pages_to_append(self, seq: Sequence, lookahead: int = 0) -> int:
        """Free pages `append_slot(seq, lookahead)` takes."""
        return max(0, self._pages_needed(seq.num_tokens + lookahead) - len(seq.pages))

    def can_append_slot(self, seq: Sequence, lookahead: int = 0) -> bool:
        return self.pages_to_append(seq, lookahead) <= self.num_free_pages

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        """Make sure every token of `seq` (the newest included) has a slot, and `lookahead` positions past it
        (a speculative step's drafted tokens; with async scheduling, the token a running step samples)."""
        for _ in range(self.pages_to_append(seq, lookahead)):
            seq.pages.append(self._take_free())

    def _release(self, pid: int) -> None:
        page = self.pages[pid]
        page.ref_count -= 1
        assert page.ref_count >= 0, f"page {pid} freed twice"
        if page.ref_count == 0:
            self.free_ids[pid] = None
            if page.hash is None:
                self.free_ids.move_to_end(pid, last=False)

    def free(self, seq: Sequence) -> None:
        for pid in reversed(seq.pages):  # tail blocks first: they are evicted before the prefix
            self._release(pid)
        seq.pages, seq.block_hashes = [], []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Return the pages past the sequence's tokens (lookahead pages of rejected drafts). They were taken for
        this sequence alone and never hashed (only blocks of accepted, computed tokens are)."""
        keep = self._pages_needed(seq.num_tokens)
        if len(seq.pages) <= keep:  # the usual case: no lookahead page left empty (reading the table costs O(pages))
            return
        for pid in reversed(seq.pages[keep:]):
            assert self.pages[pid].ref_count == 1 and self.pages[pid].hash is None, f"page {pid} is shared"
            self._release(pid)
        seq.pages.truncate(keep)

    def mark_computed(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full and computed in the prefix cache."""
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for i in range(len(seq.block_hashes), full):
            tokens = seq.block_token_ids(i, self.block_size)
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            page = self.pages[seq.pages[i]]
            if self.enable_prefix_caching and page.hash is None and h not in self.cached:
                page.hash, page.token_ids = h, tokens
                self.cached[h] = page.id
