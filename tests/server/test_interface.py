"""The Triton layer's pure parts (no server): request parsing, response building, responder logic."""
from __future__ import annotations

import json
import time
import types

import numpy as np
import pytest

from m3serve.engine.outputs import RequestOutput
from m3serve.triton import interface as I
from m3serve.triton.responder import Group, Item, Responder


def s(v):
    return np.array([v.encode() if isinstance(v, str) else v], dtype=np.object_)


def b(v):
    return np.array([v], dtype=bool)


def out(ids, text="", finished=False, reason=None, n_prompt=3, reasoning=""):
    return RequestOutput("r", list(ids), text=text, reasoning_text=reasoning, finished=finished,
                         finish_reason=reason, num_prompt_tokens=n_prompt, cumulative_logprob=-1.5)


def test_precedence_tensor_over_json_over_parameters_over_default():
    d = I.Defaults(max_tokens=7, max_model_len=100)
    r = I.parse_text_request({"text_input": s("hi")}, "{}", d)
    assert r.sampling.max_tokens == 7 and r.prepend_input and not r.stream
    r = I.parse_text_request({"text_input": s("hi")}, json.dumps({"max_tokens": 9, "triton_x": 1}), d)
    assert r.sampling.max_tokens == 9
    r = I.parse_text_request({"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": "11"}')},
                             json.dumps({"max_tokens": 9}), d)
    assert r.sampling.max_tokens == 11
    r = I.parse_text_request({"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": 11}'),
                              "max_tokens": np.array([13], np.int32), "min_length": np.array([2], np.int32)}, "", d)
    assert r.sampling.max_tokens == 13 and r.sampling.min_tokens == 2


@pytest.mark.parametrize("tensors,field", [
    ({"text_input": s(b"\xff")}, "text_input"),
    ({"text_input": s("hi"), "sampling_parameters": s('{"bogus": 1}')}, "sampling_parameters.bogus"),
    ({"text_input": s("hi"), "max_tokens": np.array([-1], np.int32)}, "max_tokens"),
    ({"text_input": s("hi"), "stream": b(True), "exclude_input_in_output": b(False)}, "exclude_input_in_output"),
    ({"stream": b(True)}, "text_input"),
])
def test_bad_text_requests_name_the_field(tensors, field):
    with pytest.raises(I.RequestError) as e:
        I.parse_text_request(tensors, "", I.Defaults())
    assert e.value.field == field and e.value.code == I.INVALID_ARG


def test_text_stream_deltas_and_final():
    req = I.parse_text_request({"text_input": s("hi"), "stream": b(True), "return_finish_reason": b(True),
                                "return_num_output_tokens": b(True)}, "", I.Defaults())
    ts = I.TextStream(req)
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


def test_non_stream_prepends_prompt():
    req = I.parse_text_request({"text_input": s("hi ")}, "", I.Defaults())
    ts = I.TextStream(req)
    ts.add(out([1], "a"))
    assert ts.take(False) is None
    ts.add(out([2], "b", finished=True, reason="stop"))
    assert ts.take(True)["text_output"].tolist() == [b"hi ab"]


def test_ids_stream_holds_split_utf8_and_tags_batch_index():
    req = I.parse_ids_request({"input_ids": np.array([[1, 2, 3]], np.int32),
                               "streaming": np.array([[True]])}, "", I.Defaults())[0]
    table = {10: b"\xe4", 11: b"\xbd", 12: b"\xa0", 13: b"!"}

    def decode(ids):
        return b"".join(table[i] for i in ids).decode("utf-8", "replace")
    st = I.IdsStream(req, I.utf8_incomplete(decode))
    st.add(out([10]))
    assert st.take(False) is None
    st.add(out([11]))
    assert st.take(False) is None
    st.add(out([12]))
    t = st.take(False)
    assert t["output_ids"].tolist() == [[[10, 11, 12]]] and t["batch_index"].tolist() == [[0]]
    st.add(out([13], finished=True, reason="length"))
    assert st.take(True)["output_ids"].tolist() == [[[13]]]


def test_word_lists_round_trip():
    arr = I.to_word_list([[[1, 2], [3]], []])
    assert arr.shape == (2, 2, 3)
    assert I.parse_word_list(arr[0], "x") == [[1, 2], [3]] and I.parse_word_list(arr[1], "x") == []


def test_ids_stop_request_and_end_id():
    assert isinstance(I.parse_ids_request({"stop": np.array([[True]])}, "", I.Defaults(), "abc"), I.StopRequest)
    r = I.parse_ids_request({"input_ids": np.array([[1, 2]], np.int32), "end_id": np.array([[7]], np.int32)},
                            "", I.Defaults())[0]
    assert r.sampling.stop_token_ids == [7] and r.sampling.ignore_eos and r.sampling.greedy


# ---- responder, with a fake pb_utils ---------------------------------------------------------------
class FakeSender:
    def __init__(self):
        self.sent, self.cancelled = [], False

    def send(self, response=None, flags=0):
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


class NoMetrics:
    enabled = False

    def __getattr__(self, name):
        return lambda *a, **k: None


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert cond()


def test_responder_coalesces_sends_one_final_and_handles_cancel():
    aborted = []
    r = Responder(fake_pb(), NoMetrics(), abort=aborted.append, cancel_period=0.01)
    r.start()
    try:
        req = I.parse_text_request({"text_input": s("x"), "stream": b(True)}, "", I.Defaults())
        sender = FakeSender()
        g = Group(sender)
        item = Item("a", g, I.TextStream(req))
        r.register(g)
        for i in range(5):
            r.output(item, out([i], str(i)))
        r.output(item, out([9], "z", finished=True, reason="stop"))
        r.end(item)
        wait_for(lambda: sender.sent and sender.sent[-1][1] == 1)
        text = "".join(resp.tensors["text_output"][0].decode() for resp, _ in sender.sent)
        assert text == "01234z" and [f for _, f in sender.sent].count(1) == 1
        # cancellation: polled, aborts the engine request, one CANCELLED final
        sender2 = FakeSender()
        g2 = Group(sender2)
        item2 = Item("b", g2, I.TextStream(req))
        r.register(g2)
        r.output(item2, out([1], "a"))
        wait_for(lambda: sender2.sent)
        sender2.cancelled = True
        wait_for(lambda: sender2.sent[-1][1] == 1)
        assert aborted == ["b"] and sender2.sent[-1][0].error.message == "Request was cancelled"
        r.output(item2, out([2], "b", finished=True, reason="abort"))  # late output: dropped
        time.sleep(0.05)
        assert [f for _, f in sender2.sent].count(1) == 1
    finally:
        r.stop()
    assert not r.alive
