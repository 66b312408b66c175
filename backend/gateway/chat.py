"""POST /v1/chat/completions: the request (vLLM's ChatCompletionRequest fields) and its translation.

The server renders the messages with the model's chat template (`messages`, `tools`, `chat_template_kwargs`
inputs of `m3`) and splits reasoning (`return_reasoning`: minimax_m3 parser) into `reasoning_content`. The
m3 contract returns tool calls as text, so the gateway splits them with the project's minimax_m3 tool
parser (m3serve.text.tool_parser), whole calls at a time in streams. tool_choice: "auto" parses, "none"
returns the text as it is; "required" and a named function start the reply with the M3 tool-call opening
(`assistant_prefix` input of `m3`: `</mm:think>`, the call block's start tag, for a named function its
`<invoke name=...>` too), so the model must write a call (without reasoning); the parser reads the prefix
before the output, so the calls returned hold it (a named choice returns that one call). Assistant
`tool_calls` sent back carry their arguments as a JSON string (OpenAI); the template wants an object, so
they are decoded here.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict

from m3serve.gateway.protocol import (Reply, Role, SamplingRequest, StrictModel, bad_request, ranked_tops,
                                      sampled, usage)
from m3serve.gateway.triton import Delta, m3_inputs
from m3serve.text.tool_parser import ToolCallStreamParser, forced_call_prefix, parse_tool_calls

MAX_TOP_LOGPROBS = 20


class Message(BaseModel):
    """A chat message; extra keys (name, refusal, ...) pass to the template."""

    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None


def _server_message(i: int, m: Message) -> dict:
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        for part in m.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                                                            f"are supported, got type {str(part.get('type'))[:40]!r}")
    if m.tool_calls is not None:
        calls = []
        for j, tc in enumerate(m.tool_calls):
            fn = tc.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"messages[{i}].tool_calls[{j}].function", "must be {\"name\", \"arguments\"}")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError as e:
                    raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments",
                                      f"is not valid JSON ({e})") from None
            if not isinstance(args, dict):
                raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments", "must be a JSON object")
            calls.append({**tc, "function": {**fn, "arguments": args}})
        d["tool_calls"] = calls
    return d


def _tool_call(c: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}


class ChatCompletion(Reply):
    """One chat request: its m3 inputs, then its reply (`complete`) or its chunks (`stream`)."""

    endpoint, prefix, object = "chat", "chatcmpl", "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, model_name: str):
        super().__init__(req, model_name)
        r = req
        if not r.messages:
            raise bad_request("messages", "must hold at least one message")
        if r.top_logprobs is not None and not r.logprobs:
            raise bad_request("top_logprobs", "needs logprobs=true")
        if r.top_logprobs is not None and not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {r.top_logprobs}")
        if r.max_tokens is not None and r.max_completion_tokens is not None and r.max_tokens != r.max_completion_tokens:
            raise bad_request("max_completion_tokens", "give max_tokens or max_completion_tokens, not two values")
        self.tools = [t.model_dump(exclude_none=True) for t in r.tools] if r.tools else None
        self.forced = self._forced_name = None  # (assistant prefix, the part the parser reads) of a forced call
        self._choose_tool(r.tool_choice)
        self.parse_tools = bool(self.tools) and r.tool_choice != "none"
        self.top_n = (r.top_logprobs or 0) if r.logprobs else None

    def _choose_tool(self, choice) -> None:
        if choice is not None and not self.tools:
            raise bad_request("tool_choice", "is only allowed together with tools")
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise bad_request("tool_choice", "a named tool choice is {\"type\": \"function\", \"function\": "
                                                 "{\"name\": ...}}")
            if name not in {t["function"]["name"] for t in self.tools}:
                raise bad_request("tool_choice.function.name", f"{name[:64]!r} is not one of the request's tools")
            if any(c in name for c in '"<>'):
                raise bad_request("tool_choice.function.name", "a forced function's name cannot hold \", < or >")
            self._forced_name = name
        elif choice not in (None, "auto", "none", "required"):
            raise bad_request("tool_choice", "must be \"auto\", \"none\", \"required\" or "
                                             f"{{\"type\": \"function\", ...}}, got {str(choice)[:40]!r}")
        if isinstance(choice, dict) or choice == "required":
            mode = (self.req.chat_template_kwargs or {}).get("thinking_mode")
            self.forced = forced_call_prefix(mode, self._forced_name)

    def inputs(self):
        r = self.req
        ctk = dict(r.chat_template_kwargs or {})
        if r.chat_template is not None:
            ctk["chat_template"] = r.chat_template
        messages = [_server_message(i, m) for i, m in enumerate(r.messages)]
        max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        sampling = r.sampling(max_tokens, self.top_n)
        if self.parse_tools:  # the tool-call markup is made of special tokens (as vLLM's tool parsers ask)
            sampling.setdefault("skip_special_tokens", False)
        return m3_inputs(messages=messages, tools=self.tools, chat_template_kwargs=ctk or None,
                         sampling=sampling, logprobs=self.top_n is not None, reasoning=True,
                         assistant_prefix=self.forced[0] if self.forced else None)

    # ---- the reply -----------------------------------------------------------------------------------
    def _logprobs(self, entries: list) -> dict | None:
        if self.top_n is None:
            return None
        content = []
        for e in entries:
            tok, lp = sampled(e)
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                            "top_logprobs": [{"token": t, "logprob": x, "bytes": list(t.encode("utf-8"))}
                                             for t, x in ranked_tops(e, self.top_n)]})
        return {"content": content}

    def _finish(self, reason: str | None, calls: int) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    def _calls(self, calls: list[dict], already: int) -> list[dict]:
        if not self.req.parallel_tool_calls or self._forced_name is not None:
            calls = calls[:max(0, 1 - already)]
        return calls

    async def complete(self, deltas: AsyncIterator[Delta]) -> dict:
        text, reasoning, entries, finish = [], [], [], None
        async for d in deltas:
            self.count(d)
            text.append(d.text)
            reasoning.append(d.reasoning)
            entries.extend(d.logprobs)
            finish = d.finish_reason or finish
        content, calls = "".join([self.forced[1]] + text if self.forced else text), []
        if self.parse_tools:
            content, parsed = parse_tool_calls(content, self.tools)
            calls = [_tool_call(c) for c in self._calls(parsed, 0)]
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None,
                                   "reasoning_content": "".join(reasoning) or None}
        if calls:
            message["tool_calls"] = calls
        return {**self.envelope("chat.completion"), "choices": [{"index": 0, "message": message, "logprobs": self._logprobs(entries),
                             "finish_reason": self._finish(finish, len(calls))}],
                "usage": usage(self.num_input, self.num_output)}

    def _chunk(self, delta: dict, logprobs=None, finish: str | None = None) -> dict:
        return {**self.envelope(self.object), "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    async def stream(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[dict]:
        parser = ToolCallStreamParser(self.tools) if self.parse_tools else None
        if self.forced:  # the reply's start, in the prompt: the block is open before the first delta
            parser.feed(self.forced[1])
        calls = 0
        first = True
        async for d in deltas:
            self.count(d)
            if first:
                yield self._chunk({"role": "assistant", "content": ""})
                first = False
            delta: dict[str, Any] = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            content, new = parser.feed(d.text) if parser else (d.text, [])
            if d.final and parser:
                content += parser.flush()[0]
            if content:
                delta["content"] = content
            new = self._calls(new, calls)
            if new:
                delta["tool_calls"] = [{"index": calls + i, **_tool_call(c)} for i, c in enumerate(new)]
                calls += len(new)
            lp = self._logprobs(d.logprobs) if d.logprobs else None
            if delta or lp or d.final:
                yield self._chunk(delta, lp, self._finish(d.finish_reason, calls) if d.final else None)
        if self.req.include_usage:
            yield self.usage_chunk()

