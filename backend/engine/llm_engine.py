"""`LLMEngine`: requests in, `RequestOutput` deltas out, one `step()` at a time (single-threaded;
`AsyncLLMEngine` drives it from its own thread). It owns everything that is a Python object (scheduler,
sequences, detokenizers); the model, the page pool and the sampler live behind the `Executor`, which gets one
typed `StepInput` per step and returns the sampled token ids. With speculative decoding (`speculative_config`,
executor/speculative/) a step may return several tokens per sequence: they are appended one by one, a stop token, stop
string or max_tokens ending the sequence at that token, and streamed as one output. With async scheduling the next
step is queued before a step's tokens are back (`_launch_ahead`; after a speculative step too: executor/ahead.py).

    engine = LLMEngine(EngineConfig(model=DIR, ...))
    engine.add_request("r1", prompt_token_ids=[...], sampling_params=SamplingParams(...))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from m3serve.config import ConfigError, EngineConfig, ModelConfig
from m3serve.engine.block_manager import BlockManager
from m3serve.engine.faults import FailedOutput, contained, describe
from m3serve.engine.outputs import RequestOutput
from m3serve.engine.sampling_params import InvalidRequest, SamplingParams, TextOptions
from m3serve.engine.scheduler import STEP_KINDS, ScheduledBatch, Scheduler
from m3serve.engine.sequence import Sequence, SequenceText
from m3serve.engine.speculative_metrics import SpeculativeStats
from m3serve.engine.speculative_scheduling import after_speculative_step, num_draft_tokens
from m3serve.executor.speculative.confidence import VerifyScheduler
from m3serve.step_io import SamplerOutput, StepInput
from m3serve.engine.step_builder import StepBuilder
from m3serve.executor import create_executor
from m3serve.executor.worker import PendingOutput

log = logging.getLogger(__name__)

REASONING_PARSERS = ("minimax_m3",)


@dataclass
class PreparedRequest:
    """A validated request, ready to become a `Sequence` (built off the engine thread)."""
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    reasoning_parser: str | None
    thinking_mode: str | None
    assistant_prefix: str = ""  # rendered after the generation prompt: the reply's start, read by the parser
    prompt_text: str | None = None  # the prompt decoded (TextOptions.prompt_text): its first output carries it
    logprob_tokens: bool = False  # its outputs carry the text of each logprobs token (TextOptions.logprob_tokens)


@dataclass
class _InFlight:
    """A step launched on the executor whose tokens the engine has not processed yet."""
    batch: ScheduledBatch
    step: StepInput
    seqs: list[Sequence]  # the sequences it samples, one per sampling row
    out: PendingOutput | None
    error: Exception | None = None  # launching it failed (a step queued ahead: its requests fail when it is due)
    launched: float = dataclasses.field(default_factory=time.perf_counter)  # host clock when it was scheduled


class LLMEngine:
    def __init__(self, config: EngineConfig, *, model=None, load_report=None, tokenizer=None):
        t_load = time.perf_counter()
        config.validate()
        self.config = config
        mcfg = ModelConfig.from_pretrained(config.model) if model is None else model.config
        self.model_config = mcfg
        if config.block_size not in (None, mcfg.index_block_size):
            raise ConfigError(f"block_size: {config.block_size} must equal the model's index_block_size "
                              f"({mcfg.index_block_size}): a KV page is one MSA block")
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(f"max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings "
                              f"({mcfg.max_position_embeddings})")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                              f"({self.max_model_len}) when chunked prefill is disabled")
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.eos_token_ids = self._eos_ids()
        self.executor = create_executor(config, mcfg, self.max_model_len, model=model, load_report=load_report)
        num_pages = self.executor.num_pages
        self.block_manager = BlockManager(num_pages, mcfg.index_block_size, config.enable_prefix_caching,
                                          watermark_pages=num_pages // 100)
        speculative = config.speculative
        k = speculative.num_speculative_tokens if speculative is not None else 0
        self.speculative_stats = SpeculativeStats(k) if speculative is not None else None
        # confidence-scheduled verification: each step's drafts per sequence (`_plan_verify_width`); else always K
        self.verify_scheduler = (VerifyScheduler(k, speculative.confidence_cost_table)
                                 if k and speculative.confidence_scheduling else None)
        self.verify_width = k
        self.draft_backoff = speculative.draft_backoff if speculative is not None else 0
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill,
                                   num_lookahead=(lambda seq: num_draft_tokens(seq, self.verify_width)) if k else None,
                                   prefill_apart=bool(k) and speculative.prefill_apart,
                                   max_waiting_steps=config.max_waiting_steps,
                                   waiting_served_ratio=config.waiting_served_ratio,
                                   max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes)
        self.step_builder = StepBuilder(mcfg.index_block_size, self.eos_token_ids, self.executor.pin_memory, k)
        self._arrivals = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self.num_steps = self.prompt_tokens_total = self.generation_tokens_total = 0
        self.device_wait_s = 0.0  # host time spent waiting for steps' sampled tokens (the rest is host work)
        self.num_steps_ahead = 0  # steps queued before the previous step's tokens were back (`_launch_ahead`)
        self._inflight: _InFlight | None = None  # the step queued on the device, its tokens not yet processed
        # steps done and their wall time by ScheduledBatch.kind: a step's time runs from when it was scheduled, or
        # when the step before it was done if later (a step queued ahead overlaps the one before), to when its outputs
        # are made; so the kinds' times add up to the engine's busy time (benchmarks/bench_learned_spec.py prints them)
        self.steps_by_kind = dict.fromkeys(STEP_KINDS, 0)
        self.step_seconds_by_kind = dict.fromkeys(STEP_KINDS, 0.0)
        self._last_step_done = 0.0
        warmup = getattr(getattr(self.executor, "worker", None), "warmup", None)  # rank 0's (executor/warmup.py)
        self.warmup_seconds = warmup.seconds if warmup is not None else 0.0
        self.load_seconds = time.perf_counter() - t_load  # model, page pool, graphs and warm-up: ready after this
        log.info("engine loaded in %.1f s (warm-up %.1f s)", self.load_seconds, self.warmup_seconds)

    # ---- setup helpers ---------------------------------------------------------------------------
    def _load_tokenizer(self):
        path = self.config.tokenizer or self.config.model
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            log.warning("no tokenizer.json in %s: token-id prompts only, no text output", path)
            return None
        from m3serve.text.tokenizer import Tokenizer
        return Tokenizer.from_pretrained(path)

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_id)
        gen = os.path.join(self.config.model, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                e = json.load(f).get("eos_token_id")
            ids |= set(e if isinstance(e, list) else [] if e is None else [e])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests --------------------------------------------------------------------------------
    def prepare_request(self, prompt=None, prompt_token_ids=None, sampling_params: SamplingParams | None = None,
                        reasoning_parser: str | None = None, chat_template_kwargs: dict | None = None,
                        text_options: TextOptions | None = None) -> PreparedRequest:
        """Validate and tokenize; decode what `text_options` asks (thread-safe: reads only immutable engine state).
        Raises InvalidRequest."""
        sp = sampling_params if sampling_params is not None else SamplingParams()
        sp.validate()
        options = text_options if text_options is not None else TextOptions()
        options.validate()
        if options.stop_words and self.tokenizer is not None:  # without a tokenizer they have no text: ignored
            words = [w for w in (self.tokenizer.decode(ids, skip_special_tokens=False) for ids in options.stop_words)
                     if w]
            if words:
                sp = dataclasses.replace(sp, stop=sp.stop + words)
        kwargs = dict(chat_template_kwargs or {})
        prefix = kwargs.pop("assistant_prefix", None) or ""
        if not isinstance(prefix, str):
            raise InvalidRequest("assistant_prefix", "must be a string")
        if prefix and not (isinstance(prompt, list) and prompt_token_ids is None):
            raise InvalidRequest("assistant_prefix", "is only allowed with chat messages")
        if prompt_token_ids is None and prompt is not None:
            if self.tokenizer is None:
                raise InvalidRequest("prompt", "text prompts need a tokenizer (tokenizer.json) in the model directory")
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt) if prompt else []
            elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
                try:  # the assistant prefix is tokenized with the rendered prompt, as a reply in history is
                    prompt_token_ids = self.tokenizer.encode(
                        self.tokenizer.apply_chat_template(prompt, tokenize=False, **kwargs) + prefix)
                except TypeError as e:  # a keyword the renderer cannot take ("tokenize", "messages", ...)
                    raise InvalidRequest("chat_template_kwargs", f"not accepted by the chat template: {e}") from None
                except ValueError as e:
                    raise InvalidRequest("prompt", f"chat template failed: {e}") from None
            else:
                raise InvalidRequest("prompt", "must be a string or a list of chat messages")
        ids = list(prompt_token_ids or [])
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest("prompt_token_ids", f"token id {bad[0]!r} is not in [0, {vocab})")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise InvalidRequest("prompt", f"{len(ids)} prompt tokens leave no room under max_model_len="
                                 f"{self.max_model_len}")
        max_tokens = room if sp.max_tokens is None else sp.max_tokens
        if max_tokens > room:
            if not options.default_max_tokens:
                raise InvalidRequest("max_tokens", f"{len(ids)} prompt tokens + max_tokens={max_tokens} exceed "
                                     f"max_model_len={self.max_model_len}")
            if sp.min_tokens > room:  # the model's default, not the client's, is cut to fit; min_tokens cannot be
                raise InvalidRequest("min_tokens", f"{len(ids)} prompt tokens leave room for {room} tokens under "
                                     f"max_model_len={self.max_model_len}, fewer than min_tokens={sp.min_tokens}")
            sp, max_tokens = dataclasses.replace(sp, max_tokens=room), room
        bad = [t for t in sp.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequest("stop_token_ids", f"token id {bad[0]} is not in [0, {vocab})")
        if sp.stop and self.tokenizer is None:
            raise InvalidRequest("stop", "stop strings need a tokenizer")
        parser = reasoning_parser if reasoning_parser is not None else self.config.reasoning_parser
        if parser is not None and parser not in REASONING_PARSERS:
            raise InvalidRequest("reasoning_parser", f"{parser!r} is not one of {list(REASONING_PARSERS)}")
        prompt_text = (self.tokenizer.decode(ids, skip_special_tokens=False)
                       if options.prompt_text and self.tokenizer is not None else None)
        return PreparedRequest(ids, sp, max_tokens, parser, kwargs.get("thinking_mode"), prefix, prompt_text,
                               options.logprob_tokens)

    def add_prepared(self, request_id: str, req: PreparedRequest) -> Sequence:
        if request_id in self.scheduler.requests:
            raise InvalidRequest.already_running(request_id)
        sp = req.sampling_params
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (), generator=self._seed_rng))
        text = None
        if self.tokenizer is not None:
            parser = None
            if req.reasoning_parser is not None:
                from m3serve.text.reasoning import MiniMaxM3ReasoningParser
                parser = MiniMaxM3ReasoningParser(req.thinking_mode, req.assistant_prefix)
            text = SequenceText(self.tokenizer, req.prompt_token_ids, sp, parser, req.prompt_text, req.logprob_tokens)
        seq = Sequence(request_id, next(self._arrivals), req.prompt_token_ids, sp, req.max_tokens, seed, text)
        self.scheduler.add(seq)
        self.prompt_tokens_total += seq.num_prompt_tokens
        return seq

    def add_request(self, request_id: str, prompt=None, prompt_token_ids=None,
                    sampling_params: SamplingParams | None = None, reasoning_parser: str | None = None,
                    chat_template_kwargs: dict | None = None, text_options: TextOptions | None = None) -> Sequence:
        req = self.prepare_request(prompt, prompt_token_ids, sampling_params, reasoning_parser, chat_template_kwargs,
                                   text_options)
        return self.add_prepared(request_id, req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request (its pages are freed now); its final output, or None."""
        seq = self.scheduler.abort(request_id)
        return None if seq is None else self._output(seq, [], "", "", [])

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or a step still queued on the device (async scheduling: its rows may all belong to
        requests that ended meanwhile; one more `step()` drains it)."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run the next step and return its outputs. With async scheduling the step after it is already queued on
        the device when this returns (`_launch_ahead`): the host's work between two steps (outputs, detokenizing,
        scheduling, the next step's input) overlaps the device's."""
        if self._inflight is None:
            t0 = time.perf_counter()
            if self.verify_scheduler is not None:
                self._plan_verify_width()
            batch = self.scheduler.schedule()
            if not batch:
                return []
            step, seqs = self.step_builder.build(batch)
            try:
                out = self.executor.launch(step)
            except Exception as e:
                return self._failed_step(batch.seqs, e)
            self._inflight = _InFlight(batch, step, seqs, out, launched=t0)
        current, self._inflight = self._inflight, None
        self._inflight = self._launch_ahead(current)
        return self._complete(current)

    def _plan_verify_width(self) -> None:
        """Confidence-scheduled verification: the drafts every speculating sequence verifies in the next step, from
        the decoding sequences' confidences of their previous step (executor/speculative/confidence.py; history only, so the
        rule stays exact)."""
        k = self.verify_scheduler.k
        limits = [(s, num_draft_tokens(s, k)) for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        w = self.verify_scheduler.width([(s.draft_confidence, n) for s, n in limits if n > 0])
        self.verify_width = self.step_builder.num_speculative_tokens = w

    def _failed_step(self, seqs: list[Sequence], e: Exception) -> list[RequestOutput]:
        """The forward or the sampler failed: this step's requests fail, their pages are freed."""
        if not contained(e) or not self.executor_alive():
            raise e  # a device fault, or a worker (tensor parallel) gone: the engine is dead
        log.exception("engine step failed: failing its %d requests", len(seqs))
        return [self._fail(seq, e) for seq in seqs if not seq.is_finished]

    def _launch_ahead(self, cur: "_InFlight") -> "_InFlight | None":
        """Queue the next decode step of `cur`'s sequences before `cur`'s tokens are back, when the step after `cur`
        can only be that: every running sequence in `cur` samples there (a decode, a speculative decode or its
        prefill's last chunk) or, without speculative decoding, is a prompt whose chunk in `cur` is not its last
        (its next chunk follows the decodes, as `schedule` would give it: `Scheduler.schedule_ahead`; a mixed step,
        or a prompt's chunks alone, are queued ahead as decode steps are), no sampling option reads the output tokens
        (penalties), no confidence-scheduled verification (its next width reads `cur`'s confidences on the host).
        Without speculative decoding or gathering (`max_waiting_steps`), requests waiting for admission join that
        step as `schedule` would admit them (`schedule_ahead`): an arrival then costs no step whose launch waits for
        the one before it, and is admitted in the same step as without async scheduling. With speculative decoding
        and `prefill_apart`, after a step of drafting decodes the prompts' own step is queued instead, when there is
        prefill work (`Scheduler.prefill_turn_ahead`); the decodes follow it, their tokens known by then.
        Each sequence feeds the last token `cur` gives it (read on the device) at the position after it; after a
        speculative step, which gives a sequence 1..k+1 tokens, the device moves that sequence's positions, slots
        and cache length by the accepted run (executor/ahead.py). Left out: a sequence `cur` may bring to
        max_tokens, and one whose drafts next step depend on how many `cur` accepts (near max_tokens or
        min_tokens). With speculative decoding the running decodes that are not in `cur` (left out of it so) join
        as the scheduler would schedule them, their tokens all known (row -1); without, a running sequence outside
        `cur` keeps steps synchronous. The block manager gives each the pages of the longest run (trimmed once a
        step that is not followed comes back). A sequence that `cur` ends otherwise (a stop token or string)
        wasted its row: `_complete` drops it. Steps that are not queued ahead are scheduled when `cur` is done."""
        sch, bm = self.scheduler, self.block_manager
        k_max = self.step_builder.num_speculative_tokens
        if (not self.config.async_scheduling or not self.executor.supports_async_scheduling or cur.error is not None
                or self.verify_scheduler is not None or sch.waiting and sch.max_waiting_steps):
            return None
        if k_max and sch.prefill_apart and any(cur.batch.num_draft_tokens):
            turn = sch.prefill_turn_ahead()  # the prompts' step `schedule` would give next (no decode in it)
            if turn is not None:
                return self._queue(turn, None, None)
        if k_max and sch.waiting:
            return None
        in_cur, sampled = {id(s) for s in cur.batch.seqs}, {id(s) for s in cur.seqs}
        known = [s for s in sch.running if id(s) not in in_cur]
        chunked = [(s, n) for s, n in zip(cur.batch.seqs, cur.batch.num_new_tokens)
                   if id(s) not in sampled and not s.is_finished]  # in the middle of their prompts
        if (not cur.seqs and not chunked or any(s.sampling_params.has_penalties for s in sch.running)
                or chunked and k_max or known and (not k_max or any(s.num_uncomputed_tokens != 1 for s in known))):
            return None
        drafted = dict(zip(map(id, cur.batch.seqs), cur.batch.num_draft_tokens or [0] * len(cur.batch.seqs)))
        rows, drafts, most = [], [], []
        for i, s in enumerate(cur.seqs):
            if s.is_finished:  # ended (or aborted) before `cur` comes back: its row in `cur` is dropped
                continue
            m = 1 + drafted[id(s)]  # the most tokens `cur` gives it
            k = num_draft_tokens(s, k_max, 1) if k_max else 0
            if s.num_output_tokens + m < s.max_tokens and (not k_max or num_draft_tokens(s, k_max, m) == k):
                rows.append(i), drafts.append(k), most.append(m)
        seqs = [cur.seqs[i] for i in rows] + known
        rows += [-1] * len(known)
        drafts += [num_draft_tokens(s, k_max) for s in known]
        most += [0] * len(known)
        if (rows and rows[0] < 0 or len(seqs) + sum(drafts) > sch.max_num_batched_tokens
                or sum(bm.pages_to_append(s, m + k) for s, m, k in zip(seqs, most, drafts)) > bm.num_free_pages):
            # nothing of `cur` to follow (then one step with every sequence beats one without those left out of
            # it), over the token budget, or a page short: the next step is scheduled when `cur` is done
            return None
        for s, m, k in zip(seqs, most, drafts):
            bm.append_slot(s, m + k)  # its next step's last position, after the longest run `cur` may accept
        # after the decodes: the next chunks of the prompts `cur` is in the middle of (their pages are all there),
        # then the waiting requests admitted in what is left of the budget
        prompts = sch.schedule_ahead([s for s, _ in chunked], [n for _, n in chunked], len(seqs) + sum(drafts),
                                     len(seqs))
        if not rows and not prompts:  # nothing to run (no slot was taken: without rows there are no decodes)
            return None
        batch = ScheduledBatch(seqs + [s for s, _, _ in prompts], [1 + k for k in drafts] + [n for *_, n in prompts],
                               drafts + [0] * len(prompts), num_decodes=len(seqs),
                               num_pending=[0] * len(seqs) + [done for _, done, _ in prompts])
        sch.count(batch)
        # prompt chunks alone (no decode of `cur` goes on) read nothing of `cur`'s result
        return self._queue(batch, rows + [-1] * len(prompts) if rows else None, cur.out.device if rows else None)

    def _queue(self, batch: ScheduledBatch, prev_rows: list[int] | None, prev) -> "_InFlight":
        """Build `batch`'s step and launch it behind the one running (`prev`: that step's result on the device, which
        rows `prev_rows` of this one read; None: it reads nothing of it)."""
        step, sampling = self.step_builder.build(batch, prev_rows=prev_rows)
        self.num_steps_ahead += 1
        try:
            return _InFlight(batch, step, sampling, self.executor.launch(step, prev))
        except Exception as e:  # its requests fail once `cur`'s tokens are out; a device fault kills the engine now
            if not contained(e) or not self.executor_alive():
                raise
            return _InFlight(batch, step, sampling, None, e)

    def _complete(self, cur: "_InFlight") -> list[RequestOutput]:
        """Wait for `cur`'s tokens and turn them into outputs; rows of sequences that ended (or were aborted) since
        it was launched are dropped."""
        batch, step, seqs = cur.batch, cur.step, cur.seqs
        try:
            if cur.error is not None:
                raise cur.error
            t0 = time.perf_counter()
            sampled = cur.out.result()
            self.device_wait_s += time.perf_counter() - t0
        except Exception as e:
            return self._failed_step(batch.seqs, e)
        rows = self._rows(sampled, seqs)
        live = [(seq, row) for seq, row in zip(seqs, rows) if not seq.is_finished]
        appended: dict[int, tuple] = {}
        failed: dict[int, Exception] = {}
        for seq, row in live:
            try:
                appended[id(seq)] = self._append(seq, row)
            except Exception as e:  # this request's text state (detokenizer, stop strings, parser)
                if not contained(e):
                    raise
                log.exception("request %s failed", seq.request_id)
                failed[id(seq)] = e
        rejected = None
        if step.speculative is not None:  # drafts past each accepted run are not in the cache
            emitted = {id(seq): len(row) for seq, row in zip(seqs, rows)}
            scheduled = {id(seq): k for seq, k in zip(batch.seqs, batch.num_draft_tokens)}
            rejected = [k and k + 1 - emitted[id(seq)] for seq, k in zip(batch.seqs, batch.num_draft_tokens)]
            # counted as vLLM counts them: sequences that ended before this step (it was launched ahead of their
            # last tokens) verified nothing, and a run cut at a stop accepted the drafts up to the stop, not past it
            kept = {id(seq): len(appended[id(seq)][0]) if id(seq) in appended else len(row) for seq, row in live}
            self.speculative_stats.observe([scheduled[id(seq)] > 0 and id(seq) in kept for seq in seqs],
                                           sampled.num_draft_tokens.tolist(),
                                           [min(len(row), kept.get(id(seq), 0) + 1) for seq, row in zip(seqs, rows)])
            if self.verify_scheduler is not None and sampled.draft_confidence is not None:
                for seq, conf in zip(seqs, sampled.draft_confidence.tolist()):
                    if scheduled[id(seq)]:
                        seq.draft_confidence = conf[:scheduled[id(seq)]]
            if self.draft_backoff:  # speculative_config.draft_backoff (off: no work on this path)
                for seq in seqs:
                    after_speculative_step(seq, scheduled[id(seq)], emitted[id(seq)], self.draft_backoff)
        queued = self._inflight.batch.seqs if self._inflight is not None else ()  # their lookahead pages stay
        self.scheduler.update(batch, rejected, keep_lookahead=queued)
        self.num_steps += 1
        outputs = []
        for seq, _ in live:
            if id(seq) in failed:
                outputs.append(self._fail(seq, failed[id(seq)]))
                continue
            new_ids, text, reasoning, tops, reason = appended[id(seq)]
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq, new_ids, text, reasoning, tops))
        done = time.perf_counter()
        self.steps_by_kind[batch.kind] += 1
        self.step_seconds_by_kind[batch.kind] += done - max(cur.launched, self._last_step_done)
        self._last_step_done = done
        return outputs

    def executor_alive(self) -> bool:
        """The executor's workers are all there (`check_health` does not raise)."""
        try:
            self.executor.check_health()
        except Exception:
            return False
        return True

    def _fail(self, seq: Sequence, exc: BaseException) -> FailedOutput:
        """End `seq` with finish_reason "error" (its pages are freed now)."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        return FailedOutput(request_id=seq.request_id, new_token_ids=[], finished=True, finish_reason="error",
                            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
                            cumulative_logprob=seq.cumulative_logprob, error=describe(exc))

    @staticmethod
    def _rows(out: SamplerOutput | None, seqs: list[Sequence]) -> list[list[tuple]]:
        """Per sampled sequence, the tokens it got this step (one, or a speculative step's accepted run and its
        last token): [(token id, its logprob, {token: logprob} of it and the top-n or None), ...]."""
        if out is None:
            return []
        ids, lps, top_ids, top_lps = out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs
        if ids.dim() == 1:
            ids, lps = ids[:, None], lps[:, None]
            if top_ids is not None:
                top_ids, top_lps = top_ids[:, None], top_lps[:, None]
        counts = [1] * len(seqs) if out.num_tokens is None else out.num_tokens.tolist()
        ids, lps = ids.tolist(), lps.tolist()
        if top_ids is not None:
            top_ids, top_lps = top_ids.tolist(), top_lps.tolist()
        rows = []
        for i, seq in enumerate(seqs):
            n, row = seq.sampling_params.logprobs, []
            for j in range(counts[i]):
                tok, lp, top = ids[i][j], lps[i][j], None
                if n is not None:
                    top = {tok: lp}
                    if n > 0:
                        top.update(zip(top_ids[i][j][:n], top_lps[i][j][:n]))
                row.append((tok, lp, top))
            rows.append(row)
        return rows

    def _append(self, seq: Sequence, row: list[tuple]) -> tuple[list[int], str, str, list, str | None]:
        """Append the step's tokens one at a time until one ends the sequence (stop token, max_tokens, stop
        string: the rest of an accepted run is dropped). (new ids, text, reasoning, logprobs, finish reason)."""
        sp = seq.sampling_params
        new_ids, tops, text, reasoning, reason = [], [], "", "", None
        for tok, logprob, top in row:
            seq.token_ids.append(tok)
            seq.cumulative_logprob += logprob
            self.generation_tokens_total += 1
            new_ids.append(tok), tops.append(top)
            stop_token = tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids)
            reason = "stop" if stop_token else "length" if seq.num_output_tokens >= seq.max_tokens else None
            if seq.text is not None:
                shown = [] if stop_token and not sp.include_stop_str_in_output else [tok]
                t, r = seq.text.feed(shown, seq.num_output_tokens, final=reason is not None)
                text, reasoning = text + t, reasoning + r
                if seq.text.stopped:
                    reason = "stop"
            if reason is not None:
                break
        return new_ids, text, reasoning, tops, reason

    def _output(self, seq: Sequence, new_ids, text, reasoning, tops: list) -> RequestOutput:
        first = not seq.first_output_sent
        seq.first_output_sent = True
        logprobs, seq_text = seq.sampling_params.logprobs is not None, seq.text
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=list(new_ids), text=text, reasoning_text=reasoning,
            finished=seq.is_finished, finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(tops) if logprobs else None,
            prompt_token_ids=list(seq.prompt_token_ids) if first else [],
            num_cached_tokens=seq.num_cached_tokens,
            prompt_text=seq_text.prompt_text if first and seq_text is not None else None,
            logprob_tokens=seq_text.token_texts(tops) if logprobs and seq_text is not None else None,
            mid_character=seq_text is not None and seq_text.detok.mid_character)

    # ---- the executor's workers -------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise if the executor lost a worker (tensor parallelism: a worker process died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Release the executor's workers and processes (idempotent)."""
        self.executor.shutdown()

    def stats(self) -> dict:
        bm, sch = self.block_manager, self.scheduler
        return {
            "num_running": len(sch.running), "num_waiting": len(sch.waiting),
            "num_free_pages": bm.num_free_pages, "num_total_pages": bm.num_pages,
            "kv_cache_usage": 1.0 - bm.num_free_pages / bm.num_pages,
            "num_preemptions": sch.num_preemptions, "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_steps": self.num_steps, "num_steps_ahead": self.num_steps_ahead,
            "num_prompt_steps": sum(n for kind, n in self.steps_by_kind.items() if "prefill" in kind),
            "steps_by_kind": dict(self.steps_by_kind), "step_seconds_by_kind": dict(self.step_seconds_by_kind),
            "device_wait_seconds": self.device_wait_s,
            "num_chunked_prefills": sch.num_chunked_prefills, "num_held_steps": sch.num_held_steps,
            "num_mixed_steps": sch.num_mixed_steps, "max_running": sch.max_running,
            "load_seconds": self.load_seconds, "warmup_seconds": self.warmup_seconds,
            **(self.speculative_stats.as_dict() if self.speculative_stats is not None else {}),
        }
