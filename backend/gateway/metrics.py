"""The gateway's own Prometheus metrics (GET /metrics), in a registry of their own: requests by endpoint and
HTTP status, errors, requests in flight, time to first token (the first Triton response with tokens, from
the request's arrival), and the tokens the server reported (on a request's final response: a request cancelled
before it counts none here; the server's own vllm:generation_tokens_total counts every token).

With several worker processes (app.run's `workers`) $PROMETHEUS_MULTIPROC_DIR names a folder they share:
prometheus_client then keeps each process's values in files there, and /metrics, from whichever worker answers,
sums them (requests in flight: over the live workers)."""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own name; read when it is imported

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("m3serve_gateway_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("m3serve_gateway_request_errors", "Requests that ended in an error (before or "
                              "during the reply), by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("m3serve_gateway_requests_in_flight", "Generation requests open now", registry=r,
                               multiprocess_mode="livesum")
        self.ttft = Histogram("m3serve_gateway_time_to_first_token_seconds", "Arrival to the first tokens",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("m3serve_gateway_prompt_tokens", "Prompt tokens (server-counted)",
                                     registry=r)
        self.generation_tokens = Counter("m3serve_gateway_generation_tokens", "Generated tokens (server-counted)",
                                         registry=r)

    def text(self) -> bytes:
        if os.environ.get(MULTIPROC_ENV):
            every = CollectorRegistry()
            multiprocess.MultiProcessCollector(every)
            return generate_latest(every)
        return generate_latest(self.registry)
