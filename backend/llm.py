"""`LLM`: the offline Python API (vLLM-style): `LLM(model=DIR).generate(prompts, SamplingParams(...))`,
running on `LLMEngine` (every prompt added, then stepped to completion with in-flight batching)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from m3serve.config import EngineConfig
from m3serve.engine.llm_engine import LLMEngine
from m3serve.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning_text: str = ""
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0


def _as_prompt(p) -> dict:
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, dict):
        return dict(p)
    return {"prompt_token_ids": [int(t) for t in p]}


class LLM:
    """`with LLM(...) as llm:` or `llm.shutdown()` releases the tensor-parallel worker processes at once (they also go
    when the object is collected or the interpreter exits)."""

    def __init__(self, model: str, **options):
        self.config = EngineConfig(model=model, **options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Prompts: strings, token-id lists, or {"prompt"/"prompt_token_ids": ...} dicts. Outputs in order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = [_as_prompt(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        # validate everything before adding anything
        prepared = [self.engine.prepare_request(p.get("prompt"), p.get("prompt_token_ids"), sp)
                    for p, sp in zip(prompts, sampling_params)]
        outs: dict[str, CompletionOutput] = {}
        order = []
        for req in prepared:
            rid = f"llm-{next(self._ids)}"
            self.engine.add_prepared(rid, req)
            outs[rid] = CompletionOutput(list(req.prompt_token_ids),
                                         logprobs=None if req.sampling_params.logprobs is None else [])
            order.append(rid)
        try:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    c = outs[o.request_id]
                    c.token_ids += o.new_token_ids
                    c.text += o.text
                    c.reasoning_text += o.reasoning_text
                    c.cumulative_logprob = o.cumulative_logprob
                    c.num_cached_tokens = o.num_cached_tokens
                    if o.logprobs is not None:
                        c.logprobs += o.logprobs
                    if o.finished:
                        c.finish_reason = o.finish_reason
        finally:
            for rid in order:  # on an exception, leave nothing behind in the engine
                self.engine.abort_request(rid)
        return [outs[r] for r in order]
