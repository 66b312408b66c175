"""The learned model's interface (m3serve.learn): tasks and their splits, the tokenizer, rendering into training rows,
the model config."""
from __future__ import annotations

import json
import re

import pytest

from m3serve.learn import tasks
from m3serve.learn.config import learned_config, make_learned, selected_span
from m3serve.learn.data import make_rows
from m3serve.learn.render import prompt_ids, render
from m3serve.learn.tasks import RETRIEVAL_PAIRS, TASKS, Example, make_examples, split_of
from m3serve.learn.tokenizer import build_tokenizer
from m3serve.text.reasoning import THINK_END
from m3serve.text.tokenizer import Tokenizer
from m3serve.text.tool_parser import CALL_START, NS, parse_tool_calls
from support.required import require


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("learned_tok")
    return str(d), build_tokenizer(str(d))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_pretrained(tok_dir[0])


def _problem(ex: Example) -> str:
    return json.dumps([ex.messages, ex.tools], sort_keys=True)


# ------------------------------------------------------------------ tasks

@pytest.mark.parametrize("task", TASKS)
def test_examples_are_seeded(task):
    a = make_examples(task, "train", 20, seed=3)
    assert a == make_examples(task, "train", 20, seed=3)
    assert [_problem(x) for x in a] != [_problem(x) for x in make_examples(task, "train", 20, seed=4)]
    assert make_examples(task, "train", 5, seed=3) == a[:5]
    assert all(x.task == task for x in a)


@pytest.mark.parametrize("task", TASKS)
def test_train_and_eval_never_overlap(task):
    train = make_examples(task, "train", 3000)
    evals = make_examples(task, "eval", 400)
    assert {x.key for x in train}.isdisjoint(x.key for x in evals)
    assert {_problem(x) for x in train}.isdisjoint(_problem(x) for x in evals)
    assert all(split_of(task, x.key) == "eval" for x in evals)
    assert all(split_of(task, x.key) == "train" for x in train)
    assert len({_problem(x) for x in evals}) > 0.6 * len(evals)  # varied, not one problem repeated


def test_the_disjointness_check_can_fail():
    """Two draws of the same split do share problems (2-digit products are only 10^4): the check above would see a
    leak if the eval split were drawn like the train split."""
    a = {x.key for x in make_examples("arithmetic", "train", 3000, seed=0)}
    b = {x.key for x in make_examples("arithmetic", "train", 3000, seed=1)}
    assert len(a & b) > 100


def test_unknown_task_or_split():
    with pytest.raises(ValueError, match="unknown task"):
        make_examples("poetry", "train", 1)
    with pytest.raises(ValueError, match="unknown split"):
        make_examples("arithmetic", "test", 1)


def _wrong(ex: Example) -> str:
    """The answer with its last digit or letter changed (for a tool call: a 0 added to its first argument)."""
    if ex.task == "tool_call":
        v = next(iter(ex.expected["arguments"].values()))
        wrong = ex.answer.replace(f">{v}{NS}", f">{v}0{NS}", 1)
        assert wrong != ex.answer
        return wrong
    i = max(j for j, c in enumerate(ex.answer) if c.isalnum())
    c = ex.answer[i]
    return ex.answer[:i] + ("0" if c == "9" else "a" if c == "z" else "A" if c == "Z" else chr(ord(c) + 1)) \
        + ex.answer[i + 1:]


@pytest.mark.parametrize("task", TASKS)
def test_check_accepts_the_answer_only(task):
    for ex in make_examples(task, "eval", 30):
        assert ex.check(ex.answer) and ex.check(ex.answer + "[e~[")
        assert not ex.check(_wrong(ex)), ex.answer
        assert not ex.check("")
        assert not ex.check(ex.answer + " extra")


def test_arithmetic_answers_are_right():
    for ex in make_examples("arithmetic", "eval", 100):
        q = ex.messages[-1]["content"]
        a, op, b = re.fullmatch(r"(?:What is |Compute )?(\d+) ([-+*]) (\d+)(?:\?|\.| = \?)", q).groups()
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert ex.answer == str(want) and want >= 0
        if op == "*":
            assert sorted([len(a), len(b)])[0] == 1 and max(len(a), len(b)) <= 2
        else:
            assert len(a) <= 3 and len(b) <= 3


