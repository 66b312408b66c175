"""The worker's DSpark speculative step (design/dspark.md section 2; the engine side is engine/spec/scheduling.py).

One `execute(step)` per engine step, all on the device, no host synchronisation in between:
1. propose: for the R speculating sequences (`step.spec`), one draft backbone pass over [anchor, mask x (gamma-1)]
   reading the draft's paged context cache through the target's block tables, then K sequential Markov steps:
   K drafts x_1..x_K per sequence, drawn from the draft distribution Q (`probabilistic`, the request's sampling
   transform) or its argmax (`greedy`), with the DRAFT uniform stream (engine/spec/rng.py);
2. the drafts go into the step's placeholder tokens (positions t+1..t+k of each sequence), and the target runs
   ONE forward over the whole step: prefill chunks, plain decodes and the speculating sequences' k+1 verify
   positions together (multi-token queries: the prefill attention kernels / the reference attention), its tapped
   layers recorded (`TapRecorder`);
3. sample: plain rows through the sampler as usual; each speculating row's k+1 verify logits -> the target's
   distributions T (the same transform), verified against Q by rule "standard" or "block" (engine/spec/verify.py)
   with the ACCEPT / FINAL uniform streams: n accepted drafts and one correction / bonus token;
4. insert: the tapped features of every row the target computed and kept (prefill rows, plain decodes, anchors
   and accepted drafts) become draft-cache rows at the target's slots; rejected drafts' rows go to the scratch
   slot -1. So every committed target row has its draft row, and prefix-cache pages stay consistent.
It returns up to K+1 tokens per row (`SamplerOutput.num_tokens`) with their raw logprobs; the engine appends them,
rolls its pages back to the accepted length and applies stop conditions.

Memory: the fp32 [rows, K+1, V] tensors of verification (and the draft's [rows, K, V]) are made `CHUNK_ELEMENTS`
at a time; only the draft's Q of every speculating row ([R, K, V] fp32, `probabilistic` only) lives through the
target forward. Speculative steps are multi-token, so they run eagerly: the worker captures no CUDA graphs when
speculative decoding is on (every step must also record the tapped layers).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from m3serve.config import ConfigError
from m3serve.engine.spec.config import SpeculativeConfig
from m3serve.engine.spec.confidence import confident_prefix_length
from m3serve.engine.spec.draft_cache import DraftKVCache, draft_kv_dtype
from m3serve.engine.spec.probs import sampling_probs
from m3serve.engine.spec.proposer import Proposal, insert_context, propose
from m3serve.engine.spec.rng import ACCEPT, DRAFT, FINAL, MAX_VOCAB, stream_uniforms
from m3serve.engine.spec.verify import verify
from m3serve.engine.step import SamplerOutput, StepInput
from m3serve.model.dspark_taps import TapRecorder

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 25  # fp32 elements of one [rows, K+1, V] chunk (128 MiB)
# (proposal, anchor ids [R], anchor positions [R], seeds [R]) -> proposal: lets a benchmark control acceptance
ProposalHook = Callable[[Proposal, torch.Tensor, torch.Tensor, torch.Tensor], Proposal]


@dataclasses.dataclass
class _Verified:
    tokens: torch.Tensor  # int64 [R, K+1]
    num_accepted: torch.Tensor  # int64 [R]
    num_verified: torch.Tensor  # int64 [R]: drafts verified (after the confidence threshold)
    logprobs: torch.Tensor  # fp32 [R, K+1]
    top: tuple[torch.Tensor, torch.Tensor] | None  # ([R, K+1, n] logprobs, ids)


class SpeculativeDecoder:
    """The draft model, its paged cache and the speculative step of one worker."""

    def __init__(self, spec: SpeculativeConfig, model_dir: str, target):
        from m3serve.model.dspark_loader import load_dspark

        self.spec = spec
        device = target.model.embed_tokens.weight.device
        self.draft, self.load_report = load_dspark(spec.draft_dir(model_dir), target, device, target.dtype)
        cfg, k = self.draft.config, spec.num_speculative_tokens
        if k > self.draft.block_size:
            raise ConfigError(f"speculative_config.num_speculative_tokens: {k} exceeds the draft's block_size "
                              f"({self.draft.block_size})")
        if spec.confidence_threshold > 0 and self.draft.confidence_head is None:
            raise ConfigError("speculative_config.confidence_threshold: the draft has no confidence head")
        if cfg.vocab_size >= MAX_VOCAB:
            raise ConfigError(f"vocabulary of {cfg.vocab_size} tokens: speculative decoding supports < {MAX_VOCAB}")
        self.kv_dtype = draft_kv_dtype(spec.kv_cache_dtype, self.draft.dtype)
        self.cache: DraftKVCache | None = None
        self.runner = None
        self.proposal_hook: ProposalHook | None = None
        log.info("speculative decoding: DSpark draft %s (%d layers, taps %s), %d tokens per step, %s drafts, %s "
                 "verification, draft cache %s, confidence threshold %g; attention_backend %r recorded (the draft "
                 "attends with torch SDPA); steps run eagerly (no CUDA graphs)", spec.draft_dir(model_dir),
                 cfg.num_hidden_layers, self.draft.tap_layers, k, spec.draft_sample_method,
                 spec.rejection_sample_method, self.kv_dtype, spec.confidence_threshold, spec.attention_backend)

    # ---- memory and setup --------------------------------------------------------------------------
    def page_bytes(self, block_size: int) -> int:
        return DraftKVCache.page_bytes(self.draft.config, block_size, self.spec.kv_cache_dtype, self.draft.dtype)

    def reserve_bytes(self, max_num_seqs: int) -> int:
        """Working memory of a speculative step beyond the target's (a heuristic, like the activation reserve):
        the draft's Q of every row (probabilistic drafts) and ~12 chunk-sized fp32 temporaries."""
        k, v = self.spec.num_speculative_tokens, self.draft.config.vocab_size
        q = max_num_seqs * k * v * 4 if self.spec.draft_sample_method == "probabilistic" else 0
        return q + 12 * CHUNK_ELEMENTS * 4

    def attach(self, runner, num_pages: int) -> None:
        """Make the draft cache over the runner's page pool; the runner's steps go through `execute` from now on."""
        self.cache = DraftKVCache(self.draft.config.num_hidden_layers, num_pages, runner.cache.block_size,
                                  self.draft.config.num_key_value_heads, self.draft.config.head_dim, self.kv_dtype,
                                  self.draft.dtype, runner.device, self.load_report.kv_scales)
        self.runner = runner
        runner.spec = self

    def _chunks(self, rows: int) -> list[slice]:
        width = (self.spec.num_speculative_tokens + 1) * self.draft.config.vocab_size
        size = max(1, CHUNK_ELEMENTS // width)
        return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]

    # ---- the step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput) -> SamplerOutput | None:
        r = self.runner
        step = step.to(r.device, non_blocking=True)
        sp, proposal = step.spec, None
        if sp is not None:
            proposal = self.propose(step)
            ids = step.input_ids.clone()
            ids[sp.draft_rows] = proposal.tokens.flatten()[sp.draft_index]
            step = dataclasses.replace(step, input_ids=ids)
        with TapRecorder(r.model, self.draft.tap_layers) as taps:
            hidden = r.forward(step)
        features = taps.take()
        out, num_accepted = None, None
        if sp is not None:
            out, num_accepted = self._sample_and_verify(step, hidden, proposal)
        elif step.sampling is not None:
            out = r.sampler(r.model.compute_logits(hidden[step.logits_indices]), step.sampling)
        self._insert(step, features, num_accepted)
        return out

    def propose(self, step: StepInput) -> Proposal:
        """K drafts for each speculating sequence (chunked over sequences), then the proposal hook if set."""
        sp, k = step.spec, step.spec.num_speculative_tokens
        st = step.sampling.select(sp.sample_rows)
        anchors, positions = step.input_ids[sp.anchor_rows], step.positions[sp.anchor_rows]
        tables = step.block_tables[sp.seq_index]
        u = stream_uniforms(st.seeds, st.positions, DRAFT, k)
        method = self.spec.draft_sample_method
        parts = [propose(self.draft, self.cache, anchors[c], positions[c], tables[c], k, method, st.select(c), u[c])
                 for c in self._chunks(sp.num_seqs)]
        probs = None if method == "greedy" else torch.cat([p.probs for p in parts])
        out = Proposal(torch.cat([p.tokens for p in parts]), probs, torch.cat([p.confidence for p in parts]), None)
        if self.proposal_hook is not None:
            out = self.proposal_hook(out, anchors, positions, st.seeds)
        return out

    def _verify(self, step: StepInput, hidden: torch.Tensor, proposal: Proposal) -> _Verified:
        sp, k, model = step.spec, step.spec.num_speculative_tokens, self.runner.model
        st = step.sampling.select(sp.sample_rows)
        cols = torch.arange(k + 1, device=hidden.device)[None, :]
        rows = sp.anchor_rows[:, None] + torch.minimum(cols, sp.num_drafts[:, None])  # [R, K+1], padded: repeats
        lens = sp.num_drafts
        if self.spec.confidence_threshold > 0:
            lens = torch.minimum(lens, confident_prefix_length(proposal.confidence, self.spec.confidence_threshold))
        u = torch.cat([stream_uniforms(st.seeds, st.positions, ACCEPT, k),
                       stream_uniforms(st.seeds, st.positions, FINAL)], 1)
        n_top = st.max_num_logprobs
        parts = []
        for c in self._chunks(sp.num_seqs):
            logits = model.compute_logits(hidden[rows[c]].flatten(0, 1))  # [c * (K+1), V]
            raw = torch.log_softmax(logits, -1).view(-1, k + 1, logits.shape[-1])
            target = sampling_probs(logits, st.select(c).repeat_rows(k + 1)).view_as(raw)
            v = verify(proposal.tokens[c], None if proposal.probs is None else proposal.probs[c], target, u[c],
                       lens[c], self.spec.rejection_sample_method)
            lp = raw.gather(2, v.tokens.clamp(min=0)[..., None])[..., 0]  # emitted token j comes from verify row j
            parts.append((v.tokens, v.num_accepted, lp, raw.topk(n_top, -1) if n_top > 0 else None))
        top = None
        if n_top > 0:
            top = (torch.cat([p[3].values for p in parts]), torch.cat([p[3].indices for p in parts]))
        return _Verified(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), lens,
                         torch.cat([p[2] for p in parts]), top)

    def _sample_and_verify(self, step: StepInput, hidden: torch.Tensor, proposal: Proposal
                           ) -> tuple[SamplerOutput, torch.Tensor]:
        """Every sampling row's tokens ([N, K+1], -1 padded): plain rows sampled, speculating rows verified."""
        r, s, sp = self.runner, step.sampling, step.spec
        n, width, n_top, dev = s.num_rows, sp.num_speculative_tokens + 1, s.max_num_logprobs, hidden.device
        out = SamplerOutput(torch.full((n, width), -1, dtype=torch.int64, device=dev),
                            torch.zeros(n, width, device=dev), num_tokens=torch.ones(n, dtype=torch.int64, device=dev),
                            num_draft_tokens=torch.zeros(n, dtype=torch.int64, device=dev))
        if n_top > 0:
            out.top_token_ids = torch.zeros(n, width, n_top, dtype=torch.int64, device=dev)
            out.top_logprobs = torch.zeros(n, width, n_top, device=dev)
        plain = sp.plain_rows
        if plain.numel():
            o = r.sampler(r.model.compute_logits(hidden[step.logits_indices[plain]]), s.select(plain))
            out.token_ids[plain, 0], out.logprobs[plain, 0] = o.token_ids, o.logprobs
            if n_top > 0:
                out.top_token_ids[plain, 0], out.top_logprobs[plain, 0] = o.top_token_ids, o.top_logprobs
        v, rows = self._verify(step, hidden, proposal), sp.sample_rows
        out.token_ids[rows], out.logprobs[rows] = v.tokens, v.logprobs
        out.num_tokens[rows], out.num_draft_tokens[rows] = v.num_accepted + 1, v.num_verified
        if v.top is not None:
            out.top_logprobs[rows], out.top_token_ids[rows] = v.top
        return out, v.num_accepted

    def _insert(self, step: StepInput, features: torch.Tensor, num_accepted: torch.Tensor | None) -> None:
        """Draft-cache rows of every target row kept: all but the rejected drafts (slot -1: the scratch page)."""
        slots, sp = step.slot_mapping, step.spec
        if sp is not None:
            k = sp.num_speculative_tokens
            keep = (sp.draft_index % k) < num_accepted[sp.draft_index // k]
            slots = slots.clone()
            slots[sp.draft_rows] = torch.where(keep, slots[sp.draft_rows], -1)
        insert_context(self.draft, self.cache, features, step.positions, slots)
