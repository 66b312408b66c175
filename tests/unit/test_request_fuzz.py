"""Hostile requests, generated (hypothesis): an `m3` request's sampling_parameters JSON, request parameters, alias
tensors, and chats (messages, tools, chat_template_kwargs, assistant_prefix) go through the text contract
(backend/triton/text_contract.py) and the engine as tritonserver's model sends them. Each request either gets an
error naming something the client sent, or runs to its end: nothing raises out of the engine's step, the reply keeps
to max_tokens, and every KV page comes back. (Its first long run found a chat prompt near max_model_len refused for
a max_tokens the client never sent, the model's default: the engine now cuts a default to the prompt's room.)

M3SERVE_FUZZ_EXAMPLES (default 150) sets the examples per test; the run is derandomized, so CI is repeatable and a
larger count searches further."""
import collections
import dataclasses
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3serve.engine.sampling_params import InvalidRequest, SamplingParams
from m3serve.triton.contract import UNSUPPORTED_SAMPLING, Defaults
from m3serve.triton.schema import TEXT_ALIASES, RequestError
from m3serve.triton.text_contract import TextContract

EXAMPLES = int(os.environ.get("M3SERVE_FUZZ_EXAMPLES", "150"))
MAX_STEPS = 120  # a request the engine took ends well within this (max_model_len 512, short prompts)

EDGE_INTS = [0, 1, -1, 2, 3, 5, 8, 16, 40, 100, 511, 512, 2 ** 31 - 1, 2 ** 31, 2 ** 53 + 1, 2 ** 63, -(2 ** 63),
             10 ** 30]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.sampled_from(EDGE_INTS),
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2),
                    st.text(max_size=6), st.sampled_from(["0.7", "3", "-1", "1e9", "nan", "inf", "", " 2", "\x00"]))
HOSTILE = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=3), inner, max_size=2), max_leaves=6)
UNIT = st.floats(0, 1)
# per option, values a client means (so that many requests reach the engine, in every combination), as the JSON a
# client writes them (numbers, numeric strings)
PLAUSIBLE = {
    "n": st.just(1), "temperature": st.one_of(st.just(0), UNIT, st.floats(0, 3), st.just("0.7")),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 60), "min_p": UNIT, "seed": st.integers(0, 2 ** 64 - 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2.5), "max_tokens": st.one_of(st.integers(1, 40), st.just("8")),
    "min_tokens": st.integers(0, 24),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 499), max_size=4), "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(), "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "skip_special_tokens": st.booleans(),
}
KEYS = list(PLAUSIBLE) * 6 + list(UNSUPPORTED_SAMPLING) + ["max_tokenz", ""]  # mostly the options we serve
assert set(PLAUSIBLE) == {f.name for f in dataclasses.fields(SamplingParams)}


def _value(key: str):
    """Mostly what a client means for `key`, sometimes anything at all."""
    if key not in PLAUSIBLE:
        return HOSTILE
    return st.sampled_from(range(8)).flatmap(lambda i: PLAUSIBLE[key] if i else HOSTILE)  # hostile 1 in 8


OPTIONS = st.lists(st.sampled_from(KEYS), unique=True, max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: _value(k) for k in keys}))
ALIAS = st.sampled_from(sorted(TEXT_ALIASES))
ALIAS_VALUE = st.one_of(st.integers(-2 ** 31, 2 ** 31 - 1), st.sampled_from(EDGE_INTS[:13]),
                        st.floats(allow_nan=True, allow_infinity=True, width=32), st.booleans())
DTYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def _tensor(value, dtype) -> np.ndarray:
    with np.errstate(all="ignore"):
        try:
            return np.array([value]).astype(dtype)
        except (OverflowError, ValueError):
            return np.array([0], dtype=dtype)


def _sent(options: dict, params: dict, tensors: dict) -> set[str]:
    """Every name under which the client sent an option: key, `source.key`, tensor."""
    names = set(tensors)
    for source, d in (("sampling_parameters", options), ("parameters", params)):
        names |= {k for k in d} | {f"{source}.{k}" for k in d}
    return names


def _run(engine, request_id: str, req) -> tuple[list[int], str | None, list]:
    """Add the parsed request and step until it ends, or for MAX_STEPS steps and then abort it: (tokens, finish
    reason, outputs). InvalidRequest propagates."""
    engine.add_request(request_id, **req.engine_args())
    toks, reason, outs = [], None, []
    for _ in range(MAX_STEPS):
        for o in engine.step():
            assert o.request_id == request_id
            toks += o.new_token_ids
            outs.append(o)
            reason = o.finish_reason or reason
        if not engine.has_unfinished_requests():
            break
    else:
        engine.abort_request(request_id)
        while engine.has_unfinished_requests():  # a step queued ahead of the abort comes back
            engine.step()
        reason = "abort"
    return toks, reason, outs


