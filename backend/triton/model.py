"""m3serve: the Python-based Triton backend (`backend: "m3serve"`) serving MiniMax-M3.

build.sh / the Dockerfile install this file as `<backend dir>/m3serve/model.py`, next to the python
backend's stub; it imports the `m3serve` package from the server's Python environment.

One file, four roles (config parameter `m3serve_role`, else guessed from the declared inputs):
  text            `m3`: the vLLM backend's text contract (decoupled, max_batch_size 0)
  ids             `m3_ids`: the TensorRT-LLM `tensorrt_llm` token-id contract (decoupled, [B, ...] shapes)
  preprocessing   text -> token ids      (TensorRT-LLM ensemble step names)
  postprocessing  token ids -> text

Threads of an LLM instance (text / ids):
  stub main thread   initialize / execute / finalize: parse, validate, queue; never blocks on the engine
  engine loop        asyncio loop running one coroutine per engine request (`engine.generate`)
  engine step loop   owned by AsyncLLMEngine
  responder          the only thread that calls send / is_cancelled / metrics (see responder.py)

Config parameters (all optional): m3serve_role, default_max_tokens (16), REPORT_CUSTOM_METRICS
("true"/"yes" default on), cancellation_check_period_ms (50), stats_period_ms (250), coalesce_responses
("true": deltas queued for one stream go out as one response),
utf8_stream_boundaries ("true": m3_ids streams whole UTF-8 characters), tokenizer_dir and
skip_special_tokens (pre/postprocessing). Testing/benchmark hook: parameter engine_factory or
$M3SERVE_ENGINE_FACTORY = "module:function" or "/path/file.py:function" builds the engine from the
EngineConfig instead of AsyncLLMEngine.
"""
from __future__ import annotations

import gc
import importlib
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

from m3serve.triton import interface as I  # noqa: E402
from m3serve.triton.responder import Group, Item, Responder, log  # noqa: E402

ROLES = ("text", "ids", "preprocessing", "postprocessing")


def _params(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}


