"""benchmarks/bench_learned_server.py on the CPU, as a test of the script itself: a random-weight learned checkpoint
with a random DSpark draft, served twice by the real tritonserver (`m3` plain, `m3_spec` with DSpark), two tasks at
batch 1 and 2; the same code path the H200 runs on the trained checkpoint."""
from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]
TASKS = ["arithmetic", "multi_turn"]


def test_bench_learned_server_runs(tmp_path, capsys):
    import bench_learned_server

    from m3serve.learn.config import make_learned

    model, out = str(tmp_path / "m"), str(tmp_path / "out")
    make_learned(model, dtype="float32", random_dspark=True)
    assert bench_learned_server.main(["--model", model, "--device", "cpu", "--dtype", "float32", "--n", "2",
                                      "--warmup-n", "1", "--batches", "1,2", "--tasks", *TASKS, "--num-pages", "256",
                                      "--out", out]) == 0
    with open(os.path.join(out, "bench_learned_server.json")) as f:
        res = json.load(f)
    assert {"date", "device_name", "command", "commit"} <= set(res) and "--batches 1,2" in res["command"]
    spec_cfg = json.load(open(os.path.join(out, "repository", "m3_spec", "1", "model.json")))
    assert spec_cfg["speculative_config"]["num_speculative_tokens"] == 7
    assert "speculative_config" not in json.load(open(os.path.join(out, "repository", "m3", "1", "model.json")))
    rows = res["rows"]
    assert [(r["task"], r["batch"]) for r in rows] == [(t, b) for b in (1, 2) for t in TASKS + ["all"]]
    for r in rows:
        # greedy: speculation changes no reply (fp32), so both models generate the same tokens, counted by the server
        assert r["identical"] and r["plain_tokens"] == r["spec_tokens"] > 0
        assert r["num_drafts"] > 0 and 1.0 <= r["mean_accepted_length"] <= 8.0
        assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["plain_tok_s"])
    for b in (1, 2):
        by = {r["task"]: r for r in rows if r["batch"] == b}
        assert by["all"]["plain_tokens"] == sum(by[t]["plain_tokens"] for t in TASKS)
        assert by["all"]["num_drafts"] == sum(by[t]["num_drafts"] for t in TASKS)
    assert "| all | 2 |" in capsys.readouterr().out
