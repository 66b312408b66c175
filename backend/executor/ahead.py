"""A step launched ahead (async scheduling, `LLMEngine._launch_ahead`): its inputs that depend on the previous step's
result, completed on the device from that result before the step runs, with no host synchronisation.

The engine builds such a step before the previous step's tokens reach the host, as if that step emitted ONE token
per sequence (a plain decode's case): each sequence feeds at positions from its `num_tokens` on, its slots taken
from its block table at those positions, its input ids zeros. Token t of the step belongs to the sequence whose
previous result is row `rows[t]` (`StepInput.prev_token_rows`; -1: a sequence whose tokens the host knows, built
as usual and left as it is). `follow_previous` then sets, per token:
- the input id: the last token the previous step emitted for that row (a speculative step's accepted run ends with
  it: the next anchor; a speculating sequence's draft placeholders take it too, the Markov phase overwrites them);
- where the previous step emitted n > 1 tokens (a speculative step, `SamplerOutput.num_tokens`): the positions,
  the cache length, the slots and the sampling positions (the random streams' counter) n - 1 further. The engine
  reserved pages for the longest run (`BlockManager.append_slot`), so the block table covers every outcome.
The host lists (`seq_lens_cpu`, `max_seq_len`) keep the one-token values; nothing on the device path reads them
(the reference attention reads the cache length from `seq_lens`).
"""
from __future__ import annotations

import torch

from m3serve.step_io import SamplerOutput, StepInput


def follow_previous(step: StepInput, prev: SamplerOutput, rows: torch.Tensor, block_size: int,
                    num_seqs: int) -> None:
    """In place, on the device: the first `num_seqs` sequences of `step` (its tokens [0, qsl[num_seqs])) read
    `prev` (the previous step's result, on the same device) through `rows` (int64, a row of `prev` per token)."""
    t = step.query_start_loc_cpu[num_seqs]
    known, rows = rows[:t] < 0, rows[:t].clamp(min=0)
    ids = step.input_ids[:t]
    if prev.num_tokens is None:  # one token per row
        ids.copy_(torch.where(known, ids, prev.token_ids.index_select(0, rows)))
        return
    # [t]: tokens the previous step emitted for each token's sequence (1: its tokens are known, nothing moves)
    n = torch.where(known, 1, prev.num_tokens.index_select(0, rows))
    ids.copy_(torch.where(known, ids, prev.token_ids.index_select(0, rows).gather(1, (n - 1)[:, None])[:, 0]))
    shift = n - 1
    pos = step.positions[:t]
    pos += shift
    qsl = step.query_start_loc[:num_seqs + 1].long()
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=pos.device), qsl.diff(), output_size=t)
    slots = step.slot_mapping[:t]
    page = step.block_tables[seq, pos // block_size].long()
    slots.copy_(torch.where(slots < 0, slots, page * block_size + pos % block_size))  # padding rows keep no slot
    step.seq_lens[:num_seqs] += shift[qsl[1:] - 1].to(step.seq_lens.dtype)
    if step.sampling is not None:  # every sequence of a step launched ahead samples one row, in order
        step.sampling.positions[:num_seqs] += shift[step.logits_indices[:num_seqs]]
