"""benchmarks/train_step_bytes.py (where a training step's device time goes, from its aten ops' bytes) and
bench_train_ops.py's `--modes`: on the CPU at toy sizes, the all-experts path's work shows up on [tokens, experts,
width] tensors, and the grouped path (train-learned --experts grouped) has none and a smaller estimate."""
import argparse
import importlib

import pytest

pytest.importorskip("transformers")


def test_the_grouped_experts_leave_no_expert_wide_work():
    bench = importlib.import_module("train_step_bytes")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
    every = bench.estimate(4, 128, "all", 3e12, 4e14)
    grouped = bench.estimate(4, 128, "grouped", 3e12, 4e14)
    assert every["expert_wide_share"] > 0.1 and grouped["expert_wide_share"] == 0.0
    assert grouped["estimate_ms"] < every["estimate_ms"]
    assert every["estimate_ms_per_131072_tokens"] == pytest.approx(every["estimate_ms"] * 256, rel=1e-3)
    for r in (every, grouped):
        assert all(t["ms"] >= 0 and t["calls"] > 0 for t in r["top"])
    ops = {t["op"] for t in grouped["top"]}
    assert "_grouped_mm" in ops and next(t for t in grouped["top"] if t["op"] == "_grouped_mm")["gflop"] > 0


def test_bench_train_ops_modes():
    bench = importlib.import_module("bench_train_ops")
    assert bench.modes_of("eager,graphed+grouped,compiled_graphed+grouped") == [
        ("eager", "eager", "all"), ("graphed+grouped", "graphed", "grouped"),
        ("compiled_graphed+grouped", "compiled_graphed", "grouped")]
    for bad in ("fast", "eager+loop"):
        with pytest.raises(argparse.ArgumentTypeError, match="MODE"):
            bench.modes_of(bad)