def _ended(reason: str | None, toks: list[int], sp: SamplingParams) -> None:
    """A request ran to its end, unless it may run longer than MAX_STEPS (no max_tokens: max_model_len bounds it),
    when it was aborted; either way within max_tokens."""
    assert reason in ("stop", "length") or reason == "abort" and (sp.max_tokens or 512) > MAX_STEPS, (reason, sp)
    assert len(toks) <= (sp.max_tokens or 512), (len(toks), sp)


def _check(engine, options: dict, params: dict, tensors: dict, counter=iter(range(10 ** 9))) -> str:
    """One generated request: "refused" (the contract's error), "invalid" (the engine's) or "ran"."""
    contract = TextContract(Defaults())
    prompt = {} if "messages" in tensors else {"text_input": np.array([b"Hello there"], dtype=object)}
    all_tensors = {**prompt, **tensors}
    sent = _sent(options, params, tensors)
    try:
        (req,) = contract.parse({**all_tensors, "sampling_parameters": np.array([json.dumps(options).encode()],
                                                                              dtype=object)}, params)
    except RequestError as e:
        assert e.field in sent, f"error names {e.field!r}, not an option the client sent ({sorted(sent)}): {e}"
        return "refused"
    try:
        toks, reason, outs = _run(engine, f"fuzz-{next(counter)}", req)
    except InvalidRequest as e:
        named = contract.client_field(req, e.field)
        assert named in sent, f"error names {named!r}, not an option the client sent ({sorted(sent)}): {e}"
        assert not engine.has_unfinished_requests()
        return "invalid"
    sp = req.sampling
    _ended(reason, toks, sp)
    if sp.logprobs is not None:
        assert sum(len(o.logprobs or []) for o in outs) == len(toks), sp
    bm = engine.block_manager
    assert bm.num_free_pages == bm.num_pages, "a finished request kept KV pages"
    return "ran"


def _fuzz(strategies: dict, request) -> None:
    """Run `request(**drawn)` (a `_check`) over EXAMPLES draws; both the errors and the engine were reached (a
    strategy that only made refused requests would test nothing past the contract)."""
    seen = collections.Counter()

    @given(**strategies)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(**drawn):
        seen[request(**drawn)] += 1

    run()
    assert seen["ran"] >= EXAMPLES // 8 and seen["refused"] + seen["invalid"] >= EXAMPLES // 10, seen


def test_generated_sampling_parameters_get_a_named_error_or_run_to_their_end(engine):
    _fuzz({"options": OPTIONS}, lambda options: _check(engine, options, {}, {}))


def test_generated_options_from_every_source_get_a_named_error_or_run_to_their_end(engine):
    """The same through all three sources at once: request parameters < sampling_parameters < alias tensors (each
    in the dtype its config declares, which tritonserver enforces)."""
    def request(options, params, aliases):
        tensors = {name: _tensor(v, DTYPES[TEXT_ALIASES[name][1]]) for name, v in aliases.items()}
        return _check(engine, options, params, tensors)

    _fuzz({"options": OPTIONS, "params": OPTIONS, "aliases": st.dictionaries(ALIAS, ALIAS_VALUE, max_size=3)},
          request)


TEXT = st.text(max_size=12)
ROLE = st.one_of(st.sampled_from(["system", "developer", "user", "user", "assistant", "tool", "ai", ""]), TEXT)
CONTENT = st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                    "text": TEXT}), max_size=2), HOSTILE)
CALL = st.fixed_dictionaries({"function": st.fixed_dictionaries(
    {"name": st.one_of(TEXT, HOSTILE), "arguments": st.one_of(st.dictionaries(TEXT, HOSTILE, max_size=3), TEXT,
                                                             HOSTILE)})})
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": CONTENT}, optional={
    "tool_calls": st.one_of(st.lists(CALL, max_size=2), HOSTILE), "reasoning_content": st.one_of(TEXT, HOSTILE),
    "name": TEXT})
TOOL = st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT, "parameters": st.dictionaries(TEXT, HOSTILE, max_size=3)})}), HOSTILE)
KWARGS = st.dictionaries(st.sampled_from(["thinking_mode", "enable_thinking", "add_generation_prompt", "tokenize",
                                          "tools", "messages", "documents", "custom"]),
                         st.one_of(st.sampled_from(["enabled", "disabled", "adaptive"]), st.booleans(), HOSTILE),
                         max_size=3)


def _json_tensor(value) -> np.ndarray:
    return np.array([json.dumps(value).encode()], dtype=object)


