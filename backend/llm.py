"""`LLM`: the offline Python API (vLLM-style): `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from m3serve.config import EngineConfig, normalize_kv_dtype
from m3serve.engine.sampling_params import SamplingParams
from m3serve.model.attention import ForwardBatch
from m3serve.model.kv_codec import KVCodec
from m3serve.model.loader import load_model
from m3serve.model.simple_cache import ContiguousCache


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        dtype = model_dtype if device.type == "cuda" else "float32"
    return getattr(torch, dtype)


class LLM:
    """A simple batched generation loop over the reference model (prefill all, then decode steps)."""

    def __init__(self, model: str, **options):
        self.config = EngineConfig(model=model, **options)
        self.config.validate()
        from m3serve.config import ModelConfig
        mcfg = ModelConfig.from_pretrained(model)
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, mcfg.dtype, self.device)
        self.model, self.load_report = load_model(model, self.device, self.dtype, mcfg, progress=False)
        kv = normalize_kv_dtype(self.config.kv_cache_dtype, str(self.dtype).replace("torch.", ""))
        idx = self.config.indexer_kv_dtype
        idx = kv if idx == "auto" else normalize_kv_dtype(idx)
        self.kv_dtype, self.index_dtype = kv, idx
        self.tokenizer = None
        if os.path.isfile(os.path.join(self.config.tokenizer or model, "tokenizer.json")):
            from m3serve.text.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_pretrained(self.config.tokenizer or model)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer.json in the model directory")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    @torch.inference_mode()
    def generate(self, prompts, sampling_params: SamplingParams | None = None) -> list[CompletionOutput]:
        sp = sampling_params or SamplingParams()
        cfg = self.model.config
        outs = [CompletionOutput(self._encode(p)) for p in prompts]
        for o in outs:
            if not o.prompt_token_ids:
                raise ValueError("empty prompt")
            bad = [t for t in o.prompt_token_ids if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} out of range [0, {cfg.vocab_size})")
        cache = ContiguousCache(len(outs), KVCodec(self.kv_dtype), KVCodec(self.index_dtype))
        gen = torch.Generator(device="cpu").manual_seed(sp.seed if sp.seed is not None else self.config.seed)
        eos = set(cfg.eos_token_id) | set(sp.stop_token_ids)
        live = list(range(len(outs)))
        feed = {i: o.prompt_token_ids for i, o in enumerate(outs)}
        lens = {i: 0 for i in live}
        max_tokens = sp.max_tokens or 1 << 30
        while live:
            ids, pos, qsl = [], [], [0]
            for i in live:
                ids += feed[i]
                pos += range(lens[i], lens[i] + len(feed[i]))
                qsl.append(len(ids))
            batch = ForwardBatch(torch.tensor(pos, device=self.device), qsl, cache, extra={"seq_ids": live})
            hidden = self.model(torch.tensor(ids, device=self.device), batch)
            logits = self.model.compute_logits(hidden[torch.tensor(qsl[1:], device=self.device) - 1]).cpu()
            if sp.greedy:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / sp.temperature, -1), 1, generator=gen)[:, 0]
            still = []
            for i, t in zip(live, nxt.tolist()):
                lens[i] += len(feed[i])
                o = outs[i]
                o.token_ids.append(t)
                if t in eos and not sp.ignore_eos and len(o.token_ids) > sp.min_tokens:
                    o.finish_reason = "stop"
                elif len(o.token_ids) >= max_tokens:
                    o.finish_reason = "length"
                else:
                    feed[i] = [t]
                    still.append(i)
            live = still
        if self.tokenizer is not None:
            for o in outs:
                o.text = self.tokenizer.decode(o.token_ids, skip_special_tokens=sp.skip_special_tokens)
        return outs
