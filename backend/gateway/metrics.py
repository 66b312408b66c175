"""The gateway's own Prometheus metrics (GET /metrics), in a registry of their own: requests by endpoint and
HTTP status, errors, requests in flight, time to first token (the first Triton response with tokens, from
the request's arrival), and the tokens the server reported."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("m3serve_gateway_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("m3serve_gateway_request_errors", "Requests that ended in an error (before or "
                              "during the reply), by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("m3serve_gateway_requests_in_flight", "Generation requests open now", registry=r)
        self.ttft = Histogram("m3serve_gateway_time_to_first_token_seconds", "Arrival to the first tokens",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("m3serve_gateway_prompt_tokens", "Prompt tokens (server-counted)",
                                     registry=r)
        self.generation_tokens = Counter("m3serve_gateway_generation_tokens", "Generated tokens (server-counted)",
                                         registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
