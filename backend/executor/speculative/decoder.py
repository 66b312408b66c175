"""The worker's DSpark speculative step (design/dspark.md section 2; the engine side is engine/speculative_scheduling.py).

One `execute(step)` per engine step, as five phases on the device (`phases`), no host synchronisation in between:
1. draft: for the R speculating sequences (`step.speculative`), one draft backbone pass over [anchor, mask x (gamma-1)]
   reading the draft's paged context cache through the target's block tables (on CUDA the decode attention kernel
   reads each sequence's pages in place up to its anchor, split-K partials merged with the block's own rows; on the
   CPU every page of the table is gathered, the torch reference) -> base logits U;
2. markov: K sequential Markov positions: K drafts x_1..x_K per sequence, drawn from the draft distribution Q
   (`probabilistic`, the request's sampling transform) or its argmax (`greedy`), with the DRAFT uniform stream
   (executor/speculative/rng.py); the drafts go into the step's placeholder tokens (positions t+1..t+k of each sequence);
3. target: ONE forward over the whole step: prefill chunks, plain decodes and the speculating sequences' k+1
   verify positions together (multi-token queries: the prefill attention kernels / the reference attention), its
   tapped layers recorded (`TapRecorder`);
4. rule: plain rows through the sampler as usual; each speculating row's k+1 verify logits -> the target's
   distributions T (the same transform), verified against Q by rule "standard" or "block" (executor/speculative/verify.py)
   with the ACCEPT / FINAL uniform streams: n accepted drafts and one correction / bonus token;
5. insert: the tapped features of every row the target computed become draft-cache rows at the target's slots
   (a rejected draft's row, like its target KV row, lies past the accepted length: never read, rewritten when that
   position is committed). So the draft cache does not depend on verification, and tensor-parallel ranks, which
   all run every phase (rank 0 alone verifies), keep identical caches and draw identical drafts.
It returns up to K+1 tokens per row (`SamplerOutput.num_tokens`) with their raw logprobs; the engine appends them,
rolls its pages back to the accepted length and applies stop conditions.

Steps where every sequence speculates with K drafts replay one CUDA graph per phase (executor/speculative/graphs.py);
other steps (prefill chunks, plain decodes, fewer drafts, top-n logprobs) run the phases eagerly.

Launches and host synchronisations of one speculative step (counted by reading the code; launches = torch ops
dispatched, counted with a dispatch mode on the CPU for the tiny draft: 2 layers, K = 7, one chunk):
  before (2026-12-04, eager):  draft + Markov 375, rule 264, insert 96 launches, plus the target's forward launched
    kernel by kernel; Python loops over K (the draft positions), the draft layers and the chunks, none over sequences.
    Host synchronisations 3 + 4 L_d (L_d = draft layers; +1 with a confidence threshold): the two attention tile
    maps copied from pageable memory, every FP8 draft-cache write and read turning its Python-float scale into a
    device tensor (K and V of each layer, twice), the confidence threshold likewise, and the tokens' copy to the
    host. 7 for the benchmark's 1-layer draft.
  after, graphed:  22 small copies / fills into the persistent buffers, then 1 graph replay (5 when timed); ONE host
    synchronisation (the tokens' copy to the host); since, 2 copies instead of the 22 (graphs.py's packed
    buffers: the step's per-row and per-sequence inputs in one, the block table's rows in the other). Eager steps:
    the same launches as before minus the sync points (tile maps from page-locked memory, scales held on the
    device): one synchronisation too.
  greedy steps, wave 3b (counted the same way, 8 sequences, 1 draft layer, K = 7): Markov 226 -> 68 (no DRAFT
    uniforms for greedy drafts, the confidence head only with a threshold, no [S, K, V] logits kept), rule 313-334
    -> 171 (verify_greedy from the argmaxes; ~120 of the 171 are the CPU sampler's hashing, one fused kernel on
    CUDA). Greedy steps with sequences near max_tokens (k < K, or k = 0 plain decodes) replay the graphs too.
  since (the tiny model's graphed path, 8 sequences, K = 7): rule 141 -> 125 (greedy steps select no sampling
    options; a step whose every row speculates returns the rule's tensors, no [N, K+1] buffers filled and scattered
    into); sampled steps run only the filters some row needs (no vocabulary sort for temperature-only requests) and
    rule "standard" with greedy drafts builds no [S, K, V] one-hot Q.
  greedy drafts of a vanilla Markov head on CUDA (kernels/markov.py, by reading the code): each of the K draft
    positions takes 2 launches instead of the loop's 5-6 (embedding, GEMM, cast, add, argmax, the draft vocabulary's
    id), and the drafts need no final stack.

Memory: the fp32 [rows, K+1, V] tensors of verification (and the draft's [rows, K, V]) are made `CHUNK_ELEMENTS`
at a time; the draft's U and Q of every speculating row ([R, K, V] fp32 each, Q for `probabilistic` only) live from
the draft phase to the rule phase. With a draft vocabulary of N ids (`draft_vocab_size`, model/dspark_vocab.py) U
and Q are [R, K, N]: the draft phase reads N lm_head rows, the Markov phase N rows of W2 per position; the rule
reads Q at the drafted ids and widens one row per sequence to V for the residual.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from m3serve.config import ConfigError
from m3serve.speculative_config import SpeculativeConfig
from m3serve.executor.speculative.confidence import confident_prefix_length
from m3serve.executor.speculative.draft_cache import DraftKVCache, draft_kv_dtype
from m3serve.executor.speculative.probs import sampling_probs
from m3serve.executor.speculative.proposer import Proposal, insert_context, sample_block
from m3serve.executor.speculative.rng import ACCEPT, DRAFT, FINAL, MAX_VOCAB, stream_uniforms
from m3serve.executor.speculative.verify import verify, verify_greedy
from m3serve.step_io import SamplerOutput, StepInput
from m3serve.kernels.sampling import sample_simple, sample_simple_ref
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

    def __init__(self, config: SpeculativeConfig, model_dir: str, target):
        from m3serve.model.dspark_loader import load_dspark

        self.config = config
        device = target.model.embed_tokens.weight.device
        self.draft, self.load_report = load_dspark(config.draft_dir(model_dir), target, device, target.dtype,
                                                   config.draft_vocab_size)
        cfg, k = self.draft.config, config.num_speculative_tokens
        if k > self.draft.block_size:
            raise ConfigError(f"speculative_config.num_speculative_tokens: {k} exceeds the draft's block_size "
                              f"({self.draft.block_size})")
        if config.confidence_threshold > 0 and self.draft.confidence_head is None:
            raise ConfigError("speculative_config.confidence_threshold: the draft has no confidence head")
        if config.confidence_scheduling and self.draft.confidence_head is None:
            raise ConfigError("speculative_config.confidence_scheduling: the draft has no confidence head")
        if cfg.vocab_size >= MAX_VOCAB:
            raise ConfigError(f"vocabulary of {cfg.vocab_size} tokens: speculative decoding supports < {MAX_VOCAB}")
        self.kv_dtype = draft_kv_dtype(config.kv_cache_dtype, self.draft.dtype)
        self.cache: DraftKVCache | None = None
        self.paged = False  # the draft reads its context pages through the kernel (`attach`: on CUDA)
        self.runner = None
        self.graphs = None  # SpeculativeGraphs (executor/speculative/graphs.py) once `enable_graphs` ran
        self._hook: ProposalHook | None = None
        log.info("speculative decoding: DSpark draft %s (%d layers, taps %s), %d tokens per step, %s drafts, %s "
                 "verification, draft cache %s, draft vocabulary %d ids, confidence threshold %g; attention_backend %r "
                 "recorded (the draft's context attention: the paged kernel on CUDA, torch elsewhere)",
                 config.draft_dir(model_dir),
                 cfg.num_hidden_layers, self.draft.tap_layers, k, config.draft_sample_method,
                 config.rejection_sample_method, self.kv_dtype, self.draft_columns, config.confidence_threshold,
                 config.attention_backend)

    # ---- memory and setup --------------------------------------------------------------------------
    def page_bytes(self, block_size: int) -> int:
        return DraftKVCache.page_bytes(self.draft.config, block_size, self.config.kv_cache_dtype, self.draft.dtype)

    def reserve_bytes(self, max_num_seqs: int) -> int:
        """Working memory of a speculative step beyond the target's (a heuristic, like the activation reserve):
        the draft's base logits U of every row (kept from the draft phase to the Markov phase), its Q (probabilistic
        drafts) and ~12 chunk-sized fp32 temporaries."""
        k, v = self.config.num_speculative_tokens, self.draft_columns
        q = max_num_seqs * k * v * 4 if self.config.draft_sample_method == "probabilistic" else 0
        return q + max_num_seqs * k * v * 4 + 12 * CHUNK_ELEMENTS * 4

    @property
    def draft_columns(self) -> int:
        """Columns of the draft's U and Q: its draft vocabulary's N, or the vocabulary's V."""
        dv = self.draft.draft_vocab
        return self.draft.config.vocab_size if dv is None else dv.size

    def attach(self, runner, num_pages: int) -> None:
        """Make the draft cache over the runner's page pool; the runner's steps go through `execute` from now on."""
        self.cache = DraftKVCache(self.draft.config.num_hidden_layers, num_pages, runner.cache.block_size,
                                  self.draft.config.num_key_value_heads, self.draft.config.head_dim, self.kv_dtype,
                                  self.draft.dtype, runner.device, self.load_report.kv_scales)
        self.runner = runner
        runner.drafter = self
        cfg = self.draft.config
        # the draft's context attention: on CUDA the kernel reads the pages in place (sliding-window layers: not yet)
        self.paged = runner.device.type == "cuda" and all(
            cfg.attention_window(i)[0] is None for i in range(cfg.num_hidden_layers))

    def enable_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Speculative steps of decoding sequences only replay CUDA graphs from now on (captured per batch and
        block-table width bucket at their first step; executor/speculative/graphs.py)."""
        from m3serve.executor.speculative.graphs import SpeculativeGraphs
        self.graphs = SpeculativeGraphs(self, StepState, max_num_seqs,
                                        -(-max_model_len // self.runner.cache.block_size))

    @property
    def proposal_hook(self) -> ProposalHook | None:
        """A callable that may replace the proposals (benchmarks, tests: executor/speculative/controlled.py)."""
        return self._hook

    @proposal_hook.setter
    def proposal_hook(self, hook: ProposalHook | None) -> None:
        self._hook = hook
        if self.graphs is not None:
            self.graphs.clear()  # the graphs captured the previous hook's launches

    def _chunks(self, rows: int) -> list[slice]:
        width = (self.config.num_speculative_tokens + 1) * self.draft.config.vocab_size
        size = max(1, CHUNK_ELEMENTS // width)
        return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]

    # ---- the step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput, prev: SamplerOutput | None = None) -> SamplerOutput | None:
        """One engine step (host tensors): a graphed replay when the step is one the graphs take, else eager.
        `prev`: the previous step's result on the device, for a step launched ahead of it (executor/ahead.py)."""
        if self.graphs is not None and self.graphs.supports(step):
            return self.graphs.execute(step, prev)
        return self.run(self.runner.on_device(step, prev))

    @torch.inference_mode()
    def run(self, step: StepInput) -> SamplerOutput | None:
        """The phases of one step already on the device, in order (eagerly; graphs.py captures each)."""
        state = StepState(step)
        for phase in self.phases:
            phase(state)
        return state.out

    @property
    def phases(self) -> tuple[Callable[["StepState"], None], ...]:
        return self.draft_phase, self.markov_phase, self.target_phase, self.rule_phase, self.insert_phase

    def draft_phase(self, st: "StepState") -> None:
        """The draft backbone over [anchor, mask x (gamma-1)] of every speculating sequence, chunked over sequences:
        block hidden h [c, K, H] and base logits U fp32 [c, K, V] per chunk."""
        step, sp = st.step, st.step.speculative
        if sp is None or not sp.num_speculative_tokens:  # no drafts (a width-0 step: graphs.py)
            return
        anchors, positions = step.input_ids[sp.anchor_rows], step.positions[sp.anchor_rows]
        tables, k = step.block_tables[sp.seq_index], sp.num_speculative_tokens
        st.blocks = []
        for c in self._chunks(sp.num_seqs):
            context = (self.cache.paged_fn if self.paged else self.cache.context_fn)(tables[c])
            h = self.draft.block_hidden(anchors[c], positions[c], context)[:, :k]
            st.blocks.append((h, self.draft.base_logits(h)))

    def markov_phase(self, st: "StepState") -> None:
        """The K sequential Markov positions (drafts drawn with the DRAFT stream), the proposal hook, and the drafts
        written into the step's placeholder tokens."""
        step, sp = st.step, st.step.speculative
        if sp is None:
            return
        k, method = sp.num_speculative_tokens, self.config.draft_sample_method
        if not k:  # a width-0 step (graphs.py: greedy plain decodes under draft backoff): the rule verifies nothing
            none = torch.zeros(sp.num_seqs, 0, device=step.input_ids.device)
            st.proposal = Proposal(none.long(), None, none, None, self.draft.vocab_ids)
            return
        ss = step.sampling.select(sp.sample_rows)
        anchors = step.input_ids[sp.anchor_rows]
        u = stream_uniforms(ss.seeds, ss.positions, DRAFT, k) if method == "probabilistic" else None
        d = self.draft
        # the confidence head only where something reads it (ones otherwise)
        conf = d.confidence_head if self.config.confidence_threshold > 0 or self.config.confidence_scheduling else None
        parts = [sample_block(d.markov_head, conf, h, base, anchors[c], method, None if u is None else ss.select(c),
                              None if u is None else u[c], keep_logits=False, vocab_ids=d.vocab_ids)
                 for c, (h, base) in zip(self._chunks(sp.num_seqs), st.blocks)]
        probs = None if method == "greedy" else torch.cat([p.probs for p in parts])
        prop = Proposal(torch.cat([p.tokens for p in parts]), probs, torch.cat([p.confidence for p in parts]), None,
                        d.vocab_ids)
        if self.proposal_hook is not None:
            prop = self.proposal_hook(prop, anchors, step.positions[sp.anchor_rows], ss.seeds)
        st.blocks, st.proposal = None, prop
        ids = step.input_ids.clone()
        ids[sp.draft_rows] = prop.tokens.flatten()[sp.draft_index]
        st.step = dataclasses.replace(step, input_ids=ids)

    def target_phase(self, st: "StepState") -> None:
        """ONE target forward over the whole step, its tapped layers recorded."""
        with TapRecorder(self.runner.model, self.draft.tap_layers) as taps:
            st.hidden = self.runner.forward(st.step)
        st.features = taps.take()

    def rule_phase(self, st: "StepState") -> None:
        """Plain rows sampled, speculating rows verified. Every rank computes its share of the logits (gathered to
        rank 0); only rank 0 samples and verifies."""
        step = st.step
        if step.speculative is not None:
            st.out = self._sample_and_verify(step, st.hidden, st.proposal)
        elif step.logits_indices is not None and step.logits_indices.numel():
            logits = self.runner.model.compute_logits(st.hidden[step.logits_indices])
            if logits is not None and step.sampling is not None:
                st.out = self.runner.sampler(logits, step.sampling)

    def insert_phase(self, st: "StepState") -> None:
        """The draft-cache rows of every row the target computed, at the target's slots: prefill rows, plain
        decodes, anchors and all verified drafts. A rejected draft's row lies past its sequence's accepted length,
        as its target KV row does: no draft reads it (context rows < the anchor) and the step that commits that
        position writes it again. So the rows written depend on nothing verification decides, and every
        tensor-parallel rank keeps the same draft cache without hearing rank 0's verdict."""
        step = st.step
        insert_context(self.draft, self.cache, st.features, step.positions, step.slot_mapping)

    def propose(self, step: StepInput) -> Proposal:
        """K drafts for each speculating sequence of a step on the device (the draft and Markov phases)."""
        st = StepState(step)
        self.draft_phase(st)
        self.markov_phase(st)
        return st.proposal

    def _verify(self, step: StepInput, hidden: torch.Tensor, proposal: Proposal) -> _Verified | None:
        """Rank 0: the verified runs; the other ranks (their logits' share gathered to rank 0): None."""
        sp, k, model = step.speculative, step.speculative.num_speculative_tokens, self.runner.model
        n_top = step.sampling.max_num_logprobs
        greedy = step.sampling.all_greedy and n_top <= 0  # argmaxes only (verify_greedy): no sampling options read
        st = None if greedy else step.sampling.select(sp.sample_rows)
        cols = torch.arange(k + 1, device=hidden.device)[None, :]
        rows = sp.anchor_rows[:, None] + torch.minimum(cols, sp.num_drafts[:, None])  # [R, K+1], padded: repeats
        lens = sp.num_drafts
        if self.config.confidence_threshold > 0:
            lens = torch.minimum(lens, confident_prefix_length(proposal.confidence, self.config.confidence_threshold))
        if not greedy:
            u = torch.cat([stream_uniforms(st.seeds, st.positions, ACCEPT, k),
                           stream_uniforms(st.seeds, st.positions, FINAL)], 1)
        parts = []
        for c in self._chunks(sp.num_seqs):
            logits = model.compute_logits(hidden[rows[c]].flatten(0, 1))  # [c * (K+1), V]
            if logits is None:
                continue
            if greedy:  # every emitted token j is verify row j's argmax: its logprob is that row's
                best, lp = _argmax_logprobs(logits)
                v = verify_greedy(proposal.tokens[c], best.view(-1, k + 1), lens[c])
                parts.append((v.tokens, v.num_accepted, lp.view(-1, k + 1), None))
                continue
            raw = torch.log_softmax(logits, -1).view(-1, k + 1, logits.shape[-1])
            target = sampling_probs(logits, st.select(c).repeat_rows(k + 1)).view_as(raw)
            v = verify(proposal.tokens[c], None if proposal.probs is None else proposal.probs[c], target, u[c],
                       lens[c], self.config.rejection_sample_method, proposal.vocab_ids)
            lp = raw.gather(2, v.tokens.clamp(min=0)[..., None])[..., 0]  # emitted token j comes from verify row j
            parts.append((v.tokens, v.num_accepted, lp, raw.topk(n_top, -1) if n_top > 0 else None))
        if not parts:
            return None
        top = None
        if n_top > 0:
            top = (torch.cat([p[3].values for p in parts]), torch.cat([p[3].indices for p in parts]))
        return _Verified(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), lens,
                         torch.cat([p[2] for p in parts]), top)

    def _sample_and_verify(self, step: StepInput, hidden: torch.Tensor, proposal: Proposal) -> SamplerOutput | None:
        """Every sampling row's tokens ([N, K+1], -1 padded): plain rows sampled, speculating rows verified."""
        r, s, sp = self.runner, step.sampling, step.speculative
        n, width, n_top, dev = s.num_rows, sp.num_speculative_tokens + 1, s.max_num_logprobs, hidden.device
        plain, o = sp.plain_rows, None
        if plain.numel():
            logits = r.model.compute_logits(hidden[step.logits_indices[plain]])
            o = None if logits is None else r.sampler(logits, s.select(plain))
        v = self._verify(step, hidden, proposal)
        if v is None:  # a tensor-parallel rank other than 0
            return None
        if not plain.numel():  # every row speculates: the rule's tensors are the output, in row order (the step
            # builder numbers the speculating rows in order, the graphs' views are 0..S-1), nothing to scatter
            return SamplerOutput(v.tokens, v.logprobs, *(v.top[::-1] if v.top is not None else (None, None)),
                                 num_tokens=v.num_accepted + 1, num_draft_tokens=v.num_verified,
                                 draft_confidence=proposal.confidence.float())
        out = SamplerOutput(torch.full((n, width), -1, dtype=torch.int64, device=dev),
                            torch.zeros(n, width, device=dev), num_tokens=torch.ones(n, dtype=torch.int64, device=dev),
                            num_draft_tokens=torch.zeros(n, dtype=torch.int64, device=dev),
                            draft_confidence=torch.zeros(n, width - 1, device=dev))
        if n_top > 0:
            out.top_token_ids = torch.zeros(n, width, n_top, dtype=torch.int64, device=dev)
            out.top_logprobs = torch.zeros(n, width, n_top, device=dev)
        if o is not None:
            out.token_ids[plain, 0], out.logprobs[plain, 0] = o.token_ids, o.logprobs
            if n_top > 0:
                out.top_token_ids[plain, 0], out.top_logprobs[plain, 0] = o.top_token_ids, o.top_logprobs
        rows = sp.sample_rows
        out.token_ids[rows], out.logprobs[rows] = v.tokens, v.logprobs
        out.num_tokens[rows], out.num_draft_tokens[rows] = v.num_accepted + 1, v.num_verified
        out.draft_confidence[rows] = proposal.confidence.float()  # the engine's next verify width reads them
        if v.top is not None:
            out.top_logprobs[rows], out.top_token_ids[rows] = v.top
        return out


def _argmax_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [N, V] -> (argmax ids [N], their raw logprobs [N]): the plain decode sampler's greedy path (on
    CUDA one fused pass over the logits, kernels/sampling.py), so verified and plainly decoded tokens agree."""
    greedy = torch.zeros(logits.shape[0], device=logits.device)
    unused = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return (sample_simple if logits.is_cuda else sample_simple_ref)(logits, greedy, unused, unused)


@dataclasses.dataclass
class StepState:
    """What a step's phases hand each other (device tensors; a captured graph's own tensors when graphed)."""

    step: StepInput  # the target's forward takes the drafts in its input ids (the Markov phase's copy)
    blocks: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # draft phase: (h, U) per chunk of sequences
    proposal: Proposal | None = None
    hidden: torch.Tensor | None = None  # the target's final hidden states [T, H]
    features: torch.Tensor | None = None  # its tapped layers [T, m*H]
    out: SamplerOutput | None = None  # rank 0's tokens
