"""The gateway's metrics across worker processes (backend/gateway/metrics.py, `m3serve openai --workers N`): with
$PROMETHEUS_MULTIPROC_DIR set, each process keeps its counts in files of that folder and the /metrics text of any
one of them sums every process's; without it a process reports its own counts only."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

RECORD = """
import sys
from m3serve.gateway.metrics import GatewayMetrics
m = GatewayMetrics()
m.requests.labels("completions", "200").inc(int(sys.argv[1]))
m.ttft.labels("completions").observe(0.01)
sys.stdout.write(m.text().decode())
"""


def _worker(env: dict, requests: int) -> str:
    """One process that records `requests` requests and one TTFT, then prints its /metrics text."""
    return subprocess.run([sys.executable, "-c", RECORD, str(requests)], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout


def _value(text: str, sample: str) -> float:
    m = re.search(rf"^{re.escape(sample)}(?:\{{[^}}]*\}})?\s+(\S+)$", text, re.M)
    assert m, f"{sample} not in:\n{text}"
    return float(m.group(1))


def test_worker_processes_count_together(tmp_path):
    shared = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    first = _worker(shared, 3)
    second = _worker(shared, 4)
    assert _value(first, "m3serve_gateway_requests_total") == 3
    assert _value(second, "m3serve_gateway_requests_total") == 7  # its own 4 and the first process's 3
    assert _value(second, "m3serve_gateway_time_to_first_token_seconds_count") == 2
    alone = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    assert _value(_worker(alone, 4), "m3serve_gateway_requests_total") == 4  # one process: its own counts


def test_a_worker_count_below_one_is_refused(capsys):
    """`--workers 0` (or less) is an operator's mistake: refused before anything serves, not one process served."""
    from m3serve.cli import main
    from m3serve.gateway.app import GatewayConfig, run

    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="workers: must be an integer >= 1"):
            run(GatewayConfig(), "127.0.0.1", 0, workers=bad)
    assert main(["openai", "--workers", "0"]) == 2  # the CLI's error exit, with run()'s message
    assert "m3serve openai: error: workers: must be an integer >= 1, got 0" in capsys.readouterr().err