def test_reasoning_answer_is_a_think_block_then_the_number():
    for ex in make_examples("reasoning", "eval", 20):
        assert ex.chat_template_kwargs == {"thinking_mode": "enabled"}
        thought, _, final = ex.answer.partition(THINK_END)
        assert final == ex.expected and thought.endswith(f"= {final}.")
        assert not ex.check(final)  # the think block is required


def test_tool_call_answer_is_m3_markup_with_the_users_arguments():
    seen = set()
    for ex in make_examples("tool_call", "eval", 40):
        assert ex.answer.startswith(CALL_START)
        content, calls = parse_tool_calls(ex.answer, ex.tools)
        assert content == "" and calls == [ex.expected]
        names = [t["function"]["name"] for t in ex.tools]
        assert 1 <= len(names) <= 3 and ex.expected["name"] in names
        for v in ex.expected["arguments"].values():
            assert str(v) in ex.messages[-1]["content"]
        seen.add(len(names))
    assert seen == {1, 2, 3}
    ex = make_examples("tool_call", "eval", 1)[0]
    args = {k: (v + 1 if isinstance(v, int) else v + "x") for k, v in ex.expected["arguments"].items()}
    other = Example(ex.task, ex.messages, ex.tools, ex.chat_template_kwargs, ex.answer, ex.key,
                    {"name": ex.expected["name"], "arguments": args})
    assert not other.check(ex.answer)


def test_multi_turn_answer_comes_from_an_earlier_turn():
    for ex in make_examples("multi_turn", "eval", 30):
        users = [m["content"] for m in ex.messages if m["role"] == "user"]
        assert 2 <= len(users) <= 3 and [m["role"] for m in ex.messages][-1] == "user"
        assert any(ex.expected in u for u in users[:-1]) and ex.expected not in users[-1]


# ------------------------------------------------------------------ tokenizer

def test_tokenizer_files_and_ids(tok_dir, tok):
    d, info = tok_dir
    # the BPE stops at BASE_VOCAB_SIZE or where the corpus has no pair left to merge (~1,500 with word retrieval)
    assert 1000 <= info["vocab_size"] <= 2048 and info["vocab_size"] == tok.vocab_size
    assert info["eos_token_id"] == tok.eos_token_id == tok.token_id("[e~[")
    assert info["bos_token_id"] == tok.bos_token_id == tok.token_id("]~!b[")
    for t in ("<mm:think>", "</mm:think>", "]<]minimax[>["):
        assert tok.encode(t) == [tok.token_id(t)]
    from m3serve.text.tiny_chat_template import TINY_M3_CHAT_TEMPLATE
    assert tok.chat_template == TINY_M3_CHAT_TEMPLATE


def test_digits_are_single_tokens(tok):
    ids = tok.encode("x 90817 + 2634")
    digits = [t for t in tok.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]
    assert digits == list("90817") + list("2634")
    assert tok.decode(ids) == "x 90817 + 2634"


def test_tokenizer_is_seeded(tok_dir, tmp_path):
    build_tokenizer(str(tmp_path))
    assert open(f"{tmp_path}/tokenizer.json").read() == open(f"{tok_dir[0]}/tokenizer.json").read()


