"""benchmarks/bench_rank.py end to end on the CPU at toy widths (`--smoke`): the code path of the H200 run (rank 0 of
TP 4 built with the collectives stood in for, the memory plan against the capacity planner, the collectives recorded
per step, the decode grid and the labelled TP4 estimate); the stand-ins and the NCCL cost model on their own."""
import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_rank", os.path.join(ROOT, "benchmarks", "bench_rank.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_rank"] = mod  # its dataclass resolves its annotations through the module
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_rank", None)


def test_bench_rank_smoke(bench, tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_rank.json").read_text())
    m = res["memory"]
    assert abs(m["weights_over_planner"] - 1) < 0.01  # the rank's shard is what the planner predicts (norms aside)
    assert m["kv_pages"] >= 2 * m["pages_per_sequence"] and m["kv_pool_bytes"] > 0
    vocab, hidden, layers = 4096, 256, 4
    for b, c in res["collectives"].items():
        # an all-reduce for the embedding, 2 per layer (o_proj, MLP / MoE), the logits' gather
        assert c["calls"] == 2 * layers + 2 and c["kinds"] == ["all_gather", "all_reduce"]
        assert c["bytes"] == int(b) * ((2 * layers + 1) * hidden * 2 + vocab * 4)
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(1, 40), (2, 40), (1, 80), (2, 80)]
    for r in res["decode"]:
        pr = r["projection"]
        assert r["fits"] and r["step_s"] > 0 and pr["estimate"] and pr["meets_goal"] is None  # no batch of 4
        assert 0 < res["collectives"][str(r["batch"])]["standin_s"] < r["step_s"]
        assert pr["tp4_step_s"] == pytest.approx(r["step_s"] + pr["nccl_model_s"])
        assert pr["nccl_model_s"] == pytest.approx(1e-6 * (2 * layers + 1) * bench.nccl_us("all_reduce", 512 * r["batch"])
                                                   + 1e-6 * bench.nccl_us("all_gather", 16384 * r["batch"]))
        assert pr["pessimistic_s"] >= pr["nccl_model_s"]
    table = (tmp_path / "bench_rank.md").read_text()
    assert "| weights |" in table and "| 2 | 80 |" in table
    # --reproject: the saved run's projection again with a 4-GPU host's all-reduces, no run (batch 1's 512 B only)
    tp = tmp_path / "tp.json"
    tp.write_text(json.dumps({"allreduce": [{"gpus": 4, "bytes": 512, "us_per_allreduce": 50.0}]}))
    assert bench.main(["--reproject", str(tmp_path / "bench_rank.json"), "--allreduce", str(tp),
                       "--out", str(tmp_path / "re")]) == 0
    again = json.loads((tmp_path / "re" / "bench_rank.json").read_text())
    for old, new in zip(res["decode"], again["decode"]):
        calls = [("all_reduce", 512 * old["batch"])] * (2 * layers + 1) + [("all_gather", 16384 * old["batch"])]
        assert new["projection"] == bench.projection(old["step_s"], calls, old["batch"], {512: 50.0})
        assert new["projection"]["measured_allreduces"] == (2 * layers + 1 if old["batch"] == 1 else 0)
    assert "measured all-reduces" in (tmp_path / "re" / "bench_rank.md").read_text()


def test_standin_and_nccl_model(bench):
    par = bench.StandIn(0, 4, calls=[])
    x = torch.randn(3, 8)
    assert par.all_reduce(x) is x  # the partial sum stays
    full = par.gather_first(x)
    assert full.shape == (3, 32) and torch.equal(full[:, 8:16], x)
    assert bench.StandIn(1, 4).gather_first(x) is None
    assert par.calls == [("all_reduce", 96), ("all_gather", 384)]
    # NCCL's tuner: 6.6 us + 0.6 us per NVLink step, 2(N-1) steps for a ring all-reduce, N-1 for an all-gather
    assert bench.nccl_us("all_reduce", 0) == pytest.approx(10.2)
    assert bench.nccl_us("all_gather", 0) == pytest.approx(8.4)
    assert bench.nccl_us("all_reduce", 370e3) == pytest.approx(10.2 + 1.5)  # 1.5 x the bytes on the bus
    proj = bench.projection(0.010, [("all_reduce", 0)] * 10, 4)
    assert proj["tp4_step_s"] == pytest.approx(0.010 + 102e-6) and proj["meets_goal"] is False
    assert bench.projection(0.003, [("all_reduce", 0)] * 10, 4)["meets_goal"] is True


def test_projection_with_measured_allreduces(bench, tmp_path):
    """bench_tp's 4-GPU rows (the graph-replayed figure where there is one) replace the model for the all-reduces
    of matching size; other sizes and the gather keep the model."""
    rows = [{"gpus": 4, "bytes": 512, "us_per_allreduce": 30.0, "us_per_allreduce_graph": 12.0},
            {"gpus": 4, "bytes": 1024, "us_per_allreduce": 40.0, "us_per_allreduce_graph": None},
            {"gpus": 2, "bytes": 2048, "us_per_allreduce": 9.0}]
    path = tmp_path / "tp.json"
    path.write_text(json.dumps({"allreduce": rows}))
    measured = bench.measured_allreduce(str(path))
    assert measured == {512: 12.0, 1024: 40.0}
    calls = [("all_reduce", 512)] * 3 + [("all_reduce", 1024), ("all_reduce", 4096), ("all_gather", 2048)]
    pr = bench.projection(0.010, calls, 1, measured)
    assert pr["measured_allreduces"] == 4
    want = 0.010 + 1e-6 * (3 * 12.0 + 40.0 + bench.nccl_us("all_reduce", 4096) + bench.nccl_us("all_gather", 2048))
    assert pr["tp4_measured_step_s"] == pytest.approx(want)
    assert "tp4_measured_step_s" not in bench.projection(0.010, calls, 1)
