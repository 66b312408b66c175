"""The real tritonserver (CPU, tiny model) driven through tritonclient.grpc."""
from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_helpers import inp, is_final, metric, metrics, run_stream, scalar, text_inputs, texts

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROMPTS = [
    "The quick brown fox",
    "What is the weather like in Paris today?",
    "def add(a, b):",
    "Please write a short poem about the sea",
    "SELECT name, count(*) FROM users",
    "Numbers: 0 1 2 3",
    "Привет, мир!",
    "你好，世界！",
    "A helpful assistant answers questions",
    "for i in range(10):",
    "Thinking step by step, we first",
    "The user asked for a summary",
    "Café, naïve, résumé",
    "import json, os, sys",
    "Let me check the weather for you.",
    "Emoji: 😀 😂 🚀",
]


def generate(server, prompt, **kw):
    responses, error = run_stream(server.grpc_url, "m3", text_inputs(prompt, **kw))
    assert error is None, error
    return responses


# ---- the shipped configs agree with the interface module -------------------------------------------
def _declared(path):
    text = open(path).read()
    ins = re.search(r"\ninput \[(.*?)\n\]", text, re.S).group(1)
    outs = re.search(r"\noutput \[(.*?)\n\]", text, re.S).group(1)
    pat = r'name: "(\w+)" data_type: (\w+) dims: \[ ([-\d, ]+) \]( optional: true)?'
    return ([(n, t, [int(d) for d in dims.split(",")], bool(o)) for n, t, dims, o in re.findall(pat, ins)],
            [(n, t, [int(d) for d in dims.split(",")]) for n, t, dims, _ in re.findall(pat, outs)])


@pytest.mark.parametrize("model,ins,outs", [("m3", "TEXT_INPUTS", "TEXT_OUTPUTS"), ("m3_ids", "IDS_INPUTS", "IDS_OUTPUTS"),
                                            ("preprocessing", "PRE_INPUTS", "PRE_OUTPUTS"),
                                            ("postprocessing", "POST_INPUTS", "POST_OUTPUTS")])
def test_configs_match_interface(model, ins, outs):
    from m3serve.triton import schema as I

    paths = [os.path.join(ROOT, "model_repository", model, "config.pbtxt")]
    if model == "m3":
        paths += [os.path.join(ROOT, "model_repository_examples", ex, "m3", "config.pbtxt")
                  for ex in ("minimax-m3.1-flash-tp4", "minimax-m3.1-flash-tp4-rocm")]
    for path in paths:
        got_in, got_out = _declared(path)
        assert got_in == [(i["name"], i["data_type"], i["dims"], bool(i.get("optional"))) for i in getattr(I, ins)]
        assert got_out == [(o["name"], o["data_type"], o["dims"]) for o in getattr(I, outs)]


# ---- text contract -------------------------------------------------------------------------------------
def test_stream_deltas_concatenate_to_the_non_streamed_text(server):
    for prompt in PROMPTS[:3]:
        whole = generate(server, prompt, max_tokens=40)
        assert len(whole) == 1 and is_final(whole[0])
        streamed = generate(server, prompt, stream=True, max_tokens=40)
        assert len(streamed) >= 2
        assert all(not is_final(r) for r in streamed[:-1]) and is_final(streamed[-1])
        assert "".join(texts(streamed)) == texts(whole)[0]
        # the counts add up, finish_reason reads "None" until the FINAL response, which carries the last token
        n_whole = int(scalar(whole[0], "num_output_tokens"))
        assert sum(int(scalar(r, "num_output_tokens")) for r in streamed) == n_whole
        assert [scalar(r, "finish_reason").decode() for r in streamed[:-1]] == ["None"] * (len(streamed) - 1)
        assert scalar(streamed[-1], "finish_reason").decode() in ("stop", "length")
        assert int(scalar(streamed[-1], "num_output_tokens")) >= 1
        assert int(scalar(streamed[0], "num_input_tokens")) == int(scalar(whole[0], "num_input_tokens")) > 0


def test_non_streamed_prepends_the_prompt_unless_excluded(server):
    prompt = PROMPTS[0]
    excluded = texts(generate(server, prompt, max_tokens=8))[0]
    default = texts(generate(server, prompt, max_tokens=8, exclude=None))[0]
    assert default == prompt + excluded