def test_generated_chats_get_a_named_error_or_run_to_their_end(engine):
    """Chat requests: generated messages (any role, content, tool calls, reasoning), tools, chat_template_kwargs and
    assistant_prefix, rendered by the engine's chat template."""
    def request(messages, tools, kwargs, prefix, options):
        tensors = {"messages": _json_tensor(messages)}
        for name, value in (("tools", tools), ("chat_template_kwargs", kwargs)):
            if value is not None:
                tensors[name] = _json_tensor(value)
        if prefix is not None:
            tensors["assistant_prefix"] = np.array([prefix.encode("utf-8", "surrogatepass")], dtype=object)
        return _check(engine, options, {}, tensors)

    _fuzz({"messages": st.lists(MESSAGE, min_size=1, max_size=4),
           "tools": st.one_of(st.none(), st.lists(TOOL, max_size=2)), "kwargs": st.one_of(st.none(), KWARGS),
           "prefix": st.one_of(st.none(), TEXT),
           "options": st.fixed_dictionaries({}, optional={"max_tokens": st.integers(1, 12),
                                                          "temperature": st.just(0)})}, request)


INT32 = st.one_of(st.integers(-3, 600), st.sampled_from([v for v in EDGE_INTS if -2 ** 31 <= v < 2 ** 31]))
IDS_OPTIONAL = {  # the m3_ids inputs a client may add, each [batch, 1] in its declared dtype
    "input_lengths": INT32, "request_output_len": st.one_of(st.integers(-1, 24), INT32), "streaming": st.booleans(),
    "end_id": st.one_of(st.integers(-1, 520), INT32), "beam_width": st.sampled_from([1, 1, 2, 0]),
    "temperature": st.floats(width=32, allow_nan=True), "runtime_top_k": INT32,
    "runtime_top_p": st.floats(width=32, allow_nan=True), "repetition_penalty": st.floats(width=32),
    "min_length": st.integers(-1, 30), "random_seed": st.integers(0, 2 ** 64 - 1),
    "exclude_input_in_output": st.booleans(), "return_log_probs": st.booleans(),
}
IDS_DTYPES = {"streaming": np.bool_, "exclude_input_in_output": np.bool_, "return_log_probs": np.bool_,
              "temperature": np.float32, "runtime_top_p": np.float32, "repetition_penalty": np.float32,
              "random_seed": np.uint64}


def _word_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's word list of one item: [2, n] (the ids, then each word's end offset, -1 padded)."""
    flat, ends = [t for w in words for t in w], list(np.cumsum([len(w) for w in words]))
    n = max(len(flat), len(ends), 1)
    return np.array([flat + [0] * (n - len(flat)), ends + [-1] * (n - len(ends))], dtype=np.int32)


def test_generated_token_id_batches_get_a_named_error_or_run_to_their_end(engine):
    """`m3_ids` (the TensorRT-LLM contract): generated batches of 1-3 rows of ids (some outside the vocabulary), each
    optional input per row, stop words as word lists; each item runs (or fails) on its own, an error naming tensors
    the client sent."""
    from m3serve.triton.ids_contract import IdsContract

    def request(rows, length, options, stop_words):
        contract = IdsContract(Defaults())
        tensors = {"input_ids": np.array([r[:length] + [7] * (length - len(r[:length])) for r in rows], np.int32)}
        for name, values in options.items():
            tensors[name] = np.stack([_tensor(v, IDS_DTYPES.get(name, np.int32)) for v in values[:len(rows)]
                                      + values[:1] * (len(rows) - len(values))])
        if stop_words is not None:
            tensors["stop_words_list"] = np.stack([_word_list(stop_words)] * len(rows))
        try:
            reqs = contract.parse(tensors, None)
        except RequestError as e:
            assert e.field in tensors, f"error names {e.field!r}, not a tensor the client sent ({sorted(tensors)}): {e}"
            return "refused"
        outcome = "ran"
        for req in reqs:
            try:
                toks, reason, _ = _run(engine, f"ids-{id(req)}", req)
            except InvalidRequest as e:
                named = contract.client_field(req, e.field)  # "end_id, stop_words_list": both made stop_token_ids
                assert set(named.split(", ")) <= set(tensors), f"error names {named!r}, not what the client sent: {e}"
                assert not engine.has_unfinished_requests()
                outcome = "invalid"
                continue
            _ended(reason, toks, req.sampling)
            assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
        return outcome

    row = st.lists(st.sampled_from(range(8)).flatmap(lambda i: st.integers(-2, 1000) if i == 0 else
                                                     st.integers(0, 499)), min_size=1, max_size=12)
    _fuzz({"rows": st.lists(row, min_size=1, max_size=3), "length": st.integers(1, 12),
           "options": st.lists(st.sampled_from(sorted(IDS_OPTIONAL)), unique=True, max_size=4).flatmap(
               lambda names: st.fixed_dictionaries({n: st.lists(IDS_OPTIONAL[n], min_size=1, max_size=3)
                                                    for n in names})),
           "stop_words": st.one_of(st.none(), st.lists(st.lists(st.integers(-1, 520), min_size=1, max_size=3),
                                                       max_size=3))}, request)
