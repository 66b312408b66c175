"""Which sequences speculate in a step, and with how many drafts (the engine side of DSpark).

A decoding sequence drafts k = min(K, tokens it may still produce - 1) tokens: a step emits at most k + 1, so an
accepted run never passes max_tokens (nor max_model_len), and a sequence with one token left decodes plainly.
k depends on the sequence alone (never on the batch, the token budget or free pages), so which tokens a request
gets at temperature > 0 does not depend on what else runs: a decode whose k + 1 tokens do not fit the step's
remaining budget waits for the next step, and one whose lookahead pages are not free preempts, as a plain decode
would.

Requests the draft cannot mirror decode plainly, in the same batches:
- repetition / frequency / presence penalties: the target's distribution at each verify position would depend on
  the drafts before it (their counts), which the verifier does not model;
- min_tokens not yet reached: EOS and the stop ids are suppressed at some verify positions and not at others.
  Such a request speculates from its min_tokens-th output token on.

Draft backoff (`speculative_config.draft_backoff` = N, off by default; greedy requests only): a speculative step
that accepted none of a sequence's drafts makes it decode plainly until it has N x 2^(f-1) more output tokens (f such
steps in a row, at most 16 N), then draft again; a step that accepts one resets it. A greedy request's tokens are the
same with or without drafts, so this changes only the speed; k then depends on the sequence's own acceptance, which
the host learns a step late when steps are launched ahead, so a sampled request (whose tokens would depend on when
its drafts stopped) never backs off.
"""
from __future__ import annotations

from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.sequence import Sequence


def can_speculate(sp: SamplingParams) -> bool:
    """The request's sampling is one the draft/verify pair reproduces exactly (no penalties)."""
    return not sp.has_penalties


def num_draft_tokens(seq: Sequence, k: int, ahead: int = 0) -> int:
    """Drafts the decoding sequence `seq` verifies in its next step (0: a plain decode). `ahead`: output tokens a
    step still running gives it before that (async scheduling: the host has not appended them yet)."""
    sp, out = seq.sampling_params, seq.num_output_tokens + ahead
    if not can_speculate(sp) or out < sp.min_tokens or out < seq.draft_resume_at:
        return 0
    return max(0, min(k, seq.max_tokens - out - 1))


def after_speculative_step(seq: Sequence, drafted: int, emitted: int, backoff: int) -> None:
    """Draft backoff (module docstring): `seq` verified `drafted` drafts in a step that gave it `emitted` tokens
    (its outputs already appended)."""
    if backoff <= 0 or drafted <= 0 or not seq.sampling_params.greedy:
        return
    if emitted > 1:  # a draft held
        seq.draft_misses, seq.draft_resume_at = 0, 0
        return
    seq.draft_misses += 1
    seq.draft_resume_at = seq.num_output_tokens + backoff * 2 ** min(seq.draft_misses - 1, 4)
