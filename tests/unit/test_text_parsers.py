"""Stop strings, minimax_m3 reasoning parser and M3 tool-call parser (streaming == one-shot)."""

import random

import pytest

from m3serve.text import (
    CALL_END,
    MiniMaxM3ReasoningParser,
    StopStringMatcher,
    Tokenizer,
    ToolCallStreamParser,
    build_tiny_tokenizer,
    extract_reasoning,
    forced_call_prefix,
    parse_tool_calls,
)

NS = "]<]minimax[>["
S, E = "<mm:think>", "</mm:think>"
MODES = [None, "enabled", "disabled", "adaptive"]


def chunkings(text, rng, n_random=25):
    """Char-by-char, every 2-way split, and random chunkings of `text`."""
    yield list(text)
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]
    for _ in range(n_random):
        out, i = [], 0
        while i < len(text):
            n = rng.randint(1, 8)
            out.append(text[i:i + n])
            i += n
        yield out


# ------------------------------------------------------------------ stop strings

def _ref_stop(text, stops, include):
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s and s in text]
    if not hits:
        return text, False
    end, _, s = min(hits)
    return text[:end if include else end - len(s)], True


def _run_stop(chunks, stops, include):
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    out, stopped = [], False
    seen = ""
    for c in chunks:
        seen += c
        emit, stopped = m.feed(c)
        out.append(emit)
        if stopped:
            break
        # only a possible partial match is held back
        held = seen[len("".join(out)):]
        assert seen.startswith("".join(out))
        assert held == "" or any(s.startswith(held) for s in stops)
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


@pytest.mark.parametrize("text,stops", [
    ("Hello world, the end. More text", ["the end"]),
    ("abcabcabd", ["abd"]),
    ("xxabcxx", ["abc", "bc", "ab"]),
    ("aaaaab", ["aab", "ab"]),
    ("no stop here at all", ["STOP", "zz"]),
    ("STOP at start", ["STOP"]),
    ("ends with stop###", ["###"]),
    ("unicode 你好世界 🚀 done", ["世界 🚀", "界"]),
    ("partial sto", ["stop"]),
    ("repeat stopstop", ["stop", "pst"]),
    ("[e~[ as text", ["[e~["]),
])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_any_split(text, stops, include):
    want = _ref_stop(text, stops, include)
    for chunks in chunkings(text, random.Random(1)):
        assert _run_stop(chunks, stops, include) == want, chunks


def test_stop_holds_only_partial_match():
    m = StopStringMatcher(["world", "xyz"])
    assert m.feed("hello wor") == ("hello ", False)
    assert m.feed("m") == ("worm", False)
    assert m.feed(" x") == (" ", False)
    assert m.feed("y") == ("", False)
    assert m.feed("q") == ("xyq", False)
    assert m.feed("xyz tail") == ("", True)
    assert m.feed("more") == ("", True) and m.matched_stop == "xyz"
    assert StopStringMatcher([]).feed("anything") == ("anything", False)
    assert StopStringMatcher(["", "ab"]).feed("cab") == ("c", True)


# ------------------------------------------------------------------ reasoning

REASONING_CASES = [
    # (text, mode, reasoning, content)
    ("plain answer", None, "", "plain answer"),
    (f"{S}think{E}answer", None, "think", "answer"),
    (f"{S}think{E}answer", "adaptive", "think", "answer"),
    (f"{S}think{E}answer", "disabled", "think", "answer"),
    (f"{E}direct answer", "adaptive", "", "direct answer"),
    (f"{E}direct {E} answer", None, "", f"direct {E} answer"),
    (f"{E}{S}x{E}y", None, "", f"{S}x{E}y"),
    (f"pre {S}mid{E} post {S}again{E}", None, "mid", f"pre  post {S}again{E}"),
    (f"{S}unterminated reasoning", None, "unterminated reasoning", ""),
    (f"before{S}unterminated", None, "unterminated", "before"),
    (f"stray {E} closer later", None, "", f"stray {E} closer later"),
    ("step 1, step 2" + E + "final", "enabled", "step 1, step 2", "final"),
    ("still thinking", "enabled", "still thinking", ""),
    (f"{S}redundant{E}ok", "enabled", "redundant", "ok"),
    (f"{E}no thoughts", "enabled", "", "no thoughts"),
    (f"a{S}b{E}c", "enabled", f"a{S}b", "c"),
    ("</mm:th partial marker text", None, "", "</mm:th partial marker text"),
    ("<mm:thin", "enabled", "<mm:thin", ""),
    ("<mm:thin", None, "", "<mm:thin"),
    ("思考 🤔" + E + "答案 ✅", "enabled", "思考 🤔", "答案 ✅"),
    ("", None, "", ""),
    ("", "enabled", "", ""),
]


