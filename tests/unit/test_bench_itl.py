"""benchmarks/bench_itl.py runs end to end on the CPU at toy sizes (`--smoke`): the code path of the H200 run (idle
ITL of the decoding streams, then per chunk size a long prompt prefilled in chunks beside them: ITL of the window,
TTFT with and without the streams; then the prompt capped beside the decodes; the JSON and the table)."""
import importlib
import json

import pytest


def test_bench_itl_smoke(tmp_path):
    bench = importlib.import_module("bench_itl")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
    from bench_engine import RUNTIME_CALLS
    assert bench.main(["--smoke", "--profile", "--tuned", "fused_norm=True", "--tuned", "prefill_block_t=2",
                       "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_itl.json").read_text())
    assert res["tuned"] == {"fused_norm": "True", "prefill_block_t": "2"}  # in effect during the run
    streams, long = res["streams"], res["long_prompt"]
    assert (streams, long) == (4, 300)
    idle = res["idle"]
    assert idle["itl_count"] == streams * (6 - 1)  # 6 recorded steps: 5 gaps per stream
    assert 0 < idle["itl_p50_ms"] <= idle["itl_p99_ms"] <= idle["itl_max_ms"]
    assert [r["chunk"] for r in res["chunks"]] == [36, 132]
    for r in res["chunks"]:
        # every step until the prompt's first token carried all the decodes and one chunk of chunk - streams tokens
        steps = -(-long // (r["chunk"] - streams))
        assert r["prompt_chunk"] == r["chunk"] - streams
        assert r["mixed_steps"] == steps and r["chunked_prefills"] == steps - 1
        # async scheduling queued each mixed step after the first ahead of the step before it
        assert steps - 1 <= r["steps_ahead"] <= steps + 1
        # each stream got a token in each of those steps (plus the decode-only step queued ahead at the admission)
        assert streams * steps <= r["itl_count"] <= streams * (steps + 1)
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]
        assert r["ttft_s"] > 0 and r["ttft_alone_s"] > 0
        assert r["p99_over_idle"] == r["itl_p99_ms"] / idle["itl_p99_ms"]
        assert r["within_2x_idle"] == (r["p99_over_idle"] <= 2.0)
    assert res["chunks"][0]["mixed_steps"] > res["chunks"][1]["mixed_steps"]
    # capped: the largest chunk, but at most 16 prompt tokens in a step that decodes (max_prefill_tokens_with_decodes)
    [capped] = res["caps"]
    steps = -(-long // 16)
    assert (capped["chunk"], capped["cap"], capped["prompt_chunk"]) == (132, 16, 16)
    assert capped["mixed_steps"] == steps and capped["chunked_prefills"] == steps - 1
    assert streams * steps <= capped["itl_count"] <= streams * (steps + 1)
    assert "From chunk 36 to 132" in res["trade_off"]
    # --profile: idle decode steps, then mixed steps at the cap (16 prompt tokens beside the 4 decodes)
    idle_p, mixed_p = res["profiles"]
    assert (idle_p["kind"], idle_p["prompt_tokens"], idle_p["mixed_steps"]) == ("idle", 0, 0)
    assert (mixed_p["kind"], mixed_p["prompt_tokens"]) == ("mixed", 16)
    assert mixed_p["steps"] - 1 <= mixed_p["mixed_steps"] <= mixed_p["steps"] + 1
    for p in (idle_p, mixed_p):
        assert p["wall_us_per_step"] > 0 and p["kernel_us_per_step"] > 0 and p["kernels"]
        # the host's side: its operators by their own CPU time, largest first, each called at least once a window
        host = [h["us_per_step"] for h in p["host_ops"]]
        assert host and host == sorted(host, reverse=True)
        assert all(h["calls_per_step"] * p["steps"] >= 1 for h in p["host_ops"])
        assert set(p["runtime"]) <= set(RUNTIME_CALLS)
    table = (tmp_path / "bench_itl.md").read_text()
    assert "| idle (no prompt) |" in table and "| 132 | 128 |" in table and "| 132 | 16 (capped) |" in table


def test_bench_itl_tuned_arguments():
    bench = importlib.import_module("bench_itl")
    assert bench.tuning_changes(["fused_norm=True", "prefill_sdpa_from=1024"]) == {"fused_norm": True,
                                                                                  "prefill_sdpa_from": 1024}
    for bad in ("fused_norm", "no_such_field=1", "fused_norm=maybe"):
        with pytest.raises(ValueError):
            bench.tuning_changes([bad])
