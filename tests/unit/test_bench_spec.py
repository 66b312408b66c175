"""benchmarks/bench_spec.py runs end to end on the CPU at toy sizes (`--smoke`): the same code path the H200 run
takes (the cut-M3 builder, a random draft written and loaded, controlled acceptance, the table and JSON)."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_spec_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_spec", os.path.join(ROOT, "benchmarks", "bench_spec.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench_spec.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["p"]) for r in rows] == [(1, 0.0), (1, 0.8), (2, 0.0), (2, 0.8)]
    for r in rows:
        assert r["match"] == 1.0  # greedy, fp32: speculation changes no token
        assert r["efficiency"] == r["speedup"] / r["ideal_speedup"] and r["spec_tok_s"] > 0
        # every decode step took the graphs' static path, those near max_tokens included (greedy)
        assert r["eager_steps"] == 0 < r["steps"]
    by_p = {(r["batch"], r["p"]): r for r in rows}
    for b in (1, 2):
        assert by_p[(b, 0.0)]["acceptance_rate"] < 0.2 < 0.4 < by_p[(b, 0.8)]["acceptance_rate"]
        assert by_p[(b, 0.8)]["ideal_speedup"] > 2.5