def _run_reasoning(chunks, mode):
    p = MiniMaxM3ReasoningParser(thinking_mode=mode)
    r, c = [], []
    for ch in chunks:
        dr, dc = p.feed(ch)
        r.append(dr)
        c.append(dc)
    dr, dc = p.flush()
    return "".join(r) + dr, "".join(c) + dc


@pytest.mark.parametrize("text,mode,reasoning,content", REASONING_CASES)
def test_reasoning_extract(text, mode, reasoning, content):
    assert extract_reasoning(text, thinking_mode=mode) == (reasoning, content)


@pytest.mark.parametrize("text,mode,reasoning,content", REASONING_CASES)
def test_reasoning_streaming_matches(text, mode, reasoning, content):
    for chunks in chunkings(text, random.Random(2)):
        assert _run_reasoning(chunks, mode) == (reasoning, content), chunks


def test_reasoning_fuzz_streaming_equals_extract():
    rng = random.Random(3)
    frags = [S, E, "<mm:", "</mm:", "think>", "<", "/", ">", "a", "b ", "你", "\n", "mm"]
    for _ in range(400):
        text = "".join(rng.choice(frags) for _ in range(rng.randint(0, 12)))
        mode = rng.choice(MODES)
        want = extract_reasoning(text, thinking_mode=mode)
        for chunks in (list(text), [text[i:i + 3] for i in range(0, len(text), 3)]):
            assert _run_reasoning(chunks, mode) == want, (text, mode)


def test_reasoning_holds_only_marker_prefix():
    p = MiniMaxM3ReasoningParser()
    assert p.feed("<") == ("", "")          # could be a leading </mm:think>
    assert p.feed("mm:th") == ("", "")      # could be <mm:think>
    assert p.feed("ink>abc</mm") == ("abc", "")
    assert p.in_reasoning
    assert p.feed(":think>") == ("", "")
    assert p.reasoning_ended
    assert p.feed(" done <mm:think>") == ("", " done <mm:think>")
    p = MiniMaxM3ReasoningParser("enabled")
    assert p.in_reasoning
    assert p.feed("x </m") == ("x ", "")
    assert p.feed("y") == ("</my", "")
    assert p.flush() == ("", "")


# ------------------------------------------------------------------ tool calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "code": {"type": "string"},
        "opts": {"type": "object", "properties": {"unit": {"type": "string"},
                                                  "limit": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "pts": {"type": "array", "items": {"type": "object", "properties": {
            "x": {"type": "number"}, "ok": {"type": "boolean"}}}},
        "maybe": {"type": ["integer", "null"]},
        "any_of": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "level": {"enum": [1, 2, 3]},
        "json_obj": {"type": "object"}, "json_arr": {"type": "array"}, "empty": {"type": "array"},
    }}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}}
TOOLS = [WEATHER, SEARCH]


def tag(k, v):
    return f"{NS}<{k}>{v}{NS}</{k}>"


def invoke(name, body):
    return f"{NS}<invoke name=\"{name}\">{body}{NS}</invoke>\n"


def block(*invokes):
    return f"{NS}<tool_call>\n" + "".join(invokes) + f"{NS}</tool_call>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_m3_tools")
    build_tiny_tokenizer(str(d))
    return Tokenizer.from_pretrained(str(d))


def _rendered_calls(tok, calls):
    """Assistant text the chat template renders for these tool calls."""
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "Let me check. ", "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=False)
    return text.split("]~b]ai\n</mm:think>")[-1].removesuffix("[e~[\n")


def test_template_round_trip(tok):
    args = {"city": "São Paulo <b>", "days": 3, "temp": -2.5, "metric": False, "code": "007",
            "opts": {"unit": "c", "limit": 10}, "tags": ["a b", "😀"],
            "pts": [{"x": 1, "ok": True}, {"x": 2.25, "ok": False}], "maybe": 4, "any_of": 9,
            "level": 2, "empty": [], "dropped": None}
    text = _rendered_calls(tok, [("get_weather", args), ("search", {"q": "你好", "n": 5})])
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check. "
    want = {k: v for k, v in args.items() if v is not None}
    assert calls == [{"name": "get_weather", "arguments": want},
                     {"name": "search", "arguments": {"q": "你好", "n": 5}}]
    assert type(calls[0]["arguments"]["days"]) is int
    assert calls[0]["arguments"]["code"] == "007"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [None, "search"])
