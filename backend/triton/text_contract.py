"""The text contract (model `m3`): the vLLM backend's tensors, `max_batch_size: 0`.

text_input (or messages + tools + chat_template_kwargs + assistant_prefix) -> text_output deltas, plus finish_reason,
num_input/output_tokens, cumulative_logprob, logprobs and reasoning_output on request. As in vLLM's backend, each
streamed response carries every output asked for; `returns_on_final_only` (an m3serve input, for the OpenAI gateway)
puts the whole-request ones (finish_reason, num_input_tokens, num_output_tokens as the total, cumulative_logprob) on
the final response alone: each tensor of a response costs the server's response thread (docs/performance.md).
Sampling options come from defaults < request parameters < sampling_parameters JSON < alias tensors (max_tokens,
top_k...).
Chat messages are rendered by the engine (its chat template, its time bound), `assistant_prefix` after the
generation prompt (the reply starts with it: the gateway's forced tool calls); a template sent by the client
(`chat_template_kwargs.chat_template`) is refused unless the model sets `trust_request_chat_template`.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from m3serve.engine.sampling_params import TextOptions
from m3serve.triton.contract import (UNSUPPORTED_SAMPLING, Contract, GenRequest, request_parameters,
                                     sampling_params, source_name)
from m3serve.triton.schema import (TEXT_ALIASES, TEXT_RETURN_SWITCHES, RequestError, bool_scalar, json_value,
                                   number, one, str_array, str_scalar)


class TextContract(Contract):
    ENGINE_FIELDS = {"prompt_token_ids": "text_input", "request_id": "request_id"}

    def parse(self, tensors: dict[str, np.ndarray], params: str | dict | None, request_id: str = ""
              ) -> list[GenRequest]:
        """One `m3` request -> one GenRequest; RequestError on bad input."""
        prompt, messages, ctk = self._prompt(tensors)
        stream = bool(bool_scalar(tensors, "stream"))
        exclude = bool_scalar(tensors, "exclude_input_in_output")
        if stream and exclude is False:
            raise RequestError("exclude_input_in_output",
                               "false is not supported with stream=true (streamed deltas never repeat the prompt)")
        prepend = (not stream) and (exclude is False if messages is not None else exclude is not True)

        returns = {n[len("return_"):] for n in TEXT_RETURN_SWITCHES if bool_scalar(tensors, n)}
        # reasoning: the model.json parser is always on (reasoning never leaks into text_output); without
        # one, return_reasoning=true turns the minimax_m3 parser on for this request
        want_reasoning = bool_scalar(tensors, "return_reasoning")
        parser = self.defaults.reasoning_parser or ("minimax_m3" if want_reasoning else None)
        returns.discard("reasoning")
        if parser and want_reasoning is not False:
            returns.add("reasoning")

        merged, sources = self._sampling_options(tensors, params)
        # the engine decodes what the response echoes: a chat prompt as it rendered it, the logprobs' tokens
        echo, logprob_tokens = prepend and messages is not None, "logprobs" in returns
        default = "max_tokens" not in sources  # the model's default: the engine cuts it to the prompt's room
        options = (TextOptions(prompt_text=echo, logprob_tokens=logprob_tokens, default_max_tokens=default)
                   if echo or logprob_tokens or default else None)
        return [GenRequest(sampling=sampling_params(merged, sources), prompt=prompt, messages=messages,
                           chat_template_kwargs=ctk, stream=stream, prepend_input=prepend,
                           returns=frozenset(returns), reasoning_parser=parser, sources=sources,
                           returns_on_final_only=bool(bool_scalar(tensors, "returns_on_final_only")) and stream,
                           text_options=options)]

    def _prompt(self, tensors) -> tuple[str | None, list | None, dict | None]:
        prompt = str_scalar(tensors, "text_input")
        messages_json = str_scalar(tensors, "messages")
        messages = tools = None
        if messages_json is not None:
            messages = json_value(messages_json, "messages", list)
            if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise RequestError("messages", "must be a non-empty JSON array of {\"role\", \"content\"} objects")
            tools_json = str_scalar(tensors, "tools")
            if tools_json is not None:
                tools = json_value(tools_json, "tools", list)
        elif "tools" in tensors:
            raise RequestError("tools", "is only allowed together with messages")
        if prompt is None and messages is None:
            raise RequestError("text_input", "is required (or give `messages`)")
        if prompt is not None and messages is not None:
            raise RequestError("messages", "give either text_input or messages, not both")
        ctk = None
        ctk_json = str_scalar(tensors, "chat_template_kwargs")
        if ctk_json is not None:
            ctk = json_value(ctk_json, "chat_template_kwargs", dict)
            if ctk.get("chat_template") is not None and not self.defaults.trust_request_chat_template:
                raise RequestError("chat_template_kwargs.chat_template",
                                   "chat templates sent with the request are refused: the model does not set "
                                   "the trust_request_chat_template parameter")
        for name, value in (("tools", tools), ("assistant_prefix", str_scalar(tensors, "assistant_prefix"))):
            if value is None:
                continue
            if messages is None:
                raise RequestError(name, "is only allowed together with messages")
            if ctk is not None and name in ctk:
                raise RequestError(name, f"give {name} either as the {name} input or in chat_template_kwargs")
            ctk = {**(ctk or {}), name: value}
        return prompt, messages, ctk

    def _sampling_options(self, tensors, params) -> tuple[dict[str, Any], dict[str, str]]:
        """defaults < request parameters < sampling_parameters JSON < explicit tensors, with each key's source."""
        merged: dict[str, Any] = {"max_tokens": self.defaults.max_tokens}
        sources: dict[str, str] = {}
        for k, v in request_parameters(params).items():
            merged[k] = v
            sources[k] = "parameters"
        sp_json = str_scalar(tensors, "sampling_parameters")
        if sp_json is not None:
            for k, v in json_value(sp_json, "sampling_parameters", dict).items():
                merged[k] = v
                sources[k] = "sampling_parameters"
        for tname, (key, _) in TEXT_ALIASES.items():
            if tname in tensors:
                merged[key] = number(one(tensors[tname], tname), tname)
                sources[key] = tname
        for k, why in UNSUPPORTED_SAMPLING.items():
            if k in merged and merged[k] not in (None, False, 1 if k == "best_of" else None):
                raise RequestError(source_name(k, sources.get(k)), why)
            merged.pop(k, None)
        return merged, sources

    def client_field(self, req: GenRequest, engine_field: str) -> str:
        if engine_field == "prompt":
            return "messages" if req.messages is not None else "text_input"
        return super().client_field(req, engine_field)

    def stream(self, req: GenRequest) -> "TextStream":
        return TextStream(req)


