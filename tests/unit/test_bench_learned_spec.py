"""benchmarks/bench_learned_spec.py end to end on the CPU: a random-weight learned checkpoint with a random DSpark
draft, eval-tasks' prompts, plain and speculative engines at batch 1 and 2 (the H200 run's code path)."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = ["arithmetic", "multi_turn"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_learned_spec",
                                                  os.path.join(ROOT, "benchmarks", "bench_learned_spec.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_learned_spec_runs(tmp_path, capsys):
    from m3serve.learn.config import make_learned
    from m3serve.learn.evaluate import eval_sets, token_budgets
    from m3serve.text.tokenizer import Tokenizer

    model = str(tmp_path / "m")
    make_learned(model, dtype="float32", random_dspark=True)
    out = tmp_path / "lspec.json"
    assert _bench().main(["--model", model, "--device", "cpu", "--dtype", "float32", "--n", "2", "--warmup-n", "1",
                          "--batches", "1,2", "--tasks", *TASKS, "--variants", "{}", '{"num_speculative_tokens": 3}',
                          "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"date", "device_name", "command", "commit", "torch"} <= set(res)
    assert "bench_learned_spec.py" in res["command"] and "--batches 1,2" in res["command"]
    assert res["k"] == 7 and res["batches"] == [1, 2] and res["tasks"] == TASKS
    # eval-tasks' budgets for the same eval sets
    assert res["budgets"] == token_budgets(eval_sets(2, 0, TASKS), Tokenizer.from_pretrained(model))
    k3 = '{"num_speculative_tokens": 3}'
    assert res["variants"] == ["{}", k3]
    rows = [r for r in res["rows"] if r["variant"] == "{}"]
    assert [(r["variant"], r["task"], r["batch"]) for r in res["rows"]] == [
        (v, t, b) for v in ("{}", k3) for b in (1, 2) for t in TASKS + ["all"]]
    for r in res["rows"]:  # K = 3: at most 3 drafts verified and 4 tokens emitted a step; K = 7: up to 7
        k = 3 if r["variant"] == k3 else 7
        assert r["identical"] and r["plain_tokens"] == r["spec_tokens"]
        assert 1.0 <= r["mean_accepted_length"] <= k + 1 and k - 2 < r["verified_per_draft"] <= k
    for r in rows:
        # greedy: speculation changes no reply (fp32 on the CPU), so both engines emit the same tokens
        assert r["identical"] and r["mismatches"]["n"] == 0 and r["plain_tokens"] == r["spec_tokens"] > 0
        assert r["plain_tok_s"] == r["plain_tokens"] / r["plain_seconds"]
        # the plain engine measured before and after the speculative ones: the faster pass counts
        first, again = r["plain_seconds_passes"]
        assert r["task"] == "all" or r["plain_seconds"] == min(first, again)
        assert r["task"] != "all" or r["plain_seconds"] <= min(first, again)
        assert r["speedup"] == r["spec_tok_s"] / r["plain_tok_s"]
        assert r["num_drafts"] > 0 and 1.0 <= r["mean_accepted_length"] <= 8.0 and 0 <= r["acceptance_rate"] <= 1
        assert 0 < r["spec_steps"] <= r["plain_steps"]
        assert r["max_running"] == r["batch"]  # 2 prompts per task: batch 2 runs both at once, batch 1 one by one
        if r["batch"] == 1:  # one request at a time: no prefill beside a decode
            assert r["plain_mixed_steps"] == r["spec_mixed_steps"] == 0
        for engine in ("plain", "spec"):  # steps by kind: every step counted once, the mixed ones as such
            kinds = r[f"{engine}_step_kinds"]
            assert sum(v["steps"] for v in kinds.values()) == r[f"{engine}_steps"]
            mixed = kinds["decode+prefill"]["steps"] + kinds["speculative+prefill"]["steps"]
            assert mixed == r[f"{engine}_mixed_steps"] and kinds["prefill"]["steps"] >= 1
            assert 0 < sum(v["seconds"] for v in kinds.values()) <= r[f"{engine}_seconds"]
        assert r["plain_step_kinds"]["speculative"]["steps"] == 0 < r["spec_step_kinds"]["speculative"]["steps"]
    for b in (1, 2):
        by = {r["task"]: r for r in rows if r["batch"] == b}
        assert by["all"]["plain_tokens"] == sum(by[t]["plain_tokens"] for t in TASKS)
        assert by["all"]["num_drafts"] == sum(by[t]["num_drafts"] for t in TASKS)
    # batch 2 runs a task's 2 prompts together: fewer steps than one by one
    assert rows[5]["plain_steps"] < rows[2]["plain_steps"]
    assert res["identical"] is True
    table = capsys.readouterr().out
    assert "| arithmetic | 1 |" in table and "| all | 2 |" in table and "NO (" not in table
    assert "| `{}` | 2 | spec | speculative |" in table and "| `{}` | 1 | plain | prefill |" in table


def test_differing_replies_are_reported():
    """A speculative reply unlike the plain one: the row says so, the table too, and the "all" row counts it."""
    from m3serve.learn.evaluate import unlike

    bench = _bench()
    kinds = {"decode": {"steps": 8, "seconds": 0.5}, "prefill": {"steps": 2, "seconds": 0.5}}
    plain = {"tokens": 10, "seconds": 1.0, "steps": 10, "mixed_steps": 0, "max_running": 1, "step_kinds": kinds}
    spec = dict(plain, seconds=0.5, steps=4, num_drafts=4, mean_accepted_length=2.5, acceptance_rate=0.25,
                verified_per_draft=7.0)
    diff = unlike({"a": ["x", "y"], "b": ["z"]}, {"a": ["x", "w"], "b": ["z"]})
    rows = [bench.row("a", 1, plain, spec, 0.5, diff["a"]), bench.row("b", 1, plain, spec, 1.0, diff["b"])]
    assert not rows[0]["identical"] and rows[0]["mismatches"]["first"] == [{"i": 1, "engine": "y", "path": "w"}]
    assert rows[1]["identical"] and rows[0]["speedup"] == 2.0
    every = bench.total(rows)
    assert not every["identical"] and every["mismatches"]["n"] == 1 and every["mismatches"]["of"] == 3
    assert every["mean_accepted_length"] == 2.5 and every["plain_accuracy"] == 0.75 and every["verified_per_draft"] == 7.0
    assert every["spec_step_kinds"] == {"decode": {"steps": 16, "seconds": 1.0},
                                        "prefill": {"steps": 4, "seconds": 1.0}}
    assert "NO (1 of 2)" in bench.table(rows) and "NO (1 of 3)" in bench.table([every])


def test_profile_pass_and_its_option(tmp_path):
    """--profile's pass: one more pass of the task's prompts under torch.profiler, its table of ops; the option needs
    --out and a measured task (refused before any engine is built)."""
    from m3serve import LLM
    from m3serve.learn.config import make_learned

    model = str(tmp_path / "m")
    make_learned(model, dtype="float32", random_dspark=True)
    bench = _bench()
    with LLM(model=model, device="cpu", dtype="float32", max_model_len=256) as llm:
        steps = llm.engine.stats()["num_steps"]
        table = bench.profile_pass(llm, [[5, 7, 9], [11, 13]], 4, 2, "cpu")
        assert llm.engine.stats()["num_steps"] > steps  # the pass ran on the engine
    assert table.startswith("2 prompts, batch 2,") and "Self CPU time total" in table and "aten::" in table
    for bad in (["--tasks", "arithmetic", "--profile", "multi_turn", "--out", str(tmp_path / "p.json")],
                ["--profile", "multi_turn"]):
        with pytest.raises(SystemExit):
            bench.main(["--model", model, "--device", "cpu", *bad])
