"""The gateway's FastAPI app and its lifecycle: routes, API key, errors in OpenAI's body, capacity, metrics,
SSE, and cancellation when the HTTP client goes away.

  GET  /v1/models                 the one served model
  POST /v1/chat/completions       chat.py (streamed as SSE chunks, `data: [DONE]` last)
  POST /v1/completions            completions.py
  GET  /health                    200 when the Triton model is ready, else 503
  GET  /metrics                   the gateway's Prometheus metrics (metrics.py)

A request opens its own gRPC stream to tritonserver (triton.py). A streamed reply starts (HTTP 200 and the
first chunk) only once the first Triton response is back, so an error the server finds in the request
is an HTTP error with its status; a later one is an error event, then `[DONE]`. A client that disconnects
(before or during its reply) cancels its Triton request at once. With --max-concurrent N, request N+1
gets 429. CORS is off unless origins are given.

`run(cfg, ..., workers=N)` with N > 1 serves the app from N processes on one port (uvicorn's workers, each with its
own gRPC channel and event loop), as vLLM's --api-server-count does: one Python process parses, relays and
re-encodes every streamed token, and at tens of thousands of tokens a second that is a core's worth of work. The
workers get the config from $M3SERVE_GATEWAY_CONFIG (`app_from_env`); their metrics go through a shared folder
(metrics.py), so /metrics from any worker counts all of them; --max-concurrent applies per worker.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import tempfile
import time
from contextlib import asynccontextmanager, aclosing
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from m3serve.gateway.chat import ChatCompletion, ChatCompletionRequest
from m3serve.gateway.completions import Completion, CompletionRequest
from m3serve.gateway.metrics import MULTIPROC_ENV, GatewayMetrics
from m3serve.gateway.protocol import APIError, new_id, now
from m3serve.gateway.triton import TritonModel


@dataclass
class GatewayConfig:
    triton_url: str = "localhost:8001"
    model: str = "m3"  # the Triton model (the m3 text contract)
    served_model_name: str | None = None  # the name clients use (default: `model`)
    api_key: str | None = None
    max_concurrent: int = 0  # 0: no limit
    cors_origins: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class ClientGone(Exception):
    """The HTTP client disconnected before its reply started."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable):
    """The awaitable's result, or ClientGone (the awaitable cancelled) when the client leaves first."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watch.cancel()
        if not task.done():  # the client left, or this handler was cancelled: stop the request too
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(cfg: GatewayConfig) -> FastAPI:
    metrics = GatewayMetrics()
    state: dict = {"open": 0}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["triton"] = TritonModel(cfg.triton_url, cfg.model)
        try:
            yield
        finally:
            await state["triton"].close()

    app = FastAPI(title="m3serve OpenAI-compatible gateway", version="1", lifespan=lifespan)
    if cfg.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=cfg.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        parts = []
        for err in e.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        first = e.errors()[0].get("loc", ()) if e.errors() else ()
        param = ".".join(str(x) for x in first if x != "body") or None
        return _error_response(APIError(400, "; ".join(parts) or "invalid request", "BadRequestError", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(e.status_code, "HTTPError")
        return _error_response(APIError(e.status_code, str(e.detail), kind))

    async def authorized(request: Request) -> None:
        if cfg.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or token.strip() != cfg.api_key:
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", "AuthenticationError")

    @app.get("/health")
    async def health():
        if await state["triton"].ready():
            return Response(status_code=200)
        return _error_response(APIError(503, f"the Triton model {cfg.model!r} at {cfg.triton_url} is not ready",
                                        "ServiceUnavailableError"))

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": cfg.name, "object": "model", "created": now(),
                                            "owned_by": "m3serve", "root": cfg.name}]}

    async def serve(request: Request, handler_cls, body):
        endpoint = handler_cls.endpoint
        arrival = time.perf_counter()
        try:
            if body.model is not None and body.model != cfg.name:
                raise APIError(404, f"The model `{body.model}` does not exist.", "NotFoundError", "model")
            handler = handler_cls(body, cfg.name)
            if cfg.max_concurrent and state["open"] >= cfg.max_concurrent:
                raise APIError(429, f"the gateway is at capacity ({cfg.max_concurrent} requests in flight); "
                                    "retry later", "RateLimitError")
            inputs = handler.inputs()
        except APIError as e:
            metrics.requests.labels(endpoint, str(e.status)).inc()
            metrics.errors.labels(endpoint, str(e.status)).inc()
            raise
        state["open"] += 1
        metrics.in_flight.inc()

        def finish():
            state["open"] -= 1
            metrics.in_flight.dec()
            metrics.prompt_tokens.inc(handler.num_input)
            metrics.generation_tokens.inc(handler.num_output)

        done = _Once(finish)
        deltas = state["triton"].generate(inputs, new_id("gw"))
        first_token = _Once(lambda: metrics.ttft.labels(endpoint).observe(time.perf_counter() - arrival))
        streaming = False
        try:
            if not body.stream:
                reply = await _unless_disconnected(request, handler.complete(_timed(deltas, first_token)))
                metrics.requests.labels(endpoint, "200").inc()
                return JSONResponse(reply)
            events = handler.stream(_timed(deltas, first_token))
            try:
                first = await _unless_disconnected(request, events.__anext__())
            except StopAsyncIteration:
                raise APIError(502, "the Triton stream ended without a response", "BadGatewayError") from None
            streaming = True
        except (APIError, ClientGone) as e:
            status = str(e.status) if isinstance(e, APIError) else "499"
            metrics.requests.labels(endpoint, status).inc()
            metrics.errors.labels(endpoint, status).inc()
            if isinstance(e, APIError):
                raise
            return Response(status_code=499)  # nobody reads it
        finally:
            if not streaming:  # else the streamed reply owns `done`
                done()
        metrics.requests.labels(endpoint, "200").inc()

        async def sse():
            try:
                async with aclosing(events):
                    yield {"data": json.dumps(first, ensure_ascii=False)}
                    async for chunk in events:
                        yield {"data": json.dumps(chunk, ensure_ascii=False)}
            except APIError as e:
                metrics.errors.labels(endpoint, str(e.status)).inc()
                yield {"data": json.dumps(e.body(), ensure_ascii=False)}
            finally:
                done()
            yield {"data": "[DONE]"}

        async def cleanup():  # the reply never started streaming (the client left at once)
            await events.aclose()
            done()

        return EventSourceResponse(sse(), sep="\n", background=BackgroundTask(cleanup))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serve(request, ChatCompletion, body)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        return await serve(request, Completion, body)

    app.state.metrics = metrics
    return app


class _Once:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


async def _timed(deltas, first_token: _Once):
    async with aclosing(deltas):
        async for d in deltas:
            if not d.final or d.num_output_tokens:  # a response before the final one carries text
                first_token()
            yield d


CONFIG_ENV = "M3SERVE_GATEWAY_CONFIG"


def app_from_env() -> FastAPI:
    """The app of one worker process of `run(..., workers > 1)`: its config from $M3SERVE_GATEWAY_CONFIG."""
    return create_app(GatewayConfig(**json.loads(os.environ[CONFIG_ENV])))


def run(cfg: GatewayConfig, host: str, port: int, log_level: str = "info", workers: int = 1) -> None:
    import uvicorn

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: must be an integer >= 1, got {workers!r}")
    # the standard asyncio loop (grpc.aio's poller is built for it); httptools parses HTTP when installed
    opts = dict(host=host, port=port, log_level=log_level, loop="asyncio")
    if workers == 1:
        uvicorn.run(create_app(cfg), **opts)
        return
    with tempfile.TemporaryDirectory(prefix="m3serve-gateway-metrics-") as shared:
        # the workers are fresh interpreters started after this: they read both when they import the app
        os.environ[CONFIG_ENV] = json.dumps(dataclasses.asdict(cfg))
        os.environ[MULTIPROC_ENV] = shared
        uvicorn.run(f"{__name__}:app_from_env", factory=True, workers=workers, **opts)
