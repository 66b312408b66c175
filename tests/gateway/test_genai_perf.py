"""genai-perf (NVIDIA's LLM benchmark: perf_analyzer's OpenAI service kind) with its chat endpoint, streaming, against
the gateway in front of the real tritonserver: it completes, measures TTFT and throughput, and every request it sent
was answered in full (the gateway's own counters: no errors, exactly max_tokens generated per request)."""
from __future__ import annotations

import json
import subprocess

from gateway_procs import start_gateway
from server.triton_helpers import metric, metrics
from support.required import require_genai_perf

MAX_TOKENS = 16


def test_genai_perf_chat_streaming(m3_server, tiny_model_dir, tmp_path):
    genai_perf = require_genai_perf()
    gw = start_gateway(m3_server.grpc_url, str(tmp_path / "gateway.log"))
    try:
        art = tmp_path / "artifacts"
        cmd = [genai_perf, "profile", "-m", "m3", "--service-kind", "openai", "--endpoint-type", "chat", "--streaming",
               "--url", gw.url.removeprefix("http://"), "--tokenizer", tiny_model_dir, "--num-prompts", "8",
               "--synthetic-input-tokens-mean", "32", "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(MAX_TOKENS), "--output-tokens-stddev", "0",
               "--extra-inputs", "ignore_eos:true", "--concurrency", "2", "--measurement-interval", "3000",
               "--artifact-dir", str(art)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:], gw.log()[-3000:])
        stats = json.loads((art / "profile_export_genai_perf.json").read_text())
        assert stats["request_throughput"]["avg"] > 0 and stats["output_token_throughput"]["avg"] > 0, stats
        assert 0 < stats["time_to_first_token"]["avg"] <= stats["request_latency"]["avg"], stats
        sent = sum(len(e["requests"]) for e in json.loads((art / "profile_export.json").read_text())["experiments"])
        values = metrics(gw.url + "/metrics")
        answered = metric(values, "m3serve_gateway_requests_total", endpoint="chat", status="200") or 0
        print(f"genai-perf: {sent} requests measured, {answered:.0f} answered;",
              {k: round(stats[k]["avg"], 1) for k in ("time_to_first_token", "request_throughput", "request_latency")})
        assert answered >= sent > 0, (answered, sent)
        assert metric(values, "m3serve_gateway_request_errors_total") is None, values
        assert metric(values, "m3serve_gateway_generation_tokens_total") == MAX_TOKENS * answered
    finally:
        gw.stop()
