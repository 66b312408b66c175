"""Speculative decoding counters, under vLLM's names (`vllm:spec_decode_*`), exposed in `LLMEngine.stats()`.

  spec_decode_num_drafts                   speculative steps of sequences (one per sequence and step); not the
                                           step launched ahead for a sequence that its previous step ended (async
                                           scheduling: it verified nothing the request kept)
  spec_decode_num_draft_tokens             drafted tokens verified (the confidence threshold may verify fewer than
                                           were drafted, down to none; confidence scheduling drafts fewer)
  spec_decode_num_accepted_tokens          drafted tokens accepted, up to a stop inside the accepted run (drafts
                                           past a stop token, stop string or max_tokens are not counted)
  spec_decode_num_accepted_tokens_per_pos  [K]: accepted at draft position i (0-based)
derived:
  spec_decode_acceptance_rate              accepted / draft tokens
  spec_decode_mean_accepted_length         1 + accepted / drafts: tokens a speculative step emits on average
  spec_decode_acceptance_rate_per_pos      [K]: accepted_per_pos[i] / drafts (vLLM's per-position rate)
"""
from __future__ import annotations


class SpeculativeStats:
    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def observe(self, speculated: list[bool], num_draft_tokens: list[int], num_emitted: list[int]) -> None:
        """One step: per sampled row, whether it speculated, the drafts it verified and the tokens it emitted."""
        for speculating, drafts, emitted in zip(speculated, num_draft_tokens, num_emitted):
            if not speculating:
                continue
            accepted = emitted - 1
            self.num_drafts += 1
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += accepted
            for i in range(accepted):
                self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict:
        d = max(self.num_drafts, 1)
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "spec_decode_mean_accepted_length": 1.0 + self.num_accepted_tokens / d if self.num_drafts else 0.0,
            "spec_decode_acceptance_rate_per_pos": [a / d for a in self.accepted_per_pos],
        }
