"""The learned model on CPU (issue 27): the engine in fp32 answers a fixed slice of every eval set exactly as the
transformers 5.25 reference does and as DSpark with greedy drafts does, the slice's accuracy clears a threshold,
and the learned draft is accepted. Runs on the committed checkpoint
(models/m3-tiny-learned); $M3SERVE_LEARNED_DIR points it at another one (a random-weight `make_learned` checkpoint
exercises the parity test; only the accuracy test needs trained weights)."""
from __future__ import annotations

import json
import os

import pytest

from m3serve.learn.evaluate import format_table, openai_reply, reply_text, score
from m3serve.learn.tasks import TASKS, make_examples
from m3serve.text.reasoning import extract
from support.required import require

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEARNED_DIR = os.environ.get("M3SERVE_LEARNED_DIR", os.path.join(ROOT, "models", "m3-tiny-learned"))
SLICE = 16  # eval examples per task
MIN_TASK_ACCURACY = 0.875  # every task: at least 14 of its 16
MIN_MEAN_ACCURACY = 0.95  # over the 80
MIN_TOOL_CALL_ACCEPTED = 4.0


@pytest.fixture(scope="module")
def report():
    if not os.path.isfile(os.path.join(LEARNED_DIR, "config.json")):
        pytest.skip("no learned checkpoint committed yet")
    require("transformers")
    from m3serve.learn.evaluate import evaluate

    return evaluate(LEARNED_DIR, n=SLICE, paths=("reference", "engine", "dspark-greedy"), device="cpu",
                    dtype="float32", slack=4)


def test_engine_answers_as_the_reference_does(report):
    assert "skipped" not in report["paths"]["reference"], report["paths"]["reference"]
    ref, eng = report["replies"]["reference"], report["replies"]["engine"]
    for task in TASKS:
        assert len(eng[task]) == SLICE
        for i, (a, b) in enumerate(zip(eng[task], ref[task])):
            assert a == b, (task, i, a, b)
    assert report["paths"]["engine"]["tasks"] == report["paths"]["reference"]["tasks"]


def test_dspark_greedy_answers_as_the_engine_does(report):
    """DSpark (7 drafts, greedy) changes no reply, and the learned draft is accepted: on tool calls, whose replies are
    markup the draft can predict, a speculative step emits at least MIN_TOOL_CALL_ACCEPTED tokens (5.4 on the H100,
    docs/quality.md; an untrained draft gives about 1)."""
    assert report["same_replies_as_engine"]["dspark-greedy"], report["replies_unlike_engine"]["dspark-greedy"]
    tasks = report["paths"]["dspark-greedy"]["tasks"]
    print({t: round(s["mean_accepted_length"], 2) for t, s in tasks.items()})
    assert tasks["tool_call"]["mean_accepted_length"] >= MIN_TOOL_CALL_ACCEPTED, tasks["tool_call"]


def test_slice_accuracy(report):
    acc = {t: s["accuracy"] for t, s in report["paths"]["engine"]["tasks"].items()}
    print(format_table(report))
    assert min(acc.values()) >= MIN_TASK_ACCURACY, acc
    assert sum(acc.values()) / len(acc) >= MIN_MEAN_ACCURACY, acc


# ---------------------------------------------------------------- the report's pieces, without a model

def test_score_and_table():
    sets = {t: make_examples(t, "eval", 3) for t in ("arithmetic", "tool_call")}
    texts = {t: [ex.answer for ex in exs] for t, exs in sets.items()}
    texts["tool_call"][1] = "no call"
    got = score(sets, texts)
    assert got["arithmetic"] == {"correct": 3, "n": 3, "accuracy": 1.0}
    assert got["tool_call"]["correct"] == 2
    got["tool_call"].update(acceptance_rate=0.5, mean_accepted_length=4.5)
    report = {"tasks": list(sets), "paths": {"engine": {"seconds": 1.0, "tasks": got},
                                             "reference": {"skipped": "no transformers"}}}
    table = format_table(report).splitlines()
    assert table[0].split() == ["path", "arithmetic", "tool_call", "seconds"]
    assert table[1].split()[:3] == ["engine", "100.0", "66.7"] and "len 4.50" in table[1]
    assert "skipped" in table[2]
    with pytest.raises(ValueError):  # a reply missing is an error, not a silent zip
        score(sets, {"arithmetic": texts["arithmetic"][:2], "tool_call": texts["tool_call"]})