def test_transformers_reads_the_same_tokenizer(tok_dir, tok):
    transformers = require("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tok_dir[0])
    for task in TASKS:
        ex = make_examples(task, "eval", 1)[0]
        text = tok.apply_chat_template(ex.messages, tools=ex.tools, **ex.chat_template_kwargs)
        assert hf.apply_chat_template(ex.messages, tools=ex.tools, tokenize=False, add_generation_prompt=True,
                                      **ex.chat_template_kwargs) == text
        assert hf.encode(text + ex.answer, add_special_tokens=False) == tok.encode(text + ex.answer)


# ------------------------------------------------------------------ render

@pytest.mark.parametrize("task", TASKS)
def test_render_rows(tok, task):
    for ex in make_examples(task, "train", 10):
        ids, mask = render(ex, tok)
        assert len(ids) == len(mask) and mask[0] == 0 and mask[-1] == 1
        n = mask.index(1)
        assert set(mask[n:]) == {1}  # one target span, at the end
        assert ids[:n] == prompt_ids(ex, tok) and ids[0] == tok.bos_token_id
        assert ids[-1] == tok.eos_token_id
        assert tok.decode(ids[n:], skip_special_tokens=False) == ex.answer + "[e~["
        assert ex.check(tok.decode(ids[n:], skip_special_tokens=False))
        # tokenizing the whole conversation at once gives the same ids: no merge across the boundary
        assert tok.encode(tok.decode(ids, skip_special_tokens=False)) == ids


def test_a_retrieval_key_and_value_are_the_same_token_in_context_question_and_answer(tok):
    """Copying is one token match: the asked key is the token its context line starts with, its value the next token,
    and the answer is that line's two tokens (key, value)."""
    for ex in make_examples("retrieval", "eval", 10) + make_examples("retrieval", "train", 10):
        ids = prompt_ids(ex, tok)
        q = ids.index(tok.encode(" for")[0], len(ids) - 12)
        key = ids[q + 1]
        assert tok.decode([key]).strip() + "?" == ex.messages[0]["content"].rsplit(" ", 1)[-1]
        at = [i for i in range(q) if ids[i] == key]
        assert len(at) == 1 and tok.decode([ids[at[0] + 1]]).strip() == ex.answer.split()[1]
        assert tok.encode(ex.answer) == ids[at[0]:at[0] + 2]


def n_pairs(ex):
    return len(tasks.context_pairs(ex))


def test_retrieval_contexts_are_4x_the_msa_span(tok):
    """The eval's list of pairs alone is at least 4x the tokens MSA selects; the pairs are one line, no separator
    between them (with a newline after each, a micro model had not learned the lookup by step 1,400:
    docs/quality.md)."""
    cfg = learned_config(2048, 0, 1)
    for ex in make_examples("retrieval", "eval", 20):
        ids = prompt_ids(ex, tok)
        pairs = tok.encode("".join(f" {k} {v}" for k, v in tasks.context_pairs(ex)))
        assert len(pairs) == 2 * RETRIEVAL_PAIRS >= 4 * selected_span(cfg) and len(ids) <= 1024
        at = next(i for i in range(len(ids)) if ids[i:i + len(pairs)] == pairs)  # the prompt holds them in a row
        assert tok.decode(ids[at - 1:at]) == "\n" and tok.decode(ids[at + len(pairs):at + len(pairs) + 1]) == "\n"
    # training contexts vary from 2 pairs up to the eval's length, log-uniformly: half hold at most ~23
    pairs = sorted(n_pairs(ex) for ex in make_examples("retrieval", "train", 200))
    assert pairs[0] == 2 and 0.8 * RETRIEVAL_PAIRS <= pairs[-1] <= RETRIEVAL_PAIRS and len(set(pairs)) > 20
    assert 12 <= pairs[len(pairs) // 2] <= 36
    assert {n_pairs(ex) for ex in make_examples("retrieval", "eval", 50)} == {RETRIEVAL_PAIRS}


def test_the_retrieval_first_phase_draws_short_training_contexts():
    """max_pairs caps the training contexts (log-uniform from 2 up to it); it is refused for the eval split, for
    other tasks and outside 2..RETRIEVAL_PAIRS."""
    pairs = [n_pairs(ex) for ex in make_examples("retrieval", "train", 300, seed=2, max_pairs=16)]
    assert min(pairs) == 2 and max(pairs) == 16 and len(set(pairs)) == 15
    assert 4 <= sorted(pairs)[len(pairs) // 2] <= 8
    for task, split, cap, match in (("retrieval", "eval", 16, "max_pairs"), ("arithmetic", "train", 16, "max_pairs"),
                                    ("retrieval", "train", 1, "2-256"), ("retrieval", "train", 257, "2-256")):
        with pytest.raises(ValueError, match=match):
            make_examples(task, split, 3, max_pairs=cap)
    # pairs: held-out contexts of one shorter length (probes of the lookup), still the eval split's problems
    short = make_examples("retrieval", "eval", 20, seed=1, pairs=16)
    assert {n_pairs(ex) for ex in short} == {16}
    assert all(split_of("retrieval", ex.key) == "eval" for ex in short)
    for task, split, n, match in (("retrieval", "train", 16, "pairs"), ("tool_call", "eval", 16, "pairs"),
                                  ("retrieval", "eval", 1, "2-256"), ("retrieval", "eval", 257, "2-256")):
        with pytest.raises(ValueError, match=match):
            make_examples(task, split, 3, pairs=n)


@pytest.mark.parametrize("form", ["chat", "plain"])
def test_recital_rows_recite_pairs_drawn_with_replacement_the_loss_on_the_values(tok_dir, tok, form):
    """A recital row (the retrieval-first phase's, data.Job recital="chat" or "plain"): the list without a question
    about one key, then the reply reciting as many pairs as it has, drawn with replacement (no elimination: some pairs
    twice, some never); the loss is on the value tokens alone, each right after its key. "chat": the ids are the chat
    template's text of that conversation tokenized whole; "plain": BOS, the list, a newline, the recital, the end of
    turn, and nothing else."""
    rows = make_rows(tok_dir[0], ("retrieval",), "train", 40, 3, workers=1, packed={"retrieval": 32}, max_pairs=16,
                     recital=form)
    examples = make_examples("retrieval", "train", 40, seed=3000, max_pairs=16)  # the job's own draw (seed*1000)
    assert len(rows) == len(examples) == 40
    repeated = 0
    for (ids, mask, task), ex in zip(rows, examples):
        assert task == TASKS.index("retrieval") and len(ids) == len(mask)
        head = ex.messages[0]["content"].rsplit("\n", 1)[0]
        words = head.split("\n")[1].split()
        pairs = list(zip(words[::2], words[1::2]))
        text = tok.decode(ids, skip_special_tokens=False)
        reply = text.split(THINK_END)[-1] if form == "chat" else text.split("\n")[-1]
        words = reply.removesuffix("[e~[").split()
        recited = list(zip(words[::2], words[1::2]))
        assert len(recited) == len(pairs) and set(recited) <= set(pairs)
        repeated += len(set(recited)) < len(pairs)
        assert "What is the code" not in text
        assert tok.encode(text) == ids  # no merge across the pieces the mask was built from
        values = [i for i, m in enumerate(mask) if m]
        assert [tok.decode([ids[i]]).strip() for i in values] == [v for _k, v in recited]
        assert all(tok.decode([ids[i - 1]]).strip() == k for i, (k, _v) in zip(values, recited))
        spoken = "".join(f" {k} {v}" for k, v in recited)
        if form == "plain":
            assert ids == [tok.bos_token_id] + tok.encode(head.split("\n")[1] + "\n" + spoken) + [tok.eos_token_id]
            continue
        assert "Repeat the codes." in text
        conversation = [{"role": "user", "content": head + "\nRepeat the codes."},
                        {"role": "assistant", "content": spoken}]
        full = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=False,
                                       thinking_mode="disabled")  # ... the reply, the end of turn, a newline
        assert full[:len(ids)] == ids and tok.decode(full[len(ids):]) == "\n"
    assert repeated >= 30
    for tasks_, recital, match in ((("arithmetic", "retrieval"), "chat", "recital"), (("retrieval",), True, "one of")):
        with pytest.raises(ValueError, match=match):
            make_rows(tok_dir[0], tasks_, "train", 4, 3, workers=1, recital=recital)


# ------------------------------------------------------------------ the engine's chat path, config

@pytest.fixture(scope="module")
def random_learned(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("learned_rand"))
    return d, make_learned(d, dtype="float32")


def test_engine_chat_template_gives_the_render_prompt(random_learned):
    from m3serve.config import EngineConfig
    from m3serve.engine.llm_engine import LLMEngine
    from m3serve.engine.sampling_params import SamplingParams

    d, _ = random_learned
    eng = LLMEngine(EngineConfig(model=d, device="cpu", dtype="float32", max_model_len=1024))
    try:
        for task in TASKS:
            for ex in make_examples(task, "eval", 3):
                kwargs = dict(ex.chat_template_kwargs, tools=ex.tools)
                req = eng.prepare_request(ex.messages, None, SamplingParams(max_tokens=8), None, kwargs)
                assert req.prompt_token_ids == render(ex, eng.tokenizer)[0][:len(req.prompt_token_ids)]
                assert req.prompt_token_ids == prompt_ids(ex, eng.tokenizer)
        assert eng.eos_token_ids == {eng.tokenizer.eos_token_id}
    finally:
        eng.shutdown()


def test_learned_config_has_every_layer_kind(random_learned):
    _, cfg = random_learned
    assert {"full_attention", "minimax_m3_sparse"} == set(cfg.layer_types)
    assert {"dense", "sparse"} == set(cfg.mlp_layer_types)
    assert cfg.shared_intermediate_size > 0 and cfg.rotary_dim < cfg.head_dim
    assert (cfg.index_block_size, cfg.index_topk_blocks) == (32, 4) and cfg.max_position_embeddings >= 2048
    from m3serve.model.tiny import random_state
    n = sum(t.numel() for t in random_state(cfg).values())
    assert 10e6 <= n <= 15e6, n
