"""Stop-string detection over streamed text deltas."""

from __future__ import annotations

from collections.abc import Iterable


def partial_suffix_len(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some pattern."""
    best = 0
    for p in patterns:
        for n in range(min(len(text), len(p) - 1), best, -1):
            if text.endswith(p[:n]):
                best = n
                break
    return best


class StopStringMatcher:
    """Feed text deltas; emits text up to the first stop string, holding back only a
    tail that could still grow into a stop string.

    The first match is the one that ends earliest (ties: the longest), so the result
    does not depend on how the text was split into deltas.
    """

    def __init__(self, stops: Iterable[str] | None, include_stop_str_in_output: bool = False):
        self.stops = [s for s in dict.fromkeys(stops or ()) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self.stopped = False
        self.matched_stop: str | None = None

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best = None  # (end, -len, start, stop)
        for s in self.stops:
            i = text.find(s)
            if i >= 0:
                key = (i + len(s), -len(s), i, s)
                best = key if best is None or key < best else best
        return None if best is None else (best[2], best[3])

    def feed(self, text_delta: str) -> tuple[str, bool]:
        """Return (text to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        buf = self._held + text_delta
        m = self._first_match(buf)
        if m is not None:
            start, stop = m
            self.stopped, self.matched_stop, self._held = True, stop, ""
            return buf[:start + (len(stop) if self.include_stop_str_in_output else 0)], True
        keep = partial_suffix_len(buf, self.stops)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """At end of generation: release the held tail (no stop matched)."""
        out, self._held = self._held, ""
        return "" if self.stopped else out