def test_reply_text_keeps_special_tokens_and_drops_eos(tmp_path):
    from m3serve.learn.tokenizer import build_tokenizer
    from m3serve.text.tokenizer import Tokenizer

    build_tokenizer(str(tmp_path))
    tok = Tokenizer.from_pretrained(str(tmp_path))
    ex = make_examples("tool_call", "eval", 1)[0]
    ids = tok.encode(ex.answer) + [tok.eos_token_id]
    assert reply_text(tok, ids) == ex.answer and ex.check(reply_text(tok, ids))
    assert not ex.check(tok.decode(ids))  # special tokens skipped: the call markup is gone


def test_eval_tasks_command(tmp_path, capsys):
    """The CLI end to end on a random-weight learned checkpoint: table, JSON fields, DSpark's acceptance per task,
    and greedy DSpark answering as the engine does."""
    import json

    from m3serve.cli import main
    from m3serve.learn.config import make_learned

    model = str(tmp_path / "m")
    make_learned(model, dtype="float32", random_dspark=True)
    out = str(tmp_path / "eval.json")
    assert main(["eval-tasks", "--model", model, "--n", "2", "--tasks", "arithmetic", "multi_turn", "--paths",
                 "engine", "dspark-greedy", "--dtype", "float32", "--out", out]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["path", "arithmetic", "multi_turn", "seconds"]
    report = json.load(open(out))
    assert report["tasks"] == ["arithmetic", "multi_turn"] and report["n_per_task"] == 2
    assert {"date", "device_name", "command", "commit"} <= set(report) and "eval-tasks" in report["command"]
    assert report["same_replies_as_engine"] == {"dspark-greedy": True}
    assert all(v["n"] == 0 and v["of"] == 2 for v in report["replies_unlike_engine"]["dspark-greedy"].values())
    spec = report["paths"]["dspark-greedy"]["tasks"]["arithmetic"]
    assert spec["num_drafts"] > 0 and 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
    assert "replies" not in report


def test_unlike_counts_and_shows_the_replies_that_differ():
    from m3serve.learn.evaluate import unlike

    base = {"a": ["1", "2", "3"], "b": ["x"]}
    got = unlike(base, {"a": ["1", "9", "8"], "b": ["x"]}, show=1)
    assert got == {"a": {"n": 2, "of": 3, "first": [{"i": 1, "engine": "2", "path": "9"}]},
                   "b": {"n": 0, "of": 1, "first": []}}


def test_openai_messages_are_written_back_as_the_models_text():
    """The openai path: a chat completion's parsed message (what the gateway sends) becomes the reply text the model
    wrote (tool calls, think block and all), which `check` scores; a wrong parse does not pass."""
    def message(ex, **change):
        reply = {"content": ex.expected if ex.task != "tool_call" else None, "reasoning_content": None}
        if ex.task == "tool_call":
            reply["tool_calls"] = [{"id": "call_0", "type": "function", "function": {
                "name": ex.expected["name"], "arguments": json.dumps(ex.expected["arguments"])}}]
        if ex.task == "reasoning":  # the trace: what the reasoning parser takes out of the answer
            reply["reasoning_content"] = extract(ex.answer, ex.chat_template_kwargs.get("thinking_mode"))[0]
        return {**reply, **change}

    for task in TASKS:
        for ex in make_examples(task, "eval", 3):
            text = ex.reply_text(openai_reply(message(ex)))
            assert text == ex.answer and ex.check(text), (task, text, ex.answer)
            wrong = message(ex, content="7") if task != "tool_call" else message(ex, tool_calls=[
                {"type": "function", "function": {"name": ex.expected["name"], "arguments": "{}"}}])
            assert not ex.check(ex.reply_text(openai_reply(wrong))), task


def test_nvfp4_a8_path_runs_the_quantized_model_on_fp8_dots(monkeypatch, tmp_path):
    """`--paths nvfp4-a8`: the nvfp4 checkpoint's engine, built and run inside `tuned(mma=False, a8=True)` (the
    portable expert kernels with FP8 dots at every step); the nvfp4 path itself under the default tuning."""
    from m3serve.kernels import dispatch
    from m3serve.learn import evaluate as E

    seen = []
    monkeypatch.setattr(E, "_quantized", lambda model_dir, tmp: os.path.join(tmp, "nvfp4"))
    monkeypatch.setattr(E, "generate_engine", lambda model, s, t, b, **kw: seen.append(
        (model, dispatch.tuning().a8, dispatch.tuning().mma)) or ({}, {}))
    for path in ("nvfp4-a8", "nvfp4"):
        E.path_runner(path, "m", str(tmp_path), "cpu", "float32", None, 64)({}, None, {})
    assert seen == [(os.path.join(str(tmp_path), "nvfp4"), True, False), (os.path.join(str(tmp_path), "nvfp4"),
                                                                          False, True)]
    assert not dispatch.tuning().a8
