"""Output processing: streamed text, stop strings across token boundaries, stop token ids, min_tokens,
ignore_eos, the reasoning parser, aborts (waiting, mid-prefill, mid-decode) and the LLM wrapper."""
import pytest

from m3serve.engine.sampling_params import InvalidRequest, SamplingParams, TextOptions

PROMPT = "def add(a, b):"


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def run_one(eng, eu, sp, prompt=PROMPT, **kw):
    eng.add_request("x", prompt=prompt, sampling_params=sp, **kw)
    toks, reason, outs = eu.run_to_completion(eng)["x"]
    return toks, reason, outs


@pytest.fixture
def base_output(make_engine, eu):
    toks, reason, outs = run_one(make_engine(), eu, greedy(30, ignore_eos=True))
    return toks, "".join(o.text for o in outs)


def test_streamed_text_is_the_decoded_output(make_engine, eu, tiny_loaded, base_output):
    tok = tiny_loaded[2]
    toks, text = base_output
    assert text == tok.decode(toks) and len(toks) == 30
    eng = make_engine()
    ids = tok.encode(PROMPT)
    _, _, outs = run_one(eng, eu, greedy(30, ignore_eos=True), prompt=None, prompt_token_ids=ids)
    assert outs[0].prompt_token_ids == ids and all(not o.prompt_token_ids for o in outs[1:])
    assert [o.num_output_tokens for o in outs] == list(range(1, 31))
    assert outs[-1].finished and outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])


def _boundary_stop(tok, toks, start=2):
    """A stop string made of the end of token i and the start of token i+1 (plain ASCII, i >= `start`), the text
    before its first occurrence, and how many tokens it takes to complete it."""
    pieces = [tok.decode([t]) for t in toks]
    full = tok.decode(toks)
    for i in range(start, len(toks) - 1):
        a, b = pieces[i], pieces[i + 1]
        if a.isascii() and b.isascii() and a.isprintable() and b.isprintable() and a and b:
            stop = a[-2:] + b[:2]
            at = full.find(stop)
            need = next(j for j in range(1, len(toks) + 1) if stop in tok.decode(toks[:j]))
            if need == i + 2 and at >= 0:
                return stop, full[:at], need
    raise AssertionError("no usable token boundary in the greedy text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(make_engine, eu, tiny_loaded, base_output, include):
    toks, full = base_output
    stop, before, need = _boundary_stop(tiny_loaded[2], toks)
    out_toks, reason, outs = run_one(make_engine(), eu, greedy(30, ignore_eos=True, stop=[stop, "never-seen"],
                                                                 include_stop_str_in_output=include))
    assert reason == "stop"
    assert out_toks == toks[:need]  # generation stopped at the token completing the stop string
    assert "".join(o.text for o in outs) == before + (stop if include else "")


def test_stop_token_ids_and_min_tokens(make_engine, eu, tiny_loaded, base_output):
    toks, _ = base_output
    tok = tiny_loaded[2]
    k = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])
    stop_id = toks[k]
    out, reason, outs = run_one(make_engine(), eu, greedy(30, stop_token_ids=[stop_id], ignore_eos=True))
    assert reason == "stop" and out == toks[:k + 1]  # the stop token is kept in the ids ...
    assert "".join(o.text for o in outs) == tok.decode(toks[:k])  # ... but not in the text
    min_tokens = k + 4
    out, reason, _ = run_one(make_engine(), eu, greedy(30, stop_token_ids=[stop_id], min_tokens=min_tokens, ignore_eos=True))
    assert len(out) >= min_tokens and stop_id not in out[:min_tokens]
    assert reason == "length" or (reason == "stop" and out[-1] == stop_id)


def test_eos_and_ignore_eos(make_engine, eu, base_output):
    toks, _ = base_output
    k = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    eng = make_engine()
    eng.eos_token_ids.add(toks[k])  # make the model's own k-th greedy token an EOS
    out, reason, _ = run_one(eng, eu, greedy(30))
    assert reason == "stop" and out == toks[:k + 1]
    eng2 = make_engine()
    eng2.eos_token_ids.add(toks[k])
    out, reason, _ = run_one(eng2, eu, greedy(30, ignore_eos=True))
    assert reason == "length" and out == toks
    eng3 = make_engine()
    eng3.eos_token_ids.add(toks[k])
    out, reason, _ = run_one(eng3, eu, greedy(30, min_tokens=k + 3))
    assert len(out) >= k + 3 and toks[k] not in out[:k + 3]