def test_sixteen_concurrent_streams_each_equal_their_solo_run(server):
    solo = {p: "".join(texts(generate(server, p, stream=True, max_tokens=24))) for p in PROMPTS}
    results, errors = {}, []

    def user(p):
        try:
            responses, error = run_stream(server.grpc_url, "m3", text_inputs(p, stream=True, max_tokens=24),
                                          request_id=f"c-{PROMPTS.index(p)}")
            if error is not None:
                errors.append(error)
            results[p] = "".join(texts(responses))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=user, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == solo


def test_aliases_and_string_numbers(server):
    """genai-perf's default TRT-LLM payload (max_tokens, min_length tensors) and string-valued JSON numbers."""
    ins = [inp("text_input", PROMPTS[1]), inp("max_tokens", 5, np.int32), inp("min_length", 5, np.int32),
           inp("exclude_input_in_output", True, bool), inp("stream", True, bool),
           inp("return_num_output_tokens", True, bool), inp("temperature", 0.0, np.float32),
           inp("ignore_eos", True, bool)]
    responses, error = run_stream(server.grpc_url, "m3", ins)
    assert error is None, error
    assert sum(int(scalar(r, "num_output_tokens")) for r in responses) == 5
    r = generate(server, PROMPTS[1], extra={"max_tokens": "6", "temperature": "0", "ignore_eos": "true"})
    assert int(scalar(r[0], "num_output_tokens")) == 6
    # the vLLM sample client puts sampling options in the request parameters
    ins = [inp("text_input", PROMPTS[1]), inp("exclude_input_in_output", True, bool),
           inp("return_num_output_tokens", True, bool)]
    responses, error = run_stream(server.grpc_url, "m3", ins,
                                  parameters={"max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert error is None, error
    assert int(scalar(responses[-1], "num_output_tokens")) == 3


def test_logprobs_and_cumulative_logprob(server):
    r = generate(server, PROMPTS[0], max_tokens=4, extra={"logprobs": 2, "ignore_eos": True},
                 returns=("logprobs", "cumulative_logprob", "num_output_tokens"))
    lp = json.loads(scalar(r[0], "logprobs"))
    assert len(lp) == 4 and all(isinstance(e, dict) and e for e in lp)
    total = sum(max(v["logprob"] for v in e.values() if v["logprob"] is not None) for e in lp)
    assert float(scalar(r[0], "cumulative_logprob")) == pytest.approx(total, abs=1e-3)


def test_chat_messages_and_reasoning_output(server):
    """With return_reasoning the streamed text is split as the minimax_m3 parser's definition (`extract`) splits
    the same reply's raw text (the same greedy request without the parser)."""
    from m3serve.text.reasoning import extract

    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]

    def chat(reasoning):
        ins = [inp("messages", json.dumps(messages)), inp("stream", True, bool),
               inp("chat_template_kwargs", json.dumps({"thinking_mode": "enabled"})),
               inp("sampling_parameters", json.dumps({"max_tokens": 24, "temperature": 0, "ignore_eos": True}))]
        responses, error = run_stream(server.grpc_url, "m3", ins + [inp("return_reasoning", reasoning, bool)])
        assert error is None, error
        return responses

    raw_deltas = texts(chat(False))
    raw = "".join(raw_deltas)
    responses = chat(True)
    split = ("".join(texts(responses, "reasoning_output")), "".join(texts(responses)))

    def check(got):  # thinking_mode "enabled": the reply starts inside the reasoning block
        assert got == extract(raw, "enabled"), (got, raw)
    check(split)
    assert len(raw_deltas) > 2 and split[0]
    # what the old check ("reasoning not empty, no marker in the content") let pass fails here: a parser that
    # drops a delta, or turns reasoning into content after the first delta
    for broken in (("".join(raw_deltas[:-1]), ""), (raw_deltas[0], "".join(raw_deltas[1:]))):
        assert broken[0] and "<mm:think>" not in broken[1] and "</mm:think>" not in broken[1]
        with pytest.raises(AssertionError):
            check(broken)


def test_http_generate_endpoint(server):
    body = json.dumps({"text_input": PROMPTS[0], "exclude_input_in_output": True,
                       "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0})}).encode()
    req = urllib.request.Request(f"{server.http_url}/v2/models/m3/generate", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as f:
        out = json.loads(f.read())
    assert out["text_output"] == texts(generate(server, PROMPTS[0], max_tokens=8))[0]
    # a bad request is INVALID_ARG: HTTP 400 with the field named
    body = json.dumps({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": -1})}).encode()
    req = urllib.request.Request(f"{server.http_url}/v2/models/m3/generate", body,
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and "max_tokens" in e.value.read().decode()


# ---- token-id contract and the ensemble -------------------------------------------------------------
def test_ensemble_streams_the_same_text(server):
    for prompt in PROMPTS[:4]:
        want = texts(generate(server, prompt, max_tokens=32))[0]
        ins = [inp("text_input", prompt, shape=[1, 1]), inp("max_tokens", 32, np.int32, [1, 1]),
               inp("stream", True, bool, [1, 1])]
        responses, error = run_stream(server.grpc_url, "ensemble", ins)
        assert error is None, error
        assert len(responses) >= 2
        assert "".join(texts(responses)) == want


def test_ids_model_batch_and_final_flag(server):
    ids = [[5, 7, 9, 11], [12, 13, 0, 0]]
    ins = [inp("input_ids", ids, np.int32), inp("input_lengths", [[4], [2]], np.int32),
           inp("request_output_len", [[6], [4]], np.int32), inp("streaming", [[True], [True]], bool),
           inp("end_id", [[-1], [-1]], np.int32)]
    responses, error = run_stream(server.grpc_url, "m3_ids", ins)
    assert error is None, error
    assert [is_final(r) for r in responses].count(True) == 1 and is_final(responses[-1])
    per = {0: [], 1: []}
    for r in responses:
        per[int(r.as_numpy("batch_index").reshape(-1)[0])] += r.as_numpy("output_ids").reshape(-1).tolist()
    assert len(per[0]) == 6 and len(per[1]) == 4
    # non-streaming: one response per item, the prompt included
    ins = [inp("input_ids", [[5, 7, 9, 11]], np.int32), inp("request_output_len", [[6]], np.int32),
           inp("end_id", [[-1]], np.int32)]
    responses, error = run_stream(server.grpc_url, "m3_ids", ins)
    assert error is None, error
    out = responses[-1].as_numpy("output_ids").reshape(-1).tolist()
    assert out == [5, 7, 9, 11] + per[0]
    assert int(responses[-1].as_numpy("sequence_length").reshape(-1)[0]) == 10


def test_ids_explicit_stop_request(server):
    """TensorRT-LLM style: a request with stop=true and the same request_id ends the running one."""
    LONG = 1000  # tokens the stopped request would make; it is stopped once it streams (a few ms later)
    result, streaming = {}, threading.Event()

    def long_run():
        ins = [inp("input_ids", [[5, 7, 9]], np.int32), inp("request_output_len", [[LONG]], np.int32),
               inp("streaming", [[True]], bool), inp("end_id", [[-1]], np.int32)]
        result["r"] = run_stream(server.grpc_url, "m3_ids", ins, request_id="stop-me", first=streaming)
    t = threading.Thread(target=long_run)
    t.start()
    assert streaming.wait(30)
    responses, error = run_stream(server.grpc_url, "m3_ids", [inp("input_ids", [[1]], np.int32),
                                                              inp("stop", [[True]], bool)], request_id="stop-me")
    assert error is None and len(responses) == 1 and is_final(responses[0])
    t.join(30)
    assert not t.is_alive()
    responses, error = result["r"]
    assert error is None and is_final(responses[-1])
    n = sum(r.as_numpy("output_ids").size for r in responses)
    assert n < LONG  # stopped while running (possibly before its first token reached the client)


# ---- cancellation --------------------------------------------------------------------------------------
def _engine_state(server, model="m3"):
    m = metrics(server.metrics_url)
    return (metric(m, "vllm:num_requests_running", model=model), metric(m, "m3serve:kv_cache_free_pages", model=model),
            metric(m, "m3serve:kv_cache_total_pages", model=model))


def test_cancel_mid_stream_frees_the_sequence(server):
    # the gauges lag the engine by a stats period: the previous test's last request may still show as running
    running, free, total = _pages_all_free(server, ("m3",))[0]
    assert running == 0 and free == total
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got, errors = [], []
    client.start_stream(callback=lambda result, error: (errors if error is not None else got).append(
        result if error is None else error))
    try:
        client.async_stream_infer("m3", text_inputs(PROMPTS[3], stream=True, max_tokens=900,
                                                    extra={"ignore_eos": True}), request_id="to-cancel")
        deadline = time.monotonic() + 60
        while len(got) < 5 and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(got) >= 5, errors
        busy = None
        while time.monotonic() < deadline:  # visible as running, holding pages
            busy = _engine_state(server)
            if busy[0] == 1 and busy[1] < busy[2]:
                break
            time.sleep(0.05)
        assert busy[0] == 1 and busy[1] < busy[2], busy
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    n_at_cancel = len(got)
    t0 = time.monotonic()
    state = None
    while time.monotonic() - t0 < 5:
        state = _engine_state(server)
        if state[0] == 0 and state[1] == state[2]:
            break
        time.sleep(0.05)
    assert state[0] == 0 and state[1] == state[2], state
    assert n_at_cancel < 900 and not is_final(got[-1])
    # and the model serves the next request normally
    assert texts(generate(server, PROMPTS[0], max_tokens=4))


# ---- malformed requests ------------------------------------------------------------------------------
LONG = "The quick brown fox jumps over the lazy dog. " * 120  # > max_model_len (1024) tokens

TEXT_BAD = {
    "missing text_input": ([inp("stream", False, bool)], "text_input"),
    "text_input wrong dtype": ([inp("text_input", 5, np.int32)], "text_input"),
    "text_input two elements": ([inp("text_input", ["a", "b"])], "text_input"),
    "empty text_input": ([inp("text_input", "")], "text_input"),
    "invalid UTF-8": ([inp("text_input", b"\xff\xfe\xfd")], "UTF-8"),
    "undeclared input": ([inp("text_input", "hi"), inp("bogus", 1, np.int32)], "bogus"),
    "stream wrong dtype": ([inp("text_input", "hi"), inp("stream", 1.0, np.float32)], "stream"),
    "bad JSON": ([inp("text_input", "hi"), inp("sampling_parameters", "{max_tokens: 3")], "sampling_parameters"),
    "JSON not an object": ([inp("text_input", "hi"), inp("sampling_parameters", "[1, 2]")], "sampling_parameters"),
    "unknown key": ([inp("text_input", "hi"), inp("sampling_parameters", '{"max_tokenz": 3}')], "max_tokenz"),
    "negative max_tokens": ([inp("text_input", "hi"), inp("sampling_parameters", '{"max_tokens": -5}')],
                            "max_tokens"),
    "zero max_tokens alias": ([inp("text_input", "hi"), inp("max_tokens", 0, np.int32)], "max_tokens"),
    "huge max_tokens": ([inp("text_input", "hi"), inp("sampling_parameters", '{"max_tokens": 1000000000}')],
                        "max_tokens"),
    "max_tokens over the room left": ([inp("text_input", "hi"), inp("max_tokens", 1024, np.int32)], "max_tokens"),
    "max_tokens not a number": ([inp("text_input", "hi"), inp("sampling_parameters", '{"max_tokens": "lots"}')],
                                "max_tokens"),
    "prompt over max_model_len": ([inp("text_input", LONG)], "max_model_len"),
    "negative temperature": ([inp("text_input", "hi"), inp("sampling_parameters", '{"temperature": -1}')],
                             "temperature"),
    "NaN temperature tensor": ([inp("text_input", "hi"), inp("temperature", float("nan"), np.float32)],
                               "temperature"),
    "top_p out of range": ([inp("text_input", "hi"), inp("sampling_parameters", '{"top_p": 1.5}')], "top_p"),
    "bad top_k": ([inp("text_input", "hi"), inp("top_k", -7, np.int32)], "top_k"),
    "n > 1": ([inp("text_input", "hi"), inp("sampling_parameters", '{"n": 2}')], "n"),
    "logprobs too many": ([inp("text_input", "hi"), inp("sampling_parameters", '{"logprobs": 99}')], "logprobs"),
    "min_tokens > max_tokens": ([inp("text_input", "hi"), inp("sampling_parameters",
                                                              '{"min_tokens": 9, "max_tokens": 3}')], "min_tokens"),
    "bad stop_token_ids": ([inp("text_input", "hi"), inp("sampling_parameters", '{"stop_token_ids": [-1]}')],
                           "stop_token_ids"),
    "seed not an integer": ([inp("text_input", "hi"), inp("sampling_parameters", '{"seed": "abc"}')], "seed"),
    "lora_name": ([inp("text_input", "hi"), inp("sampling_parameters", '{"lora_name": "x"}')], "lora_name"),
    "stream without exclusion": ([inp("text_input", "hi"), inp("stream", True, bool),
                                  inp("exclude_input_in_output", False, bool)], "exclude_input_in_output"),
    "messages bad JSON": ([inp("messages", "[{")], "messages"),
    "messages not objects": ([inp("messages", "[1, 2]")], "messages"),
    "text_input and messages": ([inp("text_input", "hi"), inp("messages", '[{"role": "user", "content": "x"}]')],
                                "messages"),
    "tools without messages": ([inp("text_input", "hi"), inp("tools", "[]")], "tools"),
    "chat_template_kwargs not an object": ([inp("text_input", "hi"), inp("chat_template_kwargs", '"x"')],
                                           "chat_template_kwargs"),
    "tokenize in chat_template_kwargs": ([inp("messages", '[{"role": "user", "content": "x"}]'),
                                          inp("chat_template_kwargs", '{"tokenize": false}')], "chat_template_kwargs"),
}
# the requests of issue #10: each once killed the engine or was silently converted


def _sp(options: str) -> list:
    return [inp("text_input", "hi"), inp("sampling_parameters", options)]


ISSUE_BAD = {
    "seed 2^64 (JSON)": (_sp('{"seed": 18446744073709551616}'), "sampling_parameters.seed"),
    "seed -1 (JSON)": (_sp('{"seed": -1}'), "sampling_parameters.seed"),
    "top_k 2^63": (_sp('{"top_k": 9223372036854775808}'), "sampling_parameters.top_k"),
    "top_k 2^31": (_sp('{"top_k": 2147483648}'), "sampling_parameters.top_k"),
    "max_tokens 2^63": (_sp('{"max_tokens": 9223372036854775807}'), "sampling_parameters.max_tokens"),
    "logprobs true": (_sp('{"logprobs": true}'), "sampling_parameters.logprobs"),
    "min_tokens 2^40": (_sp('{"min_tokens": 1099511627776}'), "sampling_parameters.min_tokens"),
    "stop [null]": (_sp('{"stop": [null]}'), "sampling_parameters.stop"),
    "stop object": (_sp('{"stop": {"a": 1}}'), "sampling_parameters.stop"),
    "stop_token_ids [1.5]": (_sp('{"stop_token_ids": [1.5]}'), "sampling_parameters.stop_token_ids"),
    "stop_token_ids outside the vocabulary": (_sp('{"stop_token_ids": [70000]}'),
                                              "sampling_parameters.stop_token_ids"),
    "request chat template": ([inp("messages", '[{"role": "user", "content": "x"}]'), inp(
        "chat_template_kwargs", json.dumps({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                                             "{% endfor %}{% endfor %}"}))],
        "trust_request_chat_template"),
}
ISSUE_BAD_ENSEMBLE = {
    "postprocessing negative ids": ("postprocessing", [inp("TOKENS_BATCH", [[[5, -3, -1]]], np.int32),
                                                       inp("SEQUENCE_LENGTH", [[2]], np.int32)], "TOKENS_BATCH"),
    "ensemble max_tokens 0": ("ensemble", [inp("text_input", "hi", shape=[1, 1]), inp("max_tokens", 0, np.int32, [1, 1])],
                              "max_tokens"),
    "ensemble max_tokens over max_model_len": ("ensemble", [inp("text_input", "hi", shape=[1, 1]),
                                                            inp("max_tokens", 5000, np.int32, [1, 1])], "max_tokens"),
    "preprocessing direct, REQUEST_OUTPUT_LEN 0": ("preprocessing", [inp("QUERY", "hi", shape=[1, 1]),
                                                                  inp("REQUEST_OUTPUT_LEN", 0, np.int32, [1, 1])],
                                                   "REQUEST_OUTPUT_LEN (ensemble: max_tokens): must be in"),
    "preprocessing direct, no QUERY": ("preprocessing", [inp("REQUEST_OUTPUT_LEN", 4, np.int32, [1, 1])], "QUERY"),
    "m3_ids request_output_len over max_model_len": ("m3_ids", [inp("input_ids", [[1, 2]], np.int32),
                                                                 inp("request_output_len", [[5000]], np.int32)],
                                                     "request_output_len"),
    "m3_ids negative input id": ("m3_ids", [inp("input_ids", [[1, -2]], np.int32)], "input_ids"),
    "m3_ids batch with one bad item": ("m3_ids", [inp("input_ids", [[1, 2], [3, 4]], np.int32),
                                                  inp("request_output_len", [[4], [5000]], np.int32),
                                                  inp("streaming", [[True], [True]], bool)], "request_output_len"),
}
IDS_BAD = {
    "ids out of vocab": ([inp("input_ids", [[1, 99999]], np.int32)], "input_ids"),
    "beam_width 2": ([inp("input_ids", [[1, 2]], np.int32), inp("beam_width", [[2]], np.int32)], "beam_width"),
    "input_lengths 0": ([inp("input_ids", [[1, 2]], np.int32), inp("input_lengths", [[0]], np.int32)],
                        "input_lengths"),
    "bad words": ([inp("input_ids", [[1, 2]], np.int32), inp("bad_words_list", [[[5], [1]]], np.int32)],
                  "bad_words_list"),
    "negative request_output_len": ([inp("input_ids", [[1, 2]], np.int32),
                                     inp("request_output_len", [[-3]], np.int32)], "request_output_len"),
    "input_ids FP32": ([inp("input_ids", [[1.0, 2.0]], np.float32)], "input_ids"),
}


def test_malformed_requests_get_errors_and_disturb_nothing(server):
    # a long stream runs alongside: it must finish normally whatever the bad requests do
    bystander = {}

    def long_stream():
        bystander["result"] = run_stream(server.grpc_url, "m3", text_inputs(PROMPTS[0], stream=True, max_tokens=200,
                                                                            extra={"ignore_eos": True}))
    t = threading.Thread(target=long_stream)
    t.start()
    cases = [("m3", k, v) for k, v in TEXT_BAD.items()] + [("m3_ids", k, v) for k, v in IDS_BAD.items()]
    cases.append(("ensemble", "ensemble invalid UTF-8", ([inp("text_input", b"\xc3\x28", shape=[1, 1])], "UTF-8")))
    assert len(cases) >= 25
    failures = []
    for model, name, (ins, needle) in cases:
        error, responses = _error_of(server.grpc_url, model, ins)
        if error is None:
            failures.append(f"{name}: no error, got {len(responses)} responses")
        elif needle.lower() not in str(error).lower():
            failures.append(f"{name}: error does not name {needle!r}: {error}")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_ready() and client.is_model_ready("m3") and client.is_model_ready("m3_ids")
    client.close()
    t.join(120)
    assert not failures, "\n".join(failures)
    responses, error = bystander["result"]
    assert error is None and scalar(responses[-1], "finish_reason").decode() == "length"
    assert sum(int(scalar(r, "num_output_tokens")) for r in responses) == 200
    assert texts(generate(server, PROMPTS[0], max_tokens=4))  # a following good request succeeds


def _error_of(url, model, ins):
    """The server's error for a request (None if it succeeded) and the responses before it: what the stream's
    callback got. A client-side exception is not the server's answer: it propagates and fails the test."""
    responses, error = run_stream(url, model, ins, timeout=60)
    return error, responses


def _pages_all_free(server, models=("m3", "m3_ids"), timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        states = [_engine_state(server, m) for m in models]
        if all(r == 0 and f == t for r, f, t in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


def test_issue_10_requests_fail_alone_and_streaming_goes_on_20_times(server):
    """Each request of issue #10 gets its own clear error naming the field the client sent, a seed at 2^64-1
    is served, and a normal streaming request succeeds right after; 20 rounds, no engine death, no abort of the
    server, every KV page back at the end."""
    cases = [("m3", k, ins, needle) for k, (ins, needle) in ISSUE_BAD.items()]
    cases += [(m, k, ins, needle) for k, (m, ins, needle) in ISSUE_BAD_ENSEMBLE.items()]
    for rnd in range(20):
        failures = []
        for model, name, ins, needle in cases:
            error, responses = _error_of(server.grpc_url, model, ins)
            if error is None:
                failures.append(f"{name}: no error, got {len(responses)} responses")
            elif needle.lower() not in str(error).lower() or "not healthy" in str(error):
                failures.append(f"{name}: error does not name {needle!r}: {error}")
            elif responses:
                failures.append(f"{name}: {len(responses)} responses before the error")
        assert not failures, f"round {rnd}:\n" + "\n".join(failures)
        responses, error = run_stream(server.grpc_url, "m3", text_inputs(PROMPTS[1], max_tokens=3, temperature=1.0,
                                                                         seed=(2**64 - 1, np.uint64)))
        assert error is None and int(scalar(responses[-1], "num_output_tokens")) >= 1
        responses, error = run_stream(server.grpc_url, "m3", text_inputs(PROMPTS[0], stream=True, max_tokens=6,
                                                                         extra={"ignore_eos": True}))
        assert error is None, f"round {rnd}: {error}"
        assert len(responses) >= 2 and sum(int(scalar(r, "num_output_tokens")) for r in responses) == 6
        assert server.alive()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert client.is_server_ready() and all(client.is_model_ready(m) for m in ("m3", "m3_ids", "ensemble"))
    finally:
        client.close()
    states = _pages_all_free(server)
    assert all(r == 0 and f == t for r, f, t in states), states


def test_seeds_are_exact_through_json_and_tensor(server):
    def sample(**kw):
        return "".join(texts(generate(server, PROMPTS[2], max_tokens=12, temperature=1.0, **kw)))
    seeds = (2**62, 2**62 + 1, 2**62 + 2)
    by_json = {seed: sample(extra={"seed": seed, "ignore_eos": True}) for seed in seeds}
    assert len(set(by_json.values())) == 3, by_json  # no rounding through a float: three streams
    by_tensor = {seed: sample(extra={"ignore_eos": True}, seed=(seed, np.uint64)) for seed in seeds}
    assert by_tensor == by_json


def test_dropped_sse_connection_is_an_abort_and_frees_its_pages(server):
    import http.client

    def aborts():
        return metric(metrics(server.metrics_url), "vllm:request_success_total", model="m3", finished_reason="abort")
    before = aborts()
    conn = http.client.HTTPConnection("localhost", server.http_port, timeout=60)
    body = json.dumps({"text_input": PROMPTS[3], "stream": True, "exclude_input_in_output": True,
                       "sampling_parameters": json.dumps({"max_tokens": 900, "ignore_eos": True, "temperature": 0})})
    conn.request("POST", "/v2/models/m3/generate_stream", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = [resp.readline() for _ in range(6)]
    assert sum(e.startswith(b"data:") for e in events) >= 3, events
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 10
    while aborts() != before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborts() == before + 1
    states = _pages_all_free(server, ("m3",))
    assert states[0][0] == 0 and states[0][1] == states[0][2], states


# ---- metrics -------------------------------------------------------------------------------------------
def test_metrics_present(server):
    generate(server, PROMPTS[0], stream=True, max_tokens=8)
    deadline = time.monotonic() + 10  # the engine's stats reach the gauges every 100 ms: poll, never read once
    while True:
        m = metrics(server.metrics_url)
        settled = (metric(m, "vllm:num_requests_running", model="m3") == 0
                   and (metric(m, "vllm:generation_tokens_total", model="m3") or 0) >= 8)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert metric(m, "vllm:num_requests_running", model="m3") == 0
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "m3serve:kv_cache_free_pages", "m3serve:kv_cache_total_pages",
                 "vllm:spec_decode_draft_acceptance_rate", "vllm:request_success_total"):
        assert metric(m, name, model="m3") is not None, name
    assert metric(m, "vllm:generation_tokens_total", model="m3") >= 8
    assert metric(m, "vllm:time_to_first_token_seconds_count", model="m3") >= 1
    assert metric(m, "vllm:spec_decode_draft_acceptance_rate", model="m3") == 0
    assert metric(m, "nv_inference_request_success", model="m3") >= 1  # Triton's own per-model metrics
