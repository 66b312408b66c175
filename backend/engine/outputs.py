"""What the engine streams back per request: one `RequestOutput` per step that produced something."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced since the previous output of this request
    text: str = ""  # detokenized content delta (reasoning excluded when a reasoning parser is on)
    reasoning_text: str = ""  # reasoning delta (only with a reasoning parser)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    cumulative_logprob: float | None = None
    # one entry per new token: {token_id: logprob} for the sampled token and the top-n alternatives
    logprobs: list[dict[int, float]] | None = None
    prompt_token_ids: list[int] = field(default_factory=list)  # filled on the first output only
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (at the latest admission)
    # text the request asked for (`TextOptions`), decoded by the engine: its callers hold no tokenizer
    prompt_text: str | None = None  # the prompt's ids decoded, on the first output only
    logprob_tokens: list[dict[int, str]] | None = None  # per `logprobs` entry, the text of each of its tokens
    # the tokens so far end inside a UTF-8 character: their text is held back until it completes (a client that
    # decodes the ids itself waits for the next output)
    mid_character: bool = False