def _min_tokens_stop_check(make_engine, eu, tok, toks, full):
    """Stop strings are looked for only in the text of outputs from the `min_tokens`-th on: the first stop string
    (completed by token `need`) comes too early and is passed over; a second one, later in the text, stops the
    output at the token that completes it. Raises AssertionError where the engine does otherwise."""
    first, _, need = _boundary_stop(tok, toks)
    later, _, need2 = _boundary_stop(tok, toks, start=need + 1)
    min_tokens = need + 1
    skipped = len(tok.decode(toks[:min_tokens - 1]))  # text before the min_tokens-th output: never searched
    end = next(j for j in range(min_tokens, len(toks) + 1)
               if any(s in tok.decode(toks[:j])[skipped:] for s in (first, later)))
    assert end <= need2 and first in full[:len(tok.decode(toks[:need]))]
    out, reason, outs = run_one(make_engine(), eu, greedy(30, ignore_eos=True, stop=[first, later],
                                                          min_tokens=min_tokens))
    assert reason == "stop" and out == toks[:end], (reason, len(out), end)
    text = tok.decode(toks[:end])
    at = min(i for i in (text.find(first, skipped), text.find(later, skipped)) if i >= 0)
    assert "".join(o.text for o in outs) == text[:at]


def test_stop_strings_wait_for_min_tokens(make_engine, eu, tiny_loaded, base_output):
    _min_tokens_stop_check(make_engine, eu, tiny_loaded[2], *base_output)


def test_min_tokens_stop_check_fails_if_stop_strings_are_ignored(make_engine, eu, tiny_loaded, base_output,
                                                                 monkeypatch):
    """The check above fails on a sequence that ignores its stop strings whenever min_tokens > 0 (the old check, a
    length only, passed it), and on one that ignores min_tokens for stop strings."""
    from m3serve.engine.sequence import SequenceText
    real = SequenceText.feed

    def no_stops_with_min_tokens(self, *a, **k):
        if self.min_tokens > 0:
            self.stops = None
        return real(self, *a, **k)

    def stops_ignore_min_tokens(self, *a, **k):
        self.min_tokens = 0
        return real(self, *a, **k)

    for broken in (no_stops_with_min_tokens, stops_ignore_min_tokens):
        monkeypatch.setattr(SequenceText, "feed", broken)
        with pytest.raises(AssertionError):
            _min_tokens_stop_check(make_engine, eu, tiny_loaded[2], *base_output)


def test_reasoning_parser(make_engine, eu, base_output):
    toks, full = base_output
    assert "<mm:think>" not in full and "</mm:think>" not in full
    _, _, outs = run_one(make_engine(), eu, greedy(30, ignore_eos=True), reasoning_parser="minimax_m3",
                         chat_template_kwargs={"thinking_mode": "enabled"})
    assert "".join(o.reasoning_text for o in outs) == full and "".join(o.text for o in outs) == ""
    _, _, outs = run_one(make_engine(), eu, greedy(30, ignore_eos=True), reasoning_parser="minimax_m3")
    assert "".join(o.text for o in outs) == full and "".join(o.reasoning_text for o in outs) == ""


def test_chat_messages_prompt(make_engine, eu, tiny_loaded):
    tok = tiny_loaded[2]
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    eng = make_engine()
    eng.add_request("c", prompt=msgs, sampling_params=greedy(4), chat_template_kwargs={"thinking_mode": "disabled"})
    outs = eu.run_to_completion(eng)["c"][2]
    assert outs[0].prompt_token_ids == tok.apply_chat_template(msgs, tokenize=True, thinking_mode="disabled")


