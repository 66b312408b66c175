"""benchmarks/recall_plateau.py: the rows ask what the context says, and both models train on them."""
import importlib.util
import pathlib

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "recall_plateau.py"
spec = importlib.util.spec_from_file_location("recall_plateau", _PATH)
rp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rp)


@pytest.mark.parametrize("colon", [False, True])
def test_every_answered_value_is_the_one_its_key_has_in_the_context(colon):
    pairs, w = 6, 3 if colon else 2  # tokens a line: key (COLON) value
    ids, answered = rp.batch(pairs, 5, torch.Generator().manual_seed(3), colon)
    assert ids.shape == (5, 2 * w * pairs + 1) and answered.sum().item() == 5 * pairs
    for row, mask in zip(ids.tolist(), answered.tolist()):
        context = dict(zip(row[0:w * pairs:w], row[w - 1:w * pairs:w]))
        assert len(context) == pairs and row[w * pairs] == rp.SEPARATOR
        assert all(row[i] == rp.COLON for i in range(1, w * pairs, w)) if colon else rp.COLON not in row
        asked = [(row[i - w + 1], row[i]) for i, m in enumerate(mask) if m]
        assert sorted(k for k, _ in asked) == sorted(context)  # every key asked once
        assert all(context[k] == v for k, v in asked)
        assert all(rp.KEYS[0] <= k < rp.KEYS[1] for k in context)
        assert all(rp.VALUES[0] <= v < rp.VALUES[1] for v in context.values())


def test_question_rows_ask_each_key_as_a_retrieval_turn():
    """--question: after the context, each asked pair is QUESTION key QUESTION_END REPLY key value; only the value
    is answered, and it is the one the key has in the context."""
    pairs = 5
    ids, answered = rp.batch(pairs, 4, torch.Generator().manual_seed(1), question=True)
    assert ids.shape == (4, 2 * pairs + 1 + 6 * pairs) and answered.sum().item() == 4 * pairs
    for row, mask in zip(ids.tolist(), answered.tolist()):
        context = dict(zip(row[0:2 * pairs:2], row[1:2 * pairs:2]))
        turns = [row[2 * pairs + 1 + 6 * t:2 * pairs + 1 + 6 * (t + 1)] for t in range(pairs)]
        assert all(t[0] == rp.QUESTION and t[2] == rp.QUESTION_END and t[3] == rp.REPLY and t[1] == t[4]
                   and context[t[4]] == t[5] for t in turns)
        assert sorted(t[1] for t in turns) == sorted(context)
        assert [i for i, m in enumerate(mask) if m] == [2 * pairs + 6 * (t + 1) for t in range(pairs)]


@pytest.mark.parametrize("question", [False, True])
def test_word_like_rows_keep_every_answer_on_its_keys_value(question):
    """--preamble, --newline, --values, --replacement: the fixed opening, a NEWLINE after every line, values from
    the first 45 ids, asked keys drawn with replacement; each answered value is still its key's in the context."""
    pairs, pre = 6, 40
    g = torch.Generator().manual_seed(5)
    ids, answered = rp.batch(pairs, 16, g, question=question, newline=True, n_values=45, preamble=pre,
                             replacement=True)
    w = 3  # key value NEWLINE
    asked_w = w + (4 if question else 0)
    assert ids.shape == (16, pre + w * pairs + 1 + asked_w * pairs) and answered.sum().item() == 16 * pairs
    repeats = 0
    for row, mask in zip(ids.tolist(), answered.tolist()):
        assert row[:pre] == [rp.PREAMBLE[0] + i % (rp.PREAMBLE[1] - rp.PREAMBLE[0]) for i in range(pre)]
        body = row[pre:pre + w * pairs]
        assert body[2::w] == [rp.NEWLINE] * pairs and row[pre + w * pairs] == rp.SEPARATOR
        context = dict(zip(body[0::w], body[1::w]))
        assert len(context) == pairs and all(rp.VALUES[0] <= v < rp.VALUES[0] + 45 for v in context.values())
        at = [i for i, m in enumerate(mask) if m]
        assert all(row[i + 1] == rp.NEWLINE and context[row[i - 1]] == row[i] for i in at)
        repeats += len({row[i - 1] for i in at}) < pairs
    assert repeats >= 8  # with replacement most rows ask some key twice


@pytest.mark.parametrize("args", [["--arch", "plain", "--qk-norm", "--rotary-fraction", "0.5"],
                                  ["--arch", "m3", "--mlp", "dense", "--init-std", "0.05"],
                                  ["--arch", "m3", "--train-init", "fan_in", "--mlp-frozen-steps", "20", "--colon",
                                   "--pairs", "2", "--pairs-to", "4"],
                                  ["--arch", "plain", "--question", "--question-from", "20"],
                                  ["--arch", "plain", "--newline", "--values", "45", "--preamble", "20",
                                   "--replacement"]])
def test_a_short_run_lowers_the_loss_and_writes_its_curve(args, tmp_path):
    out = tmp_path / "r.json"
    r = rp.main(args + ["--steps", "40", "--log-every", "10", "--rows", "8", "--out", str(out)])
    loss = [c["loss"] for c in r["curve"]]
    assert len(loss) == 4 and loss[-1] < loss[0] and all(0 <= c["acc"] <= 1 for c in r["curve"])
    assert out.read_text().count('"step"') == 4


@pytest.mark.parametrize("args", [["--pairs", "0"], ["--pairs", "257"], ["--steps", "0"], ["--log-every", "0"],
                                  ["--rotary-fraction", "1.5"], ["--init-only", "embed"],
                                  ["--pairs-to", "300"], ["--pairs", "4", "--pairs-to", "2"],
                                  ["--arch", "plain", "--train-init", "fan_in"], ["--init-std", "wide"],
                                  ["--values", "0"], ["--values", "201"], ["--preamble", "-1"]])
def test_a_bad_option_is_refused_before_any_work(args, capsys):
    with pytest.raises(SystemExit) as e:
        rp.main(args)
    captured = capsys.readouterr()
    assert e.value.code == 2 and args[0] in captured.err and not captured.out  # named, and no step ran

