"""Training rows that keep coming while the target trains (m3serve.learn.data.FreshRows, issue 27)."""
import dataclasses
import json
import os
import time

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("USE_HUB_KERNELS", "0")

from m3serve.learn.data import FreshRows, make_rows, row_jobs  # noqa: E402
from m3serve.learn.tokenizer import build_tokenizer  # noqa: E402

TASKS = ("arithmetic", "multi_turn")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(out)
    return out


def _wait(cond, timeout=60.0):
    end = time.time() + timeout
    while not cond() and time.time() < end:
        time.sleep(0.05)
    return cond()


def test_fresh_rows_arrive_with_new_seeds_up_to_the_cap_and_stop_ends_the_pool(tok_dir):
    def jobs(r):
        return row_jobs(tok_dir, TASKS, "train", 6, 1000 + r)

    rows: list = []
    fresh = FreshRows(rows, jobs, workers=1, max_rows=30)
    try:
        rows += make_rows(tok_dir, TASKS, "train", 6, 0, pool=fresh.pool)
        first = [tuple(r[0]) for r in rows]
        assert first == [tuple(r[0]) for r in make_rows(tok_dir, TASKS, "train", 6, 0, workers=1)]  # same rows
        fresh.start()
        assert _wait(lambda: fresh.added >= 12)
    finally:
        report = fresh.stop()
    assert len(rows) <= 30 and report["rows_added"] == fresh.added == len(rows) - len(first) >= 12
    new = [tuple(r[0]) for r in rows[len(first):]]
    assert len(set(new) - set(first)) >= 10  # new seeds: new problems
    assert report["error"] is None
    n = len(rows)
    time.sleep(0.3)
    assert len(rows) == n  # stopped: nothing more arrives


def test_a_failing_stream_reports_its_error_and_leaves_the_rows(tok_dir):
    rows: list = [([1, 2], [0, 1], 0)]
    fresh = FreshRows(rows, lambda r: [("no_such_task", "train", 2, r, tok_dir, 1)], workers=1)
    fresh.start()
    try:
        assert _wait(lambda: fresh.error is not None)
    finally:
        report = fresh.stop()
    assert report["error"].startswith("ValueError") and rows == [([1, 2], [0, 1], 0)]


def test_a_whole_run_trains_on_rows_rendered_while_it_runs(tmp_path):
    """train-learned end to end on a micro model with the default recipe (the retrieval-first phase included): the
    run's log counts the rows that arrived during training, and the checkpoint and log are written."""
    from m3serve.learn.train import TrainConfig, run

    from support.learned import MICRO_2L as micro
    tc = TrainConfig(out=str(tmp_path / "m"), device="cpu", tasks=(*TASKS, "retrieval"), train_examples=8,
                     eval_examples=4, workers=1, tokens_per_batch=4096, max_steps=40, warmup_steps=2, log_every=10,
                     budget_s=600, reserve_s=0, draft_frac=0.0, draft_max_steps=2, draft_tokens_per_batch=1024,
                     draft_anchors=4, model_overrides=micro, max_rows=200, focus_examples=16)
    result = run(tc)
    fresh = result["data"]["fresh"]
    assert fresh["error"] is None and 0 < fresh["rows_added"] <= 200 - result["data"]["train_rows"]
    assert result["target"]["steps"] == 40
    # the retrieval-first phase is on by default: its plain recital rows were rendered and it ran first
    assert result["data"]["retrieval_first_rows"] == 16 and result["target"]["retrieval_first"]["step"] <= 12
    parts = result["data"]["seconds_by_part"]  # where the data phase's time went: parts of its whole
    assert set(parts) == {"setup", "train_rows", "retrieval_first_rows", "eval_rows"} and min(parts.values()) >= 0
    assert sum(parts.values()) <= result["data"]["seconds"] + 0.2
    with open(os.path.join(tc.out, "train_log.json")) as f:
        assert json.load(f)["data"]["fresh"] == fresh
    # a run that goes on from it keeps its tokenizer, though this run's seed builds another one
    from m3serve.learn.tokenizer import build_tokenizer, copy_tokenizer

    other = str(tmp_path / "other")
    build_tokenizer(other, seed=3)
    assert _differs(other, tc.out)  # so a run that built its own would refuse the weights (load_weights)
    assert copy_tokenizer(tc.out, str(tmp_path / "copy")) == build_tokenizer(str(tmp_path / "again"), seed=0)
    more = dataclasses.replace(tc, out=str(tmp_path / "m2"), init_from=tc.out, seed=3, max_steps=4, dense_frac=0.0,
                               sparse_ramp_frac=0.0, fresh_rows=False)
    assert run(more)["target"]["steps"] == 4
    assert not _differs(more.out, tc.out)


def _differs(a: str, b: str) -> bool:
    with open(os.path.join(a, "tokenizer.json")) as fa, open(os.path.join(b, "tokenizer.json")) as fb:
        return json.load(fa) != json.load(fb)
