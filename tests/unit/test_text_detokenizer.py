"""IncrementalDetokenizer: deltas concatenate to the full decode and never split a character."""

import random

import pytest

from m3serve.text import IncrementalDetokenizer, Tokenizer, build_tiny_tokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji 😀🚀 👍🏽 ❤️ 🇫🇷🇯🇵 👩‍💻 ✨",
    "Café naïve Ærøskøbing — «quotes» … ß",
    "mixed 拿铁 ☕ and 🥐, 日本語 and 한국어 α+β=γ",
    "<mm:think>想一想 🤔</mm:think>答案是 42 ✅",
    "plain ascii text with code: def f(x): return x ** 2",
]
RF = "\ufffd"


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_m3_detok")
    build_tiny_tokenizer(str(d))
    return Tokenizer.from_pretrained(str(d))


def _stream(tok, prompt_ids, chunks, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.add(c) for c in chunks]
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas


def _check(tok, deltas, out_ids, skip=True):
    full = tok.decode(out_ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if RF not in full:
        assert not any(RF in d for d in deltas), deltas


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    deltas = _stream(tok, [], [[i] for i in ids])
    _check(tok, deltas, ids)
    assert deltas[-1] == ""  # nothing left to flush for complete text


@pytest.mark.parametrize("text", TEXTS)
def test_every_two_chunk_split(tok, text):
    ids = tok.encode(text)
    for k in range(len(ids) + 1):
        _check(tok, _stream(tok, [], [ids[:k], ids[k:]]), ids)


@pytest.mark.parametrize("text", TEXTS)
def test_every_prompt_split(tok, text):
    """Prompt = first k ids (ending on a character boundary), output = the rest."""
    ids = tok.encode(text)
    for k in range(len(ids) + 1):
        prompt_text = tok.decode(ids[:k])
        if prompt_text.endswith(RF):
            continue
        out = ids[k:]
        deltas = _stream(tok, ids[:k], [[i] for i in out])
        _check(tok, deltas, out)
        assert prompt_text + "".join(deltas) == text


def test_random_chunkings_with_specials(tok):
    rng = random.Random(0)
    prompt = tok.apply_chat_template([{"role": "user", "content": "你好 😀"}], tokenize=True)
    text = "".join(TEXTS) + "[e~[]~b]ai\n]<]minimax[>[<tool_call>é"
    ids = tok.encode(text)
    for skip in (True, False):
        for _ in range(30):
            chunks, i = [], 0
            while i < len(ids):
                n = rng.randint(1, 6)
                chunks.append(ids[i:i + n])
                i += n
            _check(tok, _stream(tok, prompt, chunks, skip=skip), ids, skip=skip)


def test_incomplete_tail_is_held_until_flush(tok):
    ids = tok.encode("ok 🚀")
    cut = next(k for k in range(len(ids), 0, -1) if tok.decode(ids[:k]).endswith(RF))
    detok = IncrementalDetokenizer(tok, [])
    shown = "".join(detok.add(i) for i in ids[:cut])
    assert RF not in shown and shown.rstrip() == "ok"
    tail = detok.flush()
    assert shown + tail == tok.decode(ids[:cut]) and tail.endswith(RF)
    assert detok.flush() == ""


def test_single_int_and_output_ids(tok):
    ids = tok.encode("abc 你")
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == "abc 你" and detok.output_ids == ids


def test_mid_character_says_when_text_is_held_for_a_split_character(tok):
    """`mid_character` is True exactly while the ids so far end inside a UTF-8 character (what a client decoding the
    ids itself must wait for: m3_ids' utf8_stream_boundaries)."""
    ids = tok.encode("a 🚀 b 你好")
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    seen = []
    for k, i in enumerate(ids, 1):
        detok.add(i)
        seen.append(detok.mid_character)
        assert detok.mid_character == tok.decode(ids[:k]).endswith(RF), k
    assert any(seen) and not all(seen)  # the text does split a character somewhere
    detok.add(ids[:1])
    detok.flush()
    assert not detok.mid_character
