"""benchmarks/soak_server.py, the GPU soak, run on the CPU with the tiny model for a few seconds as a test of the
script itself: streams with random cancellation against the real tritonserver, no error, every page back, the
table and the JSON written."""
from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]


def test_soak_script_on_the_tiny_model(tmp_path):
    import soak_server

    out = str(tmp_path / "soak")
    rc = soak_server.main(["--out", out, "--device", "cpu", "--dtype", "float32", "--streams", "3", "--duration", "8",
                           "--cancel", "0.4", "--prompt-lens", "4,150", "--max-tokens", "4,20", "--max-model-len", "512",
                           "--num-pages", "256", "--max-num-batched-tokens", "512"])
    with open(os.path.join(out, "soak_server.json")) as f:
        res = json.load(f)
    s = res["summary"]
    assert rc == 0, s
    assert s["requests"] >= 6 and 0 < s["cancelled"] < s["requests"] and s["errors"] == 0
    assert s["leaked_pages"] == 0 and s["running_after"] == 0 and s["ttft_ms_p50"] > 0 and s["itl_ms_p99"] > 0
    assert "| 3 |" in open(os.path.join(out, "soak_server.md")).read()
