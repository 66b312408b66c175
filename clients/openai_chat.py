#!/usr/bin/env python3
"""Stream one chat reply through the OpenAI-compatible gateway (`m3serve openai`) with the `openai` client.

  m3serve openai --triton-url localhost:8001 --port 9000 &              # in front of ./build.sh serve
  python clients/openai_chat.py "What is the weather like in Paris?"
  python clients/openai_chat.py --thinking enabled "Why is the sky blue?"  # reasoning_content, then the answer

Reasoning (`reasoning_content` deltas, vLLM's field) is shown dimmed before the answer; tool calls, if the
model makes one, are printed as JSON. `--api-key` (or $M3SERVE_OPENAI_API_KEY) when the gateway asks for one.
"""
from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("message")
    p.add_argument("--base-url", default="http://127.0.0.1:9000/v1")
    p.add_argument("--model", default="m3")
    p.add_argument("--api-key", default=os.environ.get("M3SERVE_OPENAI_API_KEY", "none"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--thinking", choices=["enabled", "disabled", "adaptive"], help="the chat template's thinking_mode")
    a = p.parse_args(argv)

    client = OpenAI(base_url=a.base_url, api_key=a.api_key)
    extra = {"chat_template_kwargs": {"thinking_mode": a.thinking}} if a.thinking else None
    stream = client.chat.completions.create(
        model=a.model, messages=[{"role": "user", "content": a.message}], max_tokens=a.max_tokens,
        temperature=a.temperature, stream=True, stream_options={"include_usage": True}, extra_body=extra)
    reasoning = False
    for chunk in stream:
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]",
                  file=sys.stderr)
        for choice in chunk.choices:
            d = choice.delta
            r = (d.model_extra or {}).get("reasoning_content")
            if r:
                sys.stdout.write(("" if reasoning else "\x1b[2m") + r)
                reasoning = True
            if d.content:
                sys.stdout.write(("\x1b[0m\n" if reasoning else "") + d.content)
                reasoning = False
            for tc in d.tool_calls or []:
                print(f"\n[tool call] {tc.function.name}({tc.function.arguments})")
            sys.stdout.flush()
    if reasoning:
        sys.stdout.write("\x1b[0m")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
