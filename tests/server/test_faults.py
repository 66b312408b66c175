"""An engine that dies: requests get UNAVAILABLE, the model turns unready (explicit model control), the
server stays up, finalize leaves no threads behind, and the model loads again."""
from __future__ import annotations

import os
import time

import pytest
import tritonclient.grpc as grpcclient

from tritonserver_proc import ROOT, free_port, start_server
from triton_helpers import run_stream, text_inputs, texts

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def faulty_server(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("faulty")
    flag = str(d / "fault")
    factory = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faulty_engine.py") + ":make"
    env = {"M3SERVE_MODEL_DIR": tiny_model_dir, "M3SERVE_ENGINE_FACTORY": factory, "M3SERVE_FAULT_FILE": flag}
    srv = start_server(os.path.join(ROOT, "model_repository"), str(d / "tritonserver.log"), env,
                       ["--model-control-mode=explicit", "--load-model=m3"], wait_models=["m3"])
    srv.flag = flag
    yield srv
    srv.stop()


def _wait(cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_dead_engine_answers_unavailable_and_the_model_turns_unready(faulty_server):
    srv = faulty_server
    responses, error = run_stream(srv.grpc_url, "m3", text_inputs("The quick brown fox", max_tokens=4))
    assert error is None and texts(responses)
    open(srv.flag, "w").close()
    responses, error = run_stream(srv.grpc_url, "m3", text_inputs("The quick brown fox", stream=True, max_tokens=4))
    assert error is not None and "not healthy" in str(error), error
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert _wait(lambda: not client.is_model_ready("m3"), 15), "the model stayed ready"
        assert client.is_server_live()
        responses, error = run_stream(srv.grpc_url, "m3", text_inputs("hi", max_tokens=4))
        assert error is not None
        # finalize ran, joined its threads, and the stub exited
        assert _wait(lambda: "model 'm3' finalized" in srv.log(), 30), srv.log()[-3000:]
        line = [ln for ln in srv.log().splitlines() if "model 'm3' finalized" in ln][-1]
        assert line.endswith("threads left: none"), line
        assert _wait(lambda: not any("m3_0_0" in _cmdline(p) for p in srv.group_pids()), 30)
        # the model loads again (a fresh stub and engine) and serves
        os.unlink(srv.flag)
        client.load_model("m3")
        assert client.is_model_ready("m3")
        responses, error = run_stream(srv.grpc_url, "m3", text_inputs("The quick brown fox", max_tokens=4))
        assert error is None and texts(responses)
    finally:
        client.close()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize("example", ["minimax-m3.1-flash-tp4", "minimax-m3.1-flash-tp4-rocm"])
def test_flash_example_fails_to_load_naming_the_unsupported_options(example, tmp_path):
    """The shipped MiniMax-M3.1-Flash TP4 repository is ready for a user with the weights; today its load
    fails, in the real server, with a message that names TP>1 (its speculative_config is accepted)."""
    import signal
    import subprocess

    (tmp_path / "MiniMax-M3.1-Flash").mkdir()  # stands in for the weights folder
    env = dict(os.environ, M3SERVE_MODEL_DIR=str(tmp_path))
    repo = os.path.join(ROOT, "model_repository_examples", example)
    cmd = [os.path.join(ROOT, "build.sh"), "serve", "--model-repository", repo, "--grpc-port", str(free_port()),
           "--http-port", str(free_port()), "--metrics-port", str(free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = out.decode(errors="replace")
    assert proc.returncode != 0
    assert "failed to load 'm3'" in log, log[-3000:]
    assert "tensor_parallel_size: 4 is not supported" in log and "speculative_config" not in log, log[-3000:]
