"""benchmarks/bench_spec.py runs end to end on the CPU at toy sizes (`--smoke`): the same code path the H200 run
takes (the cut-M3 builder, a random draft written and loaded, controlled acceptance, the table and JSON)."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_spec", os.path.join(ROOT, "benchmarks", "bench_spec.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_spec_smoke(tmp_path):
    bench = _bench()
    out = tmp_path / "bench_spec.json"
    assert bench.main(["--smoke", "--out", str(out), "--confidence-scheduling"]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    # the cost table: p = 0's step per batch size at B (K + 1) verify tokens (K = 3); no projection on the CPU
    assert [t for t, _ in res["cost_table"]["measured"]] == [4, 8] and res["cost_table"]["projected_60_layers"] == []
    assert all(ms == r["spec_step_ms"] > 0 for (_, ms), r in zip(res["cost_table"]["measured"],
                                                                 [r for r in rows if r["p"] == 0.0]))
    assert all(r["projection_60"] is None for r in rows)
    for r in rows:  # confidence-scheduled verification beside the fixed K = 3 (p > 0 only), greedy tokens unchanged
        assert ("sched_tok_s" in r) == (r["p"] > 0)
        if r["p"] > 0:
            assert r["sched_match"] == 1.0 and 1 <= r["sched_mean_width"] <= 3 and r["sched_tok_s"] > 0
    assert [(r["batch"], r["p"]) for r in rows] == [(1, 0.0), (1, 0.8), (2, 0.0), (2, 0.8)]
    for r in rows:
        assert r["match"] == 1.0  # greedy, fp32: speculation changes no token
        # the controlled runs followed the recording; the prompts prefilled in one step, nothing preempted
        assert r["recorded"] == r["repeat"] == 1.0 and r["mixed"] == r["preempted"] == r["captures"] == 0
        assert r["efficiency"] == r["speedup"] / r["ideal_speedup"] and r["spec_tok_s"] > 0
        assert r["byte_floor"] > 1  # the verify forward alone reads the plain step's bytes and more experts
        # every decode step took the graphs' static path, those near max_tokens included (greedy)
        assert r["eager_steps"] == 0 < r["steps"]
        assert 0 < r["ahead"] < r["steps"]  # steps queued ahead of the previous result; the last ones synchronous
    by_p = {(r["batch"], r["p"]): r for r in rows}
    for b in (1, 2):
        assert by_p[(b, 0.0)]["acceptance_rate"] < 0.2 < 0.4 < by_p[(b, 0.8)]["acceptance_rate"]
        assert by_p[(b, 0.8)]["ideal_speedup"] > 2.5


def test_bench_spec_smoke_with_a_draft_vocab(tmp_path):
    """--draft-vocab 64 (of the toy's 512): the draft proposes from 64 ids holding the plain runs' tokens, so the
    controlled acceptance still holds; greedy tokens unchanged."""
    bench = _bench()
    out = tmp_path / "bench_spec.json"
    assert bench.main(["--smoke", "--out", str(out), "--draft-vocab", "64"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["draft_columns"] for r in rows} == {64}
    assert all(r["match"] == r["recorded"] == 1.0 for r in rows)
    assert all(r["acceptance_rate"] > 0.4 for r in rows if r["p"] > 0)
    plain = {1: [[5, 6, 6]], 2: [[7], [6, 9]]}  # the plain runs' tokens: 6 three times, the others once
    ids = bench.draft_vocab({("plain", b): {"tokens": t} for b, t in plain.items()}, [1, 2], 5, 512)
    assert ids[:4] == [6, 5, 7, 9] and len(set(ids)) == 5 and 0 <= ids[4] < 512


def test_projection_to_60_layers():
    """4 measured layers: the target's layers (verify phase; plain forward less its head) scale by 60/4, the rest
    (draft, Markov, rule, insert, host; the plain step's head and sampling) stays."""
    bench = _bench()
    row = {"phase_ms": {"draft": 1.0, "markov": 0.5, "verify": 2.0, "rule": 0.5, "insert": 0.2, "host": 0.8},
           "baseline_step_ms": 1.5, "spec_step_ms": 5.0, "ideal_speedup": 4.0}
    pr = bench.project(row, 4, 1.0)
    assert pr["plain_step_ms"] == 1.5 + 14 * 1.0 and pr["spec_step_ms"] == 5.0 + 14 * 2.0
    assert pr["verify_ms"] == 30.0 and pr["step_cost"] == 33.0 / 15.5
    assert pr["speedup"] == 4.0 * 15.5 / 33.0 and pr["efficiency"] == 15.5 / 33.0
    assert bench.project({**row, "phase_ms": None}, 4, 1.0) is None and bench.project(row, 4, None) is None


@pytest.mark.parametrize("mixed", [True, False], ids=["prefill_mixed", "prefill_apart"])
def test_mixed_steps_are_counted(tmp_path, mixed):
    """A token budget below the batch's prompts chunks the prefill: with --prefill-mixed the decodes of the
    sequences prefilled first share steps with the others' chunks, and the table says so; apart (the default) no
    step is mixed (on the CPU, in fp32, the tokens stay the recording's either way)."""
    bench = _bench()
    out = tmp_path / "bench_spec.json"
    assert bench.main(["--smoke", "--out", str(out), "--max-num-batched-tokens", "24"]
                      + (["--prefill-mixed"] if mixed else [])) == 0
    rows = {(r["batch"], r["p"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[(1, 0.8)]["mixed"] == 0  # 20 prompt tokens: one step
    counts = [rows[(2, 0.0)]["mixed"], rows[(2, 0.8)]["mixed"]]
    assert all(n > 0 for n in counts) if mixed else counts == [0, 0]
    assert rows[(2, 0.8)]["recorded"] == 1.0 and rows[(2, 0.8)]["preempted"] == 0


def test_bench_spec_host_runs(tmp_path):
    """benchmarks/bench_spec_host.py: every part timed per decode step, the host's share positive and below the step,
    the controlled runs' tokens those of the recording (the harness checks it)."""
    spec = importlib.util.spec_from_file_location("bench_spec_host",
                                                  os.path.join(ROOT, "benchmarks", "bench_spec_host.py"))
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    out = tmp_path / "host.json"
    assert host.main(["--batches", "1,3", "--gen-len", "12", "--prompt-len", "8", "--repeats", "1",
                      "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["steps"] > 0 and all(r[n] > 0 for n in ("schedule", "build", "fill", "complete", "phases"))
        assert 0 < r["host"] and r["fill"] + r["build"] + r["schedule"] < r["host"]


def test_bench_spec_smoke_synchronous(tmp_path):
    """--no-async-scheduling: no speculative step goes ahead (the comparison run), the same greedy tokens."""
    bench = _bench()
    out = tmp_path / "bench_spec.json"
    assert bench.main(["--smoke", "--out", str(out), "--batches", "2", "--no-async-scheduling"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["ahead"] == 0 < r["steps"] and r["match"] == 1.0 for r in rows)
