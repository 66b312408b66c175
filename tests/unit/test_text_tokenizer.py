"""Tiny M3 tokenizer, Tokenizer wrapper and the M3-layout chat template."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from m3serve.text import M3_SPECIAL_TOKENS, Tokenizer, build_tiny_tokenizer
from support.required import require

NS = "]<]minimax[>["
MODES = [None, "enabled", "disabled", "adaptive"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_m3_tok")
    info = build_tiny_tokenizer(str(d))
    return str(d), info


@pytest.fixture(scope="session")
def tok(tiny_dir):
    return Tokenizer.from_pretrained(tiny_dir[0])


def _kw(mode):
    return {} if mode is None else {"thinking_mode": mode}


def _system_block(root_text="You are MiniMax-M3, an AI model built by MiniMax.", mode="adaptive"):
    return (
        "]~!b[]~b]system\n" + root_text + "\n\n<thinking_instructions>\n"
        "Reasoning goes inside <mm:think></mm:think> before the answer. With thinking disabled, "
        "answer right after the </mm:think> prefix; with adaptive thinking, choose per turn.\n"
        f"Current thinking mode: {mode}.\n</thinking_instructions>[e~[\n"
    )


def _gen_prompt(mode):
    return "]~b]ai\n" + {"enabled": "<mm:think>", "disabled": "</mm:think>"}.get(mode, "")


# ------------------------------------------------------------------ tokenizer files

def test_build_returns_ids(tiny_dir, tok):
    d, info = tiny_dir
    assert set(os.listdir(d)) >= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert 480 <= info["vocab_size"] <= 512
    assert info["vocab_size"] == tok.vocab_size
    assert info["bos_token_id"] == tok.token_id("]~!b[") == tok.bos_token_id
    assert info["eos_token_id"] == tok.token_id("[e~[") == tok.eos_token_id
    assert info["pad_token_id"] == tok.pad_token_id
    cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
    assert cfg["bos_token"] == "]~!b[" and cfg["eos_token"] == "[e~["
    assert cfg["chat_template"] == open(os.path.join(d, "chat_template.jinja")).read()
    assert cfg["model_max_length"] > 0 and tok.model_max_length == cfg["model_max_length"]


def test_build_is_deterministic(tiny_dir, tmp_path):
    d, _ = tiny_dir
    build_tiny_tokenizer(str(tmp_path / "again"))
    code = ("import sys; from m3serve.text import build_tiny_tokenizer; "
            "build_tiny_tokenizer(sys.argv[1])")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "proc")], check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        ref = open(os.path.join(d, name), "rb").read()
        assert open(tmp_path / "again" / name, "rb").read() == ref
        assert open(tmp_path / "proc" / name, "rb").read() == ref


def test_specials_are_single_ids(tok):
    seen = set()
    for content, special in M3_SPECIAL_TOKENS:
        ids = tok.encode(content)
        assert ids == [tok.token_id(content)], content
        assert (ids[0] in tok.special_token_ids) == special
        seen.add(ids[0])
        ids = tok.encode("abc" + content + "def")
        assert tok.token_id(content) in ids
    assert len(seen) == len(M3_SPECIAL_TOKENS)
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "[e~["
    with pytest.raises(KeyError):
        tok.token_id("<not-a-token>")


@pytest.mark.parametrize("text", [
    "Hello, world! def f(x): return x * 2",
    "Café naïve Zürich São Paulo — résumé",
    "你好，世界！日本語のテキスト 안녕하세요",
    "Emoji 😀🚀👍🏽 ❤️ 🇫🇷 👩‍💻 ✨ mixed 拿铁 ☕",
    "]~!b[]~b]system\nhi[e~[\n]~b]ai\n<mm:think>why</mm:think>ok",
    f"{NS}<tool_call>\n{NS}<invoke name=\"f\">{NS}<a>1{NS}</a>{NS}</invoke>\n{NS}</tool_call>",
    "  leading and trailing spaces \t\n\n",
    "",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_multibyte_chars_split_across_tokens(tok):
    ids = tok.encode("你好 😀 👍🏽 ñ")
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some char spans several byte tokens


def test_skip_special_tokens(tok):
    text = "]~b]ai\n<mm:think>r</mm:think>c[e~[" + NS + "<x>"
    ids = tok.encode(text)
    # think markers stay visible; role/eos/namespace tokens are dropped
    assert tok.decode(ids) == "ai\n<mm:think>r</mm:think>c<x>"
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_template_from_config_when_no_jinja_file(tiny_dir, tmp_path):
    d, _ = tiny_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(d, name), tmp_path / name)
    t2 = Tokenizer.from_pretrained(str(tmp_path))
    msgs = [{"role": "user", "content": "hi"}]
    assert t2.apply_chat_template(msgs) == Tokenizer.from_pretrained(d).apply_chat_template(msgs)
    (tmp_path / "chat_template.jinja").write_text("FILE{{ messages[0].content }}")
    assert Tokenizer.from_pretrained(str(tmp_path)).apply_chat_template(msgs) == "FILEhi"


# ------------------------------------------------------------------ chat template layout

@pytest.mark.parametrize("mode", MODES)
def test_minimal_prompt_every_mode(tok, mode):
    got = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], **_kw(mode))
    want = (_system_block(mode=mode or "adaptive") +
            "]~b]developer\nYou are a helpful assistant.[e~[\n"
            "]~b]user\nHi there[e~[\n" + _gen_prompt(mode))
    assert got == want
    assert tok.apply_chat_template([{"role": "user", "content": "Hi there"}],
                                   add_generation_prompt=False, **_kw(mode)) == want[:want.index("]~b]ai\n")]


def test_root_system_developer_roles(tok):
    msgs = [{"role": "root", "content": "ROOT RULES"}, {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "q"}]
    assert tok.apply_chat_template(msgs, thinking_mode="disabled") == (
        _system_block("ROOT RULES", "disabled") + "]~b]developer\nBe brief.[e~[\n"
        "]~b]user\nq[e~[\n]~b]ai\n</mm:think>")
    msgs = [{"role": "developer", "content": "Dev text"}, {"role": "user", "content": "q"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        _system_block() + "]~b]developer\nDev text[e~[\n]~b]user\nq[e~[\n")


def test_tools_listed(tok):
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string", "description": "名前"}}}}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
    ]
    got = tok.apply_chat_template([{"role": "user", "content": "q"}], tools=tools,
                                  add_generation_prompt=False)
    tool_lines = "".join("<tool>" + json.dumps(t["function"], ensure_ascii=False) + "</tool>\n"
                         for t in tools)
    want_dev = (
        "]~b]developer\nYou are a helpful assistant.\n\n# Tools\n"
        "The tools below are described in JSONSchema.\n\n<tools>\n" + tool_lines + "</tools>\n\n"
        f"Call tools inside one {NS}<tool_call>{NS}</tool_call> block; nested values become child "
        f"tags and list entries become {NS}<item> tags. Example:\n\n"
        f"{NS}<tool_call>\n{NS}<invoke name=\"f\">{NS}<a>1{NS}</a>{NS}</invoke>\n{NS}</tool_call>"
        "[e~[\n")
    assert got == _system_block() + want_dev + "]~b]user\nq[e~[\n"
    assert "名前" in got  # tojson keeps non-ASCII


def test_assistant_history_and_tool_turns(tok):
    args = {"city": "Paris", "days": 3, "skip": None, "opts": {"unit": "c", "raw": True},
            "tags": ["a", "b"], "pts": [{"x": 1}, {"x": 2.5}]}
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": [{"type": "text", "text": "see "}, {"type": "image"},
                                     {"type": "video"}]},
        {"role": "assistant", "content": "plain"},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "<mm:think>\nr3\n</mm:think>\n\na3"},
        {"role": "user", "content": "q4"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}},
            {"type": "function", "function": {"name": "noop", "arguments": {}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": [{"type": "text", "text": "ok"}]},
        {"role": "user", "content": "q5"},
    ]
    got = tok.apply_chat_template(msgs, thinking_mode="enabled")
    call = (f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">{NS}<city>Paris{NS}</city>"
            f"{NS}<days>3{NS}</days>{NS}<opts>{NS}<unit>c{NS}</unit>{NS}<raw>true{NS}</raw>{NS}</opts>"
            f"{NS}<tags>{NS}<item>a{NS}</item>{NS}<item>b{NS}</item>{NS}</tags>"
            f"{NS}<pts>{NS}<item>{NS}<x>1{NS}</x>{NS}</item>{NS}<item>{NS}<x>2.5{NS}</x>{NS}</item>"
            f"{NS}</pts>{NS}</invoke>\n{NS}<invoke name=\"noop\">{NS}</invoke>\n{NS}</tool_call>")
    want = (_system_block(mode="enabled") + "]~b]developer\nYou are a helpful assistant.[e~[\n"
            "]~b]user\nq1[e~[\n]~b]ai\n<mm:think>r1</mm:think>a1[e~[\n"
            "]~b]user\nsee ]<]image[>[]<]video[>[[e~[\n]~b]ai\n</mm:think>plain[e~[\n"
            "]~b]user\nq3[e~[\n]~b]ai\n<mm:think>r3</mm:think>a3[e~[\n"
            "]~b]user\nq4[e~[\n]~b]ai\n</mm:think>" + call + "[e~[\n"
            "]~b]tool\n<response>sunny</response>\n<response>ok</response>[e~[\n"
            "]~b]user\nq5[e~[\n]~b]ai\n<mm:think>")
    assert got == want
    assert isinstance(msgs[7]["tool_calls"][0]["function"]["arguments"], str)  # input untouched
    ids = tok.apply_chat_template(msgs, thinking_mode="enabled", tokenize=True)
    assert ids == tok.encode(want) and ids[0] == tok.bos_token_id
    assert ids.count(tok.token_id(NS)) == want.count(NS)


def test_matches_transformers_renderer(tok):
    hf = require("transformers.utils.chat_template_utils")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "f", "arguments": {"k": [1, {"z": False}]}}}]},
            {"role": "tool", "content": "res"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for mode in MODES:
        rendered, _ = hf.render_jinja_template([msgs], tools=tools, chat_template=tok.chat_template,
                                               add_generation_prompt=True, **_kw(mode))
        assert rendered[0] == tok.apply_chat_template(msgs, tools=tools, **_kw(mode))


def test_template_errors_are_value_errors(tok):
    with pytest.raises(ValueError, match="tool message must follow"):
        tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template([], chat_template="{% if %}")
    with pytest.raises(ValueError, match="boom"):
        tok.apply_chat_template([], chat_template="{{ raise_exception('boom') }}")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['json'] }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{% set _ = messages.append({'role': 'x'}) %}x",
    "{% set _ = messages[0].update({'role': 'x'}) %}x",
])
def test_sandbox_blocks_python_internals(tok, source):
    msgs = [{"role": "user", "content": "q"}]
    with pytest.raises(ValueError):
        tok.apply_chat_template(msgs, chat_template=source)
    assert msgs == [{"role": "user", "content": "q"}]


@pytest.mark.parametrize("source", ["{{ ''.__class__ }}", "{{ raise_exception.__globals__ }}",
                                    "{{ messages.__class__ }}{{ tools.__init__ }}"])
def test_sandbox_unsafe_attribute_renders_nothing(tok, source):
    # a lone unsafe attribute is an undefined value (prints ""); using it further raises
    assert tok.apply_chat_template([{"role": "user", "content": "q"}], chat_template=source) == ""


def test_tojson_is_not_html_escaped(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "<&'>"}],
                                  chat_template="{{ messages[0].content | tojson }}")
    assert out == json.dumps("<&'>")