def _truthy(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _guess_role(model_config: dict, params: dict) -> str:
    role = params.get("m3serve_role")
    if role:
        if role not in ROLES:
            raise ValueError(f"parameter m3serve_role: {role!r} is not one of {list(ROLES)}")
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
        ins, outs = {
            "text": (I.TEXT_INPUTS, I.TEXT_OUTPUTS), "ids": (I.IDS_INPUTS, I.IDS_OUTPUTS),
            "preprocessing": (I.PRE_INPUTS, I.PRE_OUTPUTS), "postprocessing": (I.POST_INPUTS, I.POST_OUTPUTS),
        }[role]
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
        from m3serve.triton.metrics import Metrics

        self.engine = self.loop = self.responder = self.metrics = None
        self.accepting = False
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError("m3serve LLM models must be decoupled: add "
                             "`model_transaction_policy { decoupled: true }` to config.pbtxt")
        if self.role == "text" and self.model_config.get("max_batch_size", 0) != 0:
            raise ValueError("the text model (vLLM contract) needs `max_batch_size: 0`")
        cfg, notes = engine_args.engine_config(self.version_dir)
        for n in notes:
            log(n)
        self.engine_config = cfg
        factory = self.params.get("engine_factory") or os.environ.get("M3SERVE_ENGINE_FACTORY")
        if factory:  # "package.module:function" or "/path/to/file.py:function"
            mod, _, fn = factory.rpartition(":")
            if mod.endswith(".py"):
                import importlib.util
                spec = importlib.util.spec_from_file_location(os.path.basename(mod)[:-3], mod)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(mod)
            self.engine = getattr(module, fn)(cfg)
        else:
            from m3serve.engine.async_engine import AsyncLLMEngine
            self.engine = AsyncLLMEngine(cfg)
        from m3serve.engine.async_engine import EngineDeadError
        from m3serve.engine.sampling_params import InvalidRequest
        self._EngineDeadError, self._InvalidRequest = EngineDeadError, InvalidRequest
        core = getattr(self.engine, "engine", None)
        self.tokenizer = self.engine.tokenizer
        self.defaults = I.Defaults(
            max_tokens=int(self.params.get("default_max_tokens") or 16),
            max_model_len=getattr(core, "max_model_len", None) or cfg.max_model_len,
            vocab_size=getattr(getattr(core, "model_config", None), "vocab_size", None),
            reasoning_parser=cfg.reasoning_parser,
            utf8_stream_boundaries=_truthy(self.params.get("utf8_stream_boundaries"), True),
        )
        tok = self.tokenizer
        self._decode_token = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok else None
        self._decode = (lambda ids: tok.decode(ids, skip_special_tokens=False)) if tok else None
        self._hold = (I.utf8_incomplete(lambda ids: tok.decode(ids, skip_special_tokens=True))
                      if tok is not None and self.defaults.utf8_stream_boundaries else None)
        self.metrics = Metrics(pb_utils, {"model": self.name, "version": str(self.args["model_version"])},
                               self.defaults.max_model_len,
                               enabled=_truthy(self.params.get("REPORT_CUSTOM_METRICS"), True))
        self.loop = EngineLoop(name=f"{self.name}-loop")
        self.responder = Responder(
            pb_utils, self.metrics, abort=self.engine.abort_sync, stats=self.engine.stats,
            healthy=self.engine.is_healthy, on_unhealthy=self._unload_self,
            cancel_period=float(self.params.get("cancellation_check_period_ms") or 50) / 1000.0,
            stats_period=float(self.params.get("stats_period_ms") or 250) / 1000.0, name=self.name,
            coalesce=_truthy(self.params.get("coalesce_responses"), True))
        self.responder.start()
        self._ids = itertools.count()
        self._prefix = f"{self.name}-{os.getpid()}-"
        self._by_client_id: dict[str, Group] = {}
        self._lock = threading.Lock()
        self.accepting = True

    def _init_tokenizer_step(self):
        from m3serve.text.tokenizer import Tokenizer
        from m3serve.triton import engine_args

        value = self.params.get("tokenizer_dir")
        if not value:
            raise ValueError("parameter tokenizer_dir (the model or tokenizer directory) is required")
        path = engine_args.resolve_path(value, self.version_dir, "tokenizer_dir")
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.default_max_tokens = int(self.params.get("default_max_tokens") or 16)
        self.skip_special = _truthy(self.params.get("skip_special_tokens"), True)

    # ------------------------------------------------------------------------------------------------
    def execute(self, requests):
        if self.role == "preprocessing":
            return [self._tokenizer_step(r, True) for r in requests]
        if self.role == "postprocessing":
            return [self._tokenizer_step(r, False) for r in requests]
        for request in requests:
            try:
                self._accept(request)
            except Exception:
                log(f"execute: {traceback.format_exc()}")
        return None

    def _tokenizer_step(self, request, pre: bool):
        try:
            tensors = _read_inputs(request)
            if pre:
                out = I.preprocess(tensors, self.tokenizer, self.default_max_tokens)
            else:
                tok = self.tokenizer
                out = I.postprocess(tensors, lambda ids: tok.decode(ids, skip_special_tokens=self.skip_special))
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()])
        except I.RequestError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        except Exception as e:
            log(f"{self.role}: {traceback.format_exc()}")
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}"))

    def _accept(self, request) -> None:
        sender = request.get_response_sender()
        if not self.accepting:
            self.responder.reject(sender, I.UNAVAILABLE, "the model is being unloaded")
            return
        if self.responder.unhealthy or not self.engine.is_healthy():
            self.responder.reject(sender, I.UNAVAILABLE, "the engine is not healthy; the model is unavailable")
            return
        try:
            tensors = _read_inputs(request)
            params = request.parameters()
            client_id = request.request_id() or ""
            try:
                requested = frozenset(request.requested_output_names())
            except Exception:
                requested = frozenset()
            if self.role == "text":
                req = I.parse_text_request(tensors, params, self.defaults)
                if req.messages is not None:
                    if self.tokenizer is None:
                        raise I.RequestError("messages", "the model has no tokenizer (tokenizer.json)")
                    I.render_chat(self.tokenizer, req)
                reqs = [req]
            else:
                parsed = I.parse_ids_request(tensors, params, self.defaults, client_id, self._decode)
                if isinstance(parsed, I.StopRequest):
                    self._stop(parsed.request_id, sender)
                    return
                reqs = parsed
        except I.RequestError as e:
            self.responder.reject(sender, e.code, str(e))
            return
        except Exception as e:
            log(f"parsing a request: {traceback.format_exc()}")
            self.responder.reject(sender, I.INTERNAL, f"{type(e).__name__}: {e}")
            return
        group = Group(sender, requested, client_id, on_close=self._on_close if client_id else None)
        items = []
        for r in reqs:
            builder = (I.TextStream(r, self._decode_token) if self.role == "text"
                       else I.IdsStream(r, self._hold))
            items.append((Item(f"{self._prefix}{next(self._ids)}", group, builder), r))
        if client_id and self.role == "ids":
            with self._lock:
                self._by_client_id[client_id] = group
        self.responder.register(group)
        for item, r in items:
            self.loop.submit(self._drive(item, r))

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

    async def _drive(self, item: Item, r: I.GenRequest) -> None:
        code = message = None
        try:
            async for out in self.engine.generate(
                    item.rid, prompt=r.prompt if r.prompt_token_ids is None else None,
                    prompt_token_ids=r.prompt_token_ids, sampling_params=r.sampling,
                    reasoning_parser=r.reasoning_parser, chat_template_kwargs=r.chat_template_kwargs):
                self.responder.output(item, out)
        except self._InvalidRequest as e:
            code, message = I.INVALID_ARG, str(e)
        except self._EngineDeadError as e:
            code, message = I.UNAVAILABLE, f"the engine is not healthy; the model is unavailable ({e})"
        except BaseException as e:  # CancelledError at shutdown included: the request still gets a FINAL
            if isinstance(e, Exception):
                log(f"request {item.rid}: {traceback.format_exc()}")
                code, message = I.INTERNAL, f"{type(e).__name__}: {e}"
            else:
                code, message = I.UNAVAILABLE, "the model is being unloaded"
            self.responder.end(item, code, message)
            if not isinstance(e, Exception):
                raise
            return
        self.responder.end(item, code, message)

    def _unload_self(self) -> None:
        """Called on the response thread once the engine is unhealthy: make the model unready."""
        try:
            pb_utils.unload_model(self.name)
            log(f"engine unhealthy: asked the server to unload model '{self.name}'")
        except Exception as e:
            log(f"engine unhealthy: cannot unload model '{self.name}' ({e}); start the server with "
                "--model-control-mode=explicit to make it unready. It stays loaded and answers UNAVAILABLE.")

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
        self.accepting = False
        responder, engine, loop = getattr(self, "responder", None), getattr(self, "engine", None), \
            getattr(self, "loop", None)
        if responder is not None and responder.alive:
            responder.abort_all(I.UNAVAILABLE, "the model is being unloaded")
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
