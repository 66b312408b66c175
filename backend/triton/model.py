"""m3serve: the Python-based Triton backend (`backend: "m3serve"`) serving MiniMax-M3.

build.sh / the Dockerfile install this file as `<backend dir>/m3serve/model.py`, next to the python
backend's stub; it imports the `m3serve` package from the server's Python environment. This file keeps the
model's lifecycle; the request contracts live in text_contract.py / ids_contract.py, the ensemble steps in
ensemble_steps.py, the wire schema in schema.py, the response thread in responder.py.

One file, four roles (config parameter `m3serve_role`, else guessed from the declared inputs):
  text            `m3`: the vLLM backend's text contract (decoupled, max_batch_size 0)
  ids             `m3_ids`: the TensorRT-LLM `tensorrt_llm` token-id contract (decoupled, [B, ...] shapes)
  preprocessing   text -> token ids      (TensorRT-LLM ensemble step names)
  postprocessing  token ids -> text

Threads of an LLM instance (text / ids):
  stub main thread   initialize / execute / finalize: parse, validate, start a request of one engine request
                     (`engine.start`: one message, no wait); never blocks on the engine
  engine loop        asyncio loop starting the engine requests of a batch or n > 1 (`engine.prepare` of every
                     item first, then `submit`)
  engine receiver    `EngineProcess`'s: reads the engine process's events, hands each output straight to the
                     responder's queue (the step loop, the request preparation and the detokenizers run in the
                     engine process, the only one that loads the tokenizer; with engine_process "false" they are
                     threads here, AsyncLLMEngine's)
  responder          the only thread that calls into the server: send / is_cancelled / metrics / model control
The model drives the engine only through `EngineClient` (engine/client.py) and holds no tokenizer: the contracts ask
the engine for the text they answer with (`TextOptions`).

A dead engine (a device fault: see engine/faults.py): the responder fails the open requests with UNAVAILABLE,
new ones are refused, and, when the server runs with --model-control-mode=explicit, the responder unloads the
model and loads it again with the parameter `m3serve_engine_failed`, which fails that load on purpose: the
model is then UNAVAILABLE with the reason in the repository index, so `/v2/models/<m>/ready` and (strict
readiness) `/v2/health/ready` answer not ready while the other models keep serving. Triton 2.51's python
backend has no readiness hook (python_backend added `is_ready()` in r26.03), a stub that exits leaves the
model READY, and an unloaded model counts as ready for the server: hence the failed load. That load goes
through the server's own HTTP endpoint, not `pb_utils.load_model` (server_control.py says why). An operator's
`load` of the model (repository API) brings it back with a fresh engine. In the default control mode the
server allows no model control: the model stays READY and answers UNAVAILABLE (logged at load time).

Config parameters (all optional): m3serve_role, default_max_tokens (16), REPORT_CUSTOM_METRICS
("true"/"yes" default on), cancellation_check_period_ms (50), stats_period_ms (250), coalesce_responses
("true": deltas queued for one stream go out as one response), trust_request_chat_template ("false": a
chat template sent in chat_template_kwargs is refused), utf8_stream_boundaries ("true": m3_ids streams whole
UTF-8 characters), tokenizer_dir, skip_special_tokens and max_model_len (pre/postprocessing).
engine_process ("true": the engine runs in a process of its own, started from the server's Python interpreter,
`engine/engine_process.py`; "false": on threads of this stub, sharing its interpreter lock with the response thread).
Any other parameter is refused at load, and none picks code or a path outside the model's folder (parameters.py:
the table, and the test-only engine factory, which comes from the server's environment only).
"""
from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import json
import os
import sys
import threading
import time
import traceback


def _fix_sys_path() -> None:
    # A folder named `m3serve` without __init__.py on sys.path (the backend folder itself, when the
    # server runs from the backends directory) would shadow the package as a namespace package.
    for p in list(sys.path):
        d = os.path.join(p or os.getcwd(), "m3serve")
        if os.path.isdir(d) and not os.path.isfile(os.path.join(d, "__init__.py")):
            sys.path.remove(p)