def test_forced_call_prefix_continues_the_prompt_as_history_renders_the_call(tok, mode, name):
    """tool_choice "required" / named: prompt + prefix + what the model writes is the text the template renders
    for that call in history (thinking "enabled": with the generation prompt's <mm:think> closed at once); the
    reasoning parser started on the prefix passes the output as content; the tool parser, given the prefix's
    call part first, returns the call."""
    kw = {} if mode is None else {"thinking_mode": mode}
    q = [{"role": "user", "content": "q"}]
    args = {"q": "你好", "n": 5}
    call = {"type": "function", "function": {"name": "search", "arguments": args}}
    history = tok.apply_chat_template(q + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                      tools=TOOLS, add_generation_prompt=False, **kw)
    if mode == "enabled":
        history = history.replace("]~b]ai\n" + E, "]~b]ai\n" + S + E)
    prompt = tok.apply_chat_template(q, tools=TOOLS, **kw)
    prefix, call_part = forced_call_prefix(mode, name)
    assert prefix.endswith(call_part) and history.startswith(prompt + prefix)
    output = history[len(prompt + prefix):].removesuffix("[e~[\n")
    assert output.endswith(CALL_END)
    for chunks in ([output], list(output)):
        p = MiniMaxM3ReasoningParser(mode, prefix)
        parts = [p.feed(ch) for ch in chunks] + [p.flush()]
        assert "".join(r for r, _ in parts) == "" and "".join(c for _, c in parts) == output
    assert parse_tool_calls(call_part + output, TOOLS) == ("", [{"name": "search", "arguments": args}])
    stream = ToolCallStreamParser(TOOLS)
    assert stream.feed(call_part) == ("", []) and stream.feed(output) == ("", [{"name": "search", "arguments": args}])


def test_coercion_by_schema():
    body = "".join([tag("days", " 12 "), tag("temp", "7"), tag("metric", "TRUE"),
                    tag("maybe", "null"), tag("any_of", "abc"), tag("json_obj", '{"a": [1]}'),
                    tag("json_arr", "[1, 2]"), tag("level", "3"), tag("city", " keep spaces "),
                    tag("unknown", "42")])
    _, calls = parse_tool_calls(block(invoke("get_weather", body)), TOOLS)
    assert calls[0]["arguments"] == {
        "days": 12, "temp": 7, "metric": True, "maybe": None, "any_of": "abc",
        "json_obj": {"a": [1]}, "json_arr": [1, 2], "level": 3, "city": " keep spaces ",
        "unknown": "42"}
    # values that do not fit the schema stay strings
    bad = tag("days", "many") + tag("metric", "yes") + tag("json_obj", "{oops")
    _, calls = parse_tool_calls(block(invoke("get_weather", bad)), TOOLS)
    assert calls[0]["arguments"] == {"days": "many", "metric": "yes", "json_obj": "{oops"}


def test_without_schema_leaves_strings_and_infers_structure():
    body = tag("n", "5") + tag("obj", tag("k", "v")) + tag("arr", tag("item", "1") + tag("item", "2"))
    content, calls = parse_tool_calls("x" + block(invoke("other", body)) + "y")
    assert content == "xy"
    assert calls == [{"name": "other", "arguments": {"n": "5", "obj": {"k": "v"},
                                                     "arr": ["1", "2"]}}]
    _, calls = parse_tool_calls(block(invoke("noargs", "")), None)
    assert calls == [{"name": "noargs", "arguments": {}}]


def test_multiple_blocks_and_surrounding_content():
    text = ("A " + block(invoke("search", tag("q", "x")), invoke("search", tag("n", "2"))) +
            " B " + block(invoke("search", tag("q", "y"))) + " C")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "A  B  C"
    assert [c["arguments"] for c in calls] == [{"q": "x"}, {"n": 2}, {"q": "y"}]


