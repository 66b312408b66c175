"""POST /v1/completions: the request (vLLM's CompletionRequest fields) and its translation.

One text prompt per request (`text_input` of `m3`, no chat template, no reasoning split); a list of prompts
or a token-id prompt is refused (the m3 contract takes text; `m3_ids` is the token-id model). `echo`
puts the prompt before the completion (not with logprobs: the server has no prompt logprobs).
`logprobs` is OpenAI's legacy integer (top-n per token).
"""
from __future__ import annotations

from typing import AsyncIterator

from m3serve.gateway.protocol import Reply, SamplingRequest, bad_request, ranked_tops, sampled, usage
from m3serve.gateway.triton import Delta, m3_inputs

MAX_LOGPROBS = 20


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None


class Completion(Reply):
    """One completion request: its m3 inputs, then its reply (`complete`) or its chunks (`stream`)."""

    endpoint, prefix, object = "completions", "cmpl", "text_completion"

    def __init__(self, req: CompletionRequest, model_name: str):
        super().__init__(req, model_name)
        r = req
        p = r.prompt
        if isinstance(p, list):
            if len(p) != 1 or not isinstance(p[0], str):
                raise bad_request("prompt", "one text prompt per request (a string, or a list of one string); "
                                            "token-id prompts and batches are not supported")
            p = p[0]
        self.prompt = p
        if r.suffix:
            raise bad_request("suffix", "is not supported")
        if r.best_of not in (None, 1):
            raise bad_request("best_of", f"best_of > 1 is not supported, got {r.best_of}")
        if r.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs", "prompt logprobs are not supported")
        if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
            raise bad_request("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {r.logprobs}")
        if r.echo and r.logprobs is not None:
            raise bad_request("echo", "echo with logprobs needs prompt logprobs, which are not supported")

    def inputs(self):
        r = self.req
        return m3_inputs(prompt=self.prompt, sampling=r.sampling(r.max_tokens, r.logprobs),
                         logprobs=r.logprobs is not None, reasoning=False)

    def _logprobs(self, entries: list, offset: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            tok, lp = sampled(e)
            out["tokens"].append(tok)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(dict(ranked_tops(e, self.req.logprobs)))
            out["text_offset"].append(offset)
            offset += len(tok)
        return out

    async def complete(self, deltas: AsyncIterator[Delta]) -> dict:
        text, entries, finish = [self.prompt] if self.req.echo else [], [], None
        async for d in deltas:
            self.count(d)
            text.append(d.text)
            entries.extend(d.logprobs)
            finish = d.finish_reason or finish
        return {**self.envelope(self.object), "choices": [{"index": 0, "text": "".join(text), "logprobs": self._logprobs(entries, 0),
                             "finish_reason": finish, "stop_reason": None}],
                "usage": usage(self.num_input, self.num_output)}

    def _chunk(self, text: str, logprobs=None, finish: str | None = None) -> dict:
        return {**self.envelope(self.object), "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                             "stop_reason": None}]}

    async def stream(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[dict]:
        offset, first = 0, True
        async for d in deltas:
            self.count(d)
            text = d.text
            if first and self.req.echo:
                text = self.prompt + text
            first = False
            lp = self._logprobs(d.logprobs, offset)
            offset += len(d.text)
            if text or lp or d.final:
                yield self._chunk(text, lp, d.finish_reason if d.final else None)
        if self.req.include_usage:
            yield self.usage_chunk()
