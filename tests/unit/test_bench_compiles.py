"""The benchmarks' compile log (benchmarks/geometry.py `log_compiles`, bench_server's count per timed level): Triton
calls the listener as its compiler does, the lines parse back from a server log, compiles are counted by level."""
import importlib
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")


def _load(name):
    """A module of benchmarks/ (on pytest's pythonpath: pyproject.toml)."""
    return importlib.import_module(name)


def test_compiles_are_logged_parsed_and_counted_by_level(tmp_path, capsys, monkeypatch):
    geometry, bench = _load("geometry"), _load("bench_server")
    monkeypatch.setattr(triton.knobs.compilation, "listener", None)
    geometry.log_compiles()
    listener = triton.knobs.compilation.listener
    times = triton.knobs.CompileTimes(ir_initialization=250_000, lowering_stages=[("ttir", 500_000),
                                                                                  ("cubin", 750_000)],
                                      store_results=0)
    listener(src=SimpleNamespace(name="_msa_decode_kernel"), metadata={}, metadata_group={}, times=times,
             cache_hit=False)
    t, seconds, name = geometry.COMPILES[-1]
    assert seconds == 1.5 and name == "_msa_decode_kernel"
    log = tmp_path / "tritonserver.log"
    log.write_text("I1203 12:00:00 server line\n" + capsys.readouterr().err
                   + f"[compile] {t + 100:.3f} 0.010 _topk_kernel cached\n")
    parsed = bench.server_compiles(str(log))
    assert [(round(x[1], 3), x[2]) for x in parsed] == [(1.5, "_msa_decode_kernel fresh"),
                                                        (0.01, "_topk_kernel cached")]
    levels = [{"t_start": t - 1, "t_end": t + 1}, {"t_start": t + 50, "t_end": t + 200}, {"t_start": 0, "t_end": 1}]
    bench.compiles_in(levels, parsed)
    assert [(lv["compiles"], lv["compiled"]) for lv in levels] == [(1, ["_msa_decode_kernel"]),
                                                                   (1, ["_topk_kernel"]), (0, [])]
    assert levels[0]["compile_s"] == pytest.approx(1.5, abs=1e-3)


def test_server_table_survives_a_failed_side():
    """A side that failed (engine-direct's engine, or the server's model, did not load) leaves placeholder rows
    without counters: the table still comes out, with nan where nothing was measured."""
    bench = _load("bench_server")
    nan = float("nan")
    res = {"null": [], "engine": [{"concurrency": 1, "tokens_per_s_total": nan}],
           "server": [{"concurrency": 1, "tokens_per_s_total": 600.0, "ttft_ms": {50: 14.0}, "itl_ms": {50: 1.5},
                       "responses_per_request_mean": 128, "engine_steps_per_s": 590.0,
                       "engine_device_wait_share": 0.3, "engine_steps_not_ahead": 12,
                       "engine_ms_per_decode_step": 1.62, "compiles": 0}]}
    row = bench.summarize(res).splitlines()[-1]
    assert row.startswith("| 1 | 1 | nan | 600 | nan | nan / 14.0 |") and "nan / 590" in row and "nan% / 30%" in row
    assert "| nan / 12 | nan / 1.62 |" in row


def test_engine_pace_reads_the_steps_ahead_and_the_decode_step_time():
    """Between two readings of the engine's counters: steps that waited for the one before them (all steps less
    those queued ahead) and the mean decode step in milliseconds (None without a decode step)."""
    bench = _load("bench_server")
    before = {"num_steps": 10, "num_steps_ahead": 4, "device_wait_seconds": 0.1, "num_prompt_steps": 2,
              "steps_by_kind": {"decode": 6}, "step_seconds_by_kind": {"decode": 0.012}}
    after = {"num_steps": 110, "num_steps_ahead": 94, "device_wait_seconds": 0.4, "num_prompt_steps": 5,
             "steps_by_kind": {"decode": 96, "decode+prefill": 3}, "step_seconds_by_kind": {"decode": 0.237}}
    pace = bench.engine_pace(before, after, 0.5)
    assert pace["engine_steps_per_s"] == 200 and pace["engine_device_wait_share"] == pytest.approx(0.6)
    assert (pace["engine_prompt_steps"], pace["engine_steps_not_ahead"]) == (3, 10)
    assert pace["engine_ms_per_decode_step"] == pytest.approx(2.5)
    assert bench.engine_pace(before, before, 0.5)["engine_ms_per_decode_step"] is None
