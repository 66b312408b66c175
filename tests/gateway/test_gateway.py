"""The OpenAI-compatible gateway (`m3serve openai`) in front of the real tritonserver on the tiny model, driven
by the real `openai` client: chat and completions (streamed and not), a tool-call round trip, reasoning,
usage, logprobs, stop strings, seeds, cancellation, errors, and schemathesis over the gateway's schema.
Tool calls and think blocks come from the scripted sampler (scripted_engine.py): the model writes the markup,
everything after the sampler is the real path."""
from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request

import openai
import pytest

from gateway_procs import SCRIPTS, start_gateway
from m3serve.text.tokenizer import Tokenizer
from m3serve.text.tool_parser import forced_call_prefix
from server.triton_helpers import metric, metrics

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
USER = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer.from_pretrained(tiny_model_dir)


def chat_prompt_tokens(tok, messages, tools=None) -> int:
    return len(tok.apply_chat_template(messages, tools=tools, tokenize=True))


def test_models_health_metrics(gateway, client):
    assert [m.id for m in client.models.list().data] == ["m3"]
    with urllib.request.urlopen(gateway.url + "/health") as f:
        assert f.status == 200
    with urllib.request.urlopen(gateway.url + "/metrics") as f:
        assert "m3serve_gateway_requests_in_flight" in f.read().decode()
    # CORS is off by default: no allow-origin header, a preflight is not answered
    req = urllib.request.Request(gateway.url + "/v1/models", headers={"Origin": "http://evil.example"})
    with urllib.request.urlopen(req) as f:
        assert "access-control-allow-origin" not in {k.lower() for k in f.headers}
    pre = urllib.request.Request(gateway.url + "/v1/chat/completions", method="OPTIONS", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(pre)
    assert e.value.code == 405 and "access-control-allow-origin" not in {k.lower() for k in e.value.headers}


def test_chat_and_completions_usage_and_streaming(client, tok):
    r = client.chat.completions.create(model="m3", messages=USER, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == chat_prompt_tokens(tok, USER)
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    text = r.choices[0].message.content
    # the same greedy request streamed: the same text, usage in the last chunk
    chunks = list(client.chat.completions.create(model="m3", messages=USER, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens

    prompt = "The quick brown fox"
    c = client.completions.create(model="m3", prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.usage.prompt_tokens == len(tok.encode(prompt)) and c.usage.completion_tokens == 6
    streamed = list(client.completions.create(model="m3", prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(s.choices[0].text for s in streamed) == c.choices[0].text
    echo = client.completions.create(model="m3", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text == prompt + c.choices[0].text


def test_tool_call_round_trip(client, tok):
    first = client.chat.completions.create(model="m3", messages=USER, tools=TOOLS, temperature=0, seed=7001)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # "3" typed by the schema

    # streamed: the call arrives whole in one delta, the markup never as content
    chunks = list(client.chat.completions.create(model="m3", messages=USER, tools=TOOLS, temperature=0,
                                                 seed=7001, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert not "".join(d.content or "" for d in deltas).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the tool's result goes back; the model answers. The server rendered exactly these messages
    # (assistant tool call with its arguments as an object, the tool response): the prompt count matches.
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    final = client.chat.completions.create(model="m3", messages=history, tools=TOOLS, temperature=0, seed=7003)
    assert final.choices[0].message.content == SCRIPTS[7003]
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    rendered = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris",
                                                                                             "days": 3}}}]},
                       {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    assert final.usage.prompt_tokens == chat_prompt_tokens(tok, rendered, TOOLS)

    # tool_choice "none": the markup is left as text
    raw = client.chat.completions.create(model="m3", messages=USER, tools=TOOLS, tool_choice="none",
                                         temperature=0, seed=7001)
    assert raw.choices[0].message.tool_calls is None and "<invoke name=\"get_weather\">" in raw.choices[0].message.content


@pytest.mark.parametrize("mode", [None, "enabled", "disabled"])
def test_forced_tool_choice(client, tok, mode):
    """tool_choice "required" and a named function: the server renders the M3 tool-call opening after the
    generation prompt (the prompt count says so), the model (scripted) writes only the rest, and the calls come
    back whole, prefix included, streamed and not; a named choice returns that one call. With thinking
    "enabled" the opening closes the think block, so the output is not taken for reasoning."""
    ctk = {"chat_template_kwargs": {"thinking_mode": mode}} if mode else {}
    kw = {"thinking_mode": mode} if mode else {}
    rendered = tok.apply_chat_template(USER, tools=TOOLS, **kw)
    for choice, seed, args in (("required", 7004, {"city": "Rome"}),
                               ({"type": "function", "function": {"name": "get_weather"}}, 7005,
                                {"city": "Lyon", "days": 2})):
        name = None if choice == "required" else "get_weather"
        prefix = forced_call_prefix(mode, name)[0]
        r = client.chat.completions.create(model="m3", messages=USER, tools=TOOLS, tool_choice=choice,
                                           temperature=0, seed=seed, extra_body=ctk)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
        assert getattr(c.message, "reasoning_content", None) is None
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
            [("get_weather", args)]
        assert r.usage.prompt_tokens == len(tok.encode(rendered + prefix))
        chunks = list(client.chat.completions.create(model="m3", messages=USER, tools=TOOLS, tool_choice=choice,
                                                     temperature=0, seed=seed, stream=True, extra_body=ctk))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == \
            [(0, "get_weather", args)]
        assert not "".join(d.content or "" for d in deltas) and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_content(client):
    r = client.chat.completions.create(model="m3", messages=USER, temperature=0, seed=7002)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "The user wants the weather."
    assert m.content == "It is sunny in Paris."
    chunks = list(client.chat.completions.create(model="m3", messages=USER, temperature=0, seed=7002, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        "The user wants the weather."
    assert "".join(d.content or "" for d in deltas) == "It is sunny in Paris."
    # chat_template_kwargs reach the server: with thinking enabled the template opens the think block and the
    # model's (greedy, unscripted) text is reasoning; without, the same model's text is content
    def greedy(**extra):
        r = client.chat.completions.create(model="m3", messages=USER, max_completion_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True, **extra})
        assert r.usage.completion_tokens == 6
        return r.choices[0].message
    thinking = greedy(chat_template_kwargs={"thinking_mode": "enabled"})
    plain = greedy()
    assert thinking.model_extra["reasoning_content"] and not thinking.content
    assert plain.content and not plain.model_extra["reasoning_content"]


def test_logprobs(client):
    r = client.chat.completions.create(model="m3", messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(x <= 0 for x in lps)
        assert e.logprob == pytest.approx(lps[0]) and e.token == e.top_logprobs[0].token  # greedy: the top one
    c = client.completions.create(model="m3", prompt="Hello there", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    # sampled (not greedy): the sampled token's own logprob, which need not be the top one
    s = client.completions.create(model="m3", prompt="Hello there", max_tokens=8, temperature=1.5, seed=5,
                                  logprobs=1, extra_body={"ignore_eos": True})
    lps = s.choices[0].logprobs
    assert any(v < max(top.values()) for v, top in zip(lps.token_logprobs, lps.top_logprobs))


def test_stop_strings_and_seeds(client):
    base = client.completions.create(model="m3", prompt="Once upon a time", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[8:11]
    cut = client.completions.create(model="m3", prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(stop)]

    def sample(seed):
        return client.chat.completions.create(model="m3", messages=USER, max_tokens=12, temperature=1.0, seed=seed,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
    a, b, c = sample(11), sample(11), sample(12)
    assert a == b and a != c


def _server_state(srv) -> tuple[float, bool]:
    """(requests the server counted as aborted, whether its KV pages are all free and nothing runs)."""
    v = metrics(srv.metrics_url)
    free, total = metric(v, "m3serve:kv_cache_free_pages"), metric(v, "m3serve:kv_cache_total_pages")
    aborted = metric(v, "vllm:request_success_total", finished_reason="abort") or 0
    return aborted, free is not None and free == total and not metric(v, "vllm:num_requests_running")


def test_cancel_by_closing_the_stream(client, gateway, m3_server):
    before, _ = _server_state(m3_server)
    tokens_before = metric(metrics(m3_server.metrics_url), "vllm:request_generation_tokens_sum") or 0
    stream = client.completions.create(model="m3", prompt="Count with me:", max_tokens=900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and _server_state(m3_server) != (before + 1, True):
        time.sleep(0.1)
    assert _server_state(m3_server) == (before + 1, True), "the request was not aborted or its pages not freed"
    v = metrics(m3_server.metrics_url)
    # stopped long before max_tokens (the count is the session's: this request's share of it)
    assert (metric(v, "vllm:request_generation_tokens_sum") or 0) - tokens_before < 800
    with urllib.request.urlopen(gateway.url + "/metrics") as f:
        text = f.read().decode()
    assert "m3serve_gateway_requests_in_flight 0.0" in text
    assert 'm3serve_gateway_time_to_first_token_seconds_count{endpoint="completions"}' in text

    # not streamed: the client gives up waiting and closes its connection
    host, port = gateway.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "m3", "prompt": "Count with me:", "max_tokens": 900,
                                                        "temperature": 0, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    time.sleep(1.0)
    conn.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and _server_state(m3_server) != (before + 2, True):
        time.sleep(0.1)
    assert _server_state(m3_server) == (before + 2, True), "the non-streamed request was not cancelled"


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 2}, "n"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),  # a named function that is not in tools
    ({"top_p": 3.0}, "top_p"),  # found by the server; its words carried through
    ({"extra_body": {"guided_json": {}}}, "guided_json"),  # an unknown field is refused, never ignored
])
def test_bad_requests_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m3", messages=USER, max_tokens=4, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert param in e.value.body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=USER, max_tokens=4)
    assert "gpt-4" in e.value.body["message"]


def test_api_key_capacity_and_not_ready(m3_server, tmp_path):
    keyed = start_gateway(m3_server.grpc_url, str(tmp_path / "keyed.log"), "--max-concurrent", "1",
                          env={"M3SERVE_OPENAI_API_KEY": "sekret"})
    dead = start_gateway("127.0.0.1:1", str(tmp_path / "dead.log"), wait_ready=False)
    try:
        url = keyed.url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=url, api_key="sekret", max_retries=0, timeout=120)
        assert ok.models.list().data[0].id == "m3"
        # one long stream holds the only slot: the next request is told 429
        stream = ok.completions.create(model="m3", prompt="Hi", max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError):
            ok.completions.create(model="m3", prompt="Hi", max_tokens=2)
        stream.close()

        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(dead.url + "/health")
        assert e.value.code == 503
        with pytest.raises(openai.InternalServerError) as e2:
            openai.OpenAI(base_url=dead.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model="m3", messages=USER, max_tokens=2)
        assert e2.value.status_code == 503
    finally:
        keyed.stop()
        dead.stop()


def _spawned_workers(pid: int) -> list[int]:
    """The worker processes uvicorn started under `pid` (multiprocessing's spawn; not its resource tracker)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(d))
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except OSError:
        return True


def test_workers_share_the_port_and_the_counts(m3_server, tmp_path):
    """--workers 2: two processes answer on one port, every request is served, /metrics counts the requests of
    both whichever worker answers it, and stopping the gateway stops its workers."""
    gw = start_gateway(m3_server.grpc_url, str(tmp_path / "workers.log"), "--workers", "2")
    try:
        workers = _spawned_workers(gw.proc.pid)
        assert len(workers) == 2, workers
        n = 6
        for i in range(n):  # a client (a connection) each: either worker may take it
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            r = c.completions.create(model="m3", prompt=f"Hello {i}", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
            c.close()
        for _ in range(4):  # a connection each: whichever worker answers counts both
            assert metric(metrics(gw.url + "/metrics"), "m3serve_gateway_requests_total", endpoint="completions",
                          status="200") == n
    finally:
        gw.stop()
    deadline = time.monotonic() + 15
    while not all(_gone(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p) for p in workers)


def _fuzz(url: str, operation, failures: list, examples: int) -> None:
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    @given(case=operation.as_strategy())
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if isinstance(case.body, dict):  # keep CPU time bounded: short generations
            case.body["max_tokens"] = 2
            case.body.pop("max_completion_tokens", None)
        response = case.call(base_url=url, timeout=60)
        if response.status_code >= 500:
            failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
        case.validate_response(response, checks=[not_a_server_error])

    run()


def test_schemathesis_no_server_errors(gateway, m3_server):
    """Generated requests over the gateway's OpenAPI schema: never a 5xx; the server stays ready."""
    import schemathesis

    schema = schemathesis.openapi.from_url(gateway.url + "/openapi.json")
    examples = int(os.environ.get("M3SERVE_SCHEMATHESIS_EXAMPLES", "100"))
    failures: list = []
    for op in schema.get_all_operations():
        operation = op.ok()
        try:
            _fuzz(gateway.url, operation, failures, examples)
        except Exception as e:  # noqa: BLE001 - reported below with the failing requests
            failures.append((operation.label, repr(e)[:800]))
    assert not failures, failures
    with urllib.request.urlopen(gateway.url + "/health") as f:
        assert f.status == 200
    assert m3_server.alive()
    with urllib.request.urlopen(gateway.url + "/metrics") as f:  # some generated requests were served
        served = [ln for ln in f.read().decode().splitlines()
                  if ln.startswith("m3serve_gateway_requests_total") and 'status="200"' in ln]
    assert sum(float(ln.split()[-1]) for ln in served) > 0
