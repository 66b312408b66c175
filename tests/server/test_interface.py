"""The Triton layer's pure parts (no server): the contracts' parsing, engine errors renamed to the client's
names, the ensemble steps' checks, response building, responder logic."""
from __future__ import annotations

import json
import time
import types

import numpy as np
import pytest

from m3serve.engine.outputs import RequestOutput
from m3serve.engine.sampling_params import InvalidRequest
from m3serve.triton.contract import Defaults
from m3serve.triton.ensemble_steps import Postprocessing, Preprocessing
from m3serve.engine.sampling_params import TextOptions
from m3serve.triton.ids_contract import IdsContract, IdsStream, parse_word_list, to_word_list
from m3serve.triton.responder import DELTAS_PER_ROUND, Group, Item, Responder
from m3serve.triton.schema import INVALID_ARG, RequestError
from m3serve.triton.text_contract import TextContract, TextStream


def s(v):
    return np.array([v.encode() if isinstance(v, str) else v], dtype=np.object_)


def b(v):
    return np.array([v], dtype=bool)


def out(ids, text="", finished=False, reason=None, n_prompt=3, reasoning="", prompt_ids=(), prompt_text=None,
        mid_character=False):
    return RequestOutput("r", list(ids), text=text, reasoning_text=reasoning, finished=finished,
                         finish_reason=reason, num_prompt_tokens=n_prompt, cumulative_logprob=-1.5,
                         prompt_token_ids=list(prompt_ids), prompt_text=prompt_text, mid_character=mid_character)


def text(tensors, params="", defaults=None):
    return TextContract(defaults or Defaults()).parse(tensors, params)[0]


def ids(tensors, params="", defaults=None, request_id=""):
    return IdsContract(defaults or Defaults()).parse(tensors, params, request_id)


def test_precedence_tensor_over_json_over_parameters_over_default():
    d = Defaults(max_tokens=7)
    r = text({"text_input": s("hi")}, "{}", d)
    assert r.sampling.max_tokens == 7 and r.prepend_input and not r.stream
    r = text({"text_input": s("hi")}, json.dumps({"max_tokens": 9, "triton_x": 1}), d)
    assert r.sampling.max_tokens == 9 and r.sources["max_tokens"] == "parameters"
    r = text({"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": "11"}')},
             json.dumps({"max_tokens": 9}), d)
    assert r.sampling.max_tokens == 11
    r = text({"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": 11}'),
              "max_tokens": np.array([13], np.int32), "min_length": np.array([2], np.int32)}, "", d)
    assert r.sampling.max_tokens == 13 and r.sampling.min_tokens == 2


@pytest.mark.parametrize("tensors,field", [
    ({"text_input": s(b"\xff")}, "text_input"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"bogus": 1}')}, "sampling_parameters.bogus"),
    ({"text_input": s("hi"), "max_tokens": np.array([-1], np.int32)}, "max_tokens"),
    ({"text_input": s("hi"), "stream": b(True), "exclude_input_in_output": b(False)}, "exclude_input_in_output"),
    ({"stream": b(True)}, "text_input"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"seed": 18446744073709551616}')}, "sampling_parameters.seed"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"top_k": 9223372036854775808}')},
     "sampling_parameters.top_k"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"stop": [null]}')}, "sampling_parameters.stop"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"stop": {"a": 1}}')}, "sampling_parameters.stop"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"stop_token_ids": [1.5]}')},
     "sampling_parameters.stop_token_ids"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": 4294967296}')}, "sampling_parameters.max_tokens"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"min_tokens": -1}')}, "sampling_parameters.min_tokens"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"logprobs": true}')}, "sampling_parameters.logprobs"),
    ({"text_input": s("hi"), "top_k": np.array([-7], np.int32)}, "top_k"),
])
def test_bad_text_requests_name_the_field(tensors, field):
    with pytest.raises(RequestError) as e:
        text(tensors)
    assert e.value.field == field and e.value.code == INVALID_ARG


