"""Engine factory for the gateway tests ($M3SERVE_TEST_ENGINE_FACTORY="m3=<this file>:make"): the real engine on
the tiny model, whose sampler, for requests seeded with a seed listed in $M3SERVE_SCRIPTS (a JSON file
{seed: text}), replaces the drawn token by the next token of that text (then EOS). The tiny model is random and
never writes a tool call or a think block by itself; scripted, its "output" goes the whole real way: the
engine's detokenizer and reasoning parser, the m3 contract, Triton's gRPC stream, the gateway's tool parser and
the `openai` client. Every other request samples as usual. One scripted request per seed at a time: the
script restarts when a seed's sampling position goes back (a new request)."""
from __future__ import annotations

import json
import os


def make(config):
    import torch

    from m3serve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(config)
    tok = engine.tokenizer
    with open(os.environ["M3SERVE_SCRIPTS"], encoding="utf-8") as f:
        scripts = {int(seed): tok.encode(text) + [tok.eos_token_id] for seed, text in json.load(f).items()}
    runner = engine.engine.executor.worker.runner
    sample = runner.sampler
    start: dict[int, int] = {}
    last: dict[int, int] = {}

    def scripted(logits, s):
        rows = [(i, seed) for i, seed in enumerate(s.seeds.tolist()) if seed in scripts]
        raw = torch.log_softmax(logits.float(), -1) if rows else None  # before the sampler edits logits in place
        out = sample(logits, s)
        for i, seed in rows:
            pos = int(s.positions[i])
            if seed not in last or pos <= last[seed]:
                start[seed] = pos
            last[seed] = pos
            script = scripts[seed]
            t = script[min(pos - start[seed], len(script) - 1)]
            out.token_ids[i] = t
            out.logprobs[i] = raw[i, t]
        return out

    runner.sampler = scripted
    return engine
