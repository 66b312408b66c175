"""Custom metrics through `pb_utils.MetricFamily`, under vLLM's names (plus a few m3serve ones).

Every update is an IPC call into the server, and 2.51 crashed when several stub threads made such calls
at once: only the response thread calls the update methods here. Families are kept referenced for as
long as their metrics live; `close()` drops the metrics first, then the families.
"""
from __future__ import annotations

import sys

from m3serve.engine.scheduler import STEP_KINDS

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_len: int | None) -> list[float]:
    """1-2-5 series up to max_len (vLLM's request_{prompt,generation}_tokens buckets)."""
    top = max_len or 1 << 20
    out, mant, exp = [], (1, 2, 5), 0
    while True:
        for m in mant:
            v = m * 10 ** exp
            if v > top:
                return [float(x) for x in out]
            out.append(v)
        exp += 1


class Metrics:
    """No-op when disabled or when the server runs without metrics."""

    def __init__(self, pb, labels: dict[str, str], max_model_len: int | None, enabled: bool = True):
        self.enabled = False
        self._families: list = []
        self._m: dict = {}
        self._last: dict[str, float] = {}
        if not enabled:
            return
        try:
            self._build(pb, labels, max_model_len)
            self.enabled = True
        except Exception as e:  # pb_utils.TritonModelException "metrics not supported" when --allow-metrics=false
            print(f"[m3serve] custom metrics disabled: {e}", file=sys.stderr, flush=True)
            self._m.clear()
            self._families.clear()

    def _build(self, pb, labels, max_model_len) -> None:
        F = pb.MetricFamily

        def fam(name, desc, kind):
            f = F(name=name, description=desc, kind=kind)
            self._families.append(f)
            return f

        def counter(key, name, desc, extra=None):
            self._m[key] = fam(name, desc, F.COUNTER).Metric(labels={**labels, **(extra or {})})

        def gauge(key, name, desc):
            self._m[key] = fam(name, desc, F.GAUGE).Metric(labels=labels)

        def hist(key, name, desc, buckets):
            self._m[key] = fam(name, desc, F.HISTOGRAM).Metric(labels=labels, buckets=buckets)

        counter("prompt_tokens", "vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        counter("generation_tokens", "vllm:generation_tokens_total", "Number of generation tokens processed.")
        succ = fam("vllm:request_success_total", "Count of finished requests, by finish reason.", F.COUNTER)
        for r in FINISH_REASONS:
            self._m[f"success_{r}"] = succ.Metric(labels={**labels, "finished_reason": r})
        counter("preemptions", "vllm:num_preemptions_total", "Cumulative number of preemptions.")
        counter("prefix_hits", "m3serve:prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.")
        counter("spec_accepted", "vllm:spec_decode_num_accepted_tokens_total",
                "Number of accepted draft tokens (0 without speculative_config).")
        counter("spec_draft", "vllm:spec_decode_num_draft_tokens_total",
                "Number of draft tokens verified (0 without speculative_config).")
        counter("spec_drafts", "vllm:spec_decode_num_drafts_total",
                "Number of speculative steps of sequences (0 without speculative_config).")
        hist("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             TTFT_BUCKETS)
        hist("tpot", "vllm:time_per_output_token_seconds",
             "Histogram of time per output token in seconds (one sample per request: its mean "
             "inter-token time after the first token, so the metric costs one update per request).",
             TPOT_BUCKETS)
        hist("e2e", "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
             E2E_BUCKETS)
        tb = token_buckets(max_model_len)
        hist("req_prompt", "vllm:request_prompt_tokens", "Number of prefill tokens processed, per request.", tb)
        hist("req_gen", "vllm:request_generation_tokens", "Number of generation tokens processed, per request.", tb)
        gauge("running", "vllm:num_requests_running", "Number of requests currently running in the engine.")
        gauge("waiting", "vllm:num_requests_waiting", "Number of requests waiting to be scheduled.")
        gauge("kv_usage", "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent usage.")
        gauge("gpu_kv_usage", "vllm:gpu_cache_usage_perc", "KV-cache usage (older vLLM name); 1 = 100 percent.")
        gauge("free_pages", "m3serve:kv_cache_free_pages", "Free KV-cache pages (one page = one MSA block).")
        gauge("total_pages", "m3serve:kv_cache_total_pages", "KV-cache pages in the pool.")
        gauge("spec_rate", "vllm:spec_decode_draft_acceptance_rate",
              "Speculative decoding draft acceptance rate, accepted / draft tokens (0 without speculative_config).")
        gauge("active", "m3serve:triton_requests_active", "Triton requests in flight in this model instance.")
        counter("steps", "m3serve:engine_steps_total", "Engine steps run (prefill, mixed and decode).")
        counter("prompt_steps", "m3serve:engine_prompt_steps_total",
                "Engine steps that carried prompt tokens (a prefill, or a prefill chunk beside decodes).")
        counter("device_wait", "m3serve:engine_device_wait_seconds_total",
                "Seconds the engine thread waited for steps' sampled tokens from the device; the rest of its "
                "time is host work (scheduling, step inputs, outputs): a share near 0 means the host sets the pace.")
        counter("steps_ahead", "m3serve:engine_steps_ahead_total",
                "Engine steps queued on the device before the step before them was back (async scheduling); each "
                "other step waited for the one before it, and the device idled while the host built it.")
        steps_by = fam("m3serve:engine_steps_by_kind_total", "Engine steps run, by what they held (decode, "
                       "speculative, prefill, decode+prefill, speculative+prefill).", F.COUNTER)
        seconds_by = fam("m3serve:engine_step_seconds_total", "Seconds from each engine step's launch (or the end of "
                         "the step before it, if later) to its tokens' return, by the step's kind: divided by "
                         "m3serve:engine_steps_by_kind_total, the time a step of that kind takes.", F.COUNTER)
        for kind in STEP_KINDS:
            self._m[f"steps_{kind}"] = steps_by.Metric(labels={**labels, "kind": kind})
            self._m[f"seconds_{kind}"] = seconds_by.Metric(labels={**labels, "kind": kind})
        counter("responses", "m3serve:responses_total", "Responses sent by the response thread.")
        counter("send_seconds", "m3serve:response_send_seconds_total",
                "Seconds the response thread spent building and sending responses (per-response cost).")
        self._m["spec_rate"].set(0.0)

    # ---- updates (response thread only) ------------------------------------------------------------
    def first_token(self, ttft: float) -> None:
        if self.enabled:
            self._m["ttft"].observe(ttft)

    def inter_token(self, seconds_per_token: float) -> None:
        if self.enabled:
            self._m["tpot"].observe(seconds_per_token)

    def request_done(self, e2e: float, num_prompt: int, num_generated: int, reason: str | None) -> None:
        if not self.enabled:
            return
        m = self._m
        m["e2e"].observe(e2e)
        m["req_prompt"].observe(float(num_prompt))
        m["req_gen"].observe(float(num_generated))
        if num_prompt:
            m["prompt_tokens"].increment(float(num_prompt))
        if num_generated:
            m["generation_tokens"].increment(float(num_generated))
        key = f"success_{reason if reason in FINISH_REASONS else 'abort'}"
        m[key].increment(1.0)

    def engine_stats(self, stats: dict, active: int) -> None:
        if not self.enabled:
            return
        m = self._m
        usage = float(stats.get("kv_cache_usage", 0.0))
        for key, value in (("running", stats.get("num_running", 0)), ("waiting", stats.get("num_waiting", 0)),
                           ("kv_usage", usage), ("gpu_kv_usage", usage),
                           ("free_pages", stats.get("num_free_pages", 0)),
                           ("total_pages", stats.get("num_total_pages", 0)), ("active", active),
                           ("spec_rate", stats.get("spec_decode_acceptance_rate", 0.0))):
            value = float(value)
            if self._last.get(key) != value:
                m[key].set(value)
                self._last[key] = value
        for key, stat in (("preemptions", "num_preemptions"), ("prefix_hits", "prefix_cache_hit_tokens"),
                          ("spec_accepted", "spec_decode_num_accepted_tokens"),
                          ("spec_draft", "spec_decode_num_draft_tokens"), ("spec_drafts", "spec_decode_num_drafts"),
                          ("steps", "num_steps"), ("prompt_steps", "num_prompt_steps"),
                          ("device_wait", "device_wait_seconds"), ("steps_ahead", "num_steps_ahead")):
            self._advance(key, stats.get(stat, 0))
        steps, seconds = stats.get("steps_by_kind") or {}, stats.get("step_seconds_by_kind") or {}
        for kind in STEP_KINDS:
            self._advance(f"steps_{kind}", steps.get(kind, 0))
            self._advance(f"seconds_{kind}", seconds.get(kind, 0.0))

    def _advance(self, key: str, total) -> None:
        """Bring counter `key` up to the engine's running `total` (a counter only grows)."""
        value = float(total)
        prev = self._last.get(key)
        if prev is not None and value > prev:
            self._m[key].increment(value - prev)
        elif prev is None and value > 0:
            self._m[key].increment(value)
        self._last[key] = value

    def responder_stats(self, responses: int, send_seconds: float) -> None:
        if not self.enabled:
            return
        for key, value in (("responses", float(responses)), ("send_seconds", float(send_seconds))):
            prev = self._last.get(key, 0.0)
            if value > prev:
                self._m[key].increment(value - prev)
                self._last[key] = value

    def close(self) -> None:
        self._m.clear()
        self._families.clear()
        self.enabled = False