def test_seeds_are_exact_by_json_and_by_tensor():
    for seed in (2**62, 2**62 + 1, 2**64 - 1):
        assert text({"text_input": s("hi"), "sampling_parameters": s(json.dumps({"seed": seed}))}).sampling.seed == seed
        assert text({"text_input": s("hi"), "seed": np.array([seed], np.uint64)}).sampling.seed == seed
        assert text({"text_input": s("hi"), "sampling_parameters": s(json.dumps({"seed": str(seed)}))}).sampling.seed \
            == seed
    r = ids({"input_ids": np.array([[1, 2]], np.int32), "random_seed": np.array([[2**64 - 1]], np.uint64)})[0]
    assert r.sampling.seed == 2**64 - 1


def test_engine_errors_come_back_under_the_clients_names():
    """The engine's range checks (max_tokens against max_model_len, prompt ids) renamed to what was sent."""
    tc, ic = TextContract(Defaults()), IdsContract(Defaults())
    err = InvalidRequest("max_tokens", "3 prompt tokens + max_tokens=2000 exceed max_model_len=1024")
    cases = [
        (tc, text({"text_input": s("hi"), "max_tokens": np.array([2000], np.int32)}), "max_tokens"),
        (tc, text({"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": 2000}')}),
         "sampling_parameters.max_tokens"),
        (tc, text({"text_input": s("hi")}, json.dumps({"max_tokens": 2000})), "parameters.max_tokens"),
        (ic, ids({"input_ids": np.array([[1]], np.int32), "request_output_len": np.array([[2000]], np.int32)})[0],
         "request_output_len"),
    ]
    for contract, req, want in cases:
        e = contract.client_error(req, err)
        assert e.field == want and str(e) == f"{want}: {err.message}"
    prompt_err = InvalidRequest("prompt", "2000 prompt tokens leave no room")
    assert tc.client_error(text({"text_input": s("hi")}), prompt_err).field == "text_input"
    chat = text({"messages": s('[{"role": "user", "content": "x"}]')})
    assert tc.client_error(chat, prompt_err).field == "messages"
    bad_id = InvalidRequest("prompt_token_ids", "token id 99999 is not in [0, 512)")
    assert ic.client_error(ids({"input_ids": np.array([[1, 99999]], np.int32)})[0], bad_id).field == "input_ids"
    end = ids({"input_ids": np.array([[1]], np.int32), "end_id": np.array([[70000]], np.int32)})[0]
    assert ic.client_error(end, InvalidRequest("stop_token_ids", "token id 70000 ...")).field == "end_id"


def test_a_max_tokens_the_client_did_not_send_is_marked_the_models_default():
    """The engine cuts the model's default max_tokens to the prompt's room (TextOptions.default_max_tokens), never
    one the client sent: by tensor, JSON, request parameter or request_output_len."""
    d = Defaults(max_tokens=64)

    def marked(req):
        return req.text_options is not None and req.text_options.default_max_tokens

    one = {"input_ids": np.array([[1]], np.int32)}
    for req in (text({"text_input": s("hi")}, "", d), ids(one, "", d)[0]):
        assert req.sampling.max_tokens == 64 and marked(req)
    for req in (text({"text_input": s("hi"), "max_tokens": np.array([64], np.int32)}, "", d),
                text({"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": 64}')}, "", d),
                text({"text_input": s("hi")}, json.dumps({"max_tokens": 64}), d),
                ids({**one, "request_output_len": np.array([[64]], np.int32)}, "", d)[0],
                ids(one, json.dumps({"max_tokens": 64}), d)[0]):
        assert req.sampling.max_tokens == 64 and not marked(req)
    word = ids({**one, "stop_words_list": np.array([[[5, 6], [2, -1]]], np.int32),
                "request_output_len": np.array([[8]], np.int32)}, "", d)[0]
    assert word.text_options.stop_words == ((5, 6),) and not marked(word)


def test_request_chat_templates_need_the_models_trust():
    ins = {"messages": s('[{"role": "user", "content": "x"}]'),
           "chat_template_kwargs": s(json.dumps({"chat_template": "{{ 'pwned' }}"}))}
    with pytest.raises(RequestError) as e:
        text(ins)
    assert e.value.field == "chat_template_kwargs.chat_template" and "trust_request_chat_template" in str(e.value)
    r = text(ins, defaults=Defaults(trust_request_chat_template=True))
    assert r.chat_template_kwargs == {"chat_template": "{{ 'pwned' }}"}
    # tools travel to the engine's renderer in chat_template_kwargs; not twice
    r = text({"messages": ins["messages"], "tools": s('[{"type": "function"}]'),
              "chat_template_kwargs": s('{"thinking_mode": "enabled"}')})
    assert r.chat_template_kwargs == {"thinking_mode": "enabled", "tools": [{"type": "function"}]}
    assert r.engine_args()["prompt"] == [{"role": "user", "content": "x"}]
    with pytest.raises(RequestError) as e:
        text({"messages": ins["messages"], "tools": s("[]"), "chat_template_kwargs": s('{"tools": []}')})
    assert e.value.field == "tools"
    # so does the assistant prefix (the reply's start, rendered after the generation prompt): with messages only
    r = text({"messages": ins["messages"], "assistant_prefix": s("</mm:think>")})
    assert r.chat_template_kwargs == {"assistant_prefix": "</mm:think>"}
    for bad in ({"text_input": s("hi"), "assistant_prefix": s("x")},
                {"messages": ins["messages"], "assistant_prefix": s("x"),
                 "chat_template_kwargs": s('{"assistant_prefix": "y"}')}):
        with pytest.raises(RequestError) as e:
            text(bad)
        assert e.value.field == "assistant_prefix"


def test_text_stream_deltas_and_final():
    req = text({"text_input": s("hi"), "stream": b(True), "return_finish_reason": b(True),
                "return_num_output_tokens": b(True)})
    ts = TextStream(req)
    ts.add(out([5], ""))  # a held-back token: nothing to send yet
    assert ts.take(False) is None
    ts.add(out([6], "ab"))
    t = ts.take(False)
    assert t["text_output"].tolist() == [b"ab"] and t["num_output_tokens"].tolist() == [2]
    assert t["finish_reason"].tolist() == [b"None"]
    ts.add(out([7], "c", finished=True, reason="length"))
    t = ts.take(True)
    assert t["text_output"].tolist() == [b"c"] and t["finish_reason"].tolist() == [b"length"]
    assert t["num_output_tokens"].tolist() == [1]


def test_returns_on_final_only_leave_the_deltas_their_text():
    """`returns_on_final_only` (the OpenAI gateway's requests): a streamed delta carries its text (and the per-token
    outputs asked for), the final response the whole request's finish reason and counts, num_output_tokens as the
    total; without the input every response carries every output asked for (the vLLM backend's contract)."""
    asked = {"text_input": s("hi"), "stream": b(True), "return_finish_reason": b(True), "return_logprobs": b(True),
             "return_num_input_tokens": b(True), "return_num_output_tokens": b(True),
             "return_cumulative_logprob": b(True)}
    req = text({**asked, "returns_on_final_only": b(True)})
    assert req.returns_on_final_only
    ts = TextStream(req)
    ts.add(out([6, 8], "ab"))
    t = ts.take(False)
    assert sorted(t) == ["logprobs", "text_output"] and t["text_output"].tolist() == [b"ab"]
    ts.add(out([9], "c"))
    assert ts.take(False)["text_output"].tolist() == [b"c"]
    ts.add(out([7], "d", finished=True, reason="stop", n_prompt=5))
    t = ts.take(True)
    assert t["text_output"].tolist() == [b"d"] and t["finish_reason"].tolist() == [b"stop"]
    assert t["num_output_tokens"].tolist() == [4] and t["num_input_tokens"].tolist() == [5]
    assert t["cumulative_logprob"].tolist() == [-1.5]
    every = TextStream(text(asked))
    every.add(out([6, 8], "ab"))
    assert set(every.take(False)) == {"text_output", "logprobs", "finish_reason", "num_input_tokens",
                                      "num_output_tokens", "cumulative_logprob"}
    assert not text({**asked, "stream": b(False), "returns_on_final_only": b(True)}).returns_on_final_only


def test_logprob_entries_put_the_sampled_token_first():
    """A sampled token outside the top-n (or below the top) comes first, with its own logprob and rank, so a
    client (the OpenAI gateway) can tell it from the top-n; the others follow by rank. Each token's text is the
    engine's (the request asks for it: TextOptions.logprob_tokens)."""
    req = text({"text_input": s("hi"), "stream": b(True), "return_logprobs": b(True),
                "sampling_parameters": s('{"logprobs": 2}')})
    assert req.engine_args()["text_options"] == TextOptions(logprob_tokens=True, default_max_tokens=True)
    ts = TextStream(req)
    o = out([9, 4], "xy")
    o.logprobs = [{9: -3.0, 1: -0.5, 2: -1.0}, {4: -0.2, 3: -0.9}]
    o.logprob_tokens = [{t: f"<{t}>" for t in e} for e in o.logprobs]
    ts.add(o)
    entries = json.loads(ts.take(False)["logprobs"].reshape(-1)[0])
    assert [list(e) for e in entries] == [["9", "1", "2"], ["4", "3"]]
    assert entries[0]["9"] == {"logprob": -3.0, "rank": 3, "decoded_token": "<9>"}
    assert entries[0]["1"]["rank"] == 1 and entries[1]["4"]["rank"] == 1


def test_non_stream_prepends_prompt():
    req = text({"text_input": s("hi ")})
    ts = TextStream(req)
    ts.add(out([1], "a"))
    assert ts.take(False) is None
    ts.add(out([2], "b", finished=True, reason="stop"))
    assert ts.take(True)["text_output"].tolist() == [b"hi ab"]
    assert not req.text_options.prompt_text  # the prompt is the client's text: nothing to decode
    # a chat prompt is rendered by the engine: the echo is its prompt ids, decoded by the engine on request
    req = text({"messages": s('[{"role": "user", "content": "x"}]'), "exclude_input_in_output": b(False)})
    assert req.engine_args()["text_options"] == TextOptions(prompt_text=True, default_max_tokens=True)
    ts = TextStream(req)
    ts.add(out([1], "a", prompt_ids=[4, 5], prompt_text="<4><5>"))
    ts.add(out([2], "b", finished=True, reason="stop"))
    assert ts.take(True)["text_output"].tolist() == [b"<4><5>ab"]
    assert not text({"messages": s('[{"role": "user", "content": "x"}]')}).text_options.prompt_text  # no echo asked


def test_ids_stream_holds_split_utf8_and_tags_batch_index():
    """Tokens the engine's detokenizer says end inside a UTF-8 character wait for the one that completes it."""
    req = ids({"input_ids": np.array([[1, 2, 3]], np.int32), "streaming": np.array([[True]])})[0]
    st = IdsContract(Defaults()).stream(req)
    st.add(out([10], mid_character=True))
    assert st.take(False) is None
    st.add(out([11], mid_character=True))
    assert st.take(False) is None
    st.add(out([12]))
    t = st.take(False)
    assert t["output_ids"].tolist() == [[[10, 11, 12]]] and t["batch_index"].tolist() == [[0]]
    st.add(out([13], mid_character=True, finished=True, reason="length"))
    assert st.take(True)["output_ids"].tolist() == [[[13]]]  # the final response holds nothing back
    st = IdsContract(Defaults(utf8_stream_boundaries=False)).stream(req)
    st.add(out([10], mid_character=True))
    assert st.take(False)["output_ids"].tolist() == [[[10]]]


def test_ids_stop_words_of_several_tokens_go_to_the_engine():
    """One-token words are stop token ids; longer ones travel as ids, for the engine to decode (this process holds
    no tokenizer), and its errors about them name stop_words_list."""
    words = to_word_list([[[7], [5, 6], [8, 9, 10]]])
    r = ids({"input_ids": np.array([[1, 2]], np.int32), "stop_words_list": words})[0]
    assert r.sampling.stop_token_ids == [7] and r.sampling.stop == []
    assert r.engine_args()["text_options"] == TextOptions(stop_words=((5, 6), (8, 9, 10)), default_max_tokens=True)
    ic = IdsContract(Defaults())
    for field in ("stop_words", "stop"):
        assert ic.client_error(r, InvalidRequest(field, "x")).field == "stop_words_list"
    assert ids({"input_ids": np.array([[1, 2]], np.int32)})[0].text_options.stop_words == ()


def test_word_lists_round_trip():
    arr = to_word_list([[[1, 2], [3]], []])
    assert arr.shape == (2, 2, 3)
    assert parse_word_list(arr[0], "x") == [[1, 2], [3]] and parse_word_list(arr[1], "x") == []


def test_ids_stop_request_and_end_id():
    from m3serve.triton.contract import StopRequest
    assert isinstance(ids({"stop": np.array([[True]])}, request_id="abc"), StopRequest)
    r = ids({"input_ids": np.array([[1, 2]], np.int32), "end_id": np.array([[7]], np.int32)})[0]
    assert r.sampling.stop_token_ids == [7] and r.sampling.ignore_eos and r.sampling.greedy


class FakeTokenizer:
    vocab_size = 100
    eos_token_id = 2
    pad_token_id = None

    def encode(self, text):
        return [ord(c) % 100 for c in text]

    def decode(self, ids_, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids_)


def test_postprocessing_checks_ids_inside_the_length_only():
    post = Postprocessing(FakeTokenizer())
    tok = np.array([[[1, 2, -1, -1]]], np.int32)  # TensorRT-LLM pads past sequence_length with -1
    got = post({"TOKENS_BATCH": tok, "SEQUENCE_LENGTH": np.array([[2]], np.int32)})
    assert got["OUTPUT"].tolist() == [[b"BC"]]
    with pytest.raises(RequestError) as e:
        post({"TOKENS_BATCH": np.array([[[1, -5]]], np.int32), "SEQUENCE_LENGTH": np.array([[2]], np.int32)})
    assert e.value.field == "TOKENS_BATCH" and "-5" in str(e.value) and "[0, 0, 1]" in str(e.value)
    with pytest.raises(RequestError) as e:
        post({"TOKENS_BATCH": np.array([[[1, 100]]], np.int32)})
    assert e.value.field == "TOKENS_BATCH"
    with pytest.raises(RequestError) as e:
        post({"TOKENS_BATCH": tok, "SEQUENCE_LENGTH": np.array([[2], [2]], np.int32)})
    assert e.value.field == "SEQUENCE_LENGTH"


def test_preprocessing_names_its_own_tensors_and_the_ensemble_inputs():
    """A direct caller finds preprocessing's tensor, an ensemble caller the ensemble's input, in one message."""
    pre = Preprocessing(FakeTokenizer(), default_max_tokens=16, max_model_len=32)
    got = pre({"QUERY": s("hello").reshape(1, 1), "REQUEST_OUTPUT_LEN": np.array([[8]], np.int32)})
    assert got["INPUT_ID"].shape == (1, 5) and got["REQUEST_OUTPUT_LEN"].tolist() == [[8]]
    assert got["OUT_END_ID"].tolist() == [[2]]
    for n, word in ((0, "must be in"), (-3, "must be in"), (28, "exceed max_model_len")):
        with pytest.raises(RequestError) as e:
            pre({"QUERY": s("hello").reshape(1, 1), "REQUEST_OUTPUT_LEN": np.array([[n]], np.int32)})
        assert str(e.value).startswith("REQUEST_OUTPUT_LEN (ensemble: max_tokens): ") and word in str(e.value)
    with pytest.raises(RequestError) as e:
        pre({"QUERY": s("x" * 40).reshape(1, 1)})
    assert str(e.value).startswith("QUERY (ensemble: text_input): prompt of ")
    with pytest.raises(RequestError, match="^QUERY: is required$"):  # only a direct caller can omit it
        pre({"REQUEST_OUTPUT_LEN": np.array([[8]], np.int32)})
    with pytest.raises(RequestError, match=r"^END_ID \(ensemble: end_id\): batch dimension"):
        pre({"QUERY": s("hello").reshape(1, 1), "END_ID": np.array([[1], [2]], np.int32)})


# ---- responder, with a fake pb_utils ---------------------------------------------------------------
class FakeSender:
    def __init__(self, broken=False):
        self.sent, self.cancelled, self.broken = [], False, broken

    def send(self, response=None, flags=0):
        if self.broken and not flags:
            raise RuntimeError("the client is gone")
        if self.sent and self.sent[-1][1]:
            raise RuntimeError("Response sender has been closed")
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


def fake_pb():
    class TritonError:
        INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL, UNSUPPORTED, NOT_FOUND, UNKNOWN = range(7)

        def __init__(self, message, code=3):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors = {t.name: t.value for t in output_tensors}
            self.error = error

    class Tensor:
        def __init__(self, name, value):
            self.name, self.value = name, value
    return types.SimpleNamespace(TritonError=TritonError, InferenceResponse=InferenceResponse, Tensor=Tensor,
                                 TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)


class RecordingMetrics:
    enabled = False

    def __init__(self):
        self.done = []

    def request_done(self, e2e, n_prompt, n_gen, reason):
        self.done.append(reason)

    def __getattr__(self, name):
        return lambda *a, **k: None


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert cond()


def test_responder_coalesces_sends_one_final_and_handles_cancel():
    aborted = []
    metrics = RecordingMetrics()
    r = Responder(fake_pb(), metrics, abort=aborted.append, cancel_period=0.01)
    r.start()
    try:
        req = text({"text_input": s("x"), "stream": b(True)})
        sender = FakeSender()
        g = Group(sender)
        item = Item("a", g, TextStream(req))
        r.register(g)
        for i in range(5):
            r.output(item, out([i], str(i)))
        r.output(item, out([9], "z", finished=True, reason="stop"))
        r.end(item)
        wait_for(lambda: sender.sent and sender.sent[-1][1] == 1)
        got = "".join(resp.tensors["text_output"][0].decode() for resp, _ in sender.sent)
        assert got == "01234z" and [f for _, f in sender.sent].count(1) == 1
        # cancellation: polled, aborts the engine request, one CANCELLED final
        sender2 = FakeSender()
        g2 = Group(sender2)
        item2 = Item("b", g2, TextStream(req))
        r.register(g2)
        r.output(item2, out([1], "a"))
        wait_for(lambda: sender2.sent)
        sender2.cancelled = True
        wait_for(lambda: sender2.sent[-1][1] == 1)
        assert aborted == ["b"] and sender2.sent[-1][0].error.message == "Request was cancelled"
        r.output(item2, out([2], "b", finished=True, reason="abort"))  # late output: dropped
        time.sleep(0.05)
        assert [f for _, f in sender2.sent].count(1) == 1
        # a dropped connection (a delta cannot be sent): aborted in the engine and counted as "abort"
        item3 = Item("c", Group(FakeSender(broken=True)), TextStream(req))
        r.register(item3.group)
        r.output(item3, out([1], "a"))
        wait_for(lambda: "c" in aborted)
        wait_for(lambda: metrics.done == ["stop", "abort", "abort"])
    finally:
        r.stop()
    assert not r.alive


class SlowSender(FakeSender):
    """A send that takes 10 ms (a round trip to the server process, slowed down), logging its stream's name."""

    def __init__(self, name, order):
        super().__init__()
        self.name = name
        self.order = order

    def send(self, response=None, flags=0):
        self.order.append(self.name)
        time.sleep(0.01)
        super().send(response, flags)


def busy_sweep(last, primed: bool) -> list[str]:
    """The order of the sends (stream names) of a busy sweep: 20 slow streams each with a delta waiting (`primed`:
    each past its first token, sent before), and the output `last` of a 21st stream once the sweep's first send
    has begun."""
    order = []
    r = Responder(fake_pb(), RecordingMetrics(), abort=lambda rid: None)
    r.start()
    try:
        req = text({"text_input": s("x"), "stream": b(True)})
        items = []
        for i in range(21):
            g = Group(SlowSender(f"s{i}", order))
            items.append(Item(f"r{i}", g, TextStream(req)))
            r.register(g)
        if primed:
            for item in items[:20]:
                r.output(item, out([1], "a"))
            wait_for(lambda: len(order) >= 20, timeout=10)
            order.clear()
        for item in items[:20]:
            r.output(item, out([2], "b"))
        wait_for(lambda: order)
        r.output(items[20], last)
        wait_for(lambda: len(order) >= 21, timeout=10)
        sent = order[:21]  # (the stop below fails the 20 open streams: more sends)
    finally:
        r.stop()
    assert sorted(sent) == sorted(f"s{i}" for i in range(21))
    return sent


def test_responder_sends_a_final_between_deltas_of_a_busy_sweep():
    """Sends are slow round trips: with 20 streams waiting for a delta, a final that arrives meanwhile goes out
    after at most DELTAS_PER_ROUND of them (its client can send its next request), not after the whole sweep."""
    sent = busy_sweep(out([3], "c", finished=True, reason="stop"), primed=False)
    assert sent.index("s20") <= DELTAS_PER_ROUND + 1, sent


def test_responder_sends_first_tokens_before_other_streams_deltas():
    """A stream's first token is its TTFT: with 20 streams past their first token each waiting for a delta, a new
    stream's first token goes out in the next round, ahead of them, not at the end of the sweep."""
    sent = busy_sweep(out([3], "c"), primed=True)
    assert sent.index("s20") <= DELTAS_PER_ROUND, sent
