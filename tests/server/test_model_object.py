"""The Triton model object (backend/triton/model.py) driven in this process, without a server: a stand-in for
`triton_python_backend_utils`, requests and response senders. With the engine in a process of its own (the default)
the model holds no tokenizer and this process loads none, yet its responses carry the text that needs one: a chat
prompt's echo, the logprobs' tokens, m3_ids' stop words of several tokens (all decoded by the engine process)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import types

import numpy as np
import pytest

from m3serve.triton.ids_contract import to_word_list

MODEL_PY = os.path.join(os.path.dirname(__file__), "..", "..", "backend", "triton", "model.py")
FINAL = 1


class TritonError:
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL, UNSUPPORTED, NOT_FOUND, UNKNOWN = range(7)

    def __init__(self, message, code=INTERNAL):
        self.message, self.code = message, code


class Tensor:
    def __init__(self, name, value):
        self.name, self.value = name, value


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.tensors, self.error = {t.name: t.value for t in output_tensors}, error


class Sender:
    def __init__(self):
        self.responses, self.done = [], threading.Event()

    def send(self, response=None, flags=0):
        if response is not None:
            self.responses.append(response)
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self):
        return False


class Request:
    def __init__(self, tensors: dict, requested: tuple = ()):
        self.tensors, self.sender, self.requested = tensors, Sender(), list(requested)

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return ""

    def requested_output_names(self):
        return self.requested

    def inputs(self):
        return [types.SimpleNamespace(name=lambda k=k: k, as_numpy=lambda v=v: v) for k, v in self.tensors.items()]

    def parameters(self):
        return "{}"


@pytest.fixture
def load_model(monkeypatch, tmp_path, tiny_model_dir):
    """`load_model(role, engine_process)`: an initialized TritonPythonModel of that role on the tiny model, its
    engine in a process of its own or on threads here; finalized at the end."""
    pb = types.SimpleNamespace(TritonError=TritonError, Tensor=Tensor, InferenceResponse=InferenceResponse,
                               TritonModelException=type("TritonModelException", (Exception,), {}),
                               TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
                               using_decoupled_model_transaction_policy=lambda config: True)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.delenv("M3SERVE_TEST_ENGINE_FACTORY", raising=False)
    spec = importlib.util.spec_from_file_location("m3serve_model_under_test", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.json").write_text(json.dumps(dict(
        model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
        max_num_seqs=8)))
    models = []

    def load(role: str, engine_process: bool):
        params = {"m3serve_role": role, "engine_process": str(engine_process).lower(), "REPORT_CUSTOM_METRICS": "false"}
        config = {"name": role, "max_batch_size": 0, "parameters": {k: {"string_value": v} for k, v in params.items()}}
        model = module.TritonPythonModel()
        models.append(model)
        model.initialize({"model_config": json.dumps(config), "model_name": role, "model_version": "1",
                          "model_repository": str(tmp_path)})
        return model
    yield load
    for model in models:
        model.finalize()


def ask(model, tensors: dict, requested: tuple = ()) -> dict:
    """One request's final response tensors (its error raised); `requested`: the output names the client asked for
    (none: every output)."""
    request = Request(tensors, requested)
    model.execute([request])
    assert request.sender.done.wait(60)
    response = request.sender.responses[-1]
    assert response.error is None, response.error.message
    return response.tensors


def s(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


@pytest.mark.parametrize("engine_process", [True, False])
def test_the_model_holds_no_tokenizer_and_answers_with_the_engines_text(load_model, tokenizer_loads, tiny_model_dir,
                                                                        engine_process):
    """Either `EngineClient` behind the model: the same answers. With the engine process, no tokenizer here."""
    from m3serve.text.tokenizer import Tokenizer

    text, ids = load_model("text", engine_process), load_model("ids", engine_process)
    assert not hasattr(text, "tokenizer") and not hasattr(text.contract, "tokenizer")
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    echo = ask(text, {"messages": s(json.dumps(msgs)), "exclude_input_in_output": np.array([False]),
                      "return_logprobs": np.array([True]), "sampling_parameters": s(json.dumps(
                          {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 1}))})
    prompt = np.array([[5, 7, 9, 11]], np.int32)
    greedy = {"input_ids": prompt, "request_output_len": np.array([[12]], np.int32),
              "end_id": np.array([[-1]], np.int32), "exclude_input_in_output": np.array([[True]])}
    first = ask(ids, greedy)["output_ids"].reshape(-1).tolist()
    # two models loaded, three requests answered: no tokenizer in this process (but the engines' on their threads)
    assert tokenizer_loads == ([] if engine_process else ["built", "built"])
    loaded = len(tokenizer_loads)

    tok = Tokenizer.from_pretrained(tiny_model_dir)
    rendered = tok.decode(tok.encode(tok.apply_chat_template(msgs)), skip_special_tokens=False)
    assert echo["text_output"][0].decode().startswith(rendered)
    entries = json.loads(echo["logprobs"][0])
    assert len(entries) == 4
    assert all(v["decoded_token"] == tok.decode([int(t)], skip_special_tokens=False)
               for entry in entries for t, v in entry.items())
    # a stop word of two tokens (as ids): the engine decodes it and stops where its text first appears
    at = next(i for i in range(2, len(first) - 2) if tok.decode(first[i:i + 2], skip_special_tokens=False).strip())
    stopped = ask(ids, {**greedy, "stop_words_list": to_word_list([[first[at:at + 2]]])})["output_ids"]
    stopped = stopped.reshape(-1).tolist()
    assert len(stopped) <= at + 2 < len(first) and stopped == first[:len(stopped)]
    assert tokenizer_loads[loaded:] == ["built"]  # only the test's own


def test_a_client_gets_only_the_outputs_it_names(load_model):
    """Each output tensor costs the Python backend's response thread a shared-memory block per response: a client
    that names its outputs (clients/bench.py asks `m3_ids` for output_ids alone) gets those and nothing else,
    streaming or not; one that names none gets every output of the contract."""
    ids = load_model("ids", False)
    req = {"input_ids": np.array([[5, 7, 9, 11]], np.int32), "request_output_len": np.array([[6]], np.int32),
           "end_id": np.array([[-1]], np.int32)}
    every = ask(ids, req)
    assert {"output_ids", "sequence_length", "batch_index", "sequence_index"} <= set(every)
    only = ask(ids, req, ("output_ids",))
    assert set(only) == {"output_ids"} and only["output_ids"].tolist() == every["output_ids"].tolist()
    request = Request({**req, "streaming": np.array([[True]])}, ("output_ids",))
    ids.execute([request])
    assert request.sender.done.wait(60)
    deltas = [r.tensors for r in request.sender.responses if r.tensors]
    assert deltas and all(set(t) == {"output_ids"} for t in deltas)
    streamed = [i for t in deltas for i in t["output_ids"].reshape(-1).tolist()]
    assert len(streamed) == 6
