"""A hostile client against `./build.sh serve` (explicit model control, m3 and preprocessing loaded): without the
repository key it can neither load, unload nor reconfigure a model, over HTTP or gRPC, nor touch logging; it gets
a clear error and the model stays ready and serving. With the key the operator can. A config override that names
a code hook (a factory that would write a marker file), an unknown parameter or a tokenizer path outside the model
folder is refused even with the key, nothing is imported, and the loaded version keeps serving."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tritonserver_proc import copy_models, start_server
from triton_helpers import run_stream, text_inputs, texts

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def srv(models_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    repo = copy_models(d / "models", ("m3", "preprocessing"))
    s = start_server(repo, str(d / "tritonserver.log"), {"M3SERVE_MODEL_DIR": models_dir},
                     ["--model-control-mode=explicit", "--load-model=m3", "--load-model=preprocessing"],
                     wait_models=["m3", "preprocessing"])
    s.dir = d
    yield s
    s.stop()


def _http(srv, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"{srv.http_url}{path}", method=method, headers=headers or {},
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=180) as f:
            return f.status, f.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _serves(srv, model="m3") -> bool:
    responses, error = run_stream(srv.grpc_url, model, text_inputs("The quick brown fox", max_tokens=4))
    return error is None and bool(texts(responses))


def _config(srv, model: str) -> dict:
    status, body = _http(srv, "GET", f"/v2/models/{model}/config")  # model config stays open
    assert status == 200, body
    return json.loads(body)


def _with_params(config: dict, **params) -> str:
    config = dict(config)
    config["parameters"] = {**config.get("parameters", {}), **{k: {"string_value": v} for k, v in params.items()}}
    return json.dumps(config)


def test_without_the_key_no_client_changes_what_is_served(srv):
    override = {"parameters": {"config": _with_params(_config(srv, "m3"), default_max_tokens="1")}}
    for key in ({}, {"m3serve-repository-key": "wrong-key-0123456789"}):
        for method, path, body in (("POST", "/v2/repository/models/m3/unload", {}),
                                   ("POST", "/v2/repository/models/m3/load", {}),
                                   ("POST", "/v2/repository/models/m3/load", override),
                                   ("POST", "/v2/repository/index", {}),
                                   ("POST", "/v2/logging", {"log_verbose_level": 1})):
            status, text = _http(srv, method, path, body, key)
            assert status == 403 and "restricted" in text and "m3serve-repository-key" in text, (path, status, text)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        calls = (lambda h: client.unload_model("m3", headers=h), lambda h: client.load_model("m3", headers=h),
                 lambda h: client.load_model("m3", headers=h, config=override["parameters"]["config"]),
                 lambda h: client.get_model_repository_index(headers=h),
                 lambda h: client.update_log_settings({"log_verbose_level": 1}, headers=h))
        for headers in (None, {"triton-grpc-protocol-m3serve-repository-key": "wrong-key-0123456789"}):
            for call in calls:
                with pytest.raises(InferenceServerException, match="restricted.*m3serve-repository-key"):
                    call(headers)
        assert client.is_model_ready("m3") and client.is_server_ready()
    finally:
        client.close()
    assert _serves(srv)
    assert "wrong-key" not in srv.log() and srv.repository_key not in srv.log()  # the key is never logged


def test_with_the_key_the_operator_unloads_and_loads(srv):
    status, text = _http(srv, "POST", "/v2/repository/models/preprocessing/unload", {}, srv.repository_headers())
    assert status == 200, text
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert not client.is_model_ready("preprocessing")
        client.load_model("preprocessing", headers=srv.repository_metadata())
        assert client.is_model_ready("preprocessing")
        index = client.get_model_repository_index(headers=srv.repository_metadata(), as_json=True)["models"]
        assert {m["name"]: m["state"] for m in index} == {"m3": "READY", "preprocessing": "READY"}
    finally:
        client.close()


def _marker_factory(d) -> tuple[str, str]:
    """A factory file that, imported or called, writes a marker: ("file:function", marker path)."""
    marker = str(d / "hook-ran")
    path = d / "hook.py"
    path.write_text(f"open({marker!r}, 'a').write('imported\\n')\n"
                    f"def make(config):\n    open({marker!r}, 'a').write('called\\n')\n")
    return f"{path}:make", marker


def test_a_config_naming_code_or_an_outside_path_is_refused_even_with_the_key(srv):
    factory, marker = _marker_factory(srv.dir)
    m3 = _config(srv, "m3")
    pre = _config(srv, "preprocessing")
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        cases = [("m3", _with_params(m3, engine_factory=factory), "engine_factory: a model config never picks code"),
                 ("m3", _with_params(m3, engine_factory="os:system"), "engine_factory: a model config never picks code"),
                 ("m3", _with_params(m3, my_hook=factory), "my_hook: a model config never picks code"),
                 ("preprocessing", _with_params(pre, tokenizer_dir=os.path.dirname(srv.env["M3SERVE_MODEL_DIR"])),
                  "must be a relative path inside the model folder"),
                 ("preprocessing", _with_params(pre, tokenizer_dir="../../../../etc"),
                  "must be a relative path inside the model folder")]
        for model, config, needle in cases:  # over gRPC and over HTTP
            with pytest.raises(InferenceServerException, match=needle):
                client.load_model(model, headers=srv.repository_metadata(), config=config)
            status, text = _http(srv, "POST", f"/v2/repository/models/{model}/load",
                                 {"parameters": {"config": config}}, srv.repository_headers())
            assert status == 400 and needle in text, (status, text)
        assert not os.path.exists(marker), open(marker).read()  # nothing imported, nothing called
        assert client.is_model_ready("m3") and client.is_model_ready("preprocessing")  # the old version serves on
    finally:
        client.close()
    assert _serves(srv)
