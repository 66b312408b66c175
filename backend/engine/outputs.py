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