def test_assistant_prefix_starts_the_reply(make_engine, eu, tiny_loaded):
    """chat_template_kwargs.assistant_prefix (m3's assistant_prefix input): tokenized with the rendered prompt, and
    read by the reasoning parser first: after a prefix that closes the think block of thinking "enabled", the
    output is content, not reasoning."""
    tok = tiny_loaded[2]
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    eng = make_engine()
    kw = {"thinking_mode": "enabled"}
    eng.add_request("p", prompt=msgs, sampling_params=greedy(6, ignore_eos=True), reasoning_parser="minimax_m3",
                    chat_template_kwargs={**kw, "assistant_prefix": "</mm:think>Sure"})
    eng.add_request("n", prompt=msgs, sampling_params=greedy(6, ignore_eos=True), reasoning_parser="minimax_m3",
                    chat_template_kwargs=kw)
    res = eu.run_to_completion(eng)
    p, n = res["p"][2], res["n"][2]
    assert p[0].prompt_token_ids == tok.encode(tok.apply_chat_template(msgs, **kw) + "</mm:think>Sure")
    assert len(p[0].prompt_token_ids) > len(n[0].prompt_token_ids)
    assert "".join(o.text for o in p) and not "".join(o.reasoning_text for o in p)
    assert "".join(o.reasoning_text for o in n) and not "".join(o.text for o in n)
    for kwargs in (dict(prompt="hi"), dict(prompt_token_ids=[1, 2]), dict(prompt=msgs, chat_template_kwargs={
            "assistant_prefix": 3})):
        with pytest.raises(InvalidRequest) as e:
            eng.add_request("bad", **{"chat_template_kwargs": {"assistant_prefix": "x"}, **kwargs})
        assert e.value.field == "assistant_prefix"


def test_text_options_the_engine_decodes_for_its_caller(make_engine, eu, tiny_loaded, base_output):
    """TextOptions: stop words given as token ids stop at their text; the prompt decoded on the first output only;
    the text of every logprobs token. A caller (the Triton model) holds no tokenizer and reads these instead."""
    tok = tiny_loaded[2]
    toks, full = base_output
    stop, before, _ = _boundary_stop(tok, toks)
    word = tuple(tok.encode(stop))
    assert len(word) > 1
    out_toks, reason, outs = run_one(make_engine(), eu, greedy(30, ignore_eos=True),
                                     text_options=TextOptions(stop_words=(word, (7, 8))))
    assert reason == "stop" and "".join(o.text for o in outs) == before and len(out_toks) < 30
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    _, _, outs = run_one(make_engine(), eu, greedy(4, ignore_eos=True, logprobs=2), prompt=msgs,
                         text_options=TextOptions(prompt_text=True, logprob_tokens=True))
    assert outs[0].prompt_text == tok.decode(outs[0].prompt_token_ids, skip_special_tokens=False)
    assert outs[0].prompt_text.startswith(tok.apply_chat_template(msgs)[:20])
    assert all(o.prompt_text is None for o in outs[1:])
    entries = [(e, t) for o in outs for e, t in zip(o.logprobs, o.logprob_tokens)]
    assert len(entries) == 4 and all(len(e) >= 2 for e, _ in entries)
    assert all(t == {i: tok.decode([i], skip_special_tokens=False) for i in e} for e, t in entries)
    _, _, outs = run_one(make_engine(), eu, greedy(4, ignore_eos=True, logprobs=2))  # asked for nothing
    assert all(o.prompt_text is None and o.logprob_tokens is None for o in outs)
    _, _, outs = run_one(make_engine(), eu, greedy(30, ignore_eos=True))
    so_far = [t for o in outs for t in o.new_token_ids]  # mid_character: the ids so far end inside a character
    assert [o.mid_character for o in outs] == [
        tok.decode(so_far[:o.num_output_tokens]).endswith("\ufffd") and not o.finished for o in outs]
    with pytest.raises(InvalidRequest) as e:
        make_engine().add_request("bad", prompt=PROMPT, text_options=TextOptions(stop_words=((1, -2),)))
    assert e.value.field == "stop_words"


def test_invalid_requests_disturb_nothing(make_engine, eu):
    eng = make_engine(max_model_len=128)
    eng.add_request("ok", prompt_token_ids=[1, 2, 3], sampling_params=greedy(5, ignore_eos=True))
    bad = [
        (dict(prompt_token_ids=[]), "prompt"), (dict(prompt=""), "prompt"),
        (dict(prompt_token_ids=[1, 10**6]), "prompt_token_ids"), (dict(prompt_token_ids=[-1]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1] * 120, sampling_params=greedy(9)), "max_tokens"),
        (dict(prompt_token_ids=[1] * 128), "prompt"),
        (dict(prompt_token_ids=[1], reasoning_parser="nope"), "reasoning_parser"),
        (dict(prompt=123), "prompt"),
    ]
    for kwargs, field in bad:
        with pytest.raises(InvalidRequest) as e:
            eng.add_request("bad", **kwargs)
        assert e.value.field == field, kwargs
    with pytest.raises(InvalidRequest) as e:
        eng.add_request("ok", prompt_token_ids=[4])
    assert e.value.field == "request_id"
    res = eu.run_to_completion(eng)
    assert list(res) == ["ok"] and len(res["ok"][0]) == 5


