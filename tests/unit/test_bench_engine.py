"""benchmarks/bench_engine.py runs end to end on the CPU at toy sizes (`--smoke`): the code path of the H200 run
(TTFT, decode rows with their roofline and host-wait share, the per-layer split, the profiles, JSON and table)."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_engine", os.path.join(ROOT, "benchmarks", "bench_engine.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_engine_smoke(tmp_path):
    """--steps 25: each decode row's sequences ask for 82 tokens above the largest context (48, decoded at), more
    than the 64 the engine once left there (a 131072-token row failed so on the H200)."""
    bench = _bench()
    assert bench.decode_tokens(25) > 64
    assert bench.main(["--smoke", "--steps", "25", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_engine.json").read_text())
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(1, 48), (2, 48)]
    for r in res["decode"]:
        assert r["step_s"] > 0 and 0 <= r["host_wait_share"] < 1
        assert r["share_of_roofline"] == r["roofline_s"] / r["step_s"]
        assert all(1 <= e <= 8 for e in r["experts_touched"])  # distinct experts of 8, at least top-k's worth
    assert [r["batch"] for r in res["scaling"]] == [1, 2]
    assert set(res["scaling"][0]["host_wait_shares"]) == {"D+M", "D+D+M", "D+3M"}
    assert set(res["profile"]) == {"b1_ctx40", "b2_ctx40", "b2_ctx48"}  # the scaling context, and the largest
    for p in res["profile"].values():
        assert p["kernels"] and p["kernel_us_per_step"] >= p["kernels"][0]["us_per_step"] > 0
    table = (tmp_path / "bench_engine.md").read_text()
    assert "| 2 | 48 |" in table and "host waits" in table