MALFORMED = [
    block(invoke("search", tag("q", "x")).replace(f"{NS}</invoke>", "")),   # unclosed invoke
    block(f"{NS}<invoke name=\"search\">{NS}<q>x{NS}</n>{NS}</invoke>"),    # mismatched tag
    block(f"{NS}<invoke name=\"search\">loose text{NS}</invoke>"),          # bare text
    block(f"{NS}<invoke>{tag('q', 'x')}{NS}</invoke>"),                      # no name
    block(f"{NS}<invoke name=\"\">{NS}</invoke>"),                           # empty name
    block(f"junk {invoke('search', tag('q', 'x'))}"),                        # text between invokes
    block(f"{NS}oops{invoke('search', '')}"),                                # ns without tag
    block(f"{NS}<invoke name=\"s\">{NS}<a>1{NS}<b>2{NS}</b>{NS}</a>{NS}</invoke>"),  # mixed
    f"{NS}<tool_call>\n" + block(invoke("search", "")),                      # nested opener
    f"{NS}<tool_call>\n" + invoke("search", tag("q", "never closed")),      # unterminated
    block(f"{NS}<invoke name=\"s\">" + f"{NS}<a>" * 3000 + f"{NS}</invoke>"),  # deep junk
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_markup_is_content(text):
    text = "pre " + text + " post"
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_valid_block_after_malformed_one():
    good = block(invoke("search", tag("n", "1")))
    text = MALFORMED[1] + "|" + good
    assert parse_tool_calls(text, TOOLS) == (MALFORMED[1] + "|", [
        {"name": "search", "arguments": {"n": 1}}])


def _run_tools(chunks, tools):
    p = ToolCallStreamParser(tools)
    content, calls = [], []
    for ch in chunks:
        dc, new = p.feed(ch)
        content.append(dc)
        calls.extend(new)
    dc, new = p.flush()
    return "".join(content) + dc, calls + new


STREAM_TEXTS = [
    "just text, no tools 😀",
    "Checking. " + block(invoke("search", tag("q", "天气 ]<] not ns")), invoke("other", "")) + " done",
    block(invoke("get_weather", tag("opts", tag("limit", "3")) + tag("pts", tag("item", tag("x", "1"))))),
    "a ]<]minimax[>[ b ]<]minimax[>[<tool c " + MALFORMED[1] + " d",
    "x" + MALFORMED[-2],
    "two " + block(invoke("search", tag("n", "1"))) + block(invoke("search", tag("n", "2"))),
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_tool_streaming_matches(text):
    want = parse_tool_calls(text, TOOLS)
    for chunks in chunkings(text, random.Random(4), n_random=15):
        assert _run_tools(chunks, TOOLS) == want


def test_tool_stream_holds_back_from_possible_start():
    p = ToolCallStreamParser(TOOLS)
    assert p.feed("Hello ]<]mini") == ("Hello ", [])
    assert p.feed("max[>[<tool_call>\n") == ("", []) and p.in_tool_call
    assert p.feed(invoke("search", tag("n", "7"))) == ("", [])
    assert p.feed(f"{NS}</tool_call>tail") == ("tail", [{"name": "search", "arguments": {"n": 7}}])
    assert not p.in_tool_call
    assert p.feed("]<]x") == ("]<]x", [])


def _random_call_text(rng):
    def value(depth):
        r = rng.random()
        if depth < 2 and r < 0.2:
            return "".join(tag(rng.choice("abc"), value(depth + 1)) for _ in range(rng.randint(1, 2)))
        if depth < 2 and r < 0.4:
            return "".join(tag("item", value(depth + 1)) for _ in range(rng.randint(0, 2)))
        return rng.choice(["7", "x y", "true", "你好", "", "<b>", "1.5"])
    invokes = [invoke(rng.choice(["search", "get_weather", "f"]),
                      "".join(tag(rng.choice(["q", "n", "opts", "tags"]), value(0))
                              for _ in range(rng.randint(0, 3))))
               for _ in range(rng.randint(1, 2))]
    return rng.choice(["", "hi ", "text\n"]) + block(*invokes) + rng.choice(["", " bye", NS])


def test_tool_fuzz_never_raises_and_streams_consistently():
    rng = random.Random(5)
    frags = [NS, "<", ">", "/", "]<]", "<item>", f"{NS}<tool_call>", f"{NS}</tool_call>", "x"]
    valid = 0
    for _ in range(300):
        text = _random_call_text(rng) + (_random_call_text(rng) if rng.random() < 0.3 else "")
        for _ in range(rng.randint(0, 2)):  # random damage
            i = rng.randint(0, len(text))
            if rng.random() < 0.5:
                text = text[:i] + text[i + rng.randint(1, 15):]
            else:
                text = text[:i] + rng.choice(frags) + text[i:]
        want = parse_tool_calls(text, TOOLS)
        valid += bool(want[1])
        got = _run_tools([text[i:i + 5] for i in range(0, len(text), 5)], TOOLS)
        assert got == want, text
        assert _run_tools(list(text), TOOLS) == want, text
    assert 50 < valid < 300  # both parsed and rejected inputs were exercised