def test_the_models_default_max_tokens_is_cut_to_the_prompts_room(make_engine, eu):
    """TextOptions.default_max_tokens (the Triton contracts set it where the client sent no max_tokens): a prompt that
    leaves less room than the default gets that room and ends by length, where the same max_tokens sent by the client
    is an error; a min_tokens over the room is the error then."""
    eng = make_engine(max_model_len=128)
    default = TextOptions(default_max_tokens=True)
    toks, reason, _ = run_one(eng, eu, greedy(16, ignore_eos=True), None, prompt_token_ids=[1] * 120,
                               text_options=default)
    assert reason == "length" and len(toks) == 8
    toks, reason, _ = run_one(eng, eu, greedy(5, ignore_eos=True), None, prompt_token_ids=[1] * 120,
                               text_options=default)
    assert reason == "length" and len(toks) == 5  # room enough: the default as it is
    with pytest.raises(InvalidRequest) as e:
        eng.add_request("sent", prompt_token_ids=[1] * 120, sampling_params=greedy(16, ignore_eos=True))
    assert e.value.field == "max_tokens"
    with pytest.raises(InvalidRequest) as e:
        eng.add_request("min", prompt_token_ids=[1] * 120, sampling_params=greedy(16, min_tokens=9),
                        text_options=default)
    assert e.value.field == "min_tokens" and "room for 8 tokens" in e.value.message
    assert not eng.has_unfinished_requests()


def test_abort_waiting_mid_prefill_mid_decode(make_engine, reference_greedy, eu):
    p_long, p_dec, p_wait, p_keep = eu.random_prompts([130, 20, 50, 70], seed=21)
    eng = make_engine(max_num_batched_tokens=16, max_num_seqs=3)
    sp = greedy(12, ignore_eos=True)
    for rid, p in (("dec", p_dec), ("keep", p_keep), ("long", p_long), ("wait", p_wait)):
        eng.add_request(rid, prompt_token_ids=p, sampling_params=sp)
    got = {}
    seqs = dict(eng.scheduler.requests)

    def step():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)

    long_seq = seqs["long"]
    for _ in range(100):
        if 0 < long_seq.num_computed_tokens < 130 and len(got.get("dec", [])) >= 3:
            break
        step()
    assert 0 < long_seq.num_computed_tokens < 130 and long_seq.pages  # mid-prefill
    assert seqs["wait"].status.value == "waiting"
    for rid in ("long", "dec", "wait"):
        held = len(set(seqs[rid].pages))
        free = eng.block_manager.num_free_pages
        out = eng.abort_request(rid)
        assert out.finished and out.finish_reason == "abort" and out.new_token_ids == []
        assert eng.block_manager.num_free_pages == free + held  # freed at once
        eu.check_invariants(eng)
    assert eng.abort_request("dec") is None  # already gone
    while eng.has_unfinished_requests():
        step()
    assert got["keep"] == reference_greedy(p_keep, 12)
    assert "long" not in got and "wait" not in got and 3 <= len(got["dec"]) < 12
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"] and st["num_running"] == st["num_waiting"] == 0


def test_llm_generate(tiny_model_dir, reference_greedy, eu):
    from m3serve import LLM

    llm = LLM(tiny_model_dir, max_model_len=256, max_num_batched_tokens=32, num_gpu_blocks_override=40,
              device="cpu", dtype="float32")  # the reference's device and dtype (the default picks a GPU where one is)
    prompts = eu.random_prompts([70, 5], seed=22)
    outs = llm.generate(prompts + [PROMPT], [greedy(8, ignore_eos=True)] * 2 + [greedy(8, logprobs=1)])
    assert [o.token_ids for o in outs[:2]] == [reference_greedy(p, 8) for p in prompts]
    assert outs[0].prompt_token_ids == prompts[0] and outs[2].prompt_token_ids == llm.tokenizer.encode(PROMPT)
    assert outs[2].text == llm.tokenizer.decode(outs[2].token_ids) and len(outs[2].logprobs) == len(outs[2].token_ids)
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    single = llm.generate(prompts[1], greedy(8, ignore_eos=True))  # one token-id prompt
    assert single[0].token_ids == outs[1].token_ids
    with pytest.raises(InvalidRequest):
        llm.generate([prompts[0], []], greedy(4))
    assert not llm.engine.has_unfinished_requests()
