"""benchmarks/bench_prefill.py runs end to end on the CPU at toy sizes (`--smoke`, the Triton interpreter): the MoE
layer and the quantized linears on both paths against bf16, the crossovers, and TTFT on the geometry as a share of
the bf16 GEMM rate. Its first GPU run is issue #30's measurement; this keeps that run from failing on a broken path."""
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_bench_prefill_smoke(tmp_path):
    out = tmp_path / "bench_prefill.json"
    # the CPU and the interpreter, on a GPU host too (the smoke sizes are for the interpreter)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", COMMIT="test", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_prefill.py"), "--smoke", "--out",
                        str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["commit"] == "test" and res["bf16_gemm_flops"] > 0
    assert [row["tokens"] for row in res["moe"]] == [1, 9]
    for row in res["moe"]:  # both paths ran and match the torch reference of the layer
        assert "dense_error" not in row and row["err"] < 1e-3
        assert row["kernels_ms"] > 0 and row["dense_ms"] > 0 and row["bf16_ms"] > 0
        assert row["best_vs_bf16"] == min(row["kernels_ms"], row["dense_ms"]) / row["bf16_ms"]
    assert {row["fmt"] for row in res["linear"]} == {"nvfp4", "mxfp8", "fp8"}
    assert {row["M"] for row in res["linear"]} == {3, 17}
    assert all(row["err"] < 1e-3 for row in res["linear"])
    rows = {row["dispatch"]: row for row in res["ttft"]["rows"]}
    assert set(rows) == {"decode kernels only", "default dispatch", "dense rows on", "tl rows unswapped",
                         "msa prefill bytes", "msa prefill 8-token tiles", "msa prefill sdpa",
                         "msa prefill plain pages", "msa prefill plain pages, sdpa",
                         "msa prefill sparse 1-token tiles", "msa prefill sparse 2-token tiles",
                         "msa prefill sparse sorted walk", "msa prefill sdpa, sparse 1-token tiles sorted",
                         "msa prefill t1-sorted sparse tiles", "moe fused gate_up, 256-token tiles",
                         "moe fused gate_up, 64 x 256 tiles", "moe a8 tiles (fp8 dots)", "norm in one launch"}
    assert res["ttft"]["profiles"] == []  # the kernel profile is a GPU measurement
    for row in rows.values():  # the share is the step's FLOPs over the TTFT, against the GEMM rate of the same run
        assert row["prompt_tokens"] == 48 and row["ttft_ms"] > 0
        flops = row["gflop_per_token"] * 1e9 * row["prompt_tokens"]
        assert abs(row["tflops"] * 1e12 - flops / (row["ttft_ms"] / 1e3)) < 1e-6 * row["tflops"] * 1e12
        assert abs(row["share_of_bf16_gemm"] - row["tflops"] * 1e12 / res["bf16_gemm_flops"]) < 1e-9
    assert "TTFT, 4-layer geometry" in r.stdout