class TextStream:
    """Turns a request's engine outputs into vLLM-contract response tensors.

    `add(out)` accumulates; `take(final)` returns the tensors of the next response, or None when a
    non-final response would carry nothing (no empty "priming" responses: TTFT stays honest).
    Streaming: text_output / logprobs / num_output_tokens are deltas, cumulative_logprob is cumulative,
    finish_reason reads "None" until the FINAL response. Non-streaming: one response with everything
    (the prompt first when it is prepended: a chat prompt as the engine rendered it, its `prompt_text`).
    """

    def __init__(self, req: GenRequest):
        self.req = req
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._n_new = 0
        self._logprobs: list | None = [] if "logprobs" in req.returns else None
        self._prompt_text = req.prompt
        self.num_input = 0
        self.num_output = 0
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.finished = False

    def add(self, out) -> None:
        if out.num_prompt_tokens:
            self.num_input = out.num_prompt_tokens
        if out.prompt_text is not None and self.req.prepend_input and self._prompt_text is None:
            self._prompt_text = out.prompt_text
        if out.text:
            self._text.append(out.text)
        if out.reasoning_text:
            self._reasoning.append(out.reasoning_text)
        n = len(out.new_token_ids)
        self._n_new += n
        self.num_output += n
        if out.cumulative_logprob is not None:
            self.cumulative_logprob = float(out.cumulative_logprob)
        if self._logprobs is not None and out.logprobs:
            texts = out.logprob_tokens or [{}] * len(out.logprobs)
            for tid, entry, text in zip(out.new_token_ids, out.logprobs, texts):
                self._logprobs.append(self._logprob_entry(tid, entry, text))
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason

    @staticmethod
    def _logprob_entry(tid: int, entry: dict, texts: dict) -> dict:
        """{token id: {logprob, rank, decoded_token}}: the sampled token first (as in vLLM's dicts, so a client
        tells it from the top-n), then the others by rank. `texts`: the tokens' text, as the engine decoded it."""
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        tops = {str(int(t)): {"logprob": float(lp), "rank": rank, "decoded_token": texts.get(t)}
                for rank, (t, lp) in enumerate(ranked, 1)}
        sampled = str(int(tid))
        first = tops.pop(sampled, {"logprob": None, "rank": None, "decoded_token": None})
        return {sampled: first, **tops}

    @property
    def has_content(self) -> bool:
        return bool(self._text or self._reasoning)

    def take(self, final: bool) -> dict[str, np.ndarray] | None:
        r = self.req
        if not final and (not r.stream or not self.has_content):
            return None
        text = "".join(self._text)
        if final and not r.stream and r.prepend_input and self._prompt_text:
            text = self._prompt_text + text
        t = {"text_output": str_array(text)}
        if "reasoning" in r.returns:
            t["reasoning_output"] = str_array("".join(self._reasoning))
        if "logprobs" in r.returns:
            t["logprobs"] = str_array(json.dumps(self._logprobs if self._logprobs or r.sampling.logprobs
                                                 is not None else None))
        if r.returns_on_final_only and not final:
            return self._taken(t)
        if "finish_reason" in r.returns:
            t["finish_reason"] = str_array(str(self.finish_reason) if final else "None")
        if "cumulative_logprob" in r.returns:
            t["cumulative_logprob"] = np.array(
                [self.cumulative_logprob if self.cumulative_logprob is not None else 0.0], dtype=np.float32)
        if "num_input_tokens" in r.returns:
            t["num_input_tokens"] = np.array([self.num_input], dtype=np.uint32)
        if "num_output_tokens" in r.returns:
            per_response = r.stream and not r.returns_on_final_only
            t["num_output_tokens"] = np.array([self._n_new if per_response else self.num_output], dtype=np.uint32)
        return self._taken(t)

    def _taken(self, t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`t`, this response's tensors, once what it sends is cleared from the stream."""
        self._text.clear()
        self._reasoning.clear()
        self._n_new = 0
        if self._logprobs is not None:
            self._logprobs = []
        return t