_fix_sys_path()

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from m3serve.engine.client import EngineClient  # noqa: E402
from m3serve.triton import parameters, schema  # noqa: E402
from m3serve.triton.contract import Defaults, GenRequest, StopRequest  # noqa: E402
from m3serve.triton.responder import Group, Item, Responder, log  # noqa: E402
from m3serve.triton.schema import INTERNAL, INVALID_ARG, UNAVAILABLE, RequestError  # noqa: E402
from m3serve.triton.server_control import load_model_over_http, server_launch  # noqa: E402

FAILED_PARAMETER = "m3serve_engine_failed"  # set on the load that marks a model whose engine died


def _params(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}


def _truthy(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _guess_role(model_config: dict, params: dict) -> str:
    role = params.get("m3serve_role")
    if role:
        if role not in schema.ROLES:
            raise ValueError(f"parameter m3serve_role: {role!r} is not one of {list(schema.ROLES)}")
        return role
    names = {i["name"] for i in model_config.get("input", [])}
    if "input_ids" in names:
        return "ids"
    if "QUERY" in names:
        return "preprocessing"
    if "TOKENS_BATCH" in names:
        return "postprocessing"
    return "text"


def _version_dir(args: dict) -> str:
    d = os.path.join(args["model_repository"], str(args["model_version"]))
    if os.path.isdir(d):
        return d
    try:
        return pb_utils.get_model_dir()
    except Exception:
        return args["model_repository"]


def _read_inputs(request) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in request.inputs()}


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        cfg = auto_complete_model_config.as_dict()
        role = _guess_role(cfg, _params(cfg))
        ins, outs = schema.ROLES[role]
        have_in = {i["name"] for i in cfg.get("input", [])}
        have_out = {o["name"] for o in cfg.get("output", [])}
        for i in ins:
            if i["name"] not in have_in:
                auto_complete_model_config.add_input(i)
        for o in outs:
            if o["name"] not in have_out:
                auto_complete_model_config.add_output(o)
        if role == "text":
            auto_complete_model_config.set_max_batch_size(0)
        if role in ("text", "ids"):
            auto_complete_model_config.set_model_transaction_policy(dict(decoupled=True))
        return auto_complete_model_config

    # ------------------------------------------------------------------------------------------------
    def initialize(self, args):
        self.args = args
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.params = _params(self.model_config)
        try:  # before anything is imported or built for this config
            parameters.check(self.params)
        except ValueError as e:
            raise pb_utils.TritonModelException(f"m3serve model '{self.name}': {e}") from None
        if self.params.get(FAILED_PARAMETER):  # the load that marks a dead engine: fail it, on purpose
            raise pb_utils.TritonModelException(
                f"m3serve model '{self.name}' is unavailable: its engine failed ({self.params[FAILED_PARAMETER]}); "
                "load the model again (repository API) or restart the server")
        self.role = _guess_role(self.model_config, self.params)
        self.version_dir = _version_dir(args)
        try:
            if self.role in ("text", "ids"):
                self._init_llm()
            else:
                self._init_tokenizer_step()
        except Exception as e:
            tb = traceback.format_exc()
            log(f"model '{self.name}' failed to load: {tb}")
            self._teardown()
            raise pb_utils.TritonModelException(f"m3serve model '{self.name}' ({self.role}): {e}") from None
        log(f"model '{self.name}' ready (role {self.role})")

    def _init_llm(self):
        from m3serve.triton import engine_args
        from m3serve.triton.engine_loop import EngineLoop
        from m3serve.triton.ids_contract import IdsContract
        from m3serve.triton.metrics import Metrics
        from m3serve.triton.text_contract import TextContract

        self.engine = self.loop = self.responder = self.metrics = None
        self.accepting = self.closing = False
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError("m3serve LLM models must be decoupled: add "
                             "`model_transaction_policy { decoupled: true }` to config.pbtxt")
        if self.role == "text" and self.model_config.get("max_batch_size", 0) != 0:
            raise ValueError("the text model (vLLM contract) needs `max_batch_size: 0`")
        cfg, notes = engine_args.engine_config(self.version_dir)
        for n in notes:
            log(n)
        self.engine_config = cfg
        self.engine = self._build_engine(cfg)
        from m3serve.engine.async_engine import EngineDeadError
        from m3serve.engine.faults import RequestFailed
        from m3serve.engine.sampling_params import InvalidRequest
        self._EngineDeadError, self._InvalidRequest, self._RequestFailed = EngineDeadError, InvalidRequest, RequestFailed
        defaults = Defaults(
            max_tokens=int(self.params.get("default_max_tokens") or 16),
            reasoning_parser=cfg.reasoning_parser,
            utf8_stream_boundaries=_truthy(self.params.get("utf8_stream_boundaries"), True),
            trust_request_chat_template=_truthy(self.params.get("trust_request_chat_template"), False),
        )
        self.contract = (TextContract if self.role == "text" else IdsContract)(defaults)
        self.server = server_launch()
        self.control_mode = self.server.control_mode if self.server is not None else None
        if self.control_mode != "explicit":
            log(f"model '{self.name}': the server's model control mode is {self.control_mode or 'unknown'}: if "
                "the engine dies the model stays ready (answering UNAVAILABLE); start tritonserver with "
                "--model-control-mode=explicit --load-model=* to have a dead engine turn it unready")
        self.metrics = Metrics(pb_utils, {"model": self.name, "version": str(self.args["model_version"])},
                               getattr(self.engine, "max_model_len", None) or cfg.max_model_len,
                               enabled=_truthy(self.params.get("REPORT_CUSTOM_METRICS"), True))
        self.loop = EngineLoop(name=f"{self.name}-loop")
        self.responder = Responder(
            pb_utils, self.metrics, abort=self.engine.abort_sync, stats=self.engine.stats,
            healthy=self._engine_alive, on_unhealthy=self._on_engine_dead,
            cancel_period=float(self.params.get("cancellation_check_period_ms") or 50) / 1000.0,
            stats_period=float(self.params.get("stats_period_ms") or 250) / 1000.0, name=self.name,
            coalesce=_truthy(self.params.get("coalesce_responses"), True))
        self.responder.start()
        self._ids = itertools.count()
        self._prefix = f"{self.name}-{os.getpid()}-"
        self._by_client_id: dict[str, Group] = {}
        self._lock = threading.Lock()
        self.accepting = True

    def _build_engine(self, cfg) -> EngineClient:
        from m3serve.engine.engine_process import build_engine
        from m3serve.engine.process_client import EngineProcess

        factory = parameters.test_engine_factory(self.name)
        if factory:
            log(f"model '{self.name}': engine built by ${parameters.TEST_FACTORY_ENV} ({factory}), a test hook")
        if _truthy(self.params.get("engine_process"), True):
            return EngineProcess(cfg, factory=factory)
        return build_engine(cfg, factory)

    def _init_tokenizer_step(self):
        from m3serve.text.tokenizer import Tokenizer
        from m3serve.triton import engine_args
        from m3serve.triton.ensemble_steps import Postprocessing, Preprocessing

        value = self.params.get("tokenizer_dir")
        if not value:
            raise ValueError("parameter tokenizer_dir (the model or tokenizer directory) is required")
        path = parameters.inside_path(value, [self.version_dir, os.environ.get(engine_args.MODEL_DIR_ENV)],
                                      "tokenizer_dir")
        tokenizer = Tokenizer.from_pretrained(path)
        if self.role == "preprocessing":
            max_len = self.params.get("max_model_len")
            self.step = Preprocessing(tokenizer, int(self.params.get("default_max_tokens") or 16),
                                      int(max_len) if max_len else None)
        else:
            self.step = Postprocessing(tokenizer, _truthy(self.params.get("skip_special_tokens"), True))

    # ------------------------------------------------------------------------------------------------
    def execute(self, requests):
        if self.role in ("preprocessing", "postprocessing"):
            return [self._tokenizer_step(r) for r in requests]
        for request in requests:
            try:
                self._accept(request)
            except Exception:
                log(f"execute: {traceback.format_exc()}")
        return None

    def _tokenizer_step(self, request):
        try:
            out = self.step(_read_inputs(request))
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()])
        except RequestError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        except Exception as e:
            log(f"{self.role}: {traceback.format_exc()}")
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}"))

    def _accept(self, request) -> None:
        sender = request.get_response_sender()
        if not self.accepting:
            self.responder.reject(sender, UNAVAILABLE, "the model is being unloaded")
            return
        if self.responder.unhealthy or not self.engine.is_healthy():
            self.responder.reject(sender, UNAVAILABLE, "the engine is not healthy; the model is unavailable")
            return
        try:
            client_id = request.request_id() or ""
            try:
                requested = frozenset(request.requested_output_names())
            except Exception:
                requested = frozenset()
            parsed = self.contract.parse(_read_inputs(request), request.parameters(), client_id)
        except RequestError as e:
            self.responder.reject(sender, e.code, str(e))
            return
        except Exception as e:
            log(f"parsing a request: {traceback.format_exc()}")
            self.responder.reject(sender, INTERNAL, f"{type(e).__name__}: {e}")
            return
        if isinstance(parsed, StopRequest):
            self._stop(parsed.request_id, sender)
            return
        group = Group(sender, requested, client_id, on_close=self._on_close if client_id else None)
        items = [(Item(f"{self._prefix}{next(self._ids)}", group, self.contract.stream(r)), r) for r in parsed]
        if client_id and self.role == "ids":
            with self._lock:
                self._by_client_id[client_id] = group
        self.responder.register(group)
        if len(items) == 1:
            self._start(*items[0])
        else:
            self.loop.submit(self._drive_group(items))

    def _on_close(self, group: Group) -> None:
        with self._lock:
            if self._by_client_id.get(group.client_id) is group:
                del self._by_client_id[group.client_id]

    def _stop(self, client_id: str, sender) -> None:
        with self._lock:
            group = self._by_client_id.get(client_id)
        if group is not None:
            for item in group.items:
                self.engine.abort_sync(item.rid)  # each item then ends with finish_reason "abort"
        self.responder.empty_final(sender)

    def _start(self, item: Item, r: GenRequest) -> None:
        """A Triton request of one engine request, started from this thread in one message (`start`: validated and
        tokenized where the engine runs): no hop through the engine loop's thread and no round trip before the
        engine sees it, so no wait for the interpreter lock while the response thread is busy. Its outputs, or the
        error that ends it, go from the engine's side straight to the response thread's queue."""
        try:
            self.engine.start(item.rid, functools.partial(self._on_output, item, r), **r.engine_args())
        except Exception as e:
            self.responder.end(item, *self._error_reply(r, e))

    async def _drive_group(self, items: list[tuple[Item, GenRequest]]) -> None:
        """Run the engine requests of one Triton request of several (a batch, n > 1). The batch is validated as a
        whole first (the engine's `prepare`), so an invalid item fails the request before any item streams."""
        results = await asyncio.gather(*(self.engine.prepare(**r.engine_args()) for _, r in items),
                                       return_exceptions=True)
        for (item, r), res in zip(items, results):
            if isinstance(res, BaseException):
                self.responder.end(item, *self._error_reply(r, res))
                return
        await asyncio.gather(*(self._drive(item, r, p) for (item, r), p in zip(items, results)))

    async def _drive(self, item: Item, r: GenRequest, prepared) -> None:
        """Start one prepared engine request. Its outputs go from the engine thread straight to the response thread's
        queue (`submit`): no per-token hop through this event loop, whose coroutines would compete with the engine
        thread for the GIL at every step."""
        try:
            self.engine.submit(item.rid, prepared, functools.partial(self._on_output, item, r))
            if item.done:  # cancelled (or the model closing) while it was being prepared: its abort came too early
                self.engine.abort_sync(item.rid)
        except Exception as e:
            self.responder.end(item, *self._error_reply(r, e))
        except BaseException:  # CancelledError at shutdown: the request still gets a FINAL
            self.responder.end(item, UNAVAILABLE, "the model is being unloaded")
            raise

    def _on_output(self, item: Item, r: GenRequest, out) -> None:
        """On the engine thread: an output of `item`, or the exception that ended it, to the response thread."""
        if isinstance(out, BaseException):
            self.responder.end(item, *self._error_reply(r, out))
        else:
            self.responder.output(item, out)

    def _error_reply(self, r: GenRequest, e: BaseException) -> tuple[str, str]:
        """(code, message) of an engine error, named as the client sent the request."""
        if isinstance(e, self._InvalidRequest):
            return INVALID_ARG, str(self.contract.client_error(r, e))
        if isinstance(e, self._EngineDeadError):
            return UNAVAILABLE, f"the engine is not healthy; the model is unavailable ({e})"
        if not isinstance(e, self._RequestFailed):  # the engine logged those
            log(f"request failed: {''.join(traceback.format_exception(e))}")
        return INTERNAL, f"{type(e).__name__}: {e}"

    def _engine_alive(self) -> bool:
        return self.closing or self.engine.is_healthy()  # a shutdown in finalize is no death

    def _on_engine_dead(self) -> None:
        """On the response thread, once the engine is dead: make the model (and the server) unready."""
        self.accepting = False
        reason = getattr(self.engine, "dead_reason", None) or "the engine is not healthy"
        if self.control_mode != "explicit":
            log(f"engine of model '{self.name}' dead ({reason}); the model stays loaded and answers UNAVAILABLE "
                f"(model control mode {self.control_mode or 'unknown'}: no unload possible)")
            return
        config = dict(self.model_config)
        config["parameters"] = {**(config.get("parameters") or {}), FAILED_PARAMETER: {"string_value": reason}}
        try:
            pb_utils.unload_model(self.name)
        except Exception as e:
            log(f"engine of model '{self.name}' dead ({reason}); cannot unload the model: {e}")
            return
        if self.server.http_url is None:
            log(f"engine of model '{self.name}' dead ({reason}): unloaded; the server's HTTP endpoint is off "
                "(--allow-http=false) or its port unreadable, so it is not marked unavailable and the server reads "
                "ready again")
            return
        log(f"engine of model '{self.name}' dead ({reason}): unloaded, marking it unavailable")
        # the load fails on purpose (initialize sees FAILED_PARAMETER); over HTTP: server_control.py says why
        error = load_model_over_http(self.server, self.name, config)
        if error is None:
            log(f"model '{self.name}': the marking load unexpectedly succeeded")
        else:
            log(f"model '{self.name}' marked unavailable: {error}")

    # ------------------------------------------------------------------------------------------------
    def finalize(self):
        t0 = time.monotonic()
        log(f"finalizing model '{self.name}'")
        self._teardown()
        gc.collect()
        left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        log(f"model '{self.name}' finalized in {time.monotonic() - t0:.2f}s; threads left: "
            f"{', '.join(left) if left else 'none'}")

    def _teardown(self):
        if self.role not in ("text", "ids"):
            return
        self.accepting, self.closing = False, True
        responder, engine, loop = getattr(self, "responder", None), getattr(self, "engine", None), \
            getattr(self, "loop", None)
        if responder is not None and responder.alive:
            responder.abort_all(UNAVAILABLE, "the model is being unloaded")
            deadline = time.monotonic() + 5.0
            while responder.num_active and time.monotonic() < deadline:
                time.sleep(0.01)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                log(f"engine shutdown: {traceback.format_exc()}")
        if loop is not None:
            loop.stop()
        if responder is not None:
            responder.stop()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        self.engine = self.loop = self.responder = None
        tqdm = sys.modules.get("tqdm")
        monitor = getattr(getattr(tqdm, "tqdm", None), "monitor", None)
        if monitor is not None:  # tqdm's monitor thread, started by the weight loader's progress bars
            try:
                monitor.exit()
                tqdm.tqdm.monitor = None
            except Exception:
                pass
